"""tests/gpu_check.py's own machinery, on the CPU, before a GPU is at hand: the plan fits the deadline from the
process's start and gives way where measured compiles are slow, each part ends by its plan and leaves its rows on
disk at once, a killed run keeps its lines and says whether it was compiling, a hung command is killed with every
process it started, the runs pass only options their scripts have, and a machine without CUDA gets one line. The
parts that need a model or a script are in test_compiled.py (slow tier)."""

import builtins
import dataclasses
import json
import os
import re
import runpy
import subprocess
import sys
import textwrap
import time
import types
import warnings
from collections import Counter

import numpy as np
import pytest
import torch

import common
import gpu_check
from conftest import ENV, ROOT
from gpu_check import Item
from nanolap import build_model, make_config

pytestmark = pytest.mark.slow  # the GPU's checks, planned and faked on the CPU

H200 = ("NVIDIA H200", (9, 0), 139.0)  # name, compute capability, free GiB: what gpu_check.gpu_facts returns
T4 = ("Tesla T4", (7, 5), 14.5)


def alive(pid):
    """Whether pid is a living process (a zombie, killed and not yet reaped, is not)."""
    try:
        return open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


@pytest.mark.parametrize("parent", ["hangs", "exits"])
def test_a_hung_command_is_killed_with_the_processes_it_started_in_new_sessions(parent, tmp_path):
    """As torch elastic starts a worker: a grandchild in a session of its own that holds the output open and stalls
    (a stuck NCCL call). Whether its parent (the torchrun agent) hangs too or has exited, run_command returns at its
    timeout with what was printed, and the grandchild is dead."""
    child = tmp_path / "child.py"
    child.write_text(textwrap.dedent(f"""
        import subprocess, sys, time
        worker = subprocess.Popen([sys.executable, "-c", "import time; print('worker up', flush=True); time.sleep(120)"],
                                  start_new_session=True)
        print("worker", worker.pid, flush=True)
        if {parent == "hangs"}:
            time.sleep(120)
    """))
    t0 = time.perf_counter()
    code, lines = gpu_check.run_command([sys.executable, str(child)], timeout=1)
    assert code is None and time.perf_counter() - t0 < 20
    texts = [text for _, text in lines]
    worker = int(next(text for text in texts if text.startswith("worker "))[7:])
    for _ in range(20):  # SIGKILL is delivered at once; reaping may take a moment
        if not alive(worker):
            break
        time.sleep(0.1)
    assert not alive(worker)


def test_a_quick_command_keeps_its_code_and_output_also_in_its_log(tmp_path):
    log = tmp_path / "run.log"
    code, lines = gpu_check.run_command([sys.executable, "-c", "print('a'); print('b'); raise SystemExit(3)"], 30,
                                        log=str(log))
    assert code == 3 and [text for _, text in lines] == ["a", "b"]
    assert [line.split()[-1] for line in log.read_text().splitlines()] == ["a", "b"]  # each with its second


def compiling_child(tmp_path, rows=()):
    """A command that prints `rows` as the cost child does, says it compiles, and then sits in a function of a file
    under torch/_inductor/ (as a slow Inductor compile sits) with faulthandler on SIGUSR1, as gpu_check's runs have."""
    inductor = tmp_path / "fake" / "torch" / "_inductor"
    inductor.mkdir(parents=True)
    (inductor / "codecache.py").write_text("import time\n\ndef compile_graph():\n    time.sleep(120)\n")
    child = tmp_path / "child.py"
    printed = "".join(f"print({gpu_check.ROW_MARK + json.dumps(r)!r}, flush=True)\n" for r in rows)
    child.write_text(f"import faulthandler, signal, sys\nfaulthandler.register(signal.SIGUSR1, all_threads=True)\n"
                     f"sys.path.insert(0, {str(inductor)!r})\n{printed}"
                     f"print('cost: compiling gpt d12 n_lap=0 as one model', flush=True)\n"
                     f"import codecache\ncodecache.compile_graph()\n")
    return [sys.executable, str(child)]


def test_a_killed_cost_run_keeps_its_rows_and_its_lines_and_says_it_was_compiling(tmp_path, monkeypatch):
    """The cost child printed its eager rows, then a compile outlived the part's time: the part keeps those rows,
    cost.log keeps every line, and the failed row says the run was compiling, with its last line."""
    eager = [gpu_check.row("cost", "gpt d12 eager: n_lap=0 50.0 ms, n_lap=3 of 6 50.5 ms", "1.010", "<= 1.1", True,
                           "lap_cost_gpt_eager_3of6", "1.010")]
    monkeypatch.setattr(gpu_check, "cost_command", lambda spec: compiling_child(tmp_path, eager))
    t0 = time.perf_counter()
    rows = gpu_check.part_cost(until=time.perf_counter() + gpu_check.KILL_S + 2.2, out=str(tmp_path))
    assert time.perf_counter() - t0 < gpu_check.KILL_S + 4
    assert rows[0]["key"] == "lap_cost_gpt_eager_3of6" and rows[0]["ok"]
    assert not rows[-1]["ok"] and "killed at its limit of 2 s, compiling" in rows[-1]["value"]
    assert re.search(r"last line at \d s: cost: compiling gpt d12 n_lap=0 as one model$", rows[-1]["value"])
    log = (tmp_path / "cost.log").read_text()
    assert "cost: compiling gpt d12" in log and "codecache.py" in log  # the stack, dumped before the kill


@pytest.mark.slow
def test_a_script_run_killed_at_its_limit_keeps_its_lines_and_the_stack_of_where_it_hung(tmp_path):
    """Through run_script_here, as every script run goes: a script that trained two log intervals and then stalls
    outside any compiler (a lost peer, a dead data loader). Its rows keep the rate its lines allow, and the failed
    row names the function it hung in. Slow: the run imports torch and waits out its limit."""
    script = tmp_path / "stalls.py"
    script.write_text(textwrap.dedent("""
        import time

        def wait_for_peer():
            time.sleep(120)

        print("batch: 32,768 tokens per step", flush=True)
        print("step 10/100 | loss 3.0 | 1 tok/s", flush=True)
        time.sleep(0.5)
        print("step 20/100 | loss 2.9 | 1 tok/s", flush=True)
        wait_for_peer()
    """))
    code, lines = gpu_check.run_command(gpu_check.timed_command(str(script), []), 20, ENV, str(tmp_path / "run.log"))
    assert code is None and [text for _, text in lines][:3] == ["batch: 32,768 tokens per step",
                                                                "step 10/100 | loss 3.0 | 1 tok/s",
                                                                "step 20/100 | loss 2.9 | 1 tok/s"]
    rows = gpu_check.script_rows("gpt stalls", 32768, "tok", 1e12, None, code, lines, 20, "scripts gpt")
    assert "killed at its limit of 20 s, in wait_for_peer (stalls.py:5)" in rows[0]["value"] and not rows[0]["ok"]
    assert rows[0]["measured"] == dict(item="scripts gpt", killed_at_s=20)  # the next plan gives it more time
    assert rows[1]["ok"] and 10 < float(rows[1]["value"].split(" | ")[0]) < 40  # 10 steps in about half a second
    assert "wait_for_peer" in (tmp_path / "run.log").read_text()


def test_a_slow_compile_measured_before_makes_the_plan_shorten_and_skip_what_no_longer_fits():
    """The GPT run of an earlier command compiled slowly (230 s besides its steps): the scripts command still plans
    within its 272 s, the GPT first (highest priority), the ViT skipped, DINO shortened, default skipped."""
    measured = {"scripts gpt": dict(fixed_s=230.0, step_s=0.1, cold=True),
                "scripts dino": dict(fixed_s=20.0, step_s=0.2, cold=True)}
    items = gpu_check.plan_items(("scripts", "default"), H200, measured)
    chosen, skipped = gpu_check.plan(items, 272)
    assert chosen["scripts gpt"] == gpu_check.SCRIPT_STEPS["gpt"]  # 240 s
    assert chosen["scripts dino"] == 60  # (272 - 240 - 20) / 0.2 steps: shortened, but at least MIN_STEPS
    assert set(skipped) == {"scripts vit", "default"} and "s (estimate), 32 s left" in skipped["scripts vit"]
    assert sum(i.seconds(chosen[i.name]) for i in items if i.name in chosen) <= 272
    by_name = {i.name: i for i in items}
    assert by_name["scripts gpt"].basis == "measured" and by_name["scripts vit"].basis == "estimate"
    # a measurement that a warm Inductor cache made fast plans nothing; a run killed at 100 s gets 125 s next time
    warm = gpu_check.plan_items(("scripts",), H200, {"scripts gpt": dict(fixed_s=10.0, step_s=0.1, cold=False)})
    assert warm[0].fixed_s == gpu_check.ESTIMATE["scripts gpt"]
    killed = gpu_check.plan_items(("scripts",), H200, {"scripts gpt": dict(killed_at_s=100.0)})
    assert killed[0].fixed_s == 125.0 and killed[0].basis == "killed before"


def test_the_default_plans_fit_the_deadline_on_an_h200_and_a_t4():
    """Both commands plan within their deadline less a start-up of 8 s, with nothing skipped but what PRIORITY puts
    last; the scripts' batches and steps follow the GPU."""
    for gpu in (H200, T4):
        for parts in (("equal", "tests", "torchrun", "cost"), ("scripts", "default")):
            items = gpu_check.plan_items(parts, gpu)
            chosen, skipped = gpu_check.plan(items, gpu_check.deadline - 8)
            assert sum(i.seconds(chosen[i.name]) for i in items if i.name in chosen) <= gpu_check.deadline - 8
            assert set(skipped) <= {"default"}, (gpu, skipped)
            assert {"scripts gpt", "scripts vit", "cost", "equal"} & set(chosen)


def test_the_cost_run_compiles_only_what_its_measured_compile_times_leave_room_for(monkeypatch, capsys):
    """A fake slow compile on a fake clock (each reading of it 1 ms later, so the outcome does not hang on this
    machine's speed): every model takes 1 s to compile, while COMPILE_ESTIMATE said 0.1 s for the GPT, 0.4 s for the
    ViT. The GPT's pair (n_lap 0 and 3) fits and is timed; then the measured second makes the all-Laplacian GPT give
    way (1 + 3 x 0.4 s for it and the ViT's compiles, which rank above it, against 1.5 s left), and the ViT's
    n_lap = 6 no longer fits after its n_lap = 0. Every row says why."""
    gpt = make_config("gpt-tiny", n_layer=1, n_embd=24, n_head=6, vocab_size=50, block_size=16)
    vit = make_config("vit-tiny", n_layer=1, n_embd=24, n_head=6, img_size=8, patch_size=4, num_classes=10)
    monkeypatch.setattr(gpu_check, "cost_cases", lambda free_gib: {
        "gpt tiny": (gpt, gpu_check.model_input(gpt, 2)), "vit tiny": (vit, gpu_check.model_input(vit, 2))})
    monkeypatch.setattr(gpu_check, "COMPILE_ESTIMATE", {"gpt": 0.1, "vit": 0.4})
    clock = [0.0]

    def perf_counter():
        clock[0] += 0.001
        return clock[0]

    class SlowCompile:
        """What torch.compile returns, with a first call that takes 1 s of the fake clock."""
        def __init__(self, model):
            self.model = model
            self.calls = 0

        def __call__(self, *args):
            self.calls += 1
            if self.calls == 1:
                clock[0] += 1.0
            return self.model(*args)

        def __getattr__(self, name):
            return getattr(self.model, name)

    monkeypatch.setattr(gpu_check, "time", types.SimpleNamespace(perf_counter=perf_counter))
    monkeypatch.setattr(gpu_check.torch, "compile", SlowCompile)
    gpu_check.cost_run(dict(seconds=3.5, device="cpu", dtype="float32", free_gib=None, rounds=1, repeats=1,
                            compile_s={}), start=0.0)
    out = capsys.readouterr().out
    rows = {r["check"]: r for r in (json.loads(line[len(gpu_check.ROW_MARK):]) for line in out.splitlines()
                                    if line.startswith(gpu_check.ROW_MARK))}
    keys = {r["key"] for r in rows.values()}
    assert {"lap_cost_gpt_eager", "lap_cost_gpt_eager_3of6", "lap_cost_vit_eager", "lap_cost_vit_eager_3of6"} <= keys
    assert "lap_cost_gpt_compiled_3of6" in keys and "lap_cost_gpt_compiled" not in keys
    compiles = [r for r in rows.values() if r["key"] == "compile_s_gpt"]
    assert compiles and all(r["measured"]["fixed_s"] >= 1.0 and r["measured"]["item"] == "compile gpt" for r in compiles)
    gpt6 = rows["gpt tiny compiled n_lap=6 of 6"]
    assert gpt6["skipped"] and "(measured here: 1 s a compile)" in gpt6["value"]
    assert rows["vit tiny compiled n_lap=6 of 6"]["skipped"] and "lap_cost_vit_compiled" not in keys


def test_compiles_rank_by_compile_order_even_where_they_come_later():
    """compile_fits: an n_lap = 0 needs room for its partner; the GPT's last layout leaves room for the ViT's three,
    which rank above it though they run after it."""
    compile_s = {"gpt": 40.0, "vit": 30.0}
    assert gpu_check.compile_fits(("gpt", 0), set(), 80, compile_s) == (True, 80.0)
    assert gpu_check.compile_fits(("gpt", 0), set(), 79, compile_s) == (False, 80.0)
    done = {("gpt", 0), ("gpt", 3)}
    assert gpu_check.compile_fits(("gpt", 6), done, 100, compile_s) == (False, 130.0)
    assert gpu_check.compile_fits(("gpt", 6), done | {("vit", 0), ("vit", 6), ("vit", 3)}, 40, compile_s)[0]


def test_each_part_ends_by_its_plan_and_leaves_its_rows_at_once(tmp_path, monkeypatch):
    """With 0.2 s of start-up already gone, a command of 1 s: equal may take SLACK times its plan, cost (rest) what
    tests' plan leaves; the finished part's rows, RESULT and measured seconds are on disk while cost runs past the
    deadline, the watchdog stops the command GRACE later in one line, and tests, left without time, is skipped."""
    monkeypatch.setattr(gpu_check, "GRACE", 0.2)
    stopped = []
    monkeypatch.setattr(gpu_check, "give_up", stopped.append)  # instead of os._exit
    items = [Item("equal", "equal", 0.1), Item("cost", "cost", 0.05, rest=True), Item("tests", "tests", 0.1)]
    seen = {}

    def equal(until):
        seen["equal"] = until - time.perf_counter()
        return [gpu_check.row("equal", "vit float32", "logits 1e-07", "1e-04", True)]

    def slow_cost(until):  # a part that ignores its time
        seen["cost"] = until
        seen["rows during cost"] = open(tmp_path / gpu_check.ROWS).read()
        seen["result during cost"] = common.read_result(str(tmp_path))
        seen["measured during cost"] = json.load(open(tmp_path / "measured.json"))
        for _ in range(100):  # hung until the watchdog has acted (its stack dump takes a second)
            if stopped:
                break
            time.sleep(0.05)
        return [gpu_check.row("cost", "gpt eager", "1.02", "<= 1.1", True, "lap_cost_gpt_eager", "1.020")]

    def tests(until):
        raise AssertionError("no time was left: tests must not start")

    start = time.perf_counter() - 0.2
    failed = gpu_check.main(("equal", "cost", "tests"), str(tmp_path), seconds=1.0, gpu=H200, start=start, items=items,
                            runners=dict(equal=equal, cost=slow_cost, tests=tests),
                            measured_path=str(tmp_path / "measured.json"))
    assert seen["equal"] == pytest.approx(gpu_check.SLACK * 0.1, abs=0.03)
    assert seen["cost"] == pytest.approx(start + 1.0 - 0.1)  # all but the 0.1 s planned for tests
    assert "vit float32" in seen["rows during cost"] and seen["result during cost"]["parts"] == "equal"
    assert list(seen["measured during cost"].values())[0]["equal"]["cold"]
    assert stopped == [1]  # the watchdog at 1 + 0.2 s after the start, during cost
    rows = open(tmp_path / gpu_check.ROWS).read()
    assert "plan: equal: 0 s = 0 s (estimate)" in rows and "deadline (1 s + 0.2 s) passed during part cost" in rows
    assert "gpt eager" in rows and re.search(r"tests +skipped: needs 0 s \(estimate\), 0 s left +skip", rows)
    result = common.read_result(str(tmp_path))
    assert failed == 0 and result["skipped"] == "1" and result["lap_cost_gpt_eager"] == "1.020"


def test_the_deadline_counts_from_the_process_start_and_the_command_ends_within_300_s():
    """process_age of a process started 0.5 s ago; the default deadline, the watchdog's grace and its stack dump stay
    inside the 300 s a GPU lease gives a command."""
    child = subprocess.Popen(["sleep", "10"])
    try:
        time.sleep(0.5)
        assert gpu_check.process_age(child.pid) == pytest.approx(0.5, abs=0.15)
    finally:
        child.kill()
        child.wait()
    assert gpu_check.deadline + gpu_check.GRACE + gpu_check.DUMP_WAIT + gpu_check.KILL_S < 300


def test_without_cuda_one_line_and_exit_status_2():
    done = subprocess.run([sys.executable, "tests/gpu_check.py", "--only=scripts,default"], cwd=ROOT, env=ENV,
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 2 and done.stdout == "" and done.stderr.count("\n") == 1
    assert done.stderr.startswith("gpu_check.py needs a CUDA GPU")


def test_missing_data_fail_their_rows_at_once_in_one_line(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(gpu_check, "ROOT", str(tmp_path))  # a fresh machine's tree: no Fashion-MNIST
    monkeypatch.setattr(gpu_check.images, "DEBIAN_FASHION", str(tmp_path / "none"))
    assert gpu_check.missing_data(None) == ""
    t0 = time.perf_counter()
    failed = gpu_check.main(("default",), str(tmp_path), seconds=100, gpu=H200)
    assert failed == 1 and time.perf_counter() - t0 < 5  # nothing ran
    out = capsys.readouterr().out
    assert out.count("gpu_check: missing data/fashion_mnist/") == 1 and "the runs that read it fail" in out
    assert "train_vit.py default: data" in open(tmp_path / gpu_check.ROWS).read()


def test_fashion_mnist_found_in_the_repository(tmp_path, monkeypatch):
    monkeypatch.setattr(gpu_check, "ROOT", str(tmp_path))
    monkeypatch.setattr(gpu_check.images, "DEBIAN_FASHION", str(tmp_path / "none"))
    os.makedirs(tmp_path / "data" / "fashion_mnist")
    for pair in gpu_check.images.FASHION_FILES.values():
        for name in pair:
            (tmp_path / "data" / "fashion_mnist" / name).write_text("x")
    assert gpu_check.missing_data("fashion_mnist") == ""


def test_sizes_fit_the_free_memory_and_old_gpus_get_float16():
    """A 16 GB T4: the cost GPT's float32 logits (B x 1024 x 65,536 x 4 bytes a copy, three copies in a step) take
    under half its free memory; an H200 keeps the full sizes. Below compute capability 8.0, float16 for every script."""
    def batch(cases, kind):
        return next(int(name.split("B=")[1]) for name in cases if name.startswith(kind))
    big, small = gpu_check.cost_cases(H200[2]), gpu_check.cost_cases(T4[2])
    assert batch(big, "gpt") == 16 and batch(big, "vit") == 128
    assert 3 * batch(small, "gpt") * 1024 * 65536 * 4 < 0.5 * T4[2] * 2**30 and batch(small, "vit") < 128
    assert gpu_check.half_dtype(T4[1]) == torch.float16 and gpu_check.half_dtype(H200[1]) == torch.bfloat16
    runs = gpu_check.script_runs("cuda", "out", T4[2], T4[1])
    assert {o for _, options, *_ in runs.values() for o in options if o.startswith("--dtype=")} == {"--dtype=float16"}
    assert "gpt d12 T=1024 B=4 n_lap=3/6" in runs  # 1.2 GiB a sequence of 1024 tokens, 14.5 GiB free
    assert "gpt d12 T=1024 B=32 n_lap=3/6" in gpu_check.script_runs("cuda", "out", H200[2], H200[1])


def script_options(script):
    """The options a script declares (configurator.declared_options: `name = value  # comment` at the top level)."""
    return set(re.findall(r"^([a-z]\w*) = .*?  # ", open(os.path.join(ROOT, script)).read(), re.M))


def test_every_option_the_runs_pass_is_one_of_their_script():
    """What the GPU would meet first: an option a script does not have (or a config file that is not there) ends the
    run at once. Checked for the scripts, default and torchrun commands, config files and their keys included."""
    commands = [gpu_check.timed_command(script, options, colour)
                for script, options, colour, *_ in gpu_check.script_runs("cuda", "out", *H200[2:], H200[1]).values()]
    commands += [gpu_check.default_command()] + list(gpu_check.torchrun_commands(2).values())
    for cmd in commands:
        script = next(a.split("=", 1)[1] for a in cmd if a.startswith("--run_script="))
        options = script_options(script)
        for arg in cmd[cmd.index(next(a for a in cmd if a.startswith("--colour="))) + 1:]:
            if arg.startswith("--"):
                assert arg[2:].split("=")[0] in options, (script, arg)
            else:
                keys = re.findall(r"^(\w+) = ", open(os.path.join(ROOT, arg)).read(), re.M)
                assert keys and set(keys) <= options, (script, arg)


def test_turns_give_each_run_its_slack_but_never_the_time_of_the_runs_after_it():
    gpt = Item("scripts", "scripts gpt", 10.0, 0.1, steps=100, min_steps=10, unit=10)
    vit = Item("scripts", "scripts vit", 10.0)
    until = time.perf_counter() + 25.05 + gpu_check.KILL_S
    turns = gpu_check.turns([(gpt, 100), (vit, 0)], until)
    item, steps, limit, why = next(turns)  # 25 s, of which vit keeps 10: 15 s, 50 steps
    assert item is gpt and steps == 50 and limit == pytest.approx(15, abs=0.1)
    item, steps, limit, why = next(turns)  # as if gpt ended at once: 25 s left, vit gets SLACK x 10
    assert item is vit and steps == 0 and limit == pytest.approx(gpu_check.SLACK * 10)
    late = gpu_check.turns([(gpt, 100)], time.perf_counter() + 5)
    assert next(late)[1] is None  # not even min_steps fit: skipped


def test_the_generated_tokens_are_a_learnable_gpt2_sized_set(tmp_path):
    """7 of 8 next tokens follow from the one before: among tokens seen at least 5 times, the usual next token is the
    next one 89% of the time (in a random stream of this vocabulary 15%)."""
    gpu_check.write_tokens(str(tmp_path), n_train=2**18, n_val=2**12)
    meta = json.load(open(tmp_path / "meta.json"))
    train = np.fromfile(tmp_path / "train.bin", dtype=np.uint16)
    assert len(train) == 2**18 and train.max() < meta["vocab_size"] - 1 == 50256 and len(meta["token_bytes"]) == 50257
    assert os.path.getsize(tmp_path / "val.bin") == 2 * 2**12
    successors = {}
    for a, b in zip(train[:-1].tolist(), train[1:].tolist()):
        successors.setdefault(a, Counter())[b] += 1
    often = [c for c in successors.values() if c.total() >= 5]
    assert sum(max(c.values()) for c in often) / sum(c.total() for c in often) > 0.8


def test_flash_rows_wait_for_compute_capability_8():
    from torch.nn.attention import SDPBackend
    cfg = make_config("vit-tiny", n_lap=[0, 2], n_layer=2, n_embd=32, n_head=4)
    rows = gpu_check.part_equal("cpu", {"vit": (cfg, 2)}, [(torch.float32, SDPBackend.FLASH_ATTENTION)], capability=(7, 5))
    flash = [r for r in rows if "flash" in r["check"]]
    assert len(flash) == 1 and flash[0]["ok"] and "needs compute capability 8.0, this GPU has 7.5" in flash[0]["value"]
    late = gpu_check.part_equal("cpu", {"vit": (cfg, 2)}, until=time.perf_counter() - 1)
    assert late and all(not r["ok"] and "time is up" in r["value"] for r in late)


def test_dino_flops_count_the_head_and_the_local_crops():
    """DINO ViT-S/16's head (65,536 prototypes: 22M weights, 45 MFLOP a crop forward) against 28 GFLOP of training per
    224 px crop: about 1%. Each 96 px local crop adds its 37 tokens' training and the head's forward and backward."""
    backbone = make_config("vit-s", n_lap=3, num_classes=0, in_chans=3, img_size=224)
    without = gpu_check.dino_flops_per_image(backbone, out_dim=1, hidden=1, bottleneck=1)
    assert 1.005 < gpu_check.dino_flops_per_image(backbone) / without < 1.03
    local = (gpu_check.dino_flops_per_image(backbone) - gpu_check.dino_flops_per_image(backbone, local_crops=0)) / 8
    assert 1.0 < local / (gpu_check.training_flops_per_token(backbone, 37) * 37) < 1.05


def test_compile_time_counts_both_graphs_and_leaves_out_the_step_0_evaluation():
    """GPT and DINO evaluate at step 0, the ViT only after its first epoch: each compiles a training graph and an
    evaluation graph, and each is charged both, never the evaluation's own time."""
    gpt = [(0.0, "batch: 32,768 tokens per step"), (50.0, "eval step 0: val loss 4.2"),  # 10 s eval + 40 s eval compile
           (80.0, "step 10/30 | loss 3.1"), (81.0, "step 20/30 | loss 3.0"), (82.0, "step 30/30 | loss 2.9"),
           (92.0, "eval step 30: val loss 2.8"), (93.0, "RESULT steps=30")]
    rate, compile_s = gpu_check.timing(gpt)
    assert rate == 10.0 and compile_s == pytest.approx((80 - 50 - 1) + (50 - 10))
    vit = [(0.0, "schedule: global batch 512"), (30.0, "epoch 1/2 step 10/20 | loss 2.3"),
           (31.0, "epoch 1/2 step 20/20 | loss 2.2"), (56.0, "eval epoch 1: val_acc 0.5 (25.0s)"),
           (57.0, "epoch 2/2 step 30/40 | loss 2.1"), (58.0, "epoch 2/2 step 40/40 | loss 2.0"),
           (63.0, "eval epoch 2: val_acc 0.6 (5.0s)")]
    rate, compile_s = gpu_check.timing(vit)
    assert rate == 10.0 and compile_s == pytest.approx((30 - 0 - 1) + (25 - 5))


# ---- the loop against its model -------------------------------------------------
def run_lines(model_line=None):
    """A finished run's output, timed: 10 steps between progress lines a second apart (10 steps/s: 100 ms a step)."""
    lines = [(0.0, "batch: 32,768 tokens per step"), (5.0, "step 10/30 | loss 3.1 | 1 tok/s"),
             (6.0, "step 20/30 | loss 3.0 | 1 tok/s"), (7.0, "step 30/30 | loss 2.9 | 1 tok/s"),
             (8.0, "RESULT steps=30 val_bpb=1.9"), (8.5, "gpu_check syncs_between_lines=0")]
    return lines + ([(9.0, model_line)] if model_line else [])


def test_the_loop_row_divides_the_step_by_its_model_passes():
    rows = gpu_check.script_rows("gpt d12", 32768, "tok", 1e12, None, 0, run_lines("gpu_check model_fwd_bwd_ms=40.00 "
                                                                                      "passes=1"))
    loop = rows[3]
    assert loop["check"] == "gpt d12: step ms | model fwd+bwd ms | step / model" and loop["ok"]
    assert loop["value"] == "100.0 | 40.0 | 2.50" and (loop["key"], loop["number"]) == ("gpt_step_over_model", "2.50")
    rows = gpu_check.script_rows("gpt d12", 32768, "tok", 1e12, None, 0, run_lines(
        "gpu_check model_fwd_bwd_error=OutOfMemoryError: CUDA out of memory"))
    assert not rows[3]["ok"] and rows[3]["value"] == "not measured: OutOfMemoryError: CUDA out of memory"
    assert all(r["ok"] for r in rows[:3] + rows[4:]) and rows[1]["value"] == "10.00 | 327,680 | -"  # its own rows stand
    missing = gpu_check.loop_row("gpt d12", 10.0, run_lines())  # the run ended, and no passes followed
    assert not missing["ok"] and "not measured" in missing["value"]
    killed = gpu_check.loop_row("gpt d12", 10.0, run_lines(), killed=True)  # its failure is the killed row's
    assert killed["ok"] and killed["key"] is None


# the child's count of host syncs: steps 0 and 3 print a line, step 2 syncs without one
SYNCING_SCRIPT = """
import warnings
step = 0
print("batch: 32,768 tokens per step")
warnings.warn("called a synchronizing CUDA operation")
for step in range(1, 4):
    if step == 2:
        warnings.warn("called a synchronizing CUDA operation")
    if step == 3:
        warnings.warn("called a synchronizing CUDA operation")
        print("step 3/3 | loss 2.9 | 1 tok/s")
"""


def test_a_sync_at_a_step_that_printed_nothing_fails_the_recipe(tmp_path, monkeypatch):
    """Under CUDA's sync debug mode (faked here: its warnings are the script's own) each sync counts at its step: those
    at steps that print a progress line or evaluate (the step's reads) pass, the one at step 2 fails the recipe."""
    script = tmp_path / "syncs.py"
    script.write_text(SYNCING_SCRIPT)
    modes = []
    monkeypatch.setattr(torch.cuda, "set_sync_debug_mode", modes.append)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(gpu_check, "SYNCS", Counter())
    monkeypatch.setattr(gpu_check, "PRINTED", set())
    monkeypatch.setattr(builtins, "print", builtins.print)  # count_syncs replaces them: back after the test
    with warnings.catch_warnings():
        gpu_check.count_syncs(str(script))
        runpy.run_path(str(script), run_name="__main__")
    line = gpu_check.syncs_line()
    assert modes == ["warn"] and re.fullmatch(r"gpu_check syncs_between_lines=1 first at step 2 \S*syncs\.py:8 x1", line)
    failed = gpu_check.sync_row("gpt d12", [(0.0, line)])
    assert not failed["ok"] and (failed["key"], failed["number"]) == ("gpt_syncs_between_lines", "1")
    passed = gpu_check.sync_row("gpt d12", [(0.0, "gpu_check syncs_between_lines=0")])
    assert passed["ok"] and passed["check"] == "gpt d12: host syncs between progress lines"
    assert not gpu_check.sync_row("gpt d12", [])["ok"] and gpu_check.sync_row("gpt d12", [], killed=True)["ok"]


def tiny_checkpoint(kind, **config):
    """A checkpoint as the scripts write it (kind, model_config, config), of a small model."""
    if kind == "gpt":
        cfg = make_config("gpt-tiny", n_layer=2, n_embd=32, n_head=2, n_lap=[1, 2], vocab_size=64, block_size=16)
        options = dict(batch_size=3, block_size=16, total_batch_size=0)
    else:
        cfg = make_config("vit-tiny", n_layer=2, n_embd=32, n_head=2, n_lap=[0, 2], num_classes=0 if kind == "dino" else 10,
                          img_size=28, patch_size=7, in_chans=3)
        options = dict(batch_size=3, grad_accum=1) if kind == "vit" else dict(
            batch_size=3, drop_path=0.1, out_dim=48, head_hidden=24, head_bottleneck=8, norm_last_layer=True,
            local_crops=2, local_size=14)
    return dict(kind=kind, model_config=dataclasses.asdict(cfg),
                config=dict(device="cpu", dtype="float32", compile_model=False, **{**options, **config}))


@pytest.mark.parametrize("kind, options, shape, passes", [
    ("gpt", {}, (3, 16), 1), ("gpt", dict(total_batch_size=4 * 3 * 16), (3, 16), 4),  # 4 micro-steps a step
    ("vit", {}, (3, 3, 28, 28), 1), ("vit", dict(grad_accum=2), (3, 3, 28, 28), 2)])
def test_model_passes_are_one_micro_batch_forward_and_backward_of_the_runs_model(kind, options, shape, passes):
    one_pass, count = gpu_check.model_passes(tiny_checkpoint(kind, **options), "cpu")
    model, x = one_pass.args
    assert count == passes and tuple(x.shape) == shape and model.training
    one_pass()
    assert all(p.grad is not None for p in model.parameters())


def test_dino_passes_are_the_teachers_forward_on_global_crops_and_the_students_on_all(monkeypatch):
    """As train_dino.py's step: the teacher (no drop path) sees the 2 x B global crops without gradients; the student
    (drop path 0.1) sees them and the 2 x B local ones, and its backbone and head get gradients."""
    built = []
    seen = []

    def recording_build_model(cfg):
        model = build_model(cfg)
        model.register_forward_pre_hook(lambda m, args: seen.append((m, tuple(args[0].shape), torch.is_grad_enabled())))
        built.append(model)
        return model

    monkeypatch.setattr(gpu_check, "build_model", recording_build_model)
    one_pass, passes = gpu_check.model_passes(tiny_checkpoint("dino"), "cpu")
    one_pass()
    student, teacher = built
    assert passes == 1 and student.config.drop_path == 0.1 and teacher.config.drop_path == 0.0
    assert seen == [(teacher, (6, 3, 28, 28), False), (student, (6, 3, 28, 28), True), (student, (6, 3, 14, 14), True)]
    assert all(p.grad is not None for p in student.parameters()) and all(p.grad is None for p in teacher.parameters())


def test_dino_passes_compile_each_backbone_as_train_dino_does(monkeypatch):
    """train_dino.py compiles each backbone with dynamic=False (a static graph per crop size, never a dynamic one):
    the loop row's model passes must time those graphs."""
    compiled = []

    def compile(model, **options):
        compiled.append(options)
        return model

    monkeypatch.setattr(torch, "compile", compile)
    ckpt = tiny_checkpoint("dino")
    ckpt["config"]["compile_model"] = True
    gpu_check.model_passes(ckpt, "cpu")
    assert compiled == [dict(dynamic=False), dict(dynamic=False)]  # the student's backbone and the teacher's


def test_a_finished_runs_model_passes_print_their_milliseconds_or_why_not(tmp_path, capsys):
    torch.save(tiny_checkpoint("gpt", total_batch_size=2 * 3 * 16), tmp_path / common.CHECKPOINT)
    gpu_check.print_model_passes(str(tmp_path))
    out = capsys.readouterr().out
    lines = [(0.0, text) for text in out.splitlines()]
    milliseconds, error = gpu_check.model_milliseconds(lines)
    assert error is None and milliseconds > 0 and out.endswith(" passes=2\n")
    gpu_check.print_model_passes(str(tmp_path / "none"))  # no checkpoint: a traceback and one line, no exception
    captured = capsys.readouterr()
    assert gpu_check.model_milliseconds([(0.0, text) for text in captured.out.splitlines()]) == (
        None, f"FileNotFoundError: [Errno 2] No such file or directory: '{tmp_path / 'none' / common.CHECKPOINT}'")
    assert "Traceback" in captured.err

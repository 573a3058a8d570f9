"""tests/gpu_check.py's own machinery, on the CPU, before a GPU is at hand: the data it needs are checked first, each
part ends by its share of the deadline and leaves its rows on disk at once, a hung command is killed with every process
it started, and the sizes and kernels follow the GPU. The parts that need a model or a script are in test_compiled.py
(slow tier)."""

import os
import sys
import textwrap
import time

import pytest
import torch

import common
import gpu_check
from conftest import ROOT
from nanolap import make_config

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


def test_a_quick_command_keeps_its_code_and_output():
    code, lines = gpu_check.run_command([sys.executable, "-c", "print('a'); print('b'); raise SystemExit(3)"], 30)
    assert code == 3 and [text for _, text in lines] == ["a", "b"]


def test_each_part_ends_by_its_share_and_leaves_its_rows_at_once(tmp_path, monkeypatch):
    """A fake slow part runs past the whole deadline: the finished part's rows and RESULT are on disk while it runs,
    the watchdog stops the check GRACE after the deadline with one line, and a part with no time left is not started
    (a failed row)."""
    monkeypatch.setattr(gpu_check, "PLAN", dict(equal=1, cost=3, tests=1))
    monkeypatch.setattr(gpu_check, "GRACE", 0.2)
    monkeypatch.setattr(gpu_check, "MIN_START", 0.3)
    stopped = []
    monkeypatch.setattr(gpu_check, "give_up", stopped.append)  # instead of os._exit
    seen = {}

    def equal(until):
        seen["equal"] = until - time.perf_counter()
        return [gpu_check.row("equal", "vit float32", "logits 1e-07", "1e-04", True)]

    def slow_cost(until):  # a part that ignores its share
        seen["cost"] = until - time.perf_counter()
        seen["rows during cost"] = open(tmp_path / gpu_check.ROWS).read()
        seen["result during cost"] = common.read_result(str(tmp_path))
        time.sleep(1.2)
        return [gpu_check.row("cost", "gpt eager", "1.02", "<= 1.1", True, "lap_cost_gpt_eager", "1.020")]

    def tests(until):
        raise AssertionError("no time was left: tests must not start")

    failed = gpu_check.main(("equal", "cost", "tests"), str(tmp_path), seconds=0.6,
                            runners=dict(equal=equal, cost=slow_cost, tests=tests), gpu=H200)
    assert seen["equal"] == pytest.approx(0.6 * 1 / 5, abs=0.05) and seen["cost"] == pytest.approx(0.6 * 3 / 4, abs=0.05)
    assert "vit float32" in seen["rows during cost"] and seen["result during cost"]["parts"] == "equal"
    assert stopped == [1]  # the watchdog at 0.6 + 0.2 s, during cost
    rows = open(tmp_path / gpu_check.ROWS).read()
    assert "deadline (1 s + 0.2 s) passed during part cost" in rows
    assert "gpt eager" in rows and "not started: 0.6 s deadline reached" in rows
    assert failed == 1 and common.read_result(str(tmp_path))["lap_cost_gpt_eager"] == "1.020"


def test_missing_data_fail_their_rows_at_once_in_one_line(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(gpu_check, "ROOT", str(tmp_path))  # a fresh machine's tree: no prepared data
    monkeypatch.setattr(gpu_check.images, "DEBIAN_FASHION", str(tmp_path / "none"))
    assert gpu_check.missing_data(None) == ""
    assert "data/shakespeare_char/{train.bin,val.bin,meta.json}" in gpu_check.missing_data("shakespeare_char")
    t0 = time.perf_counter()
    runners = gpu_check.part_runners(str(tmp_path))
    failed = gpu_check.main(("default",), str(tmp_path), seconds=60, runners=runners, gpu=H200)
    assert failed == 1 and time.perf_counter() - t0 < 5  # nothing ran
    out = capsys.readouterr().out
    assert out.count("gpu_check: missing data/fashion_mnist/") == 1 and "the runs that read it fail" in out
    assert "train_vit.py default: data" in open(tmp_path / gpu_check.ROWS).read()
    torchrun = gpu_check.TORCHRUN_DATA
    assert torchrun["gpt"] == "shakespeare_char" and gpu_check.data_row("torchrun", "gpt", torchrun["gpt"])["ok"] is False


def test_data_found_in_the_repository_or_the_debian_folder(tmp_path, monkeypatch):
    monkeypatch.setattr(gpu_check, "ROOT", str(tmp_path))
    monkeypatch.setattr(gpu_check.images, "DEBIAN_FASHION", str(tmp_path / "none"))
    for name in ("train.bin", "val.bin", "meta.json"):
        os.makedirs(tmp_path / "data" / "shakespeare_char", exist_ok=True)
        (tmp_path / "data" / "shakespeare_char" / name).write_text("x")
    os.makedirs(tmp_path / "data" / "fashion_mnist")
    for pair in gpu_check.images.FASHION_FILES.values():
        for name in pair:
            (tmp_path / "data" / "fashion_mnist" / name).write_text("x")
    assert gpu_check.missing_data("shakespeare_char") == "" and gpu_check.missing_data("fashion_mnist") == ""


def test_sizes_fit_the_free_memory_and_old_gpus_get_float16():
    """A 16 GB T4: the cost GPT's float32 logits (B x 1024 x 65,536 x 4 bytes a copy, three copies in a step) take
    under half its free memory; an H200 keeps the full sizes. Below compute capability 8.0, float16."""
    def batch(cases, kind):
        return next(int(name.split("B=")[1]) for name in cases if name.startswith(kind))
    big, small = gpu_check.cost_cases(H200[2]), gpu_check.cost_cases(T4[2])
    assert batch(big, "gpt") == 16 and batch(big, "vit") == 128
    assert 3 * batch(small, "gpt") * 1024 * 65536 * 4 < 0.5 * T4[2] * 2**30 and batch(small, "vit") < 128
    assert gpu_check.half_dtype(T4[1]) == torch.float16 and gpu_check.half_dtype(H200[1]) == torch.bfloat16


@pytest.mark.slow
def test_script_runs_fit_a_t4():
    """Below compute capability 8.0: float16 with a gradient scaler for every script, at a batch that fits."""
    runs = gpu_check.script_runs("cuda", "out", T4[2], T4[1])
    dtypes = {name.split()[0]: [o for o in options if o.startswith("--dtype=")] for name, (_, options, *_) in runs.items()}
    assert dtypes == {"vit": ["--dtype=float16"], "gpt": ["--dtype=float16"], "dino": ["--dtype=float16"]}
    assert "gpt d12 T=1024 B=8" in runs  # 0.9 GiB a sequence of 1024 characters, 14.5 GiB free
    assert "gpt d12 T=1024 B=32" in gpu_check.script_runs("cuda", "out", H200[2], H200[1])


def test_flash_rows_wait_for_compute_capability_8():
    from torch.nn.attention import SDPBackend
    cfg = make_config("vit-tiny", n_lap=[0, 2], n_layer=2, n_embd=32, n_head=4)
    rows = gpu_check.part_equal("cpu", {"vit": (cfg, 2)}, [(torch.float32, SDPBackend.FLASH_ATTENTION)], capability=(7, 5))
    flash = [r for r in rows if "flash" in r["check"]]
    assert len(flash) == 1 and flash[0]["ok"] and "needs compute capability 8.0, this GPU has 7.5" in flash[0]["value"]
    late = gpu_check.part_equal("cpu", {"vit": (cfg, 2)}, until=time.perf_counter() - 1)
    assert late and all(not r["ok"] and "time is up" in r["value"] for r in late)


def test_dino_flops_count_the_head():
    backbone = make_config("vit-cpu", n_lap=2, num_classes=0)
    without = gpu_check.dino_flops_per_image(backbone, out_dim=1, hidden=1, bottleneck=1)  # a head of ~100 FLOPs
    assert 1.05 < gpu_check.dino_flops_per_image(backbone) / without < 1.2  # the DINO head: about a tenth


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

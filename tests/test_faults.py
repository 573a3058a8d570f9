"""Reliability at the edges, as a user meets it: a fresh run started over a finished one and killed, damaged
checkpoints, an out_dir that cannot be written, temporary files of killed saves, and Ctrl-C before and after the
first checkpoint. Every script runs in its own process, on tiny settings; the tests poll the output and
the folder, they never sleep for a fixed time. Slow tier: python -m pytest -q -m slow tests/test_faults.py"""

import io
import itertools
import os
import random
import re
import shutil
import signal
import subprocess
import sys
import threading
import time

import pytest
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
import common  # noqa: E402
import configurator  # noqa: E402
from common import load_checkpoint  # noqa: E402

# as in a user's shell: stdout buffered when it is not a terminal (this machine's PYTHONUNBUFFERED=1 would hide that)
ENV = dict({k: v for k, v in os.environ.items() if k != "PYTHONUNBUFFERED"}, CUDA_VISIBLE_DEVICES="", OMP_NUM_THREADS="1")
KINDS = ("vit", "gpt", "dino")
PROGRESS = re.compile(r"^step \d+/\d+ \|", re.M)  # the progress line of every script
NOISE = ("Traceback", "remote worker", "Connection closed", "Connection reset", "weights_only")


def command(kind, data_dir, *extra):
    """A tiny run of train_<kind>.py on the CPU, in this process (--cpu_procs on the command line wins)."""
    tiny = {"vit": ["--dataset=synthetic", "--train_subset=256", "--val_subset=128", "--epochs=2", "--batch_size=32",
                    "--log_interval=1"],
            "gpt": ["--n_layer=2", "--n_head=2", "--n_embd=32", "--block_size=32", "--batch_size=4", "--eval_iters=2",
                    "--log_interval=1", "--max_new_tokens=0", f"--data_dir={data_dir}", "--dataset=tiny",
                    "--max_iters=8", "--eval_interval=4"],
            "dino": ["--dataset=synthetic", "--n_layer=2", "--n_embd=32", "--n_head=2", "--n_lap=1", "--out_dim=64",
                     "--head_hidden=32", "--head_bottleneck=16", "--train_subset=128", "--batch_size=32",
                     "--eval_train=128", "--eval_val=64", "--probe_steps=5", "--seg_dataset=none", "--log_interval=1",
                     "--epochs=2.0", "--eval_interval=100"]}[kind]
    return [f"train_{kind}.py", "--device=cpu", "--cpu_procs=1", *tiny, *extra]


def run(argv, timeout=300):
    """A script to its end, as a user runs it: (exit status, stdout, stderr)."""
    p = subprocess.run([sys.executable, *argv], cwd=ROOT, env=ENV, capture_output=True, text=True, timeout=timeout)
    return p.returncode, p.stdout, p.stderr


class Background:
    """A script started in the background whose output lines are collected as they come."""

    def __init__(self, argv):
        # Ctrl-C as a terminal delivers it: a shell's background job (`cmd &`, as CI may start pytest) passes on
        # SIGINT ignored, and a Python started so never raises KeyboardInterrupt; its children start from the default
        default_sigint = lambda: signal.signal(signal.SIGINT, signal.SIG_DFL)  # noqa: E731
        self.proc = subprocess.Popen([sys.executable, *argv], cwd=ROOT, env=ENV, text=True, stdout=subprocess.PIPE,
                                     stderr=subprocess.PIPE, preexec_fn=default_sigint)
        self.out, self.err = [], []
        self.readers = [threading.Thread(target=lambda s=s, lines=lines: lines.extend(s), daemon=True)
                        for s, lines in ((self.proc.stdout, self.out), (self.proc.stderr, self.err))]
        for t in self.readers:
            t.start()

    def stdout(self):
        return "".join(self.out)

    def wait_for(self, condition, what, timeout=180):
        """Poll until condition() holds; fail when the process ends first or the deadline passes."""
        deadline = time.time() + timeout
        while not condition():
            assert self.proc.poll() is None or condition(), f"the run ended before {what}:\n{''.join(self.err)[-2000:]}"
            assert time.time() < deadline, f"no {what} within {timeout}s"
            time.sleep(0.001)

    def kill(self):
        self.proc.send_signal(signal.SIGKILL)
        self.proc.wait()
        for t in self.readers:
            t.join(timeout=60)


def temp_files(folder):
    return [n for n in os.listdir(folder) if n.startswith("ckpt.pt.tmp")]


def assert_one_line_error(rc, out, err, *needles):
    """Exit status != 0, one line on stderr holding every needle, no traceback or process-group noise."""
    assert rc != 0, out[-2000:]
    assert len(err.strip().splitlines()) == 1, err[-3000:]
    assert err.startswith("error: ") and all(n in err for n in needles), err
    assert not any(n in err for n in NOISE), err


@pytest.fixture(scope="module")
def finished(tmp_path_factory, data_dir):
    """One finished tiny run of each script: {kind: its out_dir}. Tests copy them, never change them."""
    runs = {}
    for kind in KINDS:
        runs[kind] = str(tmp_path_factory.mktemp(f"finished-{kind}"))
        rc, out, err = run(command(kind, data_dir, f"--out_dir={runs[kind]}"))
        assert rc == 0 and "RESULT " in out, err[-3000:]
    return runs


def copy_run(src, dst):
    shutil.copytree(src, dst)
    return str(dst)


# ----------------------------------------------------------------------------- a fresh run over an old one

@pytest.mark.slow
@pytest.mark.parametrize("kind", KINDS)
def test_killed_fresh_run_keeps_the_old_run_and_resume_does_not_continue_it(kind, finished, data_dir, tmp_path):
    """A fresh run in a finished run's folder moves the old files to previous-*/ first; killed before its own first
    checkpoint, it leaves no ckpt.pt, so --resume refuses in one line instead of continuing the old run."""
    out_dir = copy_run(finished[kind], tmp_path / "run")
    old = {n: open(os.path.join(out_dir, n), "rb").read() for n in ("ckpt.pt", "log.jsonl", "result.txt")}
    # long enough that the first checkpoint comes seconds after the first line we wait for: vit checkpoints
    # after its first epoch (64 steps), gpt at its end (no evaluation in between), dino after its step-0 k-NN
    # (no progress line comes before it, so we wait for the data line)
    longer = {"vit": ["--train_subset=2048"], "gpt": ["--max_iters=500", "--eval_interval=1000"],
              "dino": ["--train_subset=2048", "--eval_train=2048", "--eval_val=512"]}[kind]
    first_line = re.compile(r"^backbone: " if kind == "dino" else PROGRESS.pattern, re.M)
    fresh = Background(command(kind, data_dir, *longer, f"--out_dir={out_dir}"))
    try:
        fresh.wait_for(lambda: first_line.search(fresh.stdout()), "a first progress/data line")
    finally:
        fresh.kill()
    assert f"note: {out_dir} held an earlier run" in fresh.stdout()
    assert not os.path.exists(os.path.join(out_dir, "ckpt.pt")), "the fresh run checkpointed before it was killed"
    aside = [n for n in os.listdir(out_dir) if n.startswith("previous-")]
    assert len(aside) == 1
    for name, content in old.items():  # the old run, byte for byte
        assert open(os.path.join(out_dir, aside[0], name), "rb").read() == content, name
    rc, out, err = run(command(kind, data_dir, "--resume", f"--out_dir={out_dir}"))
    assert_one_line_error(rc, out, err, "no checkpoint at", os.path.join(out_dir, "ckpt.pt"))
    assert not PROGRESS.search(out)


@pytest.mark.slow
def test_the_note_on_an_earlier_run_comes_first_with_processes(finished, data_dir, tmp_path):
    """--cpu_procs=2: the launcher moves the earlier run aside before its processes start, and says so first."""
    out_dir = copy_run(finished["vit"], tmp_path / "run")
    rc, out, err = run(command("vit", data_dir, "--cpu_procs=2", "--epochs=1", f"--out_dir={out_dir}"))
    assert rc == 0, err[-2000:]
    assert out.startswith(f"note: {out_dir} held an earlier run"), out[:2000]


@pytest.mark.slow
def test_a_fresh_run_moves_the_old_runs_analysis_aside_with_it(finished, data_dir, tmp_path):
    """analyze.py's outputs describe the checkpoint they were made from: a fresh run in the folder moves them
    aside with that checkpoint, so no summary.md of the old model sits next to the new run's RESULT line."""
    out_dir = copy_run(finished["vit"], tmp_path / "run")
    rc, out, err = run(["analyze.py", out_dir, "--device=cpu"])
    assert rc == 0 and os.path.isfile(os.path.join(out_dir, "analysis", "summary.md")), err[-2000:]
    rc, out, err = run(["analyze.py", out_dir, "--device=cpu", f"--out={os.path.join(out_dir, 'analysis-2')}"])
    assert rc == 0, err[-2000:]
    old_summary = open(os.path.join(out_dir, "analysis", "summary.md"), "rb").read()
    rc, out, err = run(command("vit", data_dir, "--epochs=1", f"--out_dir={out_dir}"))
    assert rc == 0 and "RESULT " in out, err[-2000:]
    aside = [n for n in os.listdir(out_dir) if n.startswith("previous-")]
    assert len(aside) == 1 and "analysis, analysis-2, ckpt.pt, log.jsonl, result.txt moved to" in out, out[:2000]
    assert sorted(os.listdir(out_dir)) == sorted(aside + ["ckpt.pt", "log.jsonl", "result.txt"])
    assert open(os.path.join(out_dir, aside[0], "analysis", "summary.md"), "rb").read() == old_summary


def test_prepare_out_dir_moves_everything_that_describes_the_old_run_together(tmp_path, capsys):
    """The run's files, analyze.py's folder, a folder it wrote with --out (it holds an analysis.json), loose
    analysis files and figures go into one previous-*/ folder; the user's other files and earlier previous-*/
    folders stay where they are."""
    out = tmp_path / "run"
    for name in ("ckpt.pt", "log.jsonl", "result.txt", "analysis/summary.md", "analysis/collapse.png",
                 "layer2/analysis.json", "summary.md", "spectrum.png", "notes.txt", "mine/data.csv",
                 "previous-1/analysis/analysis.json"):
        (out / name).parent.mkdir(parents=True, exist_ok=True)
        (out / name).write_text(name)
    common.prepare_out_dir(str(out), resume=True)  # a resume keeps everything
    assert (out / "analysis" / "summary.md").exists() and not capsys.readouterr().out
    common.prepare_out_dir(str(out), resume=False)
    aside = [n for n in os.listdir(out) if n.startswith("previous-") and n != "previous-1"]
    assert len(aside) == 1
    assert sorted(os.listdir(out)) == sorted(aside + ["mine", "notes.txt", "previous-1"])
    assert sorted(os.listdir(out / aside[0])) == ["analysis", "ckpt.pt", "layer2", "log.jsonl", "result.txt",
                                                  "spectrum.png", "summary.md"]
    assert (out / aside[0] / "analysis" / "collapse.png").read_text() == "analysis/collapse.png"
    assert "analysis, ckpt.pt, layer2, log.jsonl, result.txt, spectrum.png, summary.md moved to" in capsys.readouterr().out


# ----------------------------------------------------------------------------- --resume of a finished run

@pytest.mark.slow
@pytest.mark.parametrize("kind", KINDS)
def test_resume_of_a_finished_run_leaves_it_byte_identical_and_says_how_to_train_longer(kind, finished, data_dir,
                                                                                       tmp_path):
    """Nothing to train: exit status 0, the folder's files byte for byte (and no new ones), and one line saying that a
    longer schedule is a new run."""
    out_dir = copy_run(finished[kind], tmp_path / "run")
    before = {n: open(os.path.join(out_dir, n), "rb").read() for n in os.listdir(out_dir)}
    assert {"ckpt.pt", "log.jsonl", "result.txt"} <= set(before)
    rc, out, err = run(command(kind, data_dir, "--resume", f"--out_dir={out_dir}"))
    assert rc == 0, err[-2000:]
    assert {n: open(os.path.join(out_dir, n), "rb").read() for n in os.listdir(out_dir)} == before
    assert "RESULT " not in out and not PROGRESS.search(out), out[-2000:]
    option = {"vit": "--epochs", "gpt": "--max_iters", "dino": "--epochs"}[kind]
    total = {"vit": 16, "gpt": 8, "dino": 8}[kind]
    assert f"{out_dir} holds a finished run (step {total} of {total}): --resume has nothing to train" in out, out
    assert f"start a new --out_dir with a longer {option}" in out, out


# ----------------------------------------------------------------------------- refused options

@pytest.mark.slow
@pytest.mark.parametrize("kind", KINDS)
def test_a_refused_option_leaves_no_out_dir_behind(kind, data_dir, tmp_path):
    """A model option the config refuses and a dataset that is not there (both checked before out_dir is made): one
    line, and no out_dir made; nor a data folder by the failed download."""
    out_dir = tmp_path / "new" / "run"
    out_dir.parent.mkdir()
    rc, out, err = run(command(kind, data_dir, "--n_lap=9", f"--out_dir={out_dir}"))
    assert_one_line_error(rc, out, err, "n_lap=9", "at most n_head")
    assert not out_dir.exists() and "note:" not in out
    missing = f"--data_dir={tmp_path / 'no-data'}"  # data are read before out_dir is made, too
    rc, out, err = run(command(kind, data_dir, missing, "--dataset=cifar10" if kind != "gpt" else "--dataset=tiny",
                               "--cpu_procs=2", f"--out_dir={out_dir}"))
    assert rc != 0 and err.startswith("error: ") and len(err.splitlines()) <= 2 and not out_dir.exists(), err[-1000:]
    assert not (tmp_path / "no-data").exists()  # a failed download leaves no empty no-data/cifar10/


def test_unknown_options_name_the_closest_valid_ones(tmp_path):
    """An unknown option or config-file key: the nearest names (did you mean ...?) and --help, not every name."""
    defaults = dict(n_lap=4, n_layer=4, n_head=4, batch_size=128, lr=3e-3, out_dir="out-vit", warmup_epochs=0.5)
    for argv, message in ((["--nlap=2"], "unknown option --nlap; did you mean --n_lap? --help lists every option"),
                          (["--batchsize=64"], "unknown option --batchsize; did you mean --batch_size?"),
                          (["--zzz=1"], "unknown option --zzz; --help lists every option")):
        with pytest.raises(common.UsageError) as e:
            configurator.parse_args(defaults, argv)
        assert str(e.value).startswith(message) and len(str(e.value)) < 120, str(e.value)
    f = tmp_path / "cfg.py"
    f.write_text("n_lap = 2\nwarmup_epoch = 1.0\n")
    with pytest.raises(common.UsageError) as e:
        configurator.parse_args(defaults, [str(f)])
    assert str(e.value) == (f"config file {f}: line 2: unknown key 'warmup_epoch'; did you mean warmup_epochs? "
                            f"--help lists every option")


@pytest.mark.slow
def test_bad_input_is_one_short_line_in_a_shell(tmp_path):
    """Bad input as a user meets it: exit status 1 and one `error: ...` line, no traceback, also where each of two
    CPU processes meets it (a data folder that is not there): only the first speaks. The scripts' messages themselves
    are tested in their own files, in process."""
    for kind in KINDS:
        rc, out, err = run([f"train_{kind}.py", "--nlap=2"])
        assert_one_line_error(rc, out, err, "unknown option --nlap; did you mean --n_lap?", "--help")
        assert len(err) < 120, err
    rc, out, err = run(["train_vit.py", "--cpu_procs=2", "--dataset=imagefolder", f"--data_dir={tmp_path}/nowhere",
                        f"--out_dir={tmp_path}/o"])
    assert_one_line_error(rc, out, err, "is not a directory")


# ----------------------------------------------------------------------------- damaged checkpoints

def damage(path, how, real):
    """Write a damaged checkpoint at path: random bytes, the first half of a real checkpoint, nothing, or the real one
    with one exponent bit flipped in the first float of a weight or of the optimizer's state (1e-2 becomes 1e36)."""
    if how in ("weight", "optimizer"):
        tensor = first_float_tensor(torch.load(io.BytesIO(real), weights_only=True)["model" if how == "weight" else how])
        at = real.find(tensor.numpy().tobytes())
        assert at >= 0, how
        at += 3  # the highest byte of a little-endian float32: its sign and 7 of its 8 exponent bits
        data = real[:at] + bytes([real[at] ^ 0x40]) + real[at + 1:]
    else:
        data = {"random": random.Random(0).randbytes(4096), "truncated": real[:len(real) // 2], "empty": b""}[how]
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "wb") as f:
        f.write(data)
    return path


def first_float_tensor(state):
    """The first float32 tensor of 16 or more numbers in a state dict, an optimizer's state or a list of them."""
    values = state.values() if isinstance(state, dict) else state if isinstance(state, list) else [state]
    for value in values:
        if isinstance(value, torch.Tensor) and value.dtype == torch.float32 and value.numel() >= 16:
            return value
        found = None if isinstance(value, torch.Tensor) else first_float_tensor(value)
        if found is not None:
            return found
    return None


@pytest.mark.parametrize("how", ["random", "truncated", "empty", "weight", "optimizer"])
def test_a_damaged_checkpoint_is_refused_in_one_line(how, tmp_path):
    """The one reader of checkpoints (common.load_checkpoint): a damaged file is named and called damaged or
    truncated, never loaded with weights_only=False (which would run whatever code the file holds); a flipped bit in
    a weight or the optimizer's state too, which torch.load alone would load."""
    real = tmp_path / "real.pt"
    optimizer = {"state": {0: {"exp_avg": torch.randn(64, 64) / 100}}, "param_groups": [{"lr": 0.1, "params": [0]}]}
    common.save_checkpoint({"kind": "vit", "model": {"w": torch.randn(64, 64) / 100}, "optimizer": optimizer,
                            "step": 3}, str(real))
    path = damage(str(tmp_path / "run" / "ckpt.pt"), how, real.read_bytes())
    with pytest.raises(common.UsageError) as e:
        common.load_checkpoint(path, "--resume: ")
    assert str(e.value).startswith(f"--resume: {path} cannot be read (") and "damaged or truncated" in str(e.value)
    assert "weights_only" not in str(e.value) and "\n" not in str(e.value)


@pytest.mark.slow
def test_every_command_that_reads_a_checkpoint_refuses_a_damaged_one_in_one_line(finished, data_dir, tmp_path):
    """As a user meets it, once per command (the kinds of damage in turn): exit status 1 and one line that names the
    file and says it is damaged or truncated, and no analysis/ folder. A flipped bit reaches --resume and analyze.py of
    the ViT and DINO: loaded, a weight 1e36 times too large would end analyze.py in a LinAlgError."""
    hows = itertools.cycle(["optimizer", "weight", "random", "truncated", "empty"])
    readers = {"vit": ["--resume", "analyze.py"], "gpt": ["--resume", "analyze.py", "--sample_from"],
               "dino": ["--resume", "analyze.py", "--eval_only"]}
    for kind, names in readers.items():
        real = open(os.path.join(finished[kind], "ckpt.pt"), "rb").read()
        for name in names:
            run_dir = copy_run(finished[kind], tmp_path / f"{kind}{name}")
            path = damage(os.path.join(run_dir, "ckpt.pt"), next(hows), real)
            argv = {"--resume": command(kind, data_dir, "--resume", f"--out_dir={run_dir}"),
                    "analyze.py": ["analyze.py", run_dir],
                    "--sample_from": ["train_gpt.py", f"--sample_from={path}", "--device=cpu"],
                    "--eval_only": command(kind, data_dir, f"--eval_only={path}", f"--out_dir={tmp_path / 'probes'}")}
            rc, out, err = run(argv[name])
            assert_one_line_error(rc, out, err, path, "damaged or truncated")
            assert name == "analyze.py" or err.startswith(f"error: {name}: "), err
            assert "intact" not in err and not os.path.exists(os.path.join(run_dir, "analysis")), err


@pytest.mark.slow
def test_gpt_resume_skips_a_cut_last_log_line(finished, data_dir, tmp_path):
    """A log.jsonl whose last line was cut short (a full disk, an interrupted copy): --resume keeps the whole lines."""
    out_dir = tmp_path / "run"
    rc, out, err = run(command("gpt", data_dir, "--stop_at_step=4", f"--out_dir={out_dir}"))
    assert rc == 0, err[-2000:]
    with open(out_dir / "log.jsonl", "a") as f:
        f.write('{"step": 5, "val_lo')
    rc, out, err = run(command("gpt", data_dir, "--resume", f"--out_dir={out_dir}"))
    assert rc == 0 and "RESULT " in out, err[-2000:]
    assert [line[:12] for line in open(out_dir / "log.jsonl")] == ['{"step": 0, ', '{"step": 4, ', '{"step": 8, ']


# ----------------------------------------------------------------------------- an out_dir that cannot be written

@pytest.mark.slow
@pytest.mark.parametrize("kind", KINDS)
def test_unwritable_out_dir_fails_in_one_line_before_training(kind, data_dir, tmp_path):
    """We run as root, and root writes into a folder whatever its mode, so chmod cannot make an out_dir read-only
    here: /proc refuses new folders (one process), and a folder cannot be made inside a regular file (two processes).
    The check runs before any process starts, so with --cpu_procs=2 too there is one line and no gloo noise from a
    lost peer."""
    (tmp_path / "a_file").write_text("not a folder")
    for bad, procs in (("/proc/nope", 1), (str(tmp_path / "a_file" / "sub"), 2)):
        rc, out, err = run(command(kind, data_dir, f"--cpu_procs={procs}", f"--out_dir={bad}"))
        assert_one_line_error(rc, out, err, f"--out_dir={bad}")
        assert not PROGRESS.search(out), out


# ----------------------------------------------------------------------------- temporary files of killed saves

@pytest.mark.slow
@pytest.mark.parametrize("kind", KINDS)
def test_stale_temp_files_are_removed(kind, data_dir, tmp_path):
    """A ckpt.pt.tmp<pid> left by a killed save disappears at the next checkpoint, of a fresh or a resumed run."""
    for resume in (False, True):
        (tmp_path / "ckpt.pt.tmp12345").write_bytes(b"")
        args = ["--resume"] if resume else ["--stop_at_step=4"]
        rc, out, err = run(command(kind, data_dir, *args, f"--out_dir={tmp_path}"))
        assert rc == 0 and ("RESULT " in out) == resume, err[-2000:]
        assert temp_files(tmp_path) == [] and os.path.isfile(tmp_path / "ckpt.pt")


@pytest.mark.slow
@pytest.mark.parametrize("kind", KINDS)
def test_kills_while_checkpointing_every_step(kind, data_dir, tmp_path):
    """A checkpoint after every step, SIGKILL at a few moments once the first one exists: while a temporary file
    is being written (when the poll catches one), right after a checkpoint, and a few progress lines later. Each
    time ckpt.pt is whole, --resume runs to the end, and no temporary file is left behind."""
    every_step = {"vit": ["--eval_interval=1"], "gpt": ["--eval_interval=1", "--eval_iters=1", "--max_iters=24"],
                  "dino": ["--eval_interval=1"]}[kind]
    out_dir = tmp_path / "run"
    argv, ckpt = command(kind, data_dir, *every_step, f"--out_dir={out_dir}"), str(out_dir / "ckpt.pt")
    moments = {"during a save": lambda r: temp_files(out_dir),
               "after a checkpoint": lambda r: len(PROGRESS.findall(r.stdout())) >= 2,
               "a few lines later": lambda r: len(PROGRESS.findall(r.stdout())) >= 5}
    for moment, condition in moments.items():
        shutil.rmtree(out_dir, ignore_errors=True)
        training = Background(argv)
        try:
            training.wait_for(lambda: os.path.exists(ckpt) or training.proc.poll() is not None, "a first checkpoint")
            training.wait_for(lambda: condition(training) or training.proc.poll() is not None, moment)
        finally:
            training.kill()
        assert load_checkpoint(ckpt)["kind"] == kind, moment  # the last complete checkpoint
        rc, out, err = run(argv + ["--resume"])
        assert rc == 0 and "RESULT " in out, (moment, err[-2000:])
        assert temp_files(out_dir) == [], moment


# ----------------------------------------------------------------------------- Ctrl-C

@pytest.mark.slow
@pytest.mark.parametrize("procs", [1, 2])
def test_ctrl_c_says_what_was_saved_and_where(procs, finished, data_dir, tmp_path):
    """Ctrl-C (SIGINT to the process a user started) ends the run in one line from the first process: before the
    first checkpoint, that nothing can be resumed and where the earlier run of the folder went; after it, that
    --resume continues it from the step it names, which then works."""
    out_dir = copy_run(finished["gpt"], tmp_path / "run")
    argv = command("gpt", data_dir, f"--cpu_procs={procs}", "--max_iters=3000", "--eval_interval=40", f"--out_dir={out_dir}")
    training = Background(argv)
    try:
        training.wait_for(lambda: PROGRESS.search(training.stdout()), "a first progress line")
        training.proc.send_signal(signal.SIGINT)
        training.proc.wait(timeout=60)
    finally:
        training.kill()
    aside = [n for n in os.listdir(out_dir) if n.startswith("previous-")]
    assert len(aside) == 1 and training.proc.returncode != 0
    err = "".join(training.err)
    assert err == (f"interrupted; no checkpoint yet, nothing to resume; the earlier run in {out_dir} is in "
                   f"{os.path.join(out_dir, aside[0])}\n"), err
    training = Background(argv)
    try:
        training.wait_for(lambda: "step 41/3000" in training.stdout(), "a step after the first checkpoint")
        training.proc.send_signal(signal.SIGINT)
        training.proc.wait(timeout=60)
    finally:
        training.kill()
    err = "".join(training.err)
    assert err == (f"interrupted; the last checkpoint is intact: continue with --resume --out_dir={out_dir} (it holds "
                   f"step 40)\n"), err
    rc, out, err = run(argv[:-1] + ["--max_iters=3000", "--resume", f"--out_dir={out_dir}", "--stop_at_step=42"])
    assert rc == 0 and f"resumed from {out_dir}/ckpt.pt at step 40" in out, err[-2000:]

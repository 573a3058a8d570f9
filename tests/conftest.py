"""Test set-up shared by every test file: the repo root on sys.path, idle OpenMP threads that sleep instead of
spinning (on a busy 2-core machine spinning threads steal the cores they wait for), and the helpers the test files
share (`from conftest import ROOT, ENV, run, run_here, parse_result, result, randomise, float32_matmuls`; the
`data_dir` fixture)."""

import os
import random
import re
import runpy
import subprocess
import sys
from contextlib import contextmanager

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # before torch is first imported
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # the repository
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "results"))  # results/report.py, the sweep's report

import pytest  # noqa: E402
import torch  # noqa: E402


# the environment of every script a test starts: one thread (tiny models: a second one only waits for a busy
# core), no CUDA (the tests measure the CPU path), the repo importable from any folder
ENV = dict(os.environ, CUDA_VISIBLE_DEVICES="", OMP_NUM_THREADS="1", PYTHONPATH=ROOT)


def pytest_collection_modifyitems(config, items):
    """A test marked gpu skips where torch sees no CUDA GPU."""
    if torch.cuda.is_available():
        return
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(pytest.mark.skip(reason="needs a CUDA GPU"))


def run(script, *args, check=False, timeout=180):
    """`python script args` from the repo root, as a user runs it: a train_*.py script in one process unless args
    name --cpu_procs. check=True fails the test with the script's output unless it succeeds."""
    procs = ["--cpu_procs=1"] if os.path.basename(script).startswith("train_") else []
    if any(a.startswith("--cpu_procs") for a in args):
        procs = []
    p = subprocess.run([sys.executable, script, *procs, *args], cwd=ROOT, env=ENV, capture_output=True, text=True,
                       timeout=timeout)
    if check and p.returncode != 0:
        raise AssertionError(f"{script} {' '.join(args)} failed:\n{p.stdout[-2000:]}\n{p.stderr[-3000:]}")
    return p


def torchrun_with(prelude, script, *args, nprocs=2, timeout=300):
    """`torchrun --standalone --nproc_per_node=nprocs script args` with prelude run first in every process (a fake
    slow step, a short process-group timeout); returns the CompletedProcess."""
    code = f"import runpy, sys\nsys.path.insert(0, {ROOT!r})\n{prelude}\nrunpy.run_path({script!r}, run_name='__main__')"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nprocs}", "--no-python",
           sys.executable, "-c", code, *args]
    return subprocess.run(cmd, cwd=ROOT, env=ENV, capture_output=True, text=True, timeout=timeout)


def run_here(script, *args):
    """`python script args` in this process (its run section, as __main__); returns its globals. What a run sets for
    the whole process goes back as it was, also when the run fails: sys.argv, the exception hook (the scripts print
    bad input in one line through it) and the TF32 flags of a CUDA run. For errors met before any training: a shell's
    `error: ...` line is the raised UsageError's (or OSError's) message."""
    argv, hook = sys.argv, sys.excepthook
    sys.argv = [script, *args]
    tf32 = (torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32)
    try:
        return runpy.run_path(os.path.join(ROOT, script), run_name="__main__")
    finally:
        sys.argv, sys.excepthook = argv, hook
        torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = tf32


# every process's group gives up on a peer after 5 s, and the first process's last work takes 8 s
SHORT_GROUP_TIMEOUT = ("import datetime, torch.distributed as dist\ninit = dist.init_process_group\n"
                       "dist.init_process_group = lambda backend: init(backend, timeout=datetime.timedelta(seconds=5))\n")


def parse_result(text):
    """The key=value pairs (strings, in order) of the last RESULT line anywhere in text; {} without one."""
    lines = re.findall(r"RESULT (\S.*)", text)
    return dict(word.split("=", 1) for word in lines[-1].split() if "=" in word) if lines else {}


def result(text):
    """The last RESULT line in text as {key: value string}, in its order (parse_result); fails without one."""
    found = parse_result(text)
    assert found, f"no RESULT line in:\n{text[-2000:]}"
    return found


def spoil_weights_at(monkeypatch, call):
    """optim.optimizer_step as float16 answers it (a gradient norm of 0), whose `call`-th call writes an inf into the
    first weight after its step (the loss of that step was finite). Returns the list of calls made."""
    import optim
    optimizer_step = optim.optimizer_step
    calls = []

    def spoiling_step(optimizers, scaler, params, **clip):
        norm = optimizer_step(optimizers, scaler, params, **clip)
        calls.append(1)
        if len(calls) == call:
            with torch.no_grad():
                optimizers[0].param_groups[0]["params"][0].view(-1)[0] = float("inf")
        return torch.zeros_like(norm)  # float16's answer
    monkeypatch.setattr(optim, "optimizer_step", spoiling_step)
    return calls


def randomise(model, std=0.2, seed=0, gain=0.0):
    """A model whose every weight has a value, N(0, std^2): GPTs start with zero output projections (every block a
    no-op). gain: the mean of the norms' weights (1 keeps the tokens' scale through them)."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            mean = gain if "norm" in name and name.endswith(".weight") else 0.0
            p.copy_(torch.randn(p.shape, generator=g, dtype=p.dtype) * std + mean)
    return model


@contextmanager
def float32_matmuls():
    """Float32 matmuls and convolutions in float32 inside the block, whatever the process allowed before (a CUDA
    training run allows TF32, whose 10-bit mantissa fails a float32 comparison); the flags go back afterwards."""
    found = (torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32)
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    try:
        yield
    finally:
        torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = found


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory):
    """A data folder holding `tiny`, a small character dataset made by the prepare command a user runs."""
    root = tmp_path_factory.mktemp("data")
    r = random.Random(0)
    words = "the of and to my thou thee lord king love night sweet death crown fair".split()
    lines = [f"{r.choice(['ROMEO', 'JULIET'])}:\n" + " ".join(r.choice(words) for _ in range(8)) for _ in range(800)]
    (root / "in.txt").write_text("\n".join(lines))
    run("data/shakespeare_char/prepare.py", f"--input_file={root / 'in.txt'}", f"--out_dir={root / 'tiny'}",
        check=True)
    return str(root)


@pytest.fixture
def figure_texts(monkeypatch):
    """{PNG name: the panel titles and legend entries of that figure}, recorded as analyze.py saves it."""
    from matplotlib.figure import Figure
    texts, savefig = {}, Figure.savefig

    def spy(fig, path, *args, **kwargs):
        texts[os.path.basename(path)] = dict(titles=[ax.get_title() for ax in fig.axes], legend=[
            t.get_text() for ax in fig.axes if ax.get_legend() for t in ax.get_legend().get_texts()],
            suptitle=fig._suptitle.get_text() if fig._suptitle else "",
            labels=[(ax.get_xlabel(), ax.get_ylabel()) for ax in fig.axes if ax.axison and not hasattr(ax, "_colorbar")])
        return savefig(fig, path, *args, **kwargs)
    monkeypatch.setattr(Figure, "savefig", spy)
    return texts

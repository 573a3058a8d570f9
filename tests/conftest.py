"""Test set-up shared by every test file: the repo root on sys.path, idle OpenMP threads that sleep instead of
spinning (on a busy 2-core machine spinning threads steal the cores they wait for), and the helpers the test files
share (`from conftest import ROOT, ENV, run, result, param_checksums, randomise`; the `data_dir` fixture)."""

import os
import random
import re
import subprocess
import sys

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # before torch is first imported
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # the repository
sys.path.insert(0, ROOT)

import pytest  # noqa: E402
import torch  # noqa: E402

# the environment of every script a test starts: one thread (tiny models: a second one only waits for a busy
# core), no CUDA (the tests measure the CPU path), the repo importable from any folder
ENV = dict(os.environ, CUDA_VISIBLE_DEVICES="", OMP_NUM_THREADS="1", PYTHONPATH=ROOT)
CHECKSUM = re.compile(r"rank (\d+)/\d+ param_checksum=([-+0-9.]+e[-+]\d+)")  # nanolap.print_param_checksum's lines


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


def result(text):
    """The last RESULT line in text as {key: value string}, in its order. Searched anywhere in a line: with
    PYTHONUNBUFFERED print writes a line and its newline apart, and another process's output can land between."""
    lines = re.findall(r"RESULT (\S.*)", text)
    assert lines, f"no RESULT line in:\n{text[-2000:]}"
    return dict(pair.split("=", 1) for pair in lines[-1].split())


def param_checksums(text):
    """{rank: checksum} from nanolap.print_param_checksum's lines (the ranks' output may interleave)."""
    return dict(CHECKSUM.findall(text))


def randomise(model, std=0.2, seed=0):
    """A model whose every weight has a value: GPTs start with zero output projections (every block a no-op)."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * std)
    return model


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

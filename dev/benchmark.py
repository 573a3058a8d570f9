"""
The fused path against the explicit one, and what Laplacian heads cost: forward+backward of one GPT with n_lap = 0 and with n_lap = n_head (every
head Laplacian), timed in alternation (median of interleaved rounds, so drifting machine speed cancels),
eager and compiled, plus the explicit path, which materialises P, against the fused one.

    python dev/benchmark.py                    # about 2.5 minutes on a 2-core CPU
    python dev/benchmark.py --compile_model=False --rounds=3
    python dev/benchmark.py --control=True     # two identical n_lap = 0 models: what the ratio reads with no difference

A Laplacian head adds one elementwise subtraction (V - P V) and no parameter or matmul, so the ratio
should be 1 up to noise. On a shared machine single timings swing by more than that: read the median.
"""

import functools
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # the repo root
from common import resolve_device, write_result  # noqa: E402
from configurator import configure  # noqa: E402
from nanolap import build_model, make_config  # noqa: E402

rounds = 9  # interleaved rounds; the median ratio is reported
repeats = 3  # forward+backward passes per timing
batch_size = 4  # sequences per timed forward+backward
seq_len = 256  # tokens per sequence
explicit_len = 1024  # sequence length of the fused-vs-explicit comparison (the explicit path is O(T^2) memory)
compile_model = True  # also time torch.compile'd models
control = False  # time n_lap = 0 against an identical second n_lap = 0 model: the ratio's own noise on this machine
device = "auto"  # auto (cuda > mps > cpu), cpu, cuda, cuda:N or mps
out_dir = "out-benchmark"  # result.txt goes here


def time_step(model, idx, repeats):
    t0 = time.perf_counter()
    for _ in range(repeats):
        logits, loss = model(idx, idx)
        loss.backward()
    if idx.is_cuda:
        torch.cuda.synchronize()
    return (time.perf_counter() - t0) / repeats


def overhead(models, idx, rounds, repeats):
    """Median ratio of step times (n_lap = n_head) / (n_lap = 0), the two measured in alternation;
    and the median step time of each."""
    for m in models:
        time_step(m, idx, 1)  # warm-up (and compilation)
    times = []
    for r in range(rounds):
        t = [0.0, 0.0]
        for i in (0, 1) if r % 2 == 0 else (1, 0):  # alternate who goes first: no order bias
            t[i] = time_step(models[i], idx, repeats)
        times.append(t)
    ratio = statistics.median_high([b / a for a, b in times])  # the upper median, as the other two
    return ratio, statistics.median_high([a for a, _ in times]), statistics.median_high([b for _, b in times])


if __name__ == "__main__":
    configure(globals())
    device = resolve_device(device)
    torch.manual_seed(0)
    print(f"device {device}, torch {torch.__version__}, {torch.get_num_threads()} threads")
    errors = []  # first: the fused path equals the explicit (I - P) V path, for a mixed per-layer schedule
    for kind in ("vit", "gpt"):
        model = build_model(make_config(f"{kind}-tiny", n_lap=[0, 1, 3, 4], vocab_size=100 if kind == "gpt" else 0))
        for p in model.eval().to(device).parameters() if kind == "gpt" else []:  # zero-init projections: no-ops
            torch.nn.init.normal_(p, std=0.1)
        x = torch.randint(0, 100, (2, 64)) if kind == "gpt" else torch.randn(2, 1, 28, 28)
        with torch.no_grad():
            errors.append((model.to(device)(x.to(device)) - model(x.to(device), explicit=True)).abs().max().item())
    print(f"fused vs explicit (I - P) V, per-layer n_lap [0, 1, 3, 4]: max abs difference {max(errors):.2e}")
    cfg = dict(n_layer=4, n_embd=256, n_head=8, vocab_size=512, block_size=max(seq_len, explicit_len))
    second = 0 if control else 8  # n_lap of the second model
    models = [build_model(make_config("gpt-tiny", **cfg, n_lap=k)).to(device) for k in (0, second)]
    models[1].load_state_dict(models[0].state_dict())  # the same weights: only the head type differs (or nothing)
    idx = torch.randint(0, 512, (batch_size, seq_len), device=device)
    rows = [("eager", *overhead(models, idx, rounds, repeats))]
    if compile_model:
        rows.append(("compiled", *overhead([torch.compile(m, fullgraph=True) for m in models], idx, rounds, repeats)))
    print(f"GPT 4L d256 8h, B={batch_size} T={seq_len}, forward+backward, median of {rounds} interleaved rounds:")
    print(f"{'mode':<10}{'n_lap=0 ms':>12}{f'n_lap={second} ms':>12}{'ratio':>8}")
    for mode, ratio, a, b in rows:
        print(f"{mode:<10}{a * 1e3:>12.1f}{b * 1e3:>12.1f}{ratio:>8.3f}")
    idx = torch.randint(0, 512, (2, explicit_len), device=device)
    explicit_model = functools.partial(models[1], explicit=True)
    fused, explicit = [(time_step(m, idx, 1), time_step(m, idx, 2))[1] for m in (models[1], explicit_model)]
    print(f"explicit path at T={explicit_len} (B=2): {explicit / fused:.2f}x the fused path")
    key = "control_ratio" if control else "lap_overhead"
    results = {"max_err": f"{max(errors):.3g}", key: f"{rows[0][1]:.3f}", "explicit_slowdown": f"{explicit / fused:.2f}"}
    if compile_model:
        results[f"{key}_compiled"] = f"{rows[1][1]:.3f}"
    write_result(out_dir, **results)

"""
Sampling with and without the KV cache: tokens per second of GPT.generate for the CPU default GPT (train_gpt.py's:
gpt-tiny, 4 layers, d 128, 4 heads, n_lap 2) at block_size 256, the cached and the recomputing sampler timed in
alternation (the median of interleaved rounds, so that a drifting machine speed cancels in the ratio). The weights
are random: the speed does not depend on them, and both samplers must draw the same tokens.

    python dev/bench_generate.py                       # about a minute on a 2-core CPU
    python dev/bench_generate.py --n_kv_head=2 --rounds=3

The cache runs each new token alone through the model (O(T) work per token) where the recomputation runs the whole
context again (O(T^2) attention, O(T) everything else), so the ratio grows with the number of tokens sampled.
On a shared machine single timings swing: read the ratio, measured side by side.
"""

import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # the repo root
from common import resolve_device, write_result  # noqa: E402
from configurator import configure  # noqa: E402
from nanolap import build_model, make_config  # noqa: E402

rounds = 5  # interleaved rounds; the median of each sampler's speed and of their ratio is reported
block_size = 256  # the model's context; the prompt is one token and the sample fills the rest of the window
n_lap = 2  # Laplacian heads per layer (train_gpt.py's default)
n_kv_head = None  # key/value heads (grouped-query attention); None = n_head
vocab_size = 65  # the character vocabulary of tinyshakespeare
temperature = 0.8  # train_gpt.py's sampling
top_k = 200  # train_gpt.py's sampling
device = "cpu"  # cpu, cuda, cuda:N or mps (auto: the first there is)
out_dir = "out-benchmark"  # result.txt goes here


def sample_seconds(model, prompt, new_tokens, use_cache):
    """Seconds of one generate call, and its tokens (a fixed generator seed: both samplers draw alike)."""
    generator = torch.Generator(device=prompt.device).manual_seed(0)
    t0 = time.perf_counter()
    out = model.generate(prompt, new_tokens, temperature=temperature, top_k=top_k, generator=generator, use_cache=use_cache)
    if prompt.is_cuda:
        torch.cuda.synchronize()
    return time.perf_counter() - t0, out


if __name__ == "__main__":
    configure(globals())
    device = resolve_device(device)
    torch.manual_seed(0)
    cfg = make_config("gpt-tiny", n_lap=n_lap, n_kv_head=n_kv_head, vocab_size=vocab_size, block_size=block_size)
    model = build_model(cfg).to(device).eval()
    for p in model.parameters():  # a fresh GPT's output projections are zero: give every weight a value
        torch.nn.init.normal_(p, std=0.1)
    prompt = torch.zeros(1, 1, dtype=torch.long, device=device)
    new_tokens = block_size - 1
    print(f"device {device}, torch {torch.__version__}, {torch.get_num_threads()} threads; gpt-tiny, n_lap={n_lap}, "
          f"n_kv_head={cfg.n_kv_head or cfg.n_head}, block_size={block_size}: 1 prompt token + {new_tokens} sampled")
    for use_cache in (True, False):  # warm-up
        sample_seconds(model, prompt, 8, use_cache)
    times = []
    same = True
    for r in range(rounds):
        t = {}
        outs = {}
        for use_cache in (True, False) if r % 2 == 0 else (False, True):  # alternate who goes first: no order bias
            t[use_cache], outs[use_cache] = sample_seconds(model, prompt, new_tokens, use_cache)
        same = same and torch.equal(outs[True], outs[False])
        times.append(t)
    cached = statistics.median_high([new_tokens / t[True] for t in times])
    recomputed = statistics.median_high([new_tokens / t[False] for t in times])
    ratio = statistics.median_high([t[False] / t[True] for t in times])
    print(f"median of {rounds} interleaved rounds: cached {cached:,.0f} tok/s, recomputed {recomputed:,.0f} tok/s, "
          f"ratio {ratio:.2f}; the same tokens: {same}")
    write_result(out_dir, cached_tok_s=f"{cached:.0f}", recomputed_tok_s=f"{recomputed:.0f}", ratio=f"{ratio:.2f}",
                 same_tokens=same)

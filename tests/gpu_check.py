"""
nanolap on one GPU, checked in one command: no network, no data but what the repository generates or prepares.

    python tests/gpu_check.py                          # every part (planned for about 7 minutes; not yet timed)
    python tests/gpu_check.py --only=equal,cost        # some parts, for a short GPU lease

Parts (each adds rows to one table; any failed row makes the exit status 1; a machine without CUDA gets one line
and exit status 2):
  equal     the fused path equals the explicit (I - P) V path on CUDA, logits and gradients, for a ViT and a GPT
            with a mixed per-layer n_lap, attention and uniform graphs: float32 with SDPA restricted to the
            memory-efficient kernel, bfloat16 autocast restricted to FlashAttention and then to the memory-efficient
            kernel (sdpa_kernel raises when the restricted kernel cannot run, so a passing row ran on it)
  cost      forward+backward of an all-Laplacian model against the all-attention one with the same weights,
            eager and compiled (every block through torch.compile(fullgraph=True), which compiles once per head
            layout; the scripts part times whole-model compilation), bfloat16 autocast: ViT-S/16 at 197 tokens and a
            d12 GPT at T = 1024; the median of interleaved rounds, as tests/benchmark.py does
  scripts   train_vit.py (config/vit_cifar10.py's model on generated 32x32 colour images), train_gpt.py (a d12
            GPT on shakespeare_char) and train_dino.py (its default recipe, 0.3 epochs) for a short run with
            --compile_model=True --dtype=bfloat16: steps/s, images or tokens/s, MFU, peak memory, compile time
  default   the CPU default ViT recipe to the end (one process of batch 256: the global batch of the CPU default's
            2 x 128); its accuracy must lie within the CPU seeds' spread
  torchrun  train_vit.py and train_gpt.py under torchrun with 1 process (2 where there are 2 GPUs): the NCCL path
  tests     the repository's CUDA-only tests (CUDA_TESTS)

Data: Fashion-MNIST's four .gz files in data/fashion_mnist (or the Debian package's folder) for `default` and
DINO, and data/shakespeare_char/{train,val}.bin and meta.json (python data/shakespeare_char/prepare.py) for the
GPT; everything else is generated. The scripts' runs write under out_dir.
"""

import atexit
import math
import os
import re
import runpy
import statistics
import subprocess
import sys
import threading
import time
from contextlib import nullcontext
from dataclasses import replace
from functools import partial

import torch
import torch.nn.functional as F

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
import common  # noqa: E402
from common import configure, peak_flops, write_result  # noqa: E402
from conftest import randomise  # noqa: E402
from nanolap import build_model, make_config  # noqa: E402

only = "all"  # comma-separated parts: equal,cost,scripts,default,torchrun,tests (all = every part)
rounds = 7  # cost: interleaved rounds; the median ratio is reported
repeats = 3  # cost: forward+backward passes per timing
out_dir = "out-gpu-check"  # the scripts' runs go to out_dir/<run>, the RESULT line to out_dir/result.txt

PARTS = ("equal", "cost", "scripts", "default", "torchrun", "tests")
# the tests that skip without CUDA (tests/test_compiled.py checks that this list names every one of them)
CUDA_TESTS = ["tests/test_gpt.py::test_cuda_bf16_training_and_resume",
              "tests/test_nanolap.py::test_cuda_fused_equals_explicit_in_bf16_and_flash_is_eligible"]
CPU_DEFAULT_VAL_ACC = (0.9015, 0.8956, 0.9001)  # RESULTS.md: `python train_vit.py` on a 2-core CPU, seeds 0, 1, 2
# fused against explicit, max |difference| / max |explicit value|: float32 differs by summation order only;
# bfloat16 keeps 8 significant bits, and the two paths round P, P V and V - P V at different places
EQUAL_LIMITS = {torch.float32: (1e-4, 1e-3), torch.bfloat16: (5e-2, 1e-1)}  # (logits, gradients)
COST_LIMIT = 1.10  # all-Laplacian / all-attention step time: one subtraction per head should cost almost nothing


def row(part, check, value, limit="", ok=True, key=None, number=None):
    """One line of the table; key=number also goes into the RESULT line."""
    return dict(part=part, check=check, value=value, limit=limit, ok=bool(ok), key=key, number=number)


def run_command(cmd, timeout, env=None):
    """(return code, output lines with the seconds at which each arrived) of a command run in the repository root;
    return code None when it ran past timeout seconds."""
    env = {**os.environ, **(env or {}), "PYTHONUNBUFFERED": "1"}
    start = time.perf_counter()
    lines = []
    proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    killer = threading.Timer(timeout, proc.kill)  # also when the command hangs without a word
    killer.start()
    for line in proc.stdout:
        lines.append((time.perf_counter() - start, line.rstrip("\n")))
    code = proc.wait()
    timed_out = not killer.is_alive()
    killer.cancel()
    return (None if timed_out else code), lines


def result_of(lines):
    """The key=value pairs of the last RESULT line ({} without one)."""
    return common.parse_result("\n".join(text for _, text in lines))


def logged_losses(lines):
    """The losses of a run's progress lines ('| loss 2.3012 |') and of its RESULT line."""
    logged = [float(m) for _, text in lines for m in re.findall(r"\| loss (\S+) \|", text)]
    return logged + [float(v) for k, v in result_of(lines).items() if "loss" in k]


def tail(lines, n=3):
    return " / ".join(text for _, text in lines[-n:])[-300:]


# ---- equal: the fused path against the explicit one --------------------------
def model_input(cfg, batch, T=None, device="cpu"):
    """Images (B, C, H, W) for a ViT, token ids (B, T) for a GPT."""
    g = torch.Generator().manual_seed(2)
    if cfg.model == "vit":
        return torch.randn(batch, cfg.in_chans, cfg.img_size, cfg.img_size, generator=g).to(device)
    return torch.randint(0, cfg.vocab_size, (batch, T or cfg.block_size), generator=g).to(device)


def fused_vs_explicit(cfg, x, device="cpu", amp_dtype=torch.float32, backend=None):
    """(logits, gradients) relative differences of the fused path against the explicit one: max |a - b| / max |b|.
    backend: an SDPBackend that the fused path must run on (None = PyTorch's choice)."""
    from torch.nn.attention import sdpa_kernel
    torch.manual_seed(0)
    model = randomise(build_model(cfg), std=0.02, seed=1, gain=1.0).to(device).eval()
    x = x.to(device)
    kind = str(device).split(":")[0]
    out = {}
    for explicit in (False, True):
        model.zero_grad(set_to_none=True)
        amp = nullcontext() if amp_dtype == torch.float32 else torch.autocast(kind, dtype=amp_dtype)
        restrict = sdpa_kernel(backend) if backend is not None and not explicit else nullcontext()
        with amp, restrict:
            logits = model(x, explicit=explicit).float()
            weights = torch.randn(logits.shape, generator=torch.Generator().manual_seed(3)).to(logits.device)
            (logits * weights).sum().backward()  # a generic gradient: every logit counts
        grads = torch.cat([p.grad.float().flatten() for p in model.parameters() if p.grad is not None])
        out[explicit] = (logits.detach(), grads)
    rel = [((a - b).abs().max() / b.abs().max()).item() for a, b in zip(out[False], out[True])]
    return rel[0], rel[1]


def equal_configs():
    """A ViT and a GPT whose layers hold every head layout: no, some and all heads Laplacian."""
    vit = make_config("vit-small", n_lap=[0, 2, 4, 6, 6, 3], num_classes=10)  # 6 heads of 32, 65 tokens
    gpt = make_config("gpt-small", n_lap=[0, 1, 3, 6, 6, 2], vocab_size=512, block_size=256)
    return {"vit": (vit, 8), "gpt": (gpt, 4)}  # config, batch


def part_equal(device="cuda", configs=None, cases=None):
    """cases: (dtype, SDPA backend) pairs of the attention graph (FlashAttention runs in half precision only)."""
    from torch.nn.attention import SDPBackend
    torch.backends.cuda.matmul.allow_tf32 = False  # float32 means float32 here (the scripts allow TF32)
    cases = cases or [(torch.float32, SDPBackend.EFFICIENT_ATTENTION), (torch.bfloat16, SDPBackend.FLASH_ATTENTION),
                      (torch.bfloat16, SDPBackend.EFFICIENT_ATTENTION)]
    rows = []
    for kind, (cfg, batch) in (configs or equal_configs()).items():
        for graph in ("attention", "uniform"):
            # the uniform graph calls no SDPA kernel: one row per dtype
            todo = cases if graph == "attention" else [(torch.float32, None), (torch.bfloat16, None)]
            for amp_dtype, backend in todo:
                limits = EQUAL_LIMITS[amp_dtype]
                name = f"{kind} {graph} n_lap={cfg.n_lap} {str(amp_dtype).split('.')[1]}"
                name += f" {backend.name.replace('_ATTENTION', '').lower()}" if backend is not None else ""
                try:
                    errors = fused_vs_explicit(replace(cfg, graph=graph), model_input(cfg, batch), device, amp_dtype, backend)
                except RuntimeError as e:  # sdpa_kernel: the restricted kernel cannot run
                    rows.append(row("equal", name, str(e).splitlines()[0][:80], "runs", False))
                    continue
                ok = errors[0] <= limits[0] and errors[1] <= limits[1]
                rows.append(row("equal", name, f"logits {errors[0]:.1e}, grads {errors[1]:.1e}",
                                f"{limits[0]:.0e}, {limits[1]:.0e}", ok))
    return rows


# ---- cost: what Laplacian heads cost ------------------------------------------
def train_step(model, x):
    """One forward and backward pass (loss: the GPT's cross-entropy, a ViT's mean square logit)."""
    model.zero_grad(set_to_none=True)
    if x.dtype == torch.long:
        loss = model(x, x)[1]
    else:
        loss = model(x).float().square().mean()
    loss.backward()


def step_time(model, x, repeats, amp):
    """Seconds per forward+backward pass, the mean of `repeats` passes."""
    if x.is_cuda:
        torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(repeats):
        with amp:
            train_step(model, x)
    if x.is_cuda:
        torch.cuda.synchronize()
    return (time.perf_counter() - t0) / repeats


def interleaved_ratio(models, x, rounds, repeats, amp=nullcontext()):
    """Median over rounds of time(models[1]) / time(models[0]), the two timed in alternation (who goes first
    alternates too, so drifting machine speed cancels); and the median time of each."""
    for m in models:
        step_time(m, x, 1, amp)  # warm-up (and compilation)
    times = []
    for r in range(rounds):
        t = [0.0, 0.0]
        for i in (0, 1) if r % 2 == 0 else (1, 0):
            t[i] = step_time(models[i], x, repeats, amp)
        times.append(t)
    return statistics.median(b / a for a, b in times), statistics.median(a for a, _ in times), statistics.median(b for _, b in times)


def lap_cost(cfg, x, compiled, rounds, repeats, device="cpu", amp_dtype=torch.float32):
    """(ratio, ms all-attention, ms all-Laplacian) of forward+backward for cfg's model with n_lap = 0 and n_head."""
    torch.manual_seed(0)
    models = [build_model(replace(cfg, n_lap=k)).to(device) for k in (0, cfg.n_head)]
    models[1].load_state_dict(models[0].state_dict())  # the same weights: only the head type differs
    for block in [b for m in models for b in m.blocks] if compiled else []:
        block.compile(fullgraph=True)  # blocks of one head layout share one compilation: 2 instead of 2 x n_layer
    amp = nullcontext() if amp_dtype == torch.float32 else torch.autocast(str(device).split(":")[0], dtype=amp_dtype)
    ratio, a, b = interleaved_ratio(models, x.to(device), rounds, repeats, amp)
    return ratio, a * 1e3, b * 1e3


def cost_cases():
    """Sizes a user trains: ViT-S/16 on 224 px images (197 tokens), a d12 GPT (nanochat's) at T = 1024."""
    vit = make_config("vit-s", num_classes=1000)
    gpt = make_config("gpt-d20", n_layer=12, n_embd=768, n_head=6, vocab_size=65536, block_size=1024)
    return {"vit-s/16 T=197 B=128": (vit, model_input(vit, 128)), "gpt d12 T=1024 B=16": (gpt, model_input(gpt, 16))}


def part_cost(device="cuda", cases=None, rounds=7, repeats=3, amp_dtype=torch.bfloat16):
    rows = []
    for name, (cfg, x) in (cases or cost_cases()).items():
        for compiled in (False, True):
            mode = "compiled" if compiled else "eager"
            ratio, a, b = lap_cost(cfg, x, compiled, rounds, repeats, device, amp_dtype)
            key = f"lap_cost_{cfg.model}_{mode}"
            rows.append(row("cost", f"{name} {mode}: n_lap=0 {a:.1f} ms, n_lap={cfg.n_head} {b:.1f} ms",
                            f"{ratio:.3f}", f"<= {COST_LIMIT}", ratio <= COST_LIMIT, key, f"{ratio:.3f}"))
    return rows


# ---- scripts: short timed runs -----------------------------------------------
def colour_images(n_train, n_val=2048, num_classes=10, seed=0):
    """A learnable set of 3x32x32 uint8 images in load_images' format (the repository's synthetic set is 1x28x28):
    each class a random 3x8x8 pattern upsampled to 40x40, each image a random 32x32 window of it plus noise."""
    g = torch.Generator().manual_seed(seed)
    templates = F.interpolate(torch.rand(num_classes, 3, 8, 8, generator=g), size=40, mode="bilinear")
    windows = templates.unfold(2, 32, 1).unfold(3, 32, 1)  # (K, 3, 9, 9, 32, 32): every window of every class

    def make(n):
        y = torch.randint(0, num_classes, (n,), generator=g)
        i, j = torch.randint(0, 9, (2, n), generator=g)
        x = 0.7 * windows[y, :, i, j] + 0.3 * torch.rand(n, 3, 32, 32, generator=g)  # (n, 3, 32, 32)
        return (x * 255).round().to(torch.uint8), y

    train, val = make(n_train), make(n_val)
    pixels = train[0].float() / 255
    return dict(train=train, val=val, num_classes=num_classes, classes=[f"pattern{k}" for k in range(num_classes)],
                mean=pixels.mean(dim=(0, 2, 3)).tolist(), std=pixels.std(dim=(0, 2, 3)).tolist())


def run_script_here(script, argv, colour=0):
    """The child of a timed run: `python script argv` in this process, then one line with the peak GPU memory.
    colour > 0: --dataset=synthetic means `colour` generated 32x32 colour images (colour_images)."""
    from data import images
    load_images = images.load_images

    def load_colour_images(name, data_dir="data"):
        return colour_images(colour) if name == "synthetic" else load_images(name, data_dir)

    def print_peak_memory():
        print(f"gpu_check peak_memory_gib={torch.cuda.max_memory_allocated() / 2**30:.2f}", flush=True)

    if colour:
        images.load_images = load_colour_images
    if torch.cuda.is_available():
        atexit.register(print_peak_memory)
    sys.argv = [script, *argv]
    runpy.run_path(os.path.join(ROOT, script), run_name="__main__")


def script_runs(device="cuda", out="out-gpu-check"):
    """name -> (script, options, colour images, units per step, unit, training FLOPs per step)."""
    from data import text
    common = [f"--device={device}", "--compile_model=True", "--dtype=bfloat16"]
    vit = make_config("vit-small", n_lap=6, num_classes=10, in_chans=3, img_size=32, patch_size=4, pooling="cls")
    vit_flops = build_model(vit).flops_per_token(65) * 65  # per image: 64 patches + CLS
    vocab = text.load_meta(os.path.join(ROOT, "data"), "shakespeare_char")["vocab_size"] if os.path.isfile(
        os.path.join(ROOT, "data/shakespeare_char/meta.json")) else 65
    gpt = make_config("gpt-d20", n_layer=12, n_embd=768, n_head=6, n_lap=3, vocab_size=vocab, block_size=1024)
    gpt_flops = build_model(gpt).flops_per_token(1024)  # per token
    dino = make_config("vit-cpu", n_lap=2, num_classes=0)  # train_dino.py's default backbone: 17 tokens
    # per image: the student's forward+backward and the teacher's forward (a third of that) on 2 global crops
    dino_flops = build_model(dino).flops_per_token(17) * 17 * 2 * (1 + 1 / 3)
    return {
        "vit cifar10 model": ("train_vit.py", ["config/vit_cifar10.py", "--dataset=synthetic", "--epochs=2",
                              "--warmup_epochs=1", "--val_subset=2048", "--log_interval=25", f"--out_dir={out}/vit",
                              *common], 51200, 512, "img", 512 * vit_flops),
        "gpt d12 T=1024": ("train_gpt.py", ["--preset=gpt-d20", "--n_layer=12", "--n_embd=768", "--n_head=6",
                           "--n_lap=3", "--block_size=1024", "--batch_size=32", "--max_iters=150",
                           "--eval_interval=150", "--eval_iters=4", "--log_interval=10", "--max_new_tokens=0",
                           f"--out_dir={out}/gpt", *common], 0, 32 * 1024, "tok", 32 * 1024 * gpt_flops),
        "dino default 0.3 ep": ("train_dino.py", ["--epochs=0.3", "--eval_train=5000", "--eval_val=2000",
                                "--probe_steps=200", "--seg_dataset=none", "--log_interval=25", f"--out_dir={out}/dino", *common],
                                0, 64, "img", 64 * dino_flops),
    }


def timed_command(script, options, colour=0):
    """The command of a timed run: this file runs the script in a child process (run_script_here)."""
    return [sys.executable, os.path.abspath(__file__), f"--run_script={script}", f"--colour={colour}", *options]


def progress(lines):
    """(seconds, step) of every progress line ('... step N/M | ...')."""
    found = [(t, re.search(r"\bstep (\d+)/\d+ \|", text)) for t, text in lines]
    return [(t, int(m.group(1))) for t, m in found if m]


def timing(lines):
    """(steps/s, compile and warm-up seconds) of a run's output: steps/s is the median rate between progress lines
    that follow each other directly (no evaluation between them); compile and warm-up is the time from the set-up
    line ('schedule:', 'batch:' or 'backbone:') to the first progress line, less its steps at the steady rate
    (it includes an evaluation at step 0). None where the output has too few progress lines."""
    index = {t: i for i, (t, _) in enumerate(lines)}
    marks = progress(lines)
    rates = [(s1 - s0) / (t1 - t0) for (t0, s0), (t1, s1) in zip(marks, marks[1:])
             if index[t1] == index[t0] + 1 and t1 > t0 and s1 > s0]
    if not rates:
        return None, None
    rate = statistics.median(rates)
    setup = [t for t, text in lines if re.match(r"(schedule|batch|backbone):", text)]
    compile_s = marks[0][0] - setup[0] - marks[0][1] / rate if setup else None
    return rate, compile_s


def peak_memory(lines):
    found = [re.search(r"gpu_check peak_memory_gib=([\d.]+)", text) for _, text in lines]
    return next((float(m.group(1)) for m in reversed(found) if m), None)


def failed_run(part, name, code, lines):
    """The row of a run that ended badly or without a RESULT line, or None."""
    if code == 0 and result_of(lines):
        return None
    return row(part, f"{name}: runs", "timed out" if code is None else f"exit {code}: {tail(lines)}", "exit 0, RESULT", False)


def script_rows(name, per_step, unit, flops_per_step, peak, code, lines):
    """The rows of one timed run from its output: RESULT with finite losses; steps/s, images or tokens/s and MFU;
    compile and warm-up time and peak GPU memory."""
    failed = failed_run("scripts", name, code, lines)
    if failed:
        return [failed]
    result = result_of(lines)
    rate, compile_s = timing(lines)
    memory = peak_memory(lines)
    mfu = f"{flops_per_step * rate / peak:.1%}" if peak and rate else "-"
    losses = logged_losses(lines)
    shown = " ".join(f"{k}={v}" for k, v in result.items() if k in ("steps", "seconds", "val_acc", "val_bpb", "knn_acc"))
    speed = f"{rate:.2f} | {rate * per_step:,.0f} | {mfu}" if rate else "too few progress lines"
    setup = f"{compile_s:.0f} | {'-' if memory is None else memory}" if compile_s is not None else "-"
    return [row("scripts", f"{name}: RESULT, finite losses", shown, "finite", losses and all(map(math.isfinite, losses))),
            row("scripts", f"{name}: steps/s | {unit}/s | mfu", speed, "", rate is not None,
                f"{name.split()[0]}_{unit}_per_s", f"{rate * per_step:.0f}" if rate else "none"),
            row("scripts", f"{name}: compile+warm-up s | peak GiB", setup)]


def part_scripts(device="cuda", out="out-gpu-check", timeout=180):
    rows = []
    peak = peak_flops(device)
    for name, (script, options, colour, per_step, unit, flops_per_step) in script_runs(device, out).items():
        code, lines = run_command(timed_command(script, options, colour), timeout)
        rows += script_rows(name, per_step, unit, flops_per_step, peak, code, lines)
    return rows


# ---- default: the CPU default ViT recipe to the end -------------------------
def seed_band(values=CPU_DEFAULT_VAL_ACC, k=3):
    """mean +- k standard deviations of the CPU seeds: where another seed (or the GPU's arithmetic) lands."""
    mean, sd = statistics.mean(values), statistics.stdev(values)
    return mean - k * sd, mean + k * sd


def default_command(device="cuda", out="out-gpu-check"):
    return [sys.executable, "train_vit.py", f"--device={device}", "--batch_size=256", f"--out_dir={out}/vit-default"]


def default_row(code, lines):
    """The default recipe's accuracy against the CPU seeds' band."""
    failed = failed_run("default", "train_vit.py --batch_size=256", code, lines)
    if failed:
        return failed
    result = result_of(lines)
    low, high = seed_band()
    acc = float(result["val_acc"])
    return row("default", f"train_vit.py default to the end ({result.get('seconds', '?')} s)", f"val_acc {acc:.4f}",
               f"{low:.4f}..{high:.4f}", low <= acc <= high, "vit_default_val_acc", f"{acc:.4f}")


def part_default(out="out-gpu-check", timeout=300):
    return [default_row(*run_command(default_command("cuda", out), timeout))]


# ---- torchrun: the NCCL path --------------------------------------------------
def torchrun_commands(nprocs, out="out-gpu-check"):
    launch = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nprocs}"]
    vit = ["train_vit.py", "--dataset=synthetic", "--train_subset=1024", "--val_subset=256", "--batch_size=64",
           "--epochs=1", "--log_interval=4", f"--out_dir={out}/torchrun-vit"]
    gpt = ["train_gpt.py", "--preset=gpt-tiny", "--max_iters=20", "--eval_interval=20", "--eval_iters=2",
           "--log_interval=5", "--max_new_tokens=0", f"--out_dir={out}/torchrun-gpt"]
    return {"vit": launch + vit, "gpt": launch + gpt}


def checksums(lines):
    """{rank: checksum} of print_param_checksum's lines (several processes only)."""
    return common.read_param_checksums("\n".join(text for _, text in lines))


def torchrun_row(name, nprocs, code, lines):
    """A torchrun run: exit 0 and a RESULT line; with several processes, one checksum for all ranks."""
    failed = failed_run("torchrun", f"{name} torchrun --nproc_per_node={nprocs}", code, lines)
    if failed:
        return failed
    distinct = set(checksums(lines).values())
    ok = nprocs == 1 or (len(checksums(lines)) == nprocs and len(distinct) == 1)
    return row("torchrun", f"{name}: torchrun --nproc_per_node={nprocs}", f"RESULT, {len(distinct)} distinct checksum(s)",
               "exit 0" + (", 1 checksum" if nprocs > 1 else ""), ok)


def part_torchrun(out="out-gpu-check", timeout=150):
    nprocs = min(2, torch.cuda.device_count())
    return [torchrun_row(name, nprocs, *run_command(cmd, timeout)) for name, cmd in torchrun_commands(nprocs, out).items()]


# ---- tests: the CUDA-only tests ---------------------------------------------
def part_tests(timeout=300):
    code, lines = run_command([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-m", "slow or not slow",
                               *CUDA_TESTS], timeout)
    summary = next((text for _, text in reversed(lines) if re.search(r"\d+ (passed|failed|skipped|error)", text)), tail(lines))
    skipped = "skipped" in summary
    return [row("tests", f"{len(CUDA_TESTS)} CUDA-only tests", summary[-80:], "all pass, none skipped",
                code == 0 and not skipped)]


# ---- the table ---------------------------------------------------------------
def print_table(rows):
    widths = [max(len(str(r[k])) for r in rows + [dict(part="part", check="check", value="value", limit="limit")])
              for k in ("part", "check", "value", "limit")]
    header = ("part", "check", "value", "limit", "ok")
    print("  ".join(h.ljust(w) for h, w in zip(header, widths + [2])))
    for r in rows:
        cells = [str(r[k]) for k in ("part", "check", "value", "limit")] + ["ok" if r["ok"] else "FAIL"]
        print("  ".join(c.ljust(w) for c, w in zip(cells, widths + [4])))


def main(parts, out):
    name = torch.cuda.get_device_name(0)
    print(f"gpu_check: {name}, {torch.cuda.device_count()} GPU(s), torch {torch.__version__}, parts {','.join(parts)}", flush=True)
    start = time.perf_counter()
    rows = []
    seconds = {}
    run_part = dict(equal=part_equal, cost=partial(part_cost, rounds=rounds, repeats=repeats),
                    scripts=partial(part_scripts, out=out), default=partial(part_default, out=out),
                    torchrun=partial(part_torchrun, out=out), tests=part_tests)
    for part in parts:
        t0 = time.perf_counter()
        try:
            rows += run_part[part]()
        except Exception as e:  # one broken part (out of memory, say) still leaves the others' rows
            rows.append(row(part, "runs", f"{type(e).__name__}: {str(e).splitlines()[0][:120] if str(e) else ''}",
                            "no exception", False))
        torch.cuda.empty_cache()  # the subprocesses of later parts get the memory back
        seconds[part] = time.perf_counter() - t0
        print(f"gpu_check: {part} done in {seconds[part]:.0f} s", flush=True)
    print_table(rows)
    failed = sum(not r["ok"] for r in rows)
    numbers = {r["key"]: r["number"] for r in rows if r["key"]}
    write_result(out, gpu=name.replace(" ", "_"), torch=torch.__version__, parts=",".join(parts), checks=len(rows),
                 failed=failed, seconds=round(time.perf_counter() - start), **numbers)
    return failed


if __name__ == "__main__" and sys.argv[1:2] and sys.argv[1].startswith("--run_script="):
    run_script_here(sys.argv[1].split("=", 1)[1], sys.argv[3:], int(sys.argv[2].split("=", 1)[1]))
elif __name__ == "__main__":
    configure(globals())
    wanted = PARTS if only == "all" else tuple(only.split(","))
    unknown = [p for p in wanted if p not in PARTS]
    if unknown:
        sys.exit(f"error: --only={only}: unknown part(s) {', '.join(unknown)}; choose from {','.join(PARTS)} or all")
    if not torch.cuda.is_available():
        print(f"gpu_check.py needs a CUDA GPU and torch {torch.__version__} sees none; on a CPU run "
              f"python -m pytest -q -m slow tests/test_compiled.py", file=sys.stderr)
        sys.exit(2)
    out_dir = os.path.abspath(out_dir)  # the runs happen in the repository root
    os.makedirs(out_dir, exist_ok=True)
    sys.exit(1 if main(wanted, out_dir) else 0)

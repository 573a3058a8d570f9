"""
nanolap on one GPU, checked in two commands of at most 5 minutes each: no network, no data but what travels with the
repository (see Data below).

    python tests/gpu_check.py --only=equal,cost,tests --out_dir=out-gpu-check/model            # planned: 4.5 minutes
    python tests/gpu_check.py --only=scripts,default,torchrun --out_dir=out-gpu-check/scripts  # planned: 4.5 minutes

Parts (each adds rows to one table; any failed row makes the exit status 1; a machine without CUDA gets one line
and exit status 2):
  equal     the fused path equals the explicit (I - P) V path on CUDA, logits and gradients, for a ViT and a GPT
            with a mixed per-layer n_lap, attention and uniform graphs: float32 (TF32 off) with SDPA restricted to
            the memory-efficient kernel, half precision autocast restricted to FlashAttention and then to the
            memory-efficient kernel (sdpa_kernel raises when the restricted kernel cannot run, so a passing row ran
            on it). Below compute capability 8.0 FlashAttention cannot run: its rows say so and do not fail
  cost      forward+backward of an all-Laplacian model against the all-attention one with the same weights,
            eager and compiled (every block through torch.compile(fullgraph=True, dynamic=False), dynamo reset
            before each model; the scripts part times whole-model compilation), half precision autocast: ViT-S/16 at
            197 tokens and a d12 GPT at T = 1024, batches sized to the GPU's free memory; the median of interleaved
            rounds, as tests/benchmark.py does
  scripts   train_vit.py (config/vit_cifar10.py's model on generated 32x32 colour images), train_gpt.py (a d12
            GPT on shakespeare_char) and train_dino.py (its default recipe, 0.1 epochs) for a short run with
            --compile_model=True in half precision: steps/s, images or tokens/s, MFU, peak memory, and compile time
            (training and eval-mode graphs alike for the three: the first evaluation's time over the last one's)
  default   the CPU default ViT recipe to the end, in float32 (TF32 matmuls) as the CPU seeds ran (one process of
            batch 256: the global batch of the CPU default's 2 x 128); its accuracy must lie within their spread
  torchrun  train_vit.py and train_gpt.py under torchrun with 1 process (2 where there are 2 GPUs): with one GPU the
            world size is 1, so it exercises NCCL's start-up only, no gradient exchange
  tests     the repository's CUDA-only tests (CUDA_TESTS)

Half precision is bfloat16 from compute capability 8.0 on, float16 with a gradient scaler below it (a T4, a V100),
as the scripts' --dtype=auto decides.

Time: --deadline seconds for the whole command. Each part gets a share of the time left, by its plan (PLAN), and
a part that would start after the deadline is a failed row; a command (and every process it started, torchrun's
workers included) that outlives its share is killed, and if the whole check outlives its deadline by GRACE seconds
it stops with one line. Each part's rows and the RESULT line so far go to out_dir/gpu_check.txt and
out_dir/result.txt as soon as the part ends, so a killed check still leaves what it finished.

Data (checked at the start: a run whose data are missing is a failed row at once, named in one line): Fashion-MNIST's
four .gz files in data/fashion_mnist (or the Debian package's folder) for `default` and DINO, and
data/shakespeare_char/{train,val}.bin and meta.json (python data/shakespeare_char/prepare.py) for the GPT runs;
everything else is generated. The scripts' runs write under out_dir.
"""

import atexit
import itertools
import math
import os
import re
import runpy
import signal
import statistics
import subprocess
import sys
import threading
import time
from contextlib import nullcontext, suppress
from dataclasses import replace
from functools import partial

import torch
import torch.nn.functional as F

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
import common  # noqa: E402
from common import configure, peak_flops, write_result  # noqa: E402
from conftest import float32_matmuls, randomise  # noqa: E402
from data import images  # noqa: E402
from nanolap import DINOHead, build_model, make_config  # noqa: E402

only = "all"  # comma-separated parts: equal,cost,scripts,default,torchrun,tests (all = every part)
rounds = 7  # cost: interleaved rounds; the median ratio is reported
repeats = 3  # cost: forward+backward passes per timing
out_dir = "out-gpu-check"  # the scripts' runs go to out_dir/<run>, the rows to gpu_check.txt, the RESULT line to result.txt
deadline = 280  # seconds for the whole command (a GPU lease allows 300 a command, start-up included)

PARTS = ("equal", "cost", "scripts", "default", "torchrun", "tests")
# the tests that skip without CUDA (tests/test_compiled.py checks that this list names every one of them)
CUDA_TESTS = ["tests/test_gpt.py::test_cuda_bf16_training_and_resume",
              "tests/test_nanolap.py::test_cuda_fused_equals_explicit_and_the_fast_kernel_is_eligible"]
CPU_DEFAULT_VAL_ACC = (0.9015, 0.8956, 0.9001)  # RESULTS.md: `python train_vit.py` on a 2-core CPU, seeds 0, 1, 2
# fused against explicit, max |difference| / max |explicit value|: float32 differs by summation order only; half
# precision keeps 8 (bfloat16) or 11 (float16) significant bits, and the two paths round P, P V and V - P V apart
EQUAL_LIMITS = {torch.float32: (1e-4, 1e-3), torch.bfloat16: (5e-2, 1e-1), torch.float16: (5e-2, 1e-1)}  # (logits, grads)
COST_LIMIT = 1.10  # all-Laplacian / all-attention step time: one subtraction per head should cost almost nothing
# planned seconds of each part on one GPU (shares of a command's deadline); not yet timed on a GPU
PLAN = dict(equal=40, cost=130, tests=100, scripts=150, default=70, torchrun=60)
GRACE = 15  # seconds past the deadline before the whole check stops (a part that overran its share is killed sooner)
MIN_START = 5  # seconds: with less time left a part is not started
GIB = 2**30
DATA = {  # the data a run reads, and how a fresh machine gets it
    "fashion_mnist": "data/fashion_mnist/{train,t10k}-{images-idx3,labels-idx1}-ubyte.gz (copy the four files of "
                     "the Debian package dataset-fashion-mnist)",
    "shakespeare_char": "data/shakespeare_char/{train.bin,val.bin,meta.json} (python data/shakespeare_char/prepare.py)",
}


def row(part, check, value, limit="", ok=True, key=None, number=None):
    """One line of the table; key=number also goes into the RESULT line."""
    return dict(part=part, check=check, value=value, limit=limit, ok=bool(ok), key=key, number=number)


_runs = itertools.count()  # numbers the commands this process starts


def run_command(cmd, timeout, env=None):
    """(return code, output lines with the seconds at which each arrived) of a command run in the repository root;
    return code None when it ran past timeout seconds. Then the command and every process it started are killed,
    also those in sessions of their own (torch elastic starts its workers so) that would keep the output open:
    they carry GPU_CHECK_RUN in their environment, which kill_runs finds."""
    token = f"{os.getpid()}-{next(_runs)}"
    env = {**os.environ, **(env or {}), "PYTHONUNBUFFERED": "1", "GPU_CHECK_RUN": token}
    start = time.perf_counter()
    lines = []

    def read(stream):
        for line in stream:
            lines.append((time.perf_counter() - start, line.rstrip("\n")))

    proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)
    reader = threading.Thread(target=read, args=(proc.stdout,), daemon=True)
    reader.start()
    reader.join(max(timeout, 0))  # the output ends when every process that holds it has ended
    try:
        code = proc.wait(timeout=max(start + timeout - time.perf_counter(), 0))
    except subprocess.TimeoutExpired:
        code = None
    timed_out = code is None or reader.is_alive()
    kill_runs(token)  # a timed-out command, and whatever a finished one left running
    if proc.poll() is None:  # no /proc to search (not Linux): its process group at least
        with suppress(OSError):
            os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()
    reader.join(5)  # the last lines of the killed processes; then stop reading whatever still holds the pipe
    return (None if timed_out else code), list(lines)


def processes_of(token):
    """Process ids of the commands run_command started with this token (`<pid>-` alone: every one of process pid)."""
    found = []
    mark = f"GPU_CHECK_RUN={token}".encode()
    for pid in filter(str.isdigit, os.listdir("/proc") if os.path.isdir("/proc") else []):
        with suppress(OSError):  # gone, or another user's
            environ = open(f"/proc/{pid}/environ", "rb").read().split(b"\0")
            if any(v == mark or token.endswith("-") and v.startswith(mark) for v in environ) and int(pid) != os.getpid():
                found.append(int(pid))
    return found


def kill_runs(token):
    """SIGKILL every process started under token, and its process group: a stalled NCCL worker ignores less."""
    for _ in range(3):  # a dying parent may start no more, but check again for ones caught mid-start
        pids = processes_of(token)
        if not pids:
            return
        for pid in pids:
            with suppress(OSError):
                group = os.getpgid(pid)
                if group != os.getpgrp():
                    os.killpg(group, signal.SIGKILL)
            with suppress(OSError):
                os.kill(pid, signal.SIGKILL)
        time.sleep(0.2)


def seconds_left(until):
    """Seconds until the perf_counter time `until` (inf for None)."""
    return math.inf if until is None else until - time.perf_counter()


def share(until, n):
    """Seconds for the next of n runs that share the time until `until` (each run gets an equal part of what is left)."""
    return seconds_left(until) / max(n, 1)


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


def half_dtype(capability=None):
    """Half precision for autocast: bfloat16 from compute capability 8.0 (Ampere) on, float16 below it (a T4 or a
    V100 has no bfloat16 tensor cores). capability None: a CPU, bfloat16."""
    return torch.float16 if capability is not None and capability < (8, 0) else torch.bfloat16


def part_equal(device="cuda", configs=None, cases=None, until=None, capability=None):
    """cases: (dtype, SDPA backend) pairs of the attention graph (FlashAttention runs in half precision only, and
    from compute capability 8.0 on: below it its rows say so without failing). until: no case starts after this
    perf_counter time."""
    from torch.nn.attention import SDPBackend
    half = half_dtype(capability)
    cases = cases or [(torch.float32, SDPBackend.EFFICIENT_ATTENTION), (half, SDPBackend.FLASH_ATTENTION),
                      (half, SDPBackend.EFFICIENT_ATTENTION)]
    rows = []
    for kind, (cfg, batch) in (configs or equal_configs()).items():
        for graph in ("attention", "uniform"):
            # the uniform graph calls no SDPA kernel: one row per dtype
            todo = cases if graph == "attention" else [(torch.float32, None), (half, None)]
            for amp_dtype, backend in todo:
                limits = EQUAL_LIMITS[amp_dtype]
                name = f"{kind} {graph} n_lap={cfg.n_lap} {str(amp_dtype).split('.')[1]}"
                name += f" {backend.name.replace('_ATTENTION', '').lower()}" if backend is not None else ""
                if seconds_left(until) <= 0:
                    rows.append(row("equal", name, "not run: the part's time is up", "runs", False))
                    continue
                if backend == SDPBackend.FLASH_ATTENTION and capability is not None and capability < (8, 0):
                    rows.append(row("equal", name, f"not run: FlashAttention needs compute capability 8.0, this GPU "
                                                   f"has {capability[0]}.{capability[1]}", "", True))
                    continue
                try:
                    with float32_matmuls():  # float32 means float32 here (the scripts allow TF32)
                        errors = fused_vs_explicit(replace(cfg, graph=graph), model_input(cfg, batch), device, amp_dtype,
                                                   backend)
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
    # Module.compile compiles one frame that every Block shares: blocks of one head layout share one compilation
    # (2 instead of 2 x n_layer). Without the reset the blocks of this case would meet the earlier case's graphs and
    # recompile with symbolic shapes; dynamic=False keeps every graph specialised to its shapes
    torch._dynamo.reset()
    for block in [b for m in models for b in m.blocks] if compiled else []:
        block.compile(fullgraph=True, dynamic=False)
    amp = nullcontext() if amp_dtype == torch.float32 else torch.autocast(str(device).split(":")[0], dtype=amp_dtype)
    ratio, a, b = interleaved_ratio(models, x.to(device), rounds, repeats, amp)
    return ratio, a * 1e3, b * 1e3


def fitting_batch(full, gib_per_item, free_gib):
    """The largest power-of-two fraction of the batch `full` whose estimated memory (gib_per_item each) takes at most
    60% of the GPU's free memory (None: all of it)."""
    batch = full
    while free_gib is not None and batch > 1 and batch * gib_per_item > 0.6 * free_gib:
        batch //= 2
    return batch


def cost_cases(free_gib=None):
    """Sizes a user trains: ViT-S/16 on 224 px images (197 tokens), a d12 GPT (nanochat's) at T = 1024; batches
    halved until they fit the GPU's free memory (estimates for half precision autocast: a ViT-S image 0.08 GiB, a GPT
    sequence 1.5 GiB, a third of it its float32 logits and their gradient, 1024 x 65,536 x 4 bytes = 0.25 GiB a copy)."""
    vit = make_config("vit-s", num_classes=1000)
    gpt = make_config("gpt-d20", n_layer=12, n_embd=768, n_head=6, vocab_size=65536, block_size=1024)
    b_vit = fitting_batch(128, 0.08, free_gib)
    b_gpt = fitting_batch(16, 1.5, free_gib)
    return {f"vit-s/16 T=197 B={b_vit}": (vit, model_input(vit, b_vit)),
            f"gpt d12 T=1024 B={b_gpt}": (gpt, model_input(gpt, b_gpt))}


def part_cost(device="cuda", cases=None, rounds=7, repeats=3, amp_dtype=torch.bfloat16, until=None, free_gib=None):
    rows = []
    for name, (cfg, x) in (cases or cost_cases(free_gib)).items():
        for compiled in (False, True):
            mode = "compiled" if compiled else "eager"
            key = f"lap_cost_{cfg.model}_{mode}"
            if seconds_left(until) <= 0:
                rows.append(row("cost", f"{name} {mode}", "not run: the part's time is up", f"<= {COST_LIMIT}", False))
                continue
            ratio, a, b = lap_cost(cfg, x, compiled, rounds, repeats, device, amp_dtype)
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


def dino_flops_per_image(backbone_config, out_dim=4096, hidden=256, bottleneck=64, crops=2, tokens=17):
    """Training FLOPs per image of train_dino.py's default recipe: on each global crop the student's forward and
    backward (3 x a forward) and the teacher's forward, each through the backbone and the DINO head (its matmuls:
    2 FLOPs per weight and crop; about a tenth of the default's work)."""
    backbone = build_model(backbone_config).flops_per_token(tokens) * tokens  # forward + backward
    head = DINOHead(backbone_config.n_embd, out_dim, hidden, bottleneck)
    head_forward = 2 * sum(p.numel() for p in head.parameters() if p.ndim >= 2)
    return crops * (backbone * (1 + 1 / 3) + head_forward * (3 + 1))


def script_runs(device="cuda", out="out-gpu-check", free_gib=None, capability=None):
    """name -> (script, options, colour images, units per step, unit, training FLOPs per step, data it needs).
    Batches are halved until they fit the GPU's free memory (estimates); below compute capability 8.0 the runs are
    float16 with a gradient scaler instead of bfloat16."""
    from data import text
    half = str(half_dtype(capability)).split(".")[1]
    common = [f"--device={device}", "--compile_model=True"]
    vit = make_config("vit-small", n_lap=6, num_classes=10, in_chans=3, img_size=32, patch_size=4, pooling="cls")
    vit_flops = build_model(vit).flops_per_token(65) * 65  # per image: 64 patches + CLS
    vocab = text.load_meta(os.path.join(ROOT, "data"), "shakespeare_char")["vocab_size"] if os.path.isfile(
        os.path.join(ROOT, "data/shakespeare_char/meta.json")) else 65
    gpt = make_config("gpt-d20", n_layer=12, n_embd=768, n_head=6, n_lap=3, vocab_size=vocab, block_size=1024)
    gpt_flops = build_model(gpt).flops_per_token(1024)  # per token
    dino_flops = dino_flops_per_image(make_config("vit-cpu", n_lap=2, num_classes=0))  # the default backbone: 17 tokens
    b_vit = fitting_batch(512, 0.01, free_gib)
    b_gpt = fitting_batch(32, 0.9, free_gib)
    return {
        "vit cifar10 model": ("train_vit.py", ["config/vit_cifar10.py", "--dataset=synthetic", "--epochs=2",
                              "--warmup_epochs=1", "--val_subset=2048", "--log_interval=10", f"--batch_size={b_vit}",
                              f"--out_dir={out}/vit", *common, f"--dtype={half}"], 50 * b_vit, b_vit, "img",
                              b_vit * vit_flops, None),
        f"gpt d12 T=1024 B={b_gpt}": ("train_gpt.py", [
            "--preset=gpt-d20", "--n_layer=12", "--n_embd=768", "--n_head=6", "--n_lap=3", "--block_size=1024",
            f"--batch_size={b_gpt}", "--max_iters=60", "--eval_interval=60", "--eval_iters=4", "--log_interval=10",
            "--max_new_tokens=0", f"--out_dir={out}/gpt", *common, f"--dtype={half}"], 0, b_gpt * 1024, "tok",
            b_gpt * 1024 * gpt_flops, "shakespeare_char"),
        "dino default 0.1 ep": ("train_dino.py", ["--epochs=0.1", "--eval_train=5000", "--eval_val=2000",
                                "--probe_steps=100", "--seg_dataset=none", "--log_interval=10", f"--out_dir={out}/dino",
                                *common, f"--dtype={half}"], 0, 64, "img", 64 * dino_flops, "fashion_mnist"),
    }


def timed_command(script, options, colour=0):
    """The command of a timed run: this file runs the script in a child process (run_script_here)."""
    return [sys.executable, os.path.abspath(__file__), f"--run_script={script}", f"--colour={colour}", *options]


def progress(lines):
    """(seconds, step) of every progress line ('... step N/M | ...')."""
    found = [(t, re.search(r"\bstep (\d+)/\d+ \|", text)) for t, text in lines]
    return [(t, int(m.group(1))) for t, m in found if m]


def timing(lines):
    """(steps/s, compile and warm-up seconds) of a run's output. steps/s is the median rate between progress lines
    that follow each other directly (no evaluation between them). Compile and warm-up, alike for the three scripts:
    the training graph's (the time from the start of training to the first progress line, less its steps at the
    steady rate; training starts at the set-up line 'schedule:', 'batch:' or 'backbone:', or at the evaluation of
    step 0 where one comes first, which is left out) plus the evaluation graph's (the first evaluation's time less
    the last one's, each from the line before it). None where the output has too few progress lines."""
    index = {t: i for i, (t, _) in enumerate(lines)}
    marks = progress(lines)
    rates = [(s1 - s0) / (t1 - t0) for (t0, s0), (t1, s1) in zip(marks, marks[1:])
             if index[t1] == index[t0] + 1 and t1 > t0 and s1 > s0]
    if not rates:
        return None, None
    rate = statistics.median(rates)
    setup = [t for t, text in lines if re.match(r"(schedule|batch|backbone):", text)]
    if not setup:
        return rate, None
    evals = [i for i, (t, text) in enumerate(lines) if re.match(r"eval (step|epoch) \d+:", text) and t > setup[0]]
    before = [lines[i][0] for i in evals if lines[i][0] < marks[0][0]]  # the evaluation of step 0
    train_compile = marks[0][0] - (before[-1] if before else setup[0]) - marks[0][1] / rate
    durations = [lines[i][0] - lines[i - 1][0] for i in evals]
    eval_compile = durations[0] - durations[-1] if len(durations) > 1 else 0.0
    return rate, train_compile + eval_compile


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


def missing_data(name):
    """'' when the data `name` (a key of DATA, or None) is on disk, else what is missing and how to get it."""
    if name == "fashion_mnist":
        files = [f for pair in images.FASHION_FILES.values() for f in pair]
        folders = [os.path.join(ROOT, "data", "fashion_mnist"), os.path.join(ROOT, "data", "fashion_mnist", "FashionMNIST",
                                                                             "raw"), images.DEBIAN_FASHION]
        found = any(all(os.path.isfile(os.path.join(d, f)) for f in files) for d in folders)
    elif name == "shakespeare_char":
        found = all(os.path.isfile(os.path.join(ROOT, "data", name, f)) for f in ("train.bin", "val.bin", "meta.json"))
    else:
        found = True
    return "" if found else f"missing {DATA[name]}"


def data_row(part, name, data):
    """A failed row at once for a run whose data are missing, else None."""
    missing = missing_data(data)
    return row(part, f"{name}: data", missing, "on disk", False) if missing else None


def part_scripts(device="cuda", out="out-gpu-check", timeout=180, until=None, free_gib=None, capability=None):
    rows = []
    peak = peak_flops(device)
    runs = script_runs(device, out, free_gib, capability)
    for n, (name, (script, options, colour, per_step, unit, flops_per_step, data)) in enumerate(runs.items()):
        missing = data_row("scripts", name, data)
        if missing:
            rows.append(missing)
            continue
        code, lines = run_command(timed_command(script, options, colour), min(timeout, share(until, len(runs) - n)))
        rows += script_rows(name, per_step, unit, flops_per_step, peak, code, lines)
    return rows


# ---- default: the CPU default ViT recipe to the end -------------------------
def seed_band(values=CPU_DEFAULT_VAL_ACC, k=3):
    """mean +- k standard deviations of the CPU seeds: where another seed (or the GPU's arithmetic) lands."""
    mean, sd = statistics.mean(values), statistics.stdev(values)
    return mean - k * sd, mean + k * sd


def default_command(device="cuda", out="out-gpu-check"):
    """The CPU default recipe in one process, in float32 as the CPU seeds ran (the scripts' TF32 matmuls on a GPU)."""
    return [sys.executable, "train_vit.py", f"--device={device}", "--batch_size=256", "--dtype=float32",
            f"--out_dir={out}/vit-default"]


def default_row(code, lines):
    """The default recipe's accuracy against the CPU seeds' band."""
    failed = failed_run("default", "train_vit.py --batch_size=256 --dtype=float32", code, lines)
    if failed:
        return failed
    result = result_of(lines)
    low, high = seed_band()
    acc = float(result["val_acc"])
    return row("default", f"train_vit.py default to the end, float32 ({result.get('seconds', '?')} s)",
               f"val_acc {acc:.4f}", f"{low:.4f}..{high:.4f} (CPU seeds)", low <= acc <= high, "vit_default_val_acc",
               f"{acc:.4f}")


def part_default(out="out-gpu-check", timeout=300, until=None):
    return [data_row("default", "train_vit.py default", "fashion_mnist")
            or default_row(*run_command(default_command("cuda", out), min(timeout, share(until, 1))))]


# ---- torchrun: the NCCL path --------------------------------------------------
TORCHRUN_DATA = {"vit": None, "gpt": "shakespeare_char"}


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
    """A torchrun run: exit 0 and a RESULT line; with several processes, one checksum for all ranks. With one
    process the world size is 1: NCCL starts, and no gradient is exchanged."""
    failed = failed_run("torchrun", f"{name} torchrun --nproc_per_node={nprocs}", code, lines)
    if failed:
        return failed
    distinct = set(checksums(lines).values())
    ok = nprocs == 1 or (len(checksums(lines)) == nprocs and len(distinct) == 1)
    what = f"RESULT, {len(distinct)} distinct checksum(s)" if nprocs > 1 else "RESULT (world size 1: NCCL start-up only)"
    return row("torchrun", f"{name}: torchrun --nproc_per_node={nprocs}", what,
               "exit 0" + (", 1 checksum" if nprocs > 1 else ""), ok)


def part_torchrun(out="out-gpu-check", timeout=150, until=None):
    nprocs = min(2, torch.cuda.device_count())
    commands = torchrun_commands(nprocs, out)
    rows = []
    for n, (name, cmd) in enumerate(commands.items()):
        rows.append(data_row("torchrun", name, TORCHRUN_DATA[name])
                    or torchrun_row(name, nprocs, *run_command(cmd, min(timeout, share(until, len(commands) - n)))))
    return rows


# ---- tests: the CUDA-only tests ---------------------------------------------
def part_tests(timeout=300, until=None):
    code, lines = run_command([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-m", "slow or not slow",
                               *CUDA_TESTS], min(timeout, share(until, 1)))
    summary = next((text for _, text in reversed(lines) if re.search(r"\d+ (passed|failed|skipped|error)", text)), tail(lines))
    skipped = "skipped" in summary
    return [row("tests", f"{len(CUDA_TESTS)} CUDA-only tests", summary[-80:] if code is not None else "timed out",
                "all pass, none skipped", code == 0 and not skipped)]


# ---- the table, the deadline and the output of each part --------------------
PART_DATA = {"scripts": ("shakespeare_char", "fashion_mnist"), "default": ("fashion_mnist",),
             "torchrun": ("shakespeare_char",)}
ROWS = "gpu_check.txt"  # in out_dir: each part's rows, written as the part ends


def print_table(rows, file=None):
    widths = [max(len(str(r[k])) for r in rows + [dict(part="part", check="check", value="value", limit="limit")])
              for k in ("part", "check", "value", "limit")]
    header = ("part", "check", "value", "limit", "ok")
    print("  ".join(h.ljust(w) for h, w in zip(header, widths + [2])), file=file)
    for r in rows:
        cells = [str(r[k]) for k in ("part", "check", "value", "limit")] + ["ok" if r["ok"] else "FAIL"]
        print("  ".join(c.ljust(w) for c, w in zip(cells, widths + [4])), file=file)


def gpu_facts(index=0):
    """(name, compute capability, free memory in GiB) of a GPU."""
    free, _ = torch.cuda.mem_get_info(index)
    return torch.cuda.get_device_name(index), torch.cuda.get_device_capability(index), free / GIB


def part_runners(out, capability=None, free_gib=None):
    """part -> a function of `until` (the perf_counter time by which it must end) that returns the part's rows."""
    return dict(equal=partial(part_equal, capability=capability),
                cost=partial(part_cost, rounds=rounds, repeats=repeats, amp_dtype=half_dtype(capability), free_gib=free_gib),
                scripts=partial(part_scripts, out=out, free_gib=free_gib, capability=capability),
                default=partial(part_default, out=out), torchrun=partial(part_torchrun, out=out), tests=part_tests)


def give_up(code):
    """The end of a check that overran its deadline: threads and children may still hang, so no clean exit."""
    os._exit(code)


def overrun(out, running, seconds):
    """The watchdog's action GRACE seconds after the deadline: one line, the started processes killed, exit 1."""
    line = (f"gpu_check: the deadline ({seconds:.0f} s + {GRACE} s) passed during part {running[-1]}: stopped; the rows "
            f"of the parts that ended are in {os.path.join(out, ROWS)}")
    print(line, flush=True)
    with open(os.path.join(out, ROWS), "a") as f:
        f.write(line + "\n")
    kill_runs(f"{os.getpid()}-")
    give_up(1)


def main(parts, out, seconds=None, runners=None, gpu=None):
    """Run the parts in order within `seconds` (the --deadline); returns the number of failed rows. Each part gets a
    share of the time left by PLAN; one that cannot start in time is a failed row. runners and gpu ((name,
    capability, free GiB)) stand in for the real parts and GPU in tests."""
    seconds = deadline if seconds is None else seconds
    name, capability, free_gib = gpu or gpu_facts()
    print(f"gpu_check: {name} (compute capability {capability[0]}.{capability[1]}, {free_gib:.0f} GiB free), "
          f"{torch.cuda.device_count()} GPU(s), torch {torch.__version__}, parts {','.join(parts)}, deadline {seconds} s",
          flush=True)
    for data in sorted({d for p in parts for d in PART_DATA.get(p, ())}):
        if missing_data(data):
            print(f"gpu_check: {missing_data(data)}: the runs that read it fail", flush=True)
    start = time.perf_counter()
    end = start + seconds
    runners = runners or part_runners(out, capability, free_gib)
    rows = []
    running = ["start"]
    watchdog = threading.Timer(seconds + GRACE, overrun, args=(out, running, seconds))
    watchdog.daemon = True
    watchdog.start()
    open(os.path.join(out, ROWS), "w").close()
    for n, part in enumerate(parts):
        running.append(part)
        t0 = time.perf_counter()
        left = end - t0
        until = t0 + left * PLAN[part] / sum(PLAN[p] for p in parts[n:])
        if left < MIN_START:
            part_rows = [row(part, "runs", f"not started: {seconds} s deadline reached", "starts", False)]
        else:
            try:
                part_rows = runners[part](until=until)
            except Exception as e:  # one broken part (out of memory, say) still leaves the others' rows
                part_rows = [row(part, "runs", f"{type(e).__name__}: {str(e).splitlines()[0][:120] if str(e) else ''}",
                                 "no exception", False)]
        if torch.cuda.is_available():
            torch.cuda.empty_cache()  # the subprocesses of later parts get the memory back
        rows += part_rows
        print(f"gpu_check: {part} done in {time.perf_counter() - t0:.0f} s (its share {until - t0:.0f} s)", flush=True)
        with open(os.path.join(out, ROWS), "a") as f:
            print_table(part_rows, file=f)
        result = dict(gpu=name.replace(" ", "_"), torch=torch.__version__, parts=",".join(parts[:n + 1]),
                      checks=len(rows), failed=sum(not r["ok"] for r in rows), seconds=round(time.perf_counter() - start),
                      **{r["key"]: r["number"] for r in rows if r["key"]})
        write_result(out, **result)  # the RESULT line so far: a killed check keeps it
    watchdog.cancel()
    print_table(rows)
    write_result(out, **result)
    return result["failed"]


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
    sys.exit(1 if main(wanted, out_dir, deadline) else 0)

"""
What nanolap costs on one GPU: the price of Laplacian heads, and the config/ recipes at GPU sizes. Whether the GPU
computes the right thing is the tests' job (`python -m pytest -m gpu`); the README's one line runs both.

    python dev/gpu_bench.py                        # both parts: about 8 minutes on an H200, most of it compiling
    python dev/gpu_bench.py --only=cost --compile_model=False
    python dev/gpu_bench.py --only=recipes --steps=50

cost     forward+backward under half precision autocast of ViT-S/16 at 197 tokens and a d12 GPT (nanochat's) at
         T = 1024, each with 0, 3 and 6 of its 6 heads Laplacian and the same weights: eager, then each whole model
         compiled as --compile_model compiles it. Each layout's step time over the all-attention one is the median of
         interleaved rounds (who goes first rotates, so that a drifting clock cancels). One subtraction a head should
         cost almost nothing: a ratio near 1.
recipes  config/gpt_d20.py as a d12 at T = 1024 and config/vit_cifar10.py on ViT-S/16 at 224 px, both compiled as
         their recipes, and config/dino_vits16_imagenet.py's ViT-S/16, eager as its recipe, each for `steps` steps on
         generated data (no download): tokens or images a second and MFU from the scripts' own progress lines, the
         seconds beyond the steps (start-up, compiling, evaluations, checkpoints) and the peak GPU memory.

Half precision is bfloat16 from compute capability 8.0 on and float16 with a gradient scaler below it (a T4), as the
scripts' --dtype=auto decides. Batches are halved until they fit the free memory. Each run's output goes to
out_dir/<script>.log; the RESULT line, after each part, to out_dir/result.txt.
"""

import json
import os
import re
import runpy
import statistics
import subprocess
import sys
import time
from dataclasses import replace

import numpy as np
import torch
import torch.nn.functional as F

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
from busy_bench import parse_speed  # noqa: E402  (the one reader of the scripts' progress lines)
from common import write_result  # noqa: E402
from configurator import configure  # noqa: E402
from nanolap import build_model, make_config  # noqa: E402

only = "cost,recipes"  # the parts to run, separated by commas
rounds = 7  # cost: interleaved rounds; the median ratio is reported
repeats = 3  # cost: forward+backward passes per timing
compile_model = True  # cost: also time the compiled models (each compile takes about half a minute)
steps = 100  # recipes: training steps of each run (progress lines every 10)
out_dir = "out-gpu-bench"  # the runs, their logs, the generated tokens and result.txt

LAYOUTS = (0, 3, 6)  # cost: Laplacian heads of 6 per layer
TOKENS = "gpu_bench_tokens"  # the generated token set, in out_dir/data
TOKENS_VOCAB = 50257  # GPT-2's vocabulary size, as config/gpt_d20.py's FineWeb-Edu tokens


def half_dtype(capability):
    """bfloat16 from compute capability 8.0 (Ampere) on; float16 below it (a T4 or a V100 has no bfloat16 cores)."""
    return torch.bfloat16 if capability >= (8, 0) else torch.float16


def fitting_batch(full, gib_each, free_gib):
    """The largest power-of-two fraction of the batch `full` whose estimated memory (gib_each an item) takes at most
    60% of the free memory."""
    batch = full
    while batch > 1 and batch * gib_each > 0.6 * free_gib:
        batch //= 2
    return batch


# ---- cost: what Laplacian heads cost ------------------------------------------
def train_step(model, x):
    """One forward and backward pass (loss: the GPT's cross-entropy, a ViT's mean square logit)."""
    model.zero_grad(set_to_none=True)
    loss = model(x, x)[1] if x.dtype == torch.long else model(x).float().square().mean()
    loss.backward()


def step_seconds(model, x, amp_dtype, passes):
    """Seconds of one forward+backward pass, the mean of `passes` passes."""
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(passes):
        with torch.autocast("cuda", dtype=amp_dtype):
            train_step(model, x)
    torch.cuda.synchronize()
    return (time.perf_counter() - t0) / passes


def interleaved_times(models, x, amp_dtype):
    """{n_lap: seconds a pass in each round}, after one warm-up pass each (a compiled model compiles there). Each round
    times every model once, and who goes first rotates from round to round."""
    for model in models.values():
        step_seconds(model, x, amp_dtype, 1)
    order = list(models)
    times = {k: [] for k in order}
    for r in range(rounds):
        for k in order[r % len(order):] + order[:r % len(order)]:
            times[k].append(step_seconds(models[k], x, amp_dtype, repeats))
    return times


def cost_cases(free_gib):
    """Sizes a user trains, with batches that fit (half precision: a ViT-S image 0.08 GiB, a d12 sequence 1.5 GiB)."""
    vit = make_config("vit-s", num_classes=1000)
    gpt = make_config("gpt-d20", n_layer=12, n_embd=768, n_head=6, vocab_size=65536, block_size=1024)
    b_vit = fitting_batch(128, 0.08, free_gib)
    b_gpt = fitting_batch(16, 1.5, free_gib)
    images = torch.randn(b_vit, vit.in_chans, vit.img_size, vit.img_size, device="cuda")
    tokens = torch.randint(0, gpt.vocab_size, (b_gpt, 1024), device="cuda")
    return {f"vit-s/16 T=197 B={b_vit}": (vit, images), f"gpt d12 T=1024 B={b_gpt}": (gpt, tokens)}


def layout_ratios(name, cfg, x, amp_dtype):
    """{lap_cost_<model>_<mode>_<k>of6: ratio} of one case, each printed as it is measured."""
    torch.manual_seed(0)
    with torch.device("cuda"):  # a d12 GPT initialises in milliseconds here, in seconds on the host
        models = {k: build_model(replace(cfg, n_lap=k)) for k in LAYOUTS}
    for model in models.values():
        model.load_state_dict(models[0].state_dict())  # the same weights: only the head type differs
    modes = {"eager": models}
    if compile_model:
        modes["compiled"] = {k: torch.compile(model) for k, model in models.items()}
    ratios = {}
    for mode, timed in modes.items():
        print(f"cost: {name} {mode}, n_lap {', '.join(map(str, LAYOUTS))} of {cfg.n_head}", flush=True)
        times = interleaved_times(timed, x, amp_dtype)
        for k in LAYOUTS[1:]:
            ratio = statistics.median(t / b for t, b in zip(times[k], times[0]))
            print(f"cost: {name} {mode}: n_lap=0 {1e3 * statistics.median(times[0]):.1f} ms, n_lap={k} "
                  f"{1e3 * statistics.median(times[k]):.1f} ms, ratio {ratio:.3f}", flush=True)
            ratios[f"lap_cost_{cfg.model}_{mode}_{k}of{cfg.n_head}"] = f"{ratio:.3f}"
    return ratios


def part_cost(amp_dtype, free_gib):
    results = {}
    for name, (cfg, x) in cost_cases(free_gib).items():
        results.update(layout_ratios(name, cfg, x, amp_dtype))
        torch._dynamo.reset()  # the next model's graphs start afresh
        torch.cuda.empty_cache()  # the models of this case are gone with layout_ratios' frame
    return results


# ---- recipes: the config/ recipes at GPU sizes, on generated data ---------------
def colour_images(n_train, n_val=2048, num_classes=10, seed=0):
    """A learnable set of 3x32x32 uint8 images in load_images' format (data.images' synthetic set is 1x28x28): each
    class a random 3x8x8 pattern upsampled to 40x40, each image a random 32x32 window of it plus noise."""
    g = torch.Generator().manual_seed(seed)
    templates = F.interpolate(torch.rand(num_classes, 3, 8, 8, generator=g), size=40, mode="bilinear")
    windows = templates.unfold(2, 32, 1).unfold(3, 32, 1)  # (K, 3, 9, 9, 32, 32): every window of every class

    def make(n):
        y = torch.randint(0, num_classes, (n,), generator=g)
        i, j = torch.randint(0, 9, (2, n), generator=g)
        x = 0.7 * windows[y, :, i, j] + 0.3 * torch.rand(n, 3, 32, 32, generator=g)  # (n, 3, 32, 32)
        return (x * 255).round().to(torch.uint8), y

    train = make(n_train)
    val = make(n_val)
    pixels = train[0].float() / 255
    return dict(train=train, val=val, num_classes=num_classes, classes=[f"pattern{k}" for k in range(num_classes)],
                mean=pixels.mean(dim=(0, 2, 3)).tolist(), std=pixels.std(dim=(0, 2, 3)).tolist())


def write_tokens(folder, n_train=2**21, n_val=2**17, seed=0):
    """A learnable token set in train_gpt.py's format (uint16 train.bin and val.bin, meta.json): a text of 8-token
    words drawn from 4096 random ones over GPT-2's vocabulary, so that 7 of 8 next tokens follow from the one before.
    Each token counts as one byte."""
    rng = np.random.default_rng(seed)
    # distinct tokens in every word position, so that a token's next one is its word's; the last id is end-of-text
    words = rng.permutation(TOKENS_VOCAB - 1)[:4096 * 8].astype(np.uint16).reshape(4096, 8)
    os.makedirs(folder, exist_ok=True)
    for split, n in (("train", n_train), ("val", n_val)):
        words[rng.integers(0, len(words), n // 8)].tofile(os.path.join(folder, f"{split}.bin"))  # (n // 8, 8) tokens
    meta = dict(vocab_size=TOKENS_VOCAB, tokenizer="gpt2", encoding="gpt2", eot_token=TOKENS_VOCAB - 1,
                token_bytes=[1] * (TOKENS_VOCAB - 1) + [0], corpus=f"gpu-bench-words-{seed}",
                source="dev/gpu_bench.py: random 8-token words")
    with open(os.path.join(folder, "meta.json"), "w") as f:
        json.dump(meta, f)


def recipe_runs(device, dtype, free_gib, out, n_steps):
    """script -> (options, tokens or images a step): the config/ recipes at GPU sizes for n_steps steps."""
    system = [f"--device={device}", f"--dtype={str(dtype).split('.')[1]}"]
    b_gpt = fitting_batch(32, 1.2, free_gib)  # a d12 sequence of 1024 tokens, a third of it logits over 50,304
    b_vit = fitting_batch(512, 0.05, free_gib)  # a ViT-S/16 image
    b_dino = fitting_batch(128, 0.3, free_gib)  # a DINO image with its 10 crops
    n_vit = b_vit * n_steps // 2  # two epochs: the second evaluation runs on a compiled evaluation graph
    return {
        "train_gpt.py": (["config/gpt_d20.py", f"--dataset={TOKENS}", f"--data_dir={out}/data", "--n_layer=12",
                          "--n_embd=768", "--n_head=6", "--n_lap=3", "--block_size=1024", f"--batch_size={b_gpt}",
                          "--total_batch_size=0", f"--max_iters={n_steps}", f"--eval_interval={n_steps}",
                          "--eval_iters=2", "--log_interval=10", "--max_new_tokens=0", "--compile_model=True",
                          f"--out_dir={out}/gpt", *system], b_gpt * 1024),
        "train_vit.py": (["config/vit_cifar10.py", "--dataset=synthetic", "--preset=vit-s", "--img_size=224",
                          "--patch_size=16", f"--train_subset={n_vit}", "--epochs=2", "--warmup_epochs=1",
                          f"--batch_size={b_vit}", "--log_interval=10", "--compile_model=True", f"--out_dir={out}/vit",
                          *system], b_vit),
        "train_dino.py": (["config/dino_vits16_imagenet.py", "--dataset=synthetic", f"--train_subset={b_dino * n_steps}",
                           "--epochs=1", f"--batch_size={b_dino}", f"--eval_train={min(1024, b_dino * n_steps)}",
                           "--eval_val=512", "--probe_steps=100", "--seg_dataset=none", "--log_interval=10",
                           "--compile_model=False", f"--out_dir={out}/dino", *system], b_dino),
    }


def run_recipe(script, options):
    """In this process (the child that part_recipes starts): `python script options`, with --dataset=synthetic as
    --train_subset colour_images, then the run's peak GPU memory."""
    from data import images
    load_images = images.load_images
    n_train = next((int(o.split("=")[1]) for o in reversed(options) if o.startswith("--train_subset=")), 0)

    def load_colour_images(name, data_dir="data"):
        return colour_images(n_train) if name == "synthetic" else load_images(name, data_dir)

    images.load_images = load_colour_images
    sys.argv = [script, *options]
    try:
        runpy.run_path(os.path.join(ROOT, script), run_name="__main__")
    finally:
        if torch.cuda.is_available():
            print(f"gpu_bench peak_memory_gib={torch.cuda.max_memory_allocated() / 2**30:.2f}", flush=True)


def median_mfu(output):
    """The median MFU (%) of a script's progress lines after the first (which holds the compile); None without."""
    found = [float(m) for m in re.findall(r"\| mfu ([\d.]+)%", output)]
    return statistics.median(found[1:] or found) if found else None


def part_recipes(dtype, free_gib):
    """{<model>_<unit>_per_s, <model>_mfu, <model>_extra_s, <model>_peak_gib} of each recipe, printed as it ends."""
    if not os.path.isfile(os.path.join(out_dir, "data", TOKENS, "meta.json")):
        write_tokens(os.path.join(out_dir, "data", TOKENS))
    results = {}
    for script, (options, per_step) in recipe_runs("cuda", dtype, free_gib, out_dir, steps).items():
        kind = script[6:-3]
        log = os.path.join(out_dir, f"{kind}.log")
        print(f"recipes: {script} {' '.join(options)}  (output: {log})", flush=True)
        t0 = time.perf_counter()
        with open(log, "w") as f:
            done = subprocess.run([sys.executable, os.path.abspath(__file__), f"--recipe={script}", *options], cwd=ROOT,
                                  stdout=f, stderr=subprocess.STDOUT, env=dict(os.environ, PYTHONUNBUFFERED="1"))
        seconds = time.perf_counter() - t0
        output = open(log).read()
        rate = parse_speed(output)
        if done.returncode or rate is None:
            print(f"recipes: {script} failed (exit {done.returncode}): see {log}", flush=True)
            results[f"{kind}_failed"] = done.returncode or "no_progress_lines"
            continue
        unit = "tok" if kind == "gpt" else "img"
        mfu = median_mfu(output)
        extra = seconds - steps * per_step / rate
        peak = re.search(r"gpu_bench peak_memory_gib=([\d.]+)", output)
        print(f"recipes: {kind}: {rate:,.0f} {unit}/s, {rate / per_step:.2f} steps/s, mfu "
              f"{'-' if mfu is None else f'{mfu:.1f}%'}, {extra:.0f} s besides the steps of {seconds:.0f} s, peak "
              f"{peak.group(1) if peak else '-'} GiB", flush=True)
        results[f"{kind}_{unit}_per_s"] = f"{rate:.0f}"
        results[f"{kind}_mfu"] = "none" if mfu is None else f"{mfu:.1f}"
        results[f"{kind}_extra_s"] = f"{extra:.0f}"
        results[f"{kind}_peak_gib"] = peak.group(1) if peak else "none"
    return results


if __name__ == "__main__" and sys.argv[1:2] and sys.argv[1].startswith("--recipe="):
    run_recipe(sys.argv[1].split("=", 1)[1], sys.argv[2:])
elif __name__ == "__main__":
    configure(globals())
    parts = only.split(",")
    if set(parts) - {"cost", "recipes"}:
        sys.exit(f"error: --only={only}: choose cost, recipes or cost,recipes")
    if not torch.cuda.is_available():
        sys.exit(f"error: gpu_bench.py measures a CUDA GPU and torch {torch.__version__} sees none")
    out_dir = os.path.abspath(out_dir)  # the runs happen in the repository root
    os.makedirs(out_dir, exist_ok=True)
    name = torch.cuda.get_device_name()
    capability = torch.cuda.get_device_capability()
    free_gib = torch.cuda.mem_get_info()[0] / 2**30
    amp_dtype = half_dtype(capability)
    print(f"gpu_bench: {name} (compute capability {capability[0]}.{capability[1]}, {free_gib:.0f} GiB free), "
          f"torch {torch.__version__}, {str(amp_dtype).split('.')[1]}", flush=True)
    results = dict(gpu=name.replace(" ", "_"), torch=torch.__version__)
    if "cost" in parts:
        results.update(part_cost(amp_dtype, free_gib))
        write_result(out_dir, **results)  # a run stopped during the recipes keeps the cost rows
    if "recipes" in parts:
        results.update(part_recipes(amp_dtype, free_gib))
        write_result(out_dir, **results)
    sys.exit(1 if any(k.endswith("_failed") for k in results) else 0)

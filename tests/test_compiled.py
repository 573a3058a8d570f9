"""
The branches that only a GPU runs today, run on the CPU: every script compiled (inductor on the CPU) and under
bfloat16 CPU autocast, float16 with its gradient scaler, compiled models against eager ones for every head layout,
the FLOP count behind MFU against torch's counter, and the GPU peak table's name matching.

    python -m pytest -q -m slow tests/test_compiled.py

The script runs go two at a time (two cores); the model tests compile in this process meanwhile.
"""

import math
import os
import re
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.utils.flop_counter import FlopCounterMode

import common
import conftest
from common import load_checkpoint
from conftest import ROOT, randomise
from nanolap import build_model, make_config

sys.path.insert(0, os.path.join(ROOT, "dev"))
import gpu_bench  # noqa: E402
from busy_bench import parse_speed  # noqa: E402

pytestmark = pytest.mark.slow
ENV = dict(conftest.ENV, TORCHINDUCTOR_COMPILE_THREADS="1")  # inductor compiles in this process: no worker pool

# a few steps of each script, on top of the options of the run under test (later options win)
TINY = {
    "vit": ["--device=cpu", "--cpu_procs=1", "--dataset=synthetic", "--train_subset=128", "--val_subset=64",
            "--batch_size=32", "--epochs=1", "--warmup_epochs=0.5", "--n_layer=2", "--n_embd=32", "--n_head=2",
            "--n_lap=[0,2]", "--log_interval=1"],
    "gpt": ["--device=cpu", "--dataset=tiny", "--n_layer=2", "--n_embd=32", "--n_head=2", "--n_lap=[1,2]",
            "--block_size=32", "--batch_size=4", "--max_iters=4", "--eval_interval=4", "--eval_iters=2",
            "--log_interval=1", "--max_new_tokens=0"],
    "dino": ["--device=cpu", "--cpu_procs=1", "--dataset=synthetic", "--n_layer=2", "--n_embd=32", "--n_head=2",
             "--n_lap=[0,2]", "--out_dim=64", "--head_hidden=32", "--head_bottleneck=16", "--train_subset=128",
             "--batch_size=32", "--epochs=1", "--eval_train=128", "--eval_val=64", "--probe_steps=5",
             "--seg_dataset=none", "--log_interval=1", "--eval_interval=100"],
}


def script_commands(tmp, data_dir):
    """name -> command of every script run, all of them on the CPU. The compiled runs are dev/gpu_bench.py's recipes
    (their options, its child process and colour images) with the tiny sizes on top, in float32."""
    data = [f"--data_dir={data_dir}"]
    commands = {}
    for script, (options, _) in gpu_bench.recipe_runs("cpu", torch.float32, 1e9, str(tmp), 4).items():
        kind = script[6:-3]  # train_vit.py -> vit
        extra = TINY[kind] + (data if kind == "gpt" else []) + ["--dtype=float32", f"--out_dir={tmp / ('compiled-' + kind)}"]
        if kind == "vit":  # the bench times ViT-S/16 at 224 px: 32 px images of 8 px patches here
            extra += ["--img_size=32", "--patch_size=8"]
        if kind == "dino":  # two crop sizes, compiled: the compiled backbone sees both
            extra += ["--global_size=28", "--patch_size=7", "--local_crops=2", "--local_size=14", "--compile_model=True"]
        if kind == "gpt":  # one process, as on a GPU
            extra += ["--cpu_procs=1"]
        commands[f"compiled {kind}"] = [sys.executable, "dev/gpu_bench.py", f"--recipe={script}", *options, *extra]
    for kind in ("vit", "gpt", "dino"):
        for dtype in ("bfloat16", "float16", "float32"):  # float32: the reference that shows autocast changed the arithmetic
            commands[f"{dtype} {kind}"] = [sys.executable, f"train_{kind}.py", *TINY[kind], f"--dtype={dtype}",
                                           f"--out_dir={tmp / (dtype + '-' + kind)}"]
            if kind == "gpt":  # its data, in one process
                commands[f"{dtype} {kind}"] += data + ["--cpu_procs=1"]
    return commands


def model_input(cfg, batch, T):
    """Images (B, C, H, W) for a ViT, token ids (B, T) for a GPT."""
    g = torch.Generator().manual_seed(2)
    if cfg.model == "vit":
        return torch.randn(batch, cfg.in_chans, cfg.img_size, cfg.img_size, generator=g)
    return torch.randint(0, cfg.vocab_size, (batch, T), generator=g)


def max_weight_difference(out_a, out_b):
    """Max |difference| of the weights that two runs saved: 0 when both did the same arithmetic."""
    a, b = (load_checkpoint(os.path.join(out, "ckpt.pt")) for out in (out_a, out_b))
    key = "model" if "model" in a else "student"
    return max((a[key][k].float() - b[key][k].float()).abs().max().item() for k in a[key])


RUNS_OF_TEST = {  # the runs each script test reads ({kind}: its parameter)
    "test_each_script_compiled_on_the_cpu_as_the_gpu_bench_runs_it": ["compiled {kind}"],
    "test_each_script_under_bfloat16_cpu_autocast": ["bfloat16 {kind}", "float32 {kind}"],
    "test_float16_trains_with_its_gradient_scaler": ["float16 {kind}", "float32 {kind}"],
}


@pytest.fixture(scope="module")
def script_run(request, tmp_path_factory, data_dir):
    """name -> (its output, out_dir) of a run that succeeded. The runs that the selected tests read start together
    when the first is asked for, two at a time."""
    tmp = tmp_path_factory.mktemp("runs")
    commands = script_commands(tmp, data_dir)
    wanted = {run.format(**item.callspec.params) for item in request.session.items
              for run in RUNS_OF_TEST.get(getattr(item, "originalname", ""), [])}
    pool = ThreadPoolExecutor(max_workers=2)
    futures = {name: pool.submit(subprocess.run, cmd, cwd=ROOT, env=ENV, capture_output=True, text=True, timeout=600)
               for name, cmd in commands.items() if name in wanted}

    def get(name):
        done = futures[name].result()
        out = next(a.split("=", 1)[1] for a in reversed(commands[name]) if a.startswith("--out_dir="))
        assert done.returncode == 0, f"{name} failed ({done.returncode}):\n{done.stdout[-2000:]}\n{done.stderr[-3000:]}"
        return done.stdout, out

    yield get
    pool.shutdown(wait=True)


def losses(output):
    """The losses of a run's progress lines ('| loss 2.3012 |') and of its RESULT line."""
    logged = [float(m) for m in re.findall(r"\| loss (\S+) \|", output)]
    return logged + [float(v) for k, v in conftest.parse_result(output).items() if "loss" in k]


@pytest.mark.parametrize("kind", ["vit", "gpt", "dino"])
def test_each_script_compiled_on_the_cpu_as_the_gpu_bench_runs_it(script_run, kind):
    output, out = script_run(f"compiled {kind}")
    assert losses(output) and all(map(math.isfinite, losses(output)))
    assert parse_speed(output) > 0  # the bench reads the rate of these progress lines
    if kind == "vit":  # the bench's colour images reached the script, and config/vit_cifar10.py's recipe ran
        assert "3x32x32" in output and re.search(r"mixup.*0\.8", output)


@pytest.mark.parametrize("kind", ["vit", "gpt", "dino"])
def test_each_script_under_bfloat16_cpu_autocast(script_run, kind):
    output, out = script_run(f"bfloat16 {kind}")
    assert losses(output) and all(map(math.isfinite, losses(output)))
    # the same run in float32 (on a CPU bit-identical when repeated) ends with other weights
    assert max_weight_difference(out, script_run(f"float32 {kind}")[1]) > 1e-6


@pytest.mark.parametrize("kind", ["vit", "dino"])  # the GPT's: tests/test_devices.py
def test_float16_trains_with_its_gradient_scaler(script_run, kind):
    output, out = script_run(f"float16 {kind}")
    assert losses(output) and all(map(math.isfinite, losses(output)))
    scaler = load_checkpoint(os.path.join(out, "ckpt.pt"))["scaler"]
    assert scaler.get("scale", 0) > 0  # a disabled GradScaler saves an empty state
    assert max_weight_difference(out, script_run(f"float32 {kind}")[1]) > 1e-6  # autocast ran in float16


# ---- compiled models against eager ones -------------------------------------
LAYOUTS = {  # three layers of two heads: no, some and all heads Laplacian (the per-layer list holds every layout)
    "vit attention": make_config("vit-tiny", n_layer=3, n_embd=32, n_head=2, n_lap=[0, 1, 2]),
    "vit uniform": make_config("vit-tiny", n_layer=3, n_embd=32, n_head=2, n_lap=[0, 1, 2], graph="uniform"),
    "gpt attention": make_config("gpt-tiny", n_layer=3, n_embd=32, n_head=2, n_lap=[0, 1, 2], vocab_size=50,
                                 block_size=32),
    "gpt uniform": make_config("gpt-tiny", n_layer=3, n_embd=32, n_head=2, n_lap=[0, 1, 2], vocab_size=50,
                               block_size=32, graph="uniform"),
}


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_compiled_model_equals_eager_in_logits_and_gradients(name):
    """torch.compile(fullgraph=True) against eager in float32. Tolerance: inductor fuses and reorders the float32
    sums (about 1e-7 relative per operation, a few layers deep), so rtol=1e-4 and atol=1e-5 leave room, while a
    compiled model whose Laplacian heads output P V instead of V - P V differs by up to 8e-2."""
    cfg = LAYOUTS[name]
    torch.manual_seed(0)
    model = randomise(build_model(cfg), std=0.02, seed=1, gain=1.0).eval()
    compiled = torch.compile(model, fullgraph=True)  # raises on any graph break
    x = model_input(cfg, 2, T=32)
    results = []
    for m in (model, compiled):
        model.zero_grad(set_to_none=True)
        logits = m(x)
        (logits * torch.linspace(-1, 1, logits.numel()).view_as(logits)).sum().backward()
        results.append((logits.detach(), {k: p.grad.clone() for k, p in model.named_parameters()}))
    (eager, eager_grads), (fused, fused_grads) = results
    torch.testing.assert_close(fused, eager, rtol=1e-4, atol=1e-5)
    for k in eager_grads:
        torch.testing.assert_close(fused_grads[k], eager_grads[k], rtol=1e-4, atol=1e-5, msg=k)


# ---- MFU: flops_per_token against a FLOP counter ------------------------------
def counted_flops(cfg, batch, T):
    """FLOPs of one forward and backward pass as torch.utils.flop_counter counts them, on the meta device (shapes
    only, no arithmetic). The counter knows the matmuls, convolutions and the CUDA SDPA kernels; SDPA's math
    backend spells attention as matmuls, so that it is counted on a CPU too."""
    with torch.device("meta"):
        model = build_model(cfg)
    x = model_input(cfg, batch, T).to("meta")
    with sdpa_kernel(SDPBackend.MATH), FlopCounterMode(display=False) as counter:
        loss = model(x, x)[1] if cfg.model == "gpt" else model(x).float().square().mean()
        loss.backward()
    return counter.get_total_flops(), model.flops_per_token(T) * T * batch


GPT_D12 = dict(n_layer=12, n_embd=768, n_head=6, vocab_size=65536, block_size=1024)


def test_compiled_muon_equals_eager_muon():
    """--compile_model on a GPU compiles Muon's Newton-Schulz iteration (one graph per stack shape): compiled by
    inductor on the CPU, three steps of a GPT's matrices move them as the eager iteration does, to float32 rounding."""
    import train_gpt
    torch.manual_seed(0)
    config = make_config("gpt-tiny", n_layer=2, n_embd=64, n_head=2, vocab_size=50)
    models = [build_model(config) for _ in range(2)]
    models[1].load_state_dict(models[0].state_dict())
    muons = [train_gpt.build_optimizers(m, "muon", 1e-3, 0.02, 0.2, 0.004, 0.1, (0.8, 0.95), compile=compiled)[1]
             for m, compiled in zip(models, (False, True))]
    for _ in range(3):
        for a, b in zip(*[[p for g in muon.param_groups for p in g["params"]] for muon in muons]):
            a.grad = torch.randn_like(a)
            b.grad = a.grad.clone()
        for muon in muons:
            muon.step()
    for (name, a), b in zip(models[0].named_parameters(), models[1].parameters()):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6, msg=name)
    assert muons[1].orthogonalize is not muons[0].orthogonalize  # the second did compile


@pytest.mark.parametrize("cfg, T", [
    (make_config("gpt-d20", **GPT_D12, n_lap=[0, 2, 4, 6] * 3), 1024),
    (make_config("gpt-d20", **GPT_D12, graph="uniform"), 1024),
    (make_config("gpt-tiny", vocab_size=65, n_lap=2), 128),
], ids=["gpt-d12", "gpt-d12-uniform", "gpt-tiny"])
def test_gpt_flops_per_token_equals_the_counted_flops(cfg, T):
    """GPT: every parameter but the token table sits in a bias-free matmul (6 FLOPs per parameter and token:
    2 forward, 4 backward) and attention is 12 * d * T per layer and token; the counter leaves out only elementwise
    work (norms, RoPE, softmax, V - P V), which flops_per_token leaves out too: equal to 0.1%."""
    counted, formula = counted_flops(cfg, 2, T)
    assert counted == pytest.approx(formula, rel=1e-3)


@pytest.mark.parametrize("cfg, T", [
    (make_config("vit-s", num_classes=1000, n_lap=3), 197),
    (make_config("vit-small", num_classes=10, n_lap=6), 65),
    (make_config("vit-cpu", n_lap=4), 17),
    (make_config("vit-cpu", n_lap=4, graph="uniform"), 17),
], ids=["vit-s16", "vit-small", "vit-cpu", "vit-cpu-uniform"])
def test_vit_flops_per_token_is_the_counted_flops_plus_its_non_matmul_parameters(cfg, T):
    """ViT: 6N also counts parameters that do no matmul work per token (biases, LayerNorms, position embedding,
    CLS token), the head once per token instead of once per image, and the patch embedding's input gradient, which
    images do not need. So the formula is an upper bound, over by 1.1% (ViT-S/16) to 3.1% (vit-cpu, d 64): within 4%."""
    counted, formula = counted_flops(cfg, 2, T)
    assert counted <= formula <= 1.04 * counted


# ---- the GPU peak table -------------------------------------------------------
@pytest.mark.parametrize("name, peak", [  # strings as torch.cuda.get_device_name() returns them
    ("NVIDIA H100 80GB HBM3", 989e12), ("NVIDIA H100 PCIe", 756e12), ("NVIDIA H100 NVL", 835e12),
    ("NVIDIA H200", 989e12), ("NVIDIA H200 NVL", 835e12), ("NVIDIA GH200 480GB", 989e12),
    ("NVIDIA A100-SXM4-80GB", 312e12), ("NVIDIA A100-SXM4-40GB", 312e12), ("NVIDIA A100-PCIE-40GB", 312e12),
    ("NVIDIA A100 80GB PCIe", 312e12), ("NVIDIA A100-SXM-80GB", 312e12), ("NVIDIA H100 SXM5 80GB", 989e12),
    ("NVIDIA H100 80GB HBM3e", 989e12), ("NVIDIA H200 141GB HBM3e", 989e12), ("NVIDIA A10", 125e12), ("NVIDIA L4", 121e12), ("NVIDIA L40S", 362e12),
    ("NVIDIA L40", 181e12), ("Tesla T4", 65e12), ("Tesla V100-SXM2-32GB", 125e12),
    ("NVIDIA GeForce RTX 4090", 165e12), ("NVIDIA GeForce RTX 3090", 71e12), ("NVIDIA GeForce RTX 3090 Ti", 80e12),
    ("NVIDIA GeForce RTX 4080", 97.5e12), ("NVIDIA GeForce RTX 3080", 59.5e12), ("NVIDIA RTX A6000", 155e12),
    # unknown, or another chip under a similar name: no MFU rather than a wrong one
    ("NVIDIA A10G", None), ("NVIDIA GeForce RTX 4090 Laptop GPU", None), ("NVIDIA GeForce RTX 4090 D", None),
    ("NVIDIA A100-SXM4-40GB MIG 1g.5gb", None), ("NVIDIA H100 80GB HBM3 MIG 3g.40gb", None), ("Tesla V100S-PCIE-32GB", None), ("NVIDIA GeForce GTX 1080 Ti", None), ("Radeon RX 7900 XTX", None),
])
def test_peak_flops_by_gpu_name(name, peak):
    got = common.peak_flops("cuda", name=name)
    assert got == (pytest.approx(peak, rel=0.01) if peak else None)


def test_peak_flops_of_a_cpu_is_none():
    assert common.peak_flops("cpu") is None

"""
The checks of the nanolap exercises (exercises/README.md), one command per exercise:

    python exercises/check.py 2                  # checks your exercises/ex2_laplacian_head.py
    python exercises/check.py 2 --hint           # the first hint; --hint=2 the second, and so on
    python exercises/check.py 2 --solution       # checks the reference, exercises/solutions/ex2_laplacian_head.py
    python exercises/check.py 4 --depth=48       # options go after the number (--key=value); --help lists them

Exercises that ask for code (1, 2, 3, 4, 6, 7, 9, 10) end in PASS or FAIL (exit status 0 or 1). The experiments (5,
8) read your runs and print the numbers to compare. Each section below is one exercise's check: read it, it is part
of the exercise. It compares your code with nanolap.py, with analyze.py's numbers (geometry.py measures them), or
with values the reference solutions gave on fixed inputs (exercises/expected.json): it holds no answer. What the
experiments train and read (your runs' analyses, a trained ViT's tokens, the small image model that the checks of 6
and 10 train) lives beside it in exercises/experiments.py; a section calls it by name: experiments.train_variant.
"""

import ast
import importlib.util
import inspect
import json
import math
import os
import re
import sys
import textwrap
import traceback
from unittest import mock

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))  # the repo root: nanolap, data
import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

import common  # noqa: E402
import configurator  # noqa: E402
import experiments  # noqa: E402  (exercises/experiments.py: what the experiments train and read)
import figures  # noqa: E402
import geometry  # noqa: E402
from data import text  # noqa: E402
from nanolap import MixedHeadAttention, build_model, make_config  # noqa: E402

FILES = {1: "ex1_laplacian.py", 2: "ex2_laplacian_head.py", 3: "ex3_first_token.py", 4: "ex4_oversmoothing.py",
         6: "ex6_gated_heads.py", 7: "ex7_spectrum.py", 9: "ex9_kv_cache.py",
         10: "ex10_attnscale.py"}  # the exercises that ask for code, and their files
OPTIONS = {  # each exercise's options (--key=value after the number) and their defaults
    1: dict(seed=0),
    2: dict(seed=0),
    3: dict(seed=0),
    4: dict(depth=24, n_seq=32, seq_len=17, n_embd=64, n_head=4,  # layers per stack; random sequences of tokens
            out="out/ex4", figure=True, seed=0),  # figure: draw OUT/collapse.png
    5: dict(out="out/ex5"),  # the folder of the two runs; analyze.py wrote OUT/analysis/
    6: dict(steps=600, batch_size=128, lr=3e-3, gate_lr=3e-2,  # steps=0: only test the module and evaluate
            heads="gated", dataset="fashion_mnist", data_dir="data",  # heads: gated | attention | laplacian
            val_images=2000, seed=0),
    7: dict(run="", max_samples=1000, seed=0),  # run: a train_vit.py out_dir; max_samples as given to analyze.py
    8: dict(out="out/ex8", sample_chars=200, seed=0),  # the folder of the two runs; analyze.py wrote OUT/analysis/
    9: dict(seed=0),
    10: dict(steps=600, batch_size=128, lr=3e-3, lam_lr=3e-3,  # steps=0: only test the module and evaluate
             heads="attnscale", dataset="fashion_mnist", data_dir="data",  # heads: attnscale | attention | laplacian
             val_images=2000, rho_images=500, seed=0),  # rho_images: validation images of the per-head analysis
}


EXPECTED = os.path.join(HERE, "expected.json")  # fixed inputs and what the reference solutions return for them
PAGE = os.path.join(HERE, "README.md")  # the exercises' page: each one's rating and hints


def load(number, solution=False):
    """The student's exercise file (or with solution=True the reference) as a module."""
    if solution and not os.path.isdir(os.path.join(HERE, "solutions")):
        raise common.UsageError(f"--solution: this copy has no exercises/solutions/ (a students' copy); check your own "
                                f"file: python exercises/check.py {number}")
    return load_file(os.path.join(HERE, "solutions" if solution else "", FILES[number]))


def load_file(path):
    """A Python file as a module."""
    spec = importlib.util.spec_from_file_location(os.path.splitext(os.path.basename(path))[0], path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def expected(number):
    """Exercise `number`'s cases in exercises/expected.json: inputs and outputs as nested lists (made float32 tensors
    here) and numbers, what the reference solution returned for the inputs."""
    with open(EXPECTED) as f:
        cases = json.load(f)[str(number)]
    return [{key: torch.tensor(value) if isinstance(value, list) else value for key, value in case.items()}
            for case in cases]


def expect(ok, what):
    """Print one verdict line and return ok."""
    print(f"  [{'ok' if ok else 'FAIL'}] {what}")
    return bool(ok)


def max_error(got, want):
    """max |got - want|, or infinity when the shapes differ."""
    return (got - want).abs().max().item() if got.shape == want.shape else math.inf


def reaches_every(grad, what):
    """The verdict that the loss reaches every one of a module's `what` (its gradient has no zero)."""
    found = "None" if grad is None else " ".join(f"{v:.3g}" for v in grad.tolist())
    return expect(grad is not None and grad.abs().min() > 0, f"the loss reaches every {what}: gradient {found}")


def randomise(module, std, seed):
    """Give every weight a random value: GPTs start with zero output projections, and the ViT's init (std 0.02)
    makes P nearly uniform; both would hide mistakes."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in module.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * std)
    return module


def random_case(build, cfg, seed, T=17):
    """build(cfg) with random weights (randomise), in eval mode, and random tokens (2, T, C): the same for one seed."""
    torch.manual_seed(seed)
    module = randomise(build(cfg), 0.1, seed).eval()
    return module, torch.randn(2, T, cfg.n_embd)

# ---- exercise 1: what a Laplacian head ignores ------------------------------------------------------------------

def check_1(ex, seed):
    torch.manual_seed(seed)
    model = build_model(make_config("vit-cpu", n_lap=4)).eval()
    P = model.get_attention(torch.randn(2, 1, 28, 28), layer=1)  # (B, H, T, T) of block 2: 17 tokens
    L = ex.laplacian(P)  # (B, H, T, T)
    T = P.shape[-1]
    D = model.config.n_embd // model.config.n_head
    v = torch.randn(2, 4, T, D)  # values (B, H, T, D)
    c = torch.randn(D) * 10  # one vector c for every token
    print(f"P from get_attention: {tuple(P.shape)}, rows sum to 1 (max error {(P.sum(-1) - 1).abs().max():.1e})")
    ok = expect(L.shape == P.shape, f"laplacian(P) has the shape of P {tuple(P.shape)}")
    ones = (L @ torch.ones(T, 1)).abs().max().item()
    ok &= expect(ones < 1e-6, f"(I - P) 1 = 0: max |(I - P) 1| = {ones:.1e}")
    shift = (L @ (v + c) - L @ v).abs().max().item()
    ok &= expect(shift < 1e-4, f"Laplacian head, every value + c: its output moves by at most {shift:.1e}")
    diff = torch.einsum("bhts,bhtsd->bhtd", P, v[:, :, :, None] - v[:, :, None])  # sum_j P_tj (v_t - v_j)
    err = (L @ v - diff).abs().max().item()
    ok &= expect(err < 1e-4, f"row t of (I - P) V is sum_j P_tj (v_t - v_j): max error {err:.1e}")
    passed = (P @ (v + c) - P @ v - c).abs().max().item()  # nanolap's facts, for contrast: no student code below
    print(f"  attention head, every value + c: its output moves by exactly c (max error {passed:.1e})")
    attn = randomise(MixedHeadAttention(model.config, n_lap=4), 0.3, seed).eval()  # all heads Laplacian
    x = torch.randn(2, T, model.config.n_embd)
    before = attn(x)
    with torch.no_grad():  # the value bias adds one vector to every token's value projection
        attn.qkv.bias[2 * model.config.n_embd:] += 10 * torch.randn(model.config.n_embd)
    print(f"  MixedHeadAttention with 4 of 4 Laplacian heads, value bias + c: output moves by "
          f"{(attn(x) - before).abs().max():.1e}")
    return ok

# ---- exercise 2: a Laplacian head from scratch ---------------------------------------------------------------

def body_lines(function):
    """Lines of code in a function's body: no signature, docstring, comments or blank lines."""
    source = textwrap.dedent(inspect.getsource(function))
    body = ast.parse(source).body[0].body
    if isinstance(body[0], ast.Expr) and isinstance(getattr(body[0].value, "value", None), str):
        body = body[1:]  # the docstring
    lines = source.splitlines()[body[0].lineno - 1:body[-1].end_lineno]
    return sum(1 for line in lines if line.strip() and not line.strip().startswith("#"))


def check_2(ex, seed):
    n = body_lines(ex.mixed_head_attention)
    ok = expect(n <= 15, f"mixed_head_attention's body has {n} lines of code (at most 15)")
    cases = [("vit-cpu", n_lap) for n_lap in (0, 1, 4)] + [("gpt-tiny", n_lap) for n_lap in (0, 2, 4)]
    # ViT: biases, LayerNorm on q and k; GPT: causal, no biases, RMSNorm on q and k, and no RoPE: attn(x) without
    # `rope` skips it. RoPE only rotates q and k before the scores: it changes P, not how P and I - P mix the
    # values, which is what this exercise is about (nanolap's GPT passes rope to every block; exercise 6 does too)
    for preset, n_lap in cases:
        cfg = make_config(preset, n_lap=n_lap, n_layer=1, vocab_size=10)
        attn, x = random_case(lambda cfg: MixedHeadAttention(cfg, n_lap), cfg, seed)
        with torch.no_grad():
            fused = attn(x)
            yours = ex.mixed_head_attention(attn, x)
        err = max_error(yours, fused)
        ok &= expect(err <= 1e-5, f"{preset:8s} causal={str(cfg.causal):5s} {'no RoPE' if cfg.causal else '':7s} "
                                  f"n_lap={n_lap} of {cfg.n_head}: max |fused - yours| = {err:.1e} (at most 1e-5)")
    return ok

# ---- exercise 3: the causal case -------------------------------------------------------------------------------

def check_3(ex, seed):
    ok = True
    idx = torch.randint(0, 50, (3, 12), generator=torch.Generator().manual_seed(seed))
    for n_lap in (0, [0, 2, 4, 1], 4):
        model = randomise(build_model(make_config("gpt-tiny", n_lap=n_lap, vocab_size=50)), 0.1, seed).eval()
        with torch.no_grad():
            full = model(idx)[:, 0]
            yours = ex.first_position_logits(model, idx)
        err = max_error(yours, full)
        ok &= expect(err < 1e-4, f"n_lap={n_lap}: max |model(idx)[:, 0] - yours| = {err:.1e}")
    # nanolap's facts, for contrast: a Laplacian layer gives position 0 nothing, so its attention weights get no
    # gradient from the prediction made there
    for n_lap in (0, 4):
        model = randomise(build_model(make_config("gpt-tiny", n_lap=n_lap, vocab_size=50)), 0.1, seed)
        attn = model.blocks[0].attn
        out0 = attn(torch.randn(3, 12, model.config.n_embd))[:, 0]
        F.cross_entropy(model(idx, explicit=True)[:, 0], idx[:, 1]).backward()  # the first prediction's loss only
        grad = sum(p.grad.abs().sum() for b in model.blocks for p in b.attn.parameters()).item()
        zero = "not zero" if out0.any() else "exactly zero"
        print(f"  n_lap={n_lap} of 4: a block's attention output at position 0 is {zero}; the first prediction's "
              f"gradient on all attention weights sums to {grad:.3g}")
    return ok

# ---- exercise 4: depth and oversmoothing ---------------------------------------------------------------------

def collapse_curve(frac, n_lap, residual, depth, n_seq, seq_len, n_embd, n_head, seed):
    """frac(tokens) after 0..depth layers of attention alone (no MLP, no norm; residual: x + attn(x)) at
    initialisation. Weights ~ N(0, 1/n_embd) keep the scale of the tokens (nanolap's std 0.02 would shrink them
    ~40x per layer); every stack sees the same tokens and, layer by layer, the same weights."""
    cfg = make_config("vit-cpu", n_layer=1, n_embd=n_embd, n_head=n_head, n_lap=n_lap)
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n_seq, seq_len, n_embd, generator=g)
    curve = [frac(x)]
    with torch.no_grad():
        for _ in range(depth):
            attn = MixedHeadAttention(cfg, n_lap)
            for p in attn.parameters():
                if p.ndim == 2:  # q, k, v and output projections; biases stay 0, the q/k norms 1
                    p.copy_(torch.randn(p.shape, generator=g) * n_embd ** -0.5)
            x = attn(x) + (x if residual else 0)
            curve.append(frac(x))
    return curve


def check_4(ex, depth, n_seq, seq_len, n_embd, n_head, out, figure, seed):
    ok = True
    # the reference solution's values on fixed tokens, computed on another CPU: in float64 from small integers, another
    # CPU or another order of the sums rounds them apart by 1e-17 or so, far inside 1e-9
    for case in expected(4):
        want = case["within_seq_frac"]
        got = ex.within_seq_frac(case["h"])
        ok &= expect(abs(want - got) < 1e-9, f"{case['name']}: within_seq_frac {got:.6f}, the reference's {want:.6f}")
    if not ok:
        return False
    sizes = dict(depth=depth, n_seq=n_seq, seq_len=seq_len, n_embd=n_embd, n_head=n_head, seed=seed)
    curves = {(n_lap, res): collapse_curve(ex.within_seq_frac, n_lap, res, **sizes)
              for res in (False, True) for n_lap in (0, n_head)}
    shown = sorted(set(range(0, depth + 1, max(1, depth // 8))) | {depth})  # about nine layers, the last among them
    print("  WithinSeqVar / TotalVar of the tokens after layer L of each stack (L = 0: the random input tokens)")
    print(f"  {'after layer L =':30s}" + " ".join(f"{layer:>7d}" for layer in shown))
    for (n_lap, res), curve in curves.items():
        name = f"{'Laplacian' if n_lap else 'attention'} heads, {'x + attn(x)' if res else 'attn(x)'}"
        print(f"  {name:30s}" + " ".join(f"{curve[layer]:7.1e}" for layer in shown))
    if figure:
        path = figures.fig_random_stacks(curves, f"{n_head} heads, width {n_embd}, random weights",
                                         os.path.join(out, "collapse.png"))
        print(f"  figure: {path}")
    att = curves[(0, False)][-1]
    lap = curves[(n_head, False)][-1]
    return expect(att < lap, f"after {depth} layers: attention-only {att:.2e} < Laplacian {lap:.2e}")


# ---- exercise 5: a per-layer schedule (an experiment: numbers to compare) -------------------------------------

def check_5(ex, out):
    runs = experiments.read_comparison(out, "vit")
    if runs is None:
        return False
    layers = runs[0]["layerwise"]["layer"]
    print(f"{'run':24s} {'n_lap':10s} {'val_acc':>8s} {'k_0.99':>7s}   within-seq share after block", *layers)
    for analysis in runs:
        share = " ".join(f"{v:.3f}" for v in analysis["layerwise"]["within_seq_frac"])
        n_lap = str(analysis["n_lap"]).replace(" ", "")
        print(f"{analysis['run'][-24:]:24s} {n_lap:10s} {analysis['final_metric']['value']:8.4f} "
              f"{analysis['spectrum']['k_0.99']:7.2f}   {share}")
    print("mean pairwise cosine of the tokens in an image, after block " + " ".join(layers))
    for analysis in runs:
        print(f"{analysis['run'][-24:]:24s} " + " ".join(f"{v:.3f}" for v in analysis["layerwise"]["cosine"]))
    return True

# ---- exercise 6: a learnable head type -------------------------------------------------------------------------

def check_gates(ex, seed):
    """The gated module against nanolap's: g = 0 is MixedHeadAttention with n_lap=0, g = 1 with n_lap=n_head, any g
    is (1 - g) P V + g (V - P V) head by head, and the loss reaches the gates."""
    ok = True
    for preset in ("vit-cpu", "gpt-tiny"):
        cfg = make_config(preset, n_layer=1, vocab_size=10)
        gated, x = random_case(ex.GatedHeadAttention, cfg, seed)
        H = cfg.n_head
        model = build_model(cfg)
        rope = (model.cos[:, :17], model.sin[:, :17]) if cfg.pos == "rope" else None  # GPT: rotary positions
        for g, n_lap in ((0.0, 0), (1.0, H)):
            plain = MixedHeadAttention(cfg, n_lap).eval()
            plain.load_state_dict(gated.state_dict(), strict=False)
            with torch.no_grad():
                gated.gate_logit.fill_(-30.0 if g == 0 else 30.0)
                err = (gated(x, rope) - plain(x, rope)).abs().max().item()
            ok &= expect(err < 1e-5, f"{preset}: all gates {g:.0f} equals MixedHeadAttention with n_lap={n_lap}: "
                                     f"max error {err:.1e}")
    # any gates, in the loop's last module (the causal GPT's): head h's gate moves the output along a straight line,
    # from nanolap's module with head h an attention head to the one with head h a Laplacian head. nanolap makes the
    # trailing k heads Laplacian: going from k to k + 1 switches head H - 1 - k alone
    outputs = []
    for n_lap in range(H + 1):
        plain = MixedHeadAttention(cfg, n_lap).eval()
        plain.load_state_dict(gated.state_dict(), strict=False)
        with torch.no_grad():
            outputs.append(plain(x, rope))
    g = torch.tensor([0.0, 0.25, 0.5, 0.75])
    want = outputs[0] + sum(g[H - 1 - k] * (outputs[k + 1] - outputs[k]) for k in range(H))
    with torch.no_grad():
        gated.gate_logit.copy_(torch.logit(g))
        err = (gated(x, rope) - want).abs().max().item()
    ok &= expect(err < 1e-5, f"gates {g.tolist()}: each head's output lies g of the way from its attention output to "
                             f"its Laplacian output, max error {err:.1e}")
    with torch.no_grad():
        gated.gate_logit.zero_()  # g = 1/2
    gated(x, rope).square().sum().backward()
    return ok & reaches_every(gated.gate_logit.grad, "gate")


def check_6(ex, steps, batch_size, lr, gate_lr, heads, dataset, data_dir, val_images, seed):
    if not check_gates(ex, seed):
        return False
    model, _ = experiments.train_variant("gated", ex.gated_model, heads, steps, batch_size, lr, gate_lr, dataset,
                                         data_dir, val_images, seed)
    if heads == "gated":
        print("  learned gates g (0 = attention head, 1 = Laplacian head):")
        for number, block in enumerate(model.blocks, start=1):
            gates = block.attn.gates().detach()
            shown = " ".join(f"{v:.3f}" for v in gates.tolist())
            print(f"    layer {number}: {shown}   mean {gates.mean():.3f}")
    return True

# ---- exercise 7: the spectrum by hand ----------------------------------------------------------------------------

def check_7(ex, run, max_samples, seed):
    ok = True
    for case in expected(7):  # the reference solution's values on fixed tokens; the first by hand: eigenvalues 98, 2
        for alpha in geometry.ALPHAS:
            got = ex.k_alpha(case["h"], alpha)
            want = case[f"k_{alpha}"]
            ok &= expect(abs(got - want) < 1e-9, f"{case['name']}: k_{alpha} = {got:.4f} (the reference's {want:.4f})")
    if not run:
        print("  pass --run=DIR (a train_vit.py out_dir that analyze.py analysed) to compare with analyze.py on a "
              "trained ViT's tokens")
        return ok
    h, stored = experiments.trained_tokens(run, max_samples, seed)
    print(f"tokens: {run}: {len(h)} validation images, final-norm patch tokens, shape {tuple(h.shape)}")
    path = os.path.join(run, "analysis", "analysis.json")
    if stored is None or stored["n_sequences"] != len(h):
        found = "there is none" if stored is None else f"it measured {stored['n_sequences']} images"
        return expect(False, f"{path}: {found}; run python analyze.py {run} --max_samples={max_samples}")
    for alpha in geometry.ALPHAS:  # analysis.json keeps analyze.py's mean k over the images: a multiple of 1 / N
        got = ex.k_alpha(h, alpha)
        want = stored[f"k_{alpha}"]
        ok &= expect(abs(got - want) < 0.5 / len(h), f"k_{alpha}: yours {got:.4f}, analyze.py's {want:.4f} ({path})")
    return ok

# ---- exercise 8: language (an experiment: numbers to compare) -------------------------------------------------

def check_8(ex, out, sample_chars, seed):
    runs = experiments.read_comparison(out, "gpt")
    if runs is None:
        return False
    print(f"{'run':24s} {'n_lap':6s} {'val_loss':>8s} {'val_bpb':>8s} {'within':>7s} {'between':>8s} {'NC1':>7s} "
          f"{'k_0.99':>7s}   (ANOVA over next-token classes, final norm)")
    for analysis in runs:
        log = [json.loads(line) for line in open(os.path.join(analysis["run"], "log.jsonl")) if line.strip()]
        anova = analysis["anova"]
        print(f"{analysis['run'][-24:]:24s} {str(analysis['n_lap']):6s} {log[-1]['val_loss']:8.4f} "
              f"{log[-1]['val_bpb']:8.4f} {anova['within_class_frac']:7.3f} {anova['between_class_frac']:8.3f} "
              f"{analysis['nc']['nc1']:7.3g} {analysis['spectrum']['k_0.99']:7.2f}")
    for analysis in runs:
        ckpt = common.load_checkpoint(os.path.join(analysis["run"], "ckpt.pt"))
        model = common.load_model(ckpt).eval()
        tok = text.get_tokenizer(ckpt["meta"])
        idx = torch.tensor([tok.encode("\n")])
        g = torch.Generator().manual_seed(seed)
        sample = tok.decode(model.generate(idx, sample_chars, temperature=0.8, top_k=200, generator=g)[0].tolist())
        print(f"---- a sample of {analysis['run']} (n_lap={analysis['n_lap']}, temperature 0.8) ----\n{sample}")
    return True

# ---- exercise 9: the KV cache of a Laplacian head ------------------------------------------------------------------

SMALL = dict(n_layer=1, n_embd=8, n_head=2)  # the layers of the fixed cases in expected.json: 2 heads of size 4


def fixed_layer(module, case):
    """module (no biases) with the weights of a fixed case of exercises/expected.json, in eval mode."""
    with torch.no_grad():
        module.qkv.weight.copy_(case["qkv"])
        module.proj.weight.copy_(case["proj"])
    return module.eval()


def cached_steps(ex, attn, x):
    """ex.cached_step on the tokens of x (B, T, C) one at a time, from an empty cache: the outputs (B, T, C) and the
    cache after the last token."""
    B, T, _ = x.shape
    empty = x.new_zeros(B, attn.n_head, 0, attn.head_dim)  # (B, H, 0, D): no token yet
    cache = {"k": empty, "v": empty}
    with torch.no_grad():
        steps = [ex.cached_step(attn, x[:, t:t + 1], cache) for t in range(T)]  # T outputs (B, 1, C)
    return torch.cat(steps, dim=1), cache


def check_9(ex, seed):
    ok = True
    # the reference solution's outputs on a fixed small layer, computed on another CPU: float32 roundings differ
    # between CPUs by up to 5e-7 here (measured), 20 times less than 1e-5; a mistake moves them by 0.9 or more
    for case in expected(9):
        attn = fixed_layer(MixedHeadAttention(make_config("gpt-tiny", vocab_size=10, **SMALL), case["n_lap"]), case)
        got, _ = cached_steps(ex, attn, case["h"])
        err = max_error(got, case["out"])
        ok &= expect(err < 1e-5, f"{case['name']}: max |the reference's - yours| = {err:.1e}")
    # the whole sequence in one call of the layer (causal; no RoPE: attn(x) without `rope` skips it) against your
    # steps; the cache must hold what an attention layer's holds, keys and values, and nothing more
    cfg = make_config("gpt-tiny", n_layer=1, vocab_size=10)
    for n_lap in (0, 2, 4):
        attn, x = random_case(lambda cfg: MixedHeadAttention(cfg, n_lap), cfg, seed, T=9)  # x (B, T, C)
        with torch.no_grad():
            full = attn(x)  # (B, T, C)
        got, cache = cached_steps(ex, attn, x)
        err = max_error(got, full)
        ok &= expect(err <= 1e-5, f"n_lap={n_lap} of {cfg.n_head}, no RoPE: 9 cached steps against the whole sequence "
                                  f"at once, max error {err:.1e}")
        held = {name: tuple(t.shape) for name, t in cache.items()}
        want = {name: (2, cfg.n_head, 9, cfg.n_embd // cfg.n_head) for name in ("k", "v")}
        ok &= expect(held == want, f"n_lap={n_lap}: after 9 tokens the cache holds {held} (keys and values, "
                                   f"(B, H, T, D) each)")
    return ok

# ---- exercise 10: a high-pass relative side by side ---------------------------------------------------------------

def attnscale_by_matrix(module, config, x):
    """The reference: AttnScale's P_lambda = U + (1 + lambda)(P - U) written out for every head, with U = 11^T / T,
    times the values, then the projection. P comes from nanolap's explicit path, through a MixedHeadAttention that
    holds module's weights."""
    B, T, C = x.shape
    H = module.n_head
    D = module.head_dim
    plain = MixedHeadAttention(config, n_lap=0).eval()
    plain.load_state_dict(module.state_dict(), strict=False)  # strict=False: it has no lam
    _, P = plain(x, explicit=True, return_attn=True)  # (B, H, T, T)
    v = plain.qkv(x)[..., 2 * C:].reshape(B, T, H, D).transpose(1, 2)  # (B, H, T, D): the rows after q's and k's
    U = torch.full((T, T), 1.0 / T)  # (T, T): every row the plain mean of the sequence
    P_lam = U + (1 + module.lam.view(1, H, 1, 1)) * (P - U)  # (B, H, T, T); rows sum to 1 whatever lambda is
    return plain.proj((P_lam @ v).transpose(1, 2).reshape(B, T, C))


def fused_calls(module, x):
    """How many F.scaled_dot_product_attention calls one forward of module makes."""
    with mock.patch.object(F, "scaled_dot_product_attention", wraps=F.scaled_dot_product_attention) as fused:
        with torch.no_grad():
            module(x)
    return fused.call_count


def check_attnscale(ex, seed):
    """The module against the written-out P_lambda: a fixed case, lambda = 0 (attention), -1 (the plain mean) and
    mixed; one fused call per forward; the loss reaches every lambda."""
    ok = True
    # the reference solution's outputs on a fixed small layer, computed on another CPU: float32 roundings differ
    # between CPUs by up to 5e-7 here (measured), 20 times less than 1e-5; lambda 0.2% off moves them by 7e-4
    for case in expected(10):
        module = fixed_layer(ex.AttnScaleAttention(make_config("vit-cpu", bias=False, **SMALL)), case)
        with torch.no_grad():
            module.lam.copy_(case["lam"])
            got = module(case["h"])
        err = max_error(got, case["out"])
        ok &= expect(err < 1e-5, f"{case['name']}: max |the reference's - yours| = {err:.1e}")
    cfg = make_config("vit-cpu", n_layer=1)
    module, x = random_case(ex.AttnScaleAttention, cfg, seed)  # x (B, T, C)
    for lam in ([0.0] * 4, [-1.0] * 4, [0.5, -0.5, -2.0, 1.5]):
        with torch.no_grad():
            module.lam.copy_(torch.tensor(lam))
            got = module(x)
            want = attnscale_by_matrix(module, cfg, x)
        err = max_error(got, want)
        ok &= expect(err < 1e-5, f"lambda = {lam}: against U + (1 + lambda)(P - U) written out, max error {err:.1e}")
    calls = fused_calls(module, x)
    ok &= expect(calls == 1, f"one forward makes {calls} F.scaled_dot_product_attention call(s): one gives every P V")
    module(x).square().sum().backward()
    return ok & reaches_every(module.lam.grad, "lambda")


def check_10(ex, steps, batch_size, lr, lam_lr, heads, dataset, data_dir, val_images, rho_images, seed):
    if not check_attnscale(ex, seed):
        return False
    model, data = experiments.train_variant("attnscale", ex.attnscale_model, heads, steps, batch_size, lr, lam_lr,
                                            dataset, data_dir, val_images, seed)
    xv = data["val"][0][:rho_images]
    rho = experiments.head_rho(model, experiments.normalised(xv, model, data))
    print(f"  rho_h of every head on {len(xv)} validation images, the first-order change of the within-image "
          f"variance of the patch tokens (negative: the head smooths them):")
    for number, (block, block_rho) in enumerate(zip(model.blocks, rho), start=1):
        lam = block.attn.lam.tolist() if heads == "attnscale" else []
        rhos = " ".join(f"{v:+.3f}" for v in block_rho.tolist())
        print(f"    block {number}: rho {rhos}   mean {block_rho.mean():+.3f}"
              + ("   lambda " + " ".join(f"{v:+.2f}" for v in lam) if lam else ""))
    return True

# ---- the exercises' page: each one's rating and hints -------------------------------------------------------

def page_section(number):
    """Exercise `number`'s section of exercises/README.md, from its heading to the next."""
    with open(PAGE, encoding="utf-8") as f:  # the page writes lambda as λ
        page = f.read()
    return re.search(rf"^## Exercise {number}:.*?(?=^## |\Z)", page, re.M | re.S).group(0)


def rating(number):
    """The section's rating line: 'difficulty d/5, importance i/5, about m minutes'."""
    line = re.search(r"^Difficulty (\d)/5, importance (\d)/5, about (\d+) minutes\.$", page_section(number), re.M)
    return f"difficulty {line[1]}/5, importance {line[2]}/5, about {line[3]} minutes"


def hints(number):
    """The section's hints, in order: each in a <details> block, folded on the page until a student opens it."""
    return re.findall(r"^<details><summary>Hint \d</summary>\n\n(.*?)\n\n</details>$", page_section(number),
                      re.M | re.S)


def show_hint(number, option):
    """Print hint k of --hint=k (--hint: k = 1) and say how to see the next; returns the exit status."""
    found = hints(number)
    k = option.partition("=")[2] or "1"
    if not k.isdigit() or not 1 <= int(k) <= len(found):
        print(f"error: {option}: exercise {number} has hints 1 to {len(found)}")
        return 2
    print(f"exercise {number} ({rating(number)}), hint {k} of {len(found)}:\n")
    print(textwrap.indent(found[int(k) - 1], "  "))
    if int(k) < len(found):
        print(f"\nthe next hint: python exercises/check.py {number} --hint={int(k) + 1}")
    return 0

# ---- run ----------------------------------------------------------------------------------------------------------

CHECKS = {1: check_1, 2: check_2, 3: check_3, 4: check_4, 5: check_5, 6: check_6, 7: check_7, 8: check_8, 9: check_9,
          10: check_10}


def main(argv=None):
    """Run one exercise's check; returns the exit status (0 = PASS or numbers printed, 1 = FAIL)."""
    argv = sys.argv[1:] if argv is None else list(argv)
    if not argv or not argv[0].isdigit() or int(argv[0]) not in CHECKS:
        print(__doc__.strip() + f"\n\nusage: python exercises/check.py N [--hint[=K]] [--solution] [--key=value ...], "
              f"N in 1..{max(CHECKS)}")
        return 0 if {"-h", "--help"} & set(argv) else 2
    number = int(argv[0])
    rest = argv[1:]
    if {"-h", "--help"} & set(rest):
        print(f"exercise {number} options: " + " ".join(f"--{k}={v!r}" for k, v in OPTIONS[number].items()))
        return 0
    asked = [a for a in rest if a == "--hint" or a.startswith("--hint=")]
    if asked:
        return show_hint(number, asked[-1])
    solution = "--solution" in rest
    try:
        options = configurator.parse_args(OPTIONS[number], [a for a in rest if a != "--solution"])
        module = load(number, solution) if number in FILES else None
        what = f"checking {os.path.relpath(module.__file__)}" if module is not None else "your runs"
        print(f"exercise {number} ({rating(number)}): {what}")
        ok = CHECKS[number](module, **options)
    except common.UsageError as e:
        print(f"error: {e}")
        return 2
    except Exception:  # the student's code raised: show where
        traceback.print_exc()
        print(f"FAIL: exercise {number} raised an exception (above)")
        return 1
    if number in FILES or not ok:
        print(f"{'PASS' if ok else 'FAIL'}: exercise {number}")
    else:
        print(f"exercise {number}: the numbers above are the result; compare them (exercises/README.md)")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())

"""The worked proofs of the method, in the order a reader of nanolap.py meets its ideas: with n_lap = 0 a layer is
standard multi-head attention; a Laplacian head outputs (I - P) V, so it ignores whatever every token shares; the
fused path (P V for every head in one call, then V - P V) equals (I - P) V written out, with RoPE, causally (where the
future never leaks and the first position is exactly 0) and with a per-layer schedule; Laplacian heads cost no
parameters and no FLOPs; a GPT's zero output projections make every block a no-op at step 0; and the uniform graph
(every P the sequence mean, the mean-mixing baseline) has a fused path equal to its explicit one and no queries or
keys. The models around the idea are tested in test_models.py, the run plumbing in test_plumbing.py."""

import contextlib
import dataclasses
import os
import re
import types

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import nanolap
from conftest import ROOT, float32_matmuls, randomise
from nanolap import MixedHeadAttention, build_model, make_config


def test_no_laplacian_heads_is_standard_multihead_attention():
    torch.manual_seed(0)
    cfg = make_config("vit-tiny", n_lap=0, qk_norm=False)
    attn = MixedHeadAttention(cfg, 0).eval()
    mha = nn.MultiheadAttention(cfg.n_embd, cfg.n_head, batch_first=True).eval()
    with torch.no_grad():
        mha.in_proj_weight.copy_(attn.qkv.weight)
        mha.in_proj_bias.copy_(attn.qkv.bias.uniform_(-1, 1))
        mha.out_proj.weight.copy_(attn.proj.weight)
        mha.out_proj.bias.copy_(attn.proj.bias.uniform_(-1, 1))
    x = torch.randn(3, 20, cfg.n_embd)
    expected = mha(x, x, x, need_weights=False)[0]
    torch.testing.assert_close(attn(x), expected, atol=1e-5, rtol=1e-4)
    # and causally, against MHA with a boolean mask
    attn.causal = True
    expected = mha(x, x, x, attn_mask=torch.ones(20, 20, dtype=torch.bool).triu(1), need_weights=False)[0]
    torch.testing.assert_close(attn(x), expected, atol=1e-5, rtol=1e-4)


def test_laplacian_head_ignores_a_shared_value_component():
    torch.manual_seed(0)
    cfg = make_config("vit-tiny", n_lap=4)
    attn = randomise(MixedHeadAttention(cfg, 4), std=0.3).eval()
    x = torch.randn(2, 10, cfg.n_embd)
    before = attn(x)
    with torch.no_grad():  # add the same vector to every token's value (through the value bias)
        attn.qkv.bias[2 * cfg.n_embd:] += torch.randn(cfg.n_embd) * 5
    torch.testing.assert_close(attn(x), before, atol=1e-4, rtol=1e-4)
    # an attention head passes the shared component straight through: its output does change
    cfg0 = make_config("vit-tiny", n_lap=0)
    attn0 = randomise(MixedHeadAttention(cfg0, 0), std=0.3).eval()
    before = attn0(x)
    with torch.no_grad():
        attn0.qkv.bias[2 * cfg.n_embd:] += torch.randn(cfg.n_embd) * 5
    assert (attn0(x) - before).abs().max() > 0.1


def reference_attention(attn, x, rope=None):
    """(I - P) V for Laplacian heads and P V for attention heads, written out from the module's weights, head by head.
    The weight's rows are q (n_head heads), then k and v (n_kv_head heads each); query head h reads key and value head
    h // (n_head / n_kv_head) (grouped-query attention; n_kv_head = n_head: its own)."""
    B, T, C = x.shape
    H, K, D = attn.n_head, attn.n_kv_head, attn.head_dim
    W, b = attn.qkv.weight, attn.qkv.bias
    qkv = x @ W.T + (b if b is not None else 0)
    q, k, v = qkv[..., :C], qkv[..., C:C + K * D], qkv[..., C + K * D:]
    assert v.shape[-1] == K * D
    heads = []
    for h in range(H):
        g = h // (H // K)  # the query head's group
        qh, kh, vh = q[..., h * D:(h + 1) * D], k[..., g * D:(g + 1) * D], v[..., g * D:(g + 1) * D]
        qh, kh = attn.q_norm(qh), attn.k_norm(kh)
        if rope is not None:
            qh, kh = nanolap.apply_rope(qh[:, :, None], *rope)[:, :, 0], nanolap.apply_rope(kh[:, :, None], *rope)[:, :, 0]
        scores = qh @ kh.transpose(1, 2) / D ** 0.5
        if attn.causal:
            scores = scores + torch.full((T, T), float("-inf")).triu(1)
        P = scores.softmax(-1)
        op = torch.eye(T) - P if h >= H - attn.n_lap else P
        heads.append(op @ vh)
    y = torch.cat(heads, dim=-1)
    return y @ attn.proj.weight.T + (attn.proj.bias if attn.proj.bias is not None else 0)


@pytest.mark.parametrize("n_kv_head", [None, 2, 1])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("n_lap", [0, 1, 3, 4])
def test_fused_equals_explicit_reference(causal, n_lap, n_kv_head):
    """The fused path, the explicit one and the head-by-head reference agree, with grouped-query attention too
    (n_kv_head 2 and 1: pairs of query heads share a key and value head, or all four share one)."""
    torch.manual_seed(0)
    preset = "gpt-tiny" if causal else "vit-tiny"
    cfg = make_config(preset, n_lap=n_lap, n_layer=1, n_kv_head=n_kv_head, **({"vocab_size": 10} if causal else {}))
    attn = randomise(MixedHeadAttention(cfg, n_lap), std=0.3).eval()
    x = torch.randn(2, 17, cfg.n_embd)
    expected = reference_attention(attn, x)
    torch.testing.assert_close(attn(x), expected, atol=2e-5, rtol=1e-4)
    torch.testing.assert_close(attn(x, explicit=True), expected, atol=2e-5, rtol=1e-4)


@pytest.mark.parametrize("n_kv_head", [None, 2])
def test_fused_equals_reference_with_rope(n_kv_head):
    torch.manual_seed(0)
    model = randomise(build_model(make_config("gpt-tiny", n_lap=2, n_kv_head=n_kv_head, vocab_size=10)), std=0.3)
    attn, T = model.blocks[0].attn, 12
    rope = (model.cos[:, :T], model.sin[:, :T])
    x = torch.randn(2, T, model.config.n_embd)
    expected = reference_attention(attn, x, rope)
    torch.testing.assert_close(attn(x, rope), expected, atol=2e-5, rtol=1e-4)
    torch.testing.assert_close(attn(x, rope, explicit=True), expected, atol=2e-5, rtol=1e-4)


def test_the_readme_quotes_the_fused_path_as_nanolap_writes_it():
    """README.md's code under "The idea in one line of code" is nanolap.py's own: every quoted line, indentation aside,
    is a line of nanolap.py, the SDPA call and V - P V among them."""
    readme = open(os.path.join(ROOT, "README.md")).read()
    quoted = re.search(r"## The idea in one line of code\n.*?```python\n(.*?)```", readme, re.S).group(1).splitlines()
    code = {line.strip() for line in open(nanolap.__file__)}
    assert [line for line in quoted if line.strip() not in code] == []
    assert "F.scaled_dot_product_attention(" in quoted[0] and "v[:, :, self.n_att:] - y[:, :, self.n_att:]" in quoted[1]


def test_causal_first_position_is_zero_and_future_never_leaks():
    torch.manual_seed(0)
    cfg = make_config("gpt-tiny", n_lap=4, vocab_size=10)  # no biases
    attn = randomise(MixedHeadAttention(cfg, 4), std=0.3).eval()
    x = torch.randn(2, 16, cfg.n_embd)
    y = attn(x)
    assert torch.equal(y[:, 0], torch.zeros_like(y[:, 0]))  # (I - P) V at t = 0 is v_0 - v_0, exactly
    x2 = x.clone()
    x2[:, 9:] = torch.randn(2, 7, cfg.n_embd)
    torch.testing.assert_close(attn(x2)[:, :9], y[:, :9], atol=0, rtol=0)
    model = randomise(build_model(make_config("gpt-tiny", n_lap=[0, 2, 4, 1], vocab_size=10)), std=0.1).eval()
    idx = torch.randint(0, 10, (1, 30))
    idx2 = idx.clone()
    idx2[:, 20:] = (idx2[:, 20:] + 1) % 10
    torch.testing.assert_close(model(idx)[:, :20], model(idx2)[:, :20], atol=1e-6, rtol=0)


@pytest.mark.parametrize("n_kv_head", [None, 2])
@pytest.mark.parametrize("kind", ["vit", "gpt"])
def test_whole_model_fused_equals_explicit_mixed_schedule(kind, n_kv_head):
    torch.manual_seed(0)
    cfg = make_config(f"{kind}-tiny", n_lap=[4, 0, 2, 1], n_kv_head=n_kv_head, **({"vocab_size": 50} if kind == "gpt" else {}))
    model = randomise(build_model(cfg), std=0.1).eval()
    x = torch.randint(0, 50, (2, 40)) if kind == "gpt" else torch.randn(2, 1, 28, 28)
    with torch.no_grad():
        torch.testing.assert_close(model(x), model(x, explicit=True), atol=1e-4, rtol=1e-4)
    assert [b.attn.n_lap for b in model.blocks] == [4, 0, 2, 1]


@pytest.mark.parametrize("preset", ["vit-tiny", "vit-b", "gpt-tiny", "gpt-d20"])
def test_parameters_do_not_depend_on_n_lap(preset):
    with torch.device("meta"):  # no memory for the big ones
        H = nanolap.PRESETS[preset]["n_head"]
        layouts = (0, 1, H, [H] + [0] * (nanolap.PRESETS[preset]["n_layer"] - 1))
        counts = {build_model(make_config(preset, n_lap=n_lap)).num_params() for n_lap in layouts}
    assert len(counts) == 1


@pytest.mark.parametrize("preset", ["vit-tiny", "gpt-tiny"])
def test_measured_flops_do_not_depend_on_n_lap(preset):
    """FLOPs counted by torch (FlopCounterMode: every matmul, convolution and attention product, forward and backward)
    are the same with no Laplacian head as with every head Laplacian: V - P V adds only the subtraction, which is not
    a matmul. The math kernel writes attention out as two matmuls, so that they are counted too."""
    from torch.nn.attention import SDPBackend, sdpa_kernel
    from torch.utils.flop_counter import FlopCounterMode
    counts = []
    for n_lap in (0, 4, [4, 0, 2, 1]):
        model = build_model(make_config(preset, n_lap=n_lap, **({"vocab_size": 50} if preset == "gpt-tiny" else {})))
        x = torch.randint(0, 50, (2, 16)) if preset == "gpt-tiny" else torch.randn(2, 1, 28, 28)
        with sdpa_kernel(SDPBackend.MATH), FlopCounterMode(display=False) as counter:
            model(x).float().square().sum().backward()
        counts.append({str(op): n for op, n in counter.get_flop_counts()["Global"].items()})
    assert counts[0]["aten.bmm"] > 0  # the attention products QK^T and PV are in the count
    assert counts[0] == counts[1] == counts[2]


def test_zero_initialised_projections_make_every_block_a_no_op():
    model = build_model(make_config("gpt-tiny", n_lap=[0, 2, 4, 1], vocab_size=10))
    idx = torch.randint(0, 10, (2, 8))
    hidden = model.forward_features(idx, all_layers=True)
    x0 = F.rms_norm(model.wte(idx), (model.config.n_embd,))
    assert len(hidden) == model.config.n_layer + 1
    for h in hidden[:-1]:
        assert torch.equal(h, x0)


# On the GPU's kernels, fused against explicit: max |difference| / max |explicit value| of the logits and of the
# gradients. float32 differs by summation order only; half precision keeps 8 (bfloat16) or 11 (float16) significant
# bits, and the two paths round P, P V and V - P V apart.
CUDA_LIMITS = {"float32": (1e-4, 1e-3), "half": (5e-2, 1e-1)}
CUDA_CASES = [("attention", "float32", "EFFICIENT_ATTENTION"), ("attention", "half", "FLASH_ATTENTION"),
              ("attention", "half", "EFFICIENT_ATTENTION"), ("uniform", "float32", None), ("uniform", "half", None)]
CUDA_MODELS = {  # every head layout in one model: no, some and all heads Laplacian
    "vit": make_config("vit-small", n_lap=[0, 2, 4, 6, 6, 3], num_classes=10),
    "gpt": make_config("gpt-small", n_lap=[0, 1, 3, 6, 6, 2], vocab_size=512, block_size=256),
    "gpt gqa": make_config("gpt-small", n_lap=[0, 1, 3, 6, 6, 2], n_kv_head=2, vocab_size=512, block_size=256),
}


@pytest.mark.gpu
@pytest.mark.parametrize("graph, dtype, kernel", CUDA_CASES)
@pytest.mark.parametrize("name", CUDA_MODELS)
def test_cuda_fused_equals_explicit_on_each_fast_kernel(name, graph, dtype, kernel):
    """In float32 (TF32 off) and in what --dtype=auto trains: bfloat16 from compute capability 8.0, float16 below (a
    T4). sdpa_kernel raises when the kernel it restricts SDPA to cannot run (grouped keys and values that lost the
    fast kernel, say), so a passing case ran on that kernel; the uniform graph calls none."""
    from torch.nn.attention import SDPBackend, sdpa_kernel
    capability = torch.cuda.get_device_capability()
    if kernel == "FLASH_ATTENTION" and capability < (8, 0):
        pytest.skip(f"FlashAttention needs compute capability 8.0, this GPU has {capability[0]}.{capability[1]}")
    half = torch.bfloat16 if capability >= (8, 0) else torch.float16
    amp_dtype = torch.float32 if dtype == "float32" else half
    cfg = dataclasses.replace(CUDA_MODELS[name], graph=graph)
    torch.manual_seed(0)
    model = randomise(build_model(cfg), std=0.02, seed=1, gain=1.0).cuda().eval()
    g = torch.Generator().manual_seed(2)
    if cfg.model == "vit":
        x = torch.randn(8, cfg.in_chans, cfg.img_size, cfg.img_size, generator=g).cuda()
    else:
        x = torch.randint(0, cfg.vocab_size, (4, cfg.block_size), generator=g).cuda()
    paths = []
    for explicit in (False, True):
        model.zero_grad(set_to_none=True)
        restrict = sdpa_kernel(getattr(SDPBackend, kernel)) if kernel and not explicit else contextlib.nullcontext()
        with float32_matmuls(), torch.autocast("cuda", dtype=half, enabled=amp_dtype != torch.float32), restrict:
            logits = model(x, explicit=explicit).float()
            weights = torch.randn(logits.shape, generator=torch.Generator().manual_seed(3)).cuda()
            (logits * weights).sum().backward()  # a generic gradient: every logit counts
        grads = torch.cat([p.grad.float().flatten() for p in model.parameters() if p.grad is not None])
        paths.append((logits.detach(), grads))
    for (fused, reference), limit in zip(zip(*paths), CUDA_LIMITS[dtype]):
        assert ((fused - reference).abs().max() / reference.abs().max()).item() <= limit


@pytest.mark.parametrize("device, dtype, capability, reads", [
    ("cpu", torch.float32, None, True),  # CPU SDPA takes grouped keys and values
    ("cuda", torch.bfloat16, (8, 0), True),  # FlashAttention
    ("cuda", torch.float16, (7, 5), False),  # a T4: the memory-efficient kernel, which would fall back to the math one
    ("cuda", torch.float32, (9, 0), False),  # float32: no FlashAttention
])
def test_grouped_query_attention_goes_to_a_kernel_that_reads_it(monkeypatch, device, dtype, capability, reads):
    """Where SDPA's kernel cannot read grouped keys and values itself, the layer expands them first (a T4 would
    otherwise run the math kernel, memory quadratic in T), and that path equals the explicit one."""
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: capability)
    q = types.SimpleNamespace(is_cuda=device == "cuda", dtype=dtype, device=device)
    assert nanolap.sdpa_reads_groups(q) == reads
    torch.manual_seed(0)
    cfg = make_config("gpt-tiny", n_lap=2, n_layer=1, n_kv_head=2, vocab_size=10)
    attn = randomise(MixedHeadAttention(cfg, 2), std=0.3).eval()
    x = torch.randn(2, 17, cfg.n_embd)
    monkeypatch.setattr(nanolap, "sdpa_reads_groups", lambda q: reads)  # the CPU takes the path a GPU would
    torch.testing.assert_close(attn(x), reference_attention(attn, x), atol=2e-5, rtol=1e-4)


# the uniform graph: the mean-mixing baseline (P = 11^T / T, causally the running mean)

@pytest.mark.parametrize("n_kv_head", [None, 2])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("n_lap", [0, 2, 4])
def test_uniform_graph_fused_equals_explicit_and_mixes_by_the_mean(causal, n_lap, n_kv_head):
    torch.manual_seed(0)
    preset = "gpt-tiny" if causal else "vit-tiny"
    cfg = make_config(preset, n_lap=n_lap, n_layer=1, graph="uniform", n_kv_head=n_kv_head,
                      **({"vocab_size": 10} if causal else {}))
    attn = randomise(nanolap.UniformGraphAttention(cfg, n_lap), std=0.3).eval()
    x = torch.randn(2, 9, cfg.n_embd)
    K = n_kv_head or cfg.n_head
    v = (x @ attn.qkv.weight.T + (attn.qkv.bias if attn.qkv.bias is not None else 0)).view(2, 9, K, -1)
    v = v.repeat_interleave(cfg.n_head // K, dim=2)  # each query head's group's values
    count = torch.arange(1, 10).view(1, 9, 1, 1)
    mean = v.cumsum(1) / count if causal else v.mean(1, keepdim=True).expand_as(v)  # written out: P V
    expected = torch.cat([mean[:, :, :cfg.n_head - n_lap], (v - mean)[:, :, cfg.n_head - n_lap:]], dim=2)
    torch.testing.assert_close(attn.heads(x), expected, atol=1e-5, rtol=1e-4)
    y, P = attn(x, return_attn=True)
    torch.testing.assert_close(attn(x), y, atol=1e-5, rtol=1e-4)  # fused == explicit
    rows = torch.ones(9, 9).tril() if causal else torch.ones(9, 9)
    torch.testing.assert_close(P[0, 0], rows / rows.sum(-1, keepdim=True))


def test_uniform_graph_has_no_queries_or_keys():
    attention = build_model(make_config("vit-tiny"))
    uniform = build_model(make_config("vit-tiny", graph="uniform"))
    assert uniform.blocks[0].attn.qkv.out_features == 96 and isinstance(uniform.blocks[0].attn.q_norm, nn.Identity)
    per_layer = 2 * 96 * 96 + 2 * 96 + 2 * 2 * 24  # the query and key rows and biases; the two QK-norms (gain, bias)
    assert attention.num_params() - uniform.num_params() == 4 * per_layer
    with pytest.raises(ValueError, match=r"graph='mean': allowed values are \('attention', 'uniform', 'lap_uniform'\)"):
        make_config("vit-tiny", graph="mean")


# the mixed graph control: the Laplacian heads alone on the uniform graph, the attention heads on softmax

@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("n_lap", [1, 2, 3])
def test_lap_uniform_keeps_the_attention_heads_and_mixes_the_laplacian_heads_by_the_mean(causal, n_lap):
    """Against two independent references from the same weights: the attention heads equal an attention-graph module's
    (its q and k rows of those heads copied in, the rest random), and each Laplacian head outputs v - mean(v) (causally
    minus the running mean); the fused path equals the explicit one, whose P is the uniform matrix on those heads."""
    torch.manual_seed(0)
    preset = "gpt-tiny" if causal else "vit-tiny"
    cfg = make_config(preset, n_lap=n_lap, n_layer=1, graph="lap_uniform", **({"vocab_size": 10} if causal else {}))
    attn = randomise(nanolap.UniformLaplacianAttention(cfg, n_lap), std=0.3).eval()
    full = randomise(MixedHeadAttention(cfg, 0), std=0.3).eval()  # every head an attention head
    C, H = cfg.n_embd, cfg.n_head
    A = C // H * (H - n_lap)  # the attention heads' rows of q (and of k)
    with torch.no_grad():
        for module in ("q_norm", "k_norm"):
            getattr(full, module).load_state_dict(getattr(attn, module).state_dict())
        for name in ("weight", "bias"):
            src, dst = getattr(attn.qkv, name), getattr(full.qkv, name)
            if src is not None:
                dst[:A] = src[:A]  # q of the attention heads
                dst[C:C + A] = src[A:2 * A]  # k of the attention heads
                dst[2 * C:] = src[2 * A:]  # v of every head
    x = torch.randn(2, 9, C)
    rope = None
    if causal:
        model = build_model(cfg)
        rope = (model.cos[:, :9], model.sin[:, :9])
    y = attn.heads(x, rope)  # (B, T, H, D)
    torch.testing.assert_close(y[:, :, :H - n_lap], full.heads(x, rope)[:, :, :H - n_lap], atol=1e-5, rtol=1e-4)
    v = (x @ attn.qkv.weight[2 * A:].T + (attn.qkv.bias[2 * A:] if attn.qkv.bias is not None else 0)).view(2, 9, H, -1)
    count = torch.arange(1, 10).view(1, 9, 1, 1)
    mean = v.cumsum(1) / count if causal else v.mean(1, keepdim=True).expand_as(v)
    torch.testing.assert_close(y[:, :, H - n_lap:], (v - mean)[:, :, H - n_lap:], atol=1e-5, rtol=1e-4)
    y_explicit, P = attn(x, rope, return_attn=True)
    torch.testing.assert_close(attn(x, rope), y_explicit, atol=1e-5, rtol=1e-4)  # fused == explicit
    rows = torch.ones(9, 9).tril() if causal else torch.ones(9, 9)
    torch.testing.assert_close(P[0, H - 1], rows / rows.sum(-1, keepdim=True))


def test_lap_uniform_drops_only_the_laplacian_heads_queries_and_keys():
    """At n_lap 0 it is the attention graph, weight for weight and output for output; at n_lap = n_head it holds the
    uniform graph's parameters; in between it lacks the Laplacian heads' query and key rows and biases."""
    def model(graph, n_lap):
        torch.manual_seed(0)
        return build_model(make_config("vit-tiny", graph=graph, n_lap=n_lap)).eval()
    x = torch.randn(2, 1, 28, 28)
    torch.testing.assert_close(model("lap_uniform", 0)(x), model("attention", 0)(x), atol=0, rtol=0)
    assert model("lap_uniform", 4).num_params() == model("uniform", 4).num_params() + 4 * 2 * 2 * 24  # its QK-norms
    per_head = 2 * 24 * 96 + 2 * 24  # a head's query and key rows and biases (head_dim 24)
    assert model("attention", 2).num_params() - model("lap_uniform", 2).num_params() == 4 * 2 * per_head
    with pytest.raises(ValueError, match="graph='lap_uniform' has no grouped-query attention"):
        make_config("gpt-tiny", graph="lap_uniform", n_kv_head=2, vocab_size=10)


# grouped-query attention and the KV cache

def tiny_gpt(n_lap, n_kv_head=None, block_size=24, **overrides):
    """A 2-layer GPT whose every weight has a value (a fresh GPT's zero projections would hide every error)."""
    cfg = make_config("gpt-tiny", n_layer=2, n_lap=n_lap, n_kv_head=n_kv_head, vocab_size=50, block_size=block_size,
                      **overrides)
    return randomise(build_model(cfg), std=0.1).eval()  # logits of a few units: float32 rounding stays near 1e-6


@pytest.mark.parametrize("n_kv_head", [None, 2])
@pytest.mark.parametrize("n_lap", [0, 2, 4])
def test_cached_generation_equals_full_recomputation(n_lap, n_kv_head):
    """Within block_size a KV cache changes nothing: the logits of every new token, fed alone at its position, equal
    the full recomputation's within 1e-5, and generate samples the same tokens with the cache as without it."""
    torch.manual_seed(0)
    model = tiny_gpt(n_lap, n_kv_head)
    idx = torch.randint(0, 50, (2, 24))
    with torch.no_grad():
        full = model(idx)  # (B, 24, vocab): each position sees the ones before it
        cache = nanolap.KVCache(model.config.n_layer)
        steps = [model(idx[:, :5], cache=cache)]  # the prompt: 5 positions
        for t in range(5, 24):
            steps.append(model(idx[:, t:t + 1], cache=cache))  # one token, at position t
    assert len(cache) == 24
    torch.testing.assert_close(torch.cat(steps, dim=1), full, atol=1e-5, rtol=0)
    prompt = idx[:, :5]
    cached = model.generate(prompt, 19, top_k=10, generator=torch.Generator().manual_seed(1))
    recomputed = model.generate(prompt, 19, top_k=10, generator=torch.Generator().manual_seed(1), use_cache=False)
    assert cached.shape == (2, 24) and torch.equal(cached, recomputed)


@pytest.mark.parametrize("graph", ["attention", "uniform"])
def test_cached_generation_past_block_size_refills_the_last_half_window(graph):
    """A full cache is refilled with the last block_size // 2 tokens from position 0, as the docstring says: greedy
    generation past block_size equals recomputing exactly those contexts (the uniform graph's running mean too)."""
    torch.manual_seed(0)
    model = tiny_gpt([4, 2], 2, block_size=8, graph=graph)
    idx = torch.randint(0, 50, (1, 3))
    out = model.generate(idx, 20, temperature=0)
    start = 0  # where the context of the next token begins
    with torch.no_grad():
        for n in range(3, 23):
            if n - start > 8:  # the cache is full: keep the last half window
                start = n - 4
            assert model(out[:, start:n])[0, -1].argmax() == out[0, n]
    assert not torch.equal(out, model.generate(idx, 20, temperature=0, use_cache=False))  # another context: a full window
    with pytest.raises(ValueError, match="one prompt first and then one token per call"):
        cache = nanolap.KVCache(2)
        model(idx, cache=cache)
        model(idx, cache=cache)


def test_n_kv_head_equal_to_n_head_is_the_default_model():
    """n_kv_head = n_head builds what n_kv_head None builds: the same parameter names, shapes and initial values."""
    models = []
    for n_kv_head in (None, 4):
        torch.manual_seed(0)
        models.append(build_model(make_config("gpt-tiny", n_lap=2, n_kv_head=n_kv_head, vocab_size=65)))
    default, grouped = [m.state_dict() for m in models]
    assert list(default) == list(grouped) and all(torch.equal(default[key], grouped[key]) for key in default)


@pytest.mark.parametrize("preset", ["gpt-tiny", "gpt-d20", "vit-b"])
def test_grouped_query_attention_shrinks_k_and_v(preset):
    """k and v project to n_kv_head heads: each layer saves 2 x (n_head - n_kv_head) x head_dim x n_embd weights."""
    with torch.device("meta"):
        H = nanolap.PRESETS[preset]["n_head"]
        full, grouped = (build_model(make_config(preset, n_kv_head=k)) for k in (None, H // 2))
        c = full.config
        assert grouped.blocks[0].attn.qkv.out_features == c.n_embd + 2 * (H // 2) * (c.n_embd // H)
        saved = c.n_layer * 2 * (H - H // 2) * (c.n_embd // H) * (c.n_embd + c.bias)
        assert full.num_params() - grouped.num_params() == saved


@pytest.mark.parametrize("preset, width", [("gpt-small", None), ("gpt-d20", 768), ("gpt-d20", None)],
                         ids=["gpt-small (the README's T4 line)", "d12 (gpu_bench)", "d20"])
def test_relu_squared_cannot_overflow_float16_at_the_recipes_widths(preset, width):
    """float16 autocast (a T4) squares the MLP's pre-activations in float16, whose largest number is 65504: from
    |x| >= 256 the square is inf, and a gradient scaler guards no forward pass. A pre-activation is x_j = w_j . n with
    n = rmsnorm(h) (no gain, so |n| <= sqrt(d)), at most |w_j| sqrt(d) whatever the input; at the recipes' widths and
    init that bound is below 64 for every row: the rows may grow fourfold in training before an overflow is possible.
    Should one happen, the loss turns non-finite and the loop stops on it before a checkpoint."""
    config = make_config(preset, n_layer=1, vocab_size=64, **({"n_embd": width, "n_head": 6} if width else {}))
    mlp = build_model(config).blocks[0].mlp
    assert mlp.relu2 and mlp.fc.bias is None
    bound = mlp.fc.weight.norm(dim=1).max() * config.n_embd ** 0.5
    assert bound < 64, bound


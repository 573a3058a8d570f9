"""geometry.py: every metric against a known answer, streaming == all-in-memory, and the per-head analysis against
an exact diffusion step, the model's own forward and a direct computation."""

import math
import os
import sys

import pytest
import torch
import torch.nn.functional as F

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
import geometry  # noqa: E402
from conftest import randomise  # noqa: E402
from nanolap import MixedHeadAttention, build_model, make_config  # noqa: E402

FRACS = geometry.FRACS


def close(a, b, tol=1e-9):
    return abs(a - b) <= tol * max(1.0, abs(a), abs(b))


def simplex_etf(C, d, scale=1.0, seed=0):
    """C unit-norm vectors in R^d with pairwise cosine -1/(C-1), centred, randomly rotated: (C, d)."""
    g = torch.Generator().manual_seed(seed)
    M = (torch.eye(C) - torch.ones(C, C) / C) * math.sqrt(C / (C - 1))  # rows: the standard simplex ETF in R^C
    Q, _ = torch.linalg.qr(torch.randn(d, C, generator=g, dtype=torch.float64))  # (d, C) orthonormal columns
    return scale * M.double() @ Q.T


# -----------------------------------------------------------------------------
# ANOVA


def test_anova_hand_built_cases():
    g = torch.Generator().manual_seed(0)
    h, y = torch.randn(12, 5, 4, generator=g), torch.arange(12) % 3
    a = geometry.anova(h, y)
    assert close(sum(a[k] for k in FRACS), 1.0)
    # identical tokens inside each sequence: nothing varies within a sequence
    same = torch.randn(12, 1, 4, generator=g).expand(12, 5, 4)
    a = geometry.anova(same, y)
    assert a["within_seq_frac"] == pytest.approx(0, abs=1e-12) and close(sum(a[k] for k in FRACS), 1.0)
    # every sequence mean equals its class mean: no within-class spread
    class_mean = torch.randn(3, 4, generator=g)
    noise = torch.randn(12, 5, 4, generator=g)
    h2 = class_mean[y][:, None] + noise - noise.mean(1, keepdim=True)
    a = geometry.anova(h2, y)
    assert a["within_class_frac"] == pytest.approx(0, abs=1e-12) and a["within_seq_frac"] > 0.1
    # all classes share one mean: the two sequences of each class have means +m and -m
    m = torch.randn(3, 4, generator=g)
    seq_means = torch.stack([m, -m], 1).reshape(6, 4)  # (6, d): +m0, -m0, +m1, -m1, +m2, -m2
    noise = torch.randn(6, 5, 4, generator=g)
    a = geometry.anova(seq_means[:, None] + noise - noise.mean(1, keepdim=True), torch.arange(6) // 2)
    assert a["between_class_frac"] == pytest.approx(0, abs=1e-12) and a["within_class_frac"] > 0.1
    # a 1-d example by hand: class 0 = sequences (0, 2) and (2, 4), class 1 = (10, 10) and (14, 14); mu_G = 7
    h4 = torch.tensor([[0.0, 2], [2, 4], [10, 10], [14, 14]])[..., None]
    a = geometry.anova(h4, torch.tensor([0, 0, 1, 1]))
    total = ((h4 - 7) ** 2).mean().item()  # (49 + 25 + 25 + 9 + 9 + 9 + 49 + 49) / 8 = 28
    assert a["within_seq_var"] == pytest.approx(0.5)  # |t - mu_i| = 1 for the first two, 0 after
    assert a["within_class_var"] == pytest.approx(2.5)  # means 1, 3 around 2; 10, 14 around 12
    assert a["between_class_var"] == pytest.approx(25.0)  # class means 2 and 12 around 7
    assert a["total_var"] == pytest.approx(total) == pytest.approx(28.0)


def test_anova_streaming_equals_in_memory():
    g = torch.Generator().manual_seed(1)
    h, y = torch.randn(37, 9, 6, generator=g) * 3 + 100, torch.randint(0, 5, (37,), generator=g)  # large offset
    ref = geometry.anova(h, y)
    acc = geometry.AnovaStats(7)  # more classes than present: absent ones are ignored
    for i in range(0, 37, 10):
        acc.update(h[i: i + 10], y[i: i + 10])
    got = acc.result()
    for k, v in ref.items():
        assert close(got[k], v, 1e-7), (k, got[k], v)


def test_class_anova_and_class_stats_streaming():
    g = torch.Generator().manual_seed(2)
    x, y = torch.randn(200, 7, generator=g) + 5, torch.randint(0, 6, (200,), generator=g)
    W, b = torch.randn(6, 7, generator=g), torch.randn(6, generator=g)
    ref_anova, ref_nc = geometry.class_anova(x, y), geometry.neural_collapse(x, y, W, b)
    assert close(ref_anova["within_class_frac"] + ref_anova["between_class_frac"], 1.0)
    # by hand: the class means and the global mean, from the samples
    mu = torch.stack([x[y == c].double().mean(0) for c in range(6)])
    assert close(ref_anova["within_class_var"], (x.double() - mu[y]).square().sum(1).mean().item())
    assert close(ref_anova["between_class_var"], (mu[y] - x.double().mean(0)).square().sum(1).mean().item())
    acc = geometry.ClassStats(6)
    for i in range(0, 200, 33):
        acc.update(x[i: i + 33], y[i: i + 33])
    acc.update(x[:0], y[:0])  # an empty batch (no position of a window has a frequent target) changes nothing
    for k, v in ref_anova.items():
        assert close(acc.anova()[k], v, 1e-7), k
    got = acc.neural_collapse(W)
    for k in ("nc1", "nc2_equinorm", "nc2_equiangular", "nc2_equinorm_w", "nc2_equiangular_w", "nc3"):
        assert close(got[k], ref_nc[k], 1e-6), (k, got[k], ref_nc[k])
    assert got["n_samples"] == 200 and got["n_classes"] == 6


# -----------------------------------------------------------------------------
# cosine, spectrum, k_alpha


def test_seq_cosine():
    g = torch.Generator().manual_seed(3)
    same = torch.randn(3, 1, 5, generator=g).expand(3, 4, 5)
    assert torch.allclose(geometry.seq_cosine(same), torch.ones(3, dtype=torch.float64))
    ortho = torch.eye(4)[None].repeat(2, 1, 1)
    assert torch.allclose(geometry.seq_cosine(ortho), torch.zeros(2, dtype=torch.float64))
    h = torch.randn(4, 6, 3, generator=g)
    u = torch.nn.functional.normalize(h.double(), dim=-1)
    cos = u @ u.transpose(1, 2)
    ref = (cos.sum((1, 2)) - cos.diagonal(dim1=1, dim2=2).sum(-1)) / 30
    assert torch.allclose(geometry.seq_cosine(h), ref)


def test_k_alpha_hand_and_rank():
    lam = torch.tensor([[4.0, 3, 2, 1], [1, 0, 0, 0]])
    assert geometry.k_alpha(lam, 0.5).tolist() == [2, 1]
    assert geometry.k_alpha(lam, 0.9).tolist() == [3, 1]  # 0.4, 0.7, 0.9 reaches 0.9 exactly
    assert geometry.k_alpha(lam, 0.99).tolist() == [4, 1]
    g = torch.Generator().manual_seed(4)
    for r in (1, 3, 5):  # rank-r centred tokens: k_alpha <= r for every alpha, and lambda_j = 0 beyond r
        h = torch.randn(8, 20, r, generator=g) @ torch.randn(r, 16, generator=g) + torch.randn(8, 1, 16, generator=g)
        lam = geometry.seq_spectrum(h)
        assert lam.shape == (8, 16)
        assert (lam[:, r:] < 1e-8 * lam[:, :1]).all()
        for a in (0.5, 0.9, 0.99, 1.0):
            assert (geometry.k_alpha(lam, a) <= r).all()
        assert (geometry.k_alpha(lam, 1.0) == r).all()
    # the eigenvalues are those of X~^T X~, whichever Gram matrix is used (T > d here, T < d above)
    h = torch.randn(2, 7, 5, generator=g, dtype=torch.float64)
    xc = h - h.mean(1, keepdim=True)
    ref = torch.linalg.eigvalsh(xc.transpose(1, 2) @ xc).flip(-1)
    assert torch.allclose(geometry.seq_spectrum(h), ref, atol=1e-10)


def test_spectrum_streaming_equals_in_memory():
    g = torch.Generator().manual_seed(5)
    h = torch.randn(23, 10, 6, generator=g) * torch.linspace(3, 0.1, 6)
    acc = geometry.SpectrumStats()
    for i in range(0, 23, 7):
        acc.update(h[i: i + 7])
    got = acc.result()
    lam = geometry.seq_spectrum(h)
    assert torch.allclose(torch.tensor(got["lambda_mean"], dtype=torch.float64), lam.mean(0))
    assert torch.allclose(torch.tensor(got["lambda_std"], dtype=torch.float64), lam.std(0, correction=0), atol=1e-8)
    for a in geometry.ALPHAS:
        assert close(got[f"k_{a}"], geometry.k_alpha(lam, a).double().mean().item())
    assert got["n_sequences"] == 23


# -----------------------------------------------------------------------------
# Neural Collapse and the simplex-ETF projection


def test_neural_collapse_on_exact_etf_is_zero():
    C, d = 5, 12
    M = simplex_etf(C, d, scale=2.0)
    y = torch.arange(C).repeat(8)
    nc = geometry.neural_collapse(M[y], y, W=M.clone())  # collapsed features, self-dual classifier
    for k in ("nc1", "nc2_equinorm", "nc2_equiangular", "nc2_equinorm_w", "nc2_equiangular_w", "nc3", "nc4"):
        assert abs(nc[k]) < 1e-9, (k, nc[k])
    # a small within-class spread gives a small NC1, the same classifier still agrees with the class means
    g = torch.Generator().manual_seed(6)
    x = M[y] + 0.01 * torch.randn(len(y), d, generator=g, dtype=torch.float64)
    nc = geometry.neural_collapse(x, y, W=M)
    assert 0 < nc["nc1"] < 1e-3 and nc["nc4"] == 0


def test_neural_collapse_on_random_features_is_not():
    g = torch.Generator().manual_seed(7)
    x, y = torch.randn(300, 16, generator=g), torch.randint(0, 5, (300,), generator=g)
    nc = geometry.neural_collapse(x, y, W=torch.randn(5, 16, generator=g))
    assert nc["nc1"] > 1 and nc["nc3"] > 0.5 and nc["nc4"] > 0.3
    assert nc["nc2_equinorm"] > 0.05 and nc["nc2_equiangular"] > 0.05


def test_nc_metrics_by_hand():
    # two classes on a line, means -1 and +3 (mu_G = 1, M = [[-2], [2]]), within-class variance 0.5:
    # Sigma_B = M^T M / 2 = 4, NC1 = Tr(Sigma_W Sigma_B^+) / C = (0.5 / 4) / 2; equal norms; cos = -1 = -1/(C-1)
    nc = geometry.nc_metrics(torch.tensor([[-1.0], [3.0]]), torch.tensor([[0.5]]), W=torch.tensor([[-1.0], [1.0]]))
    assert nc["nc1"] == pytest.approx(0.0625) and nc["nc2_equinorm"] == pytest.approx(0, abs=1e-12)
    assert nc["nc2_equiangular"] == pytest.approx(0, abs=1e-12) and nc["nc3"] == pytest.approx(0, abs=1e-12)
    # NC4: a classifier pointing the other way disagrees with the nearest class mean on every sample
    x, y = torch.tensor([[-1.5], [-0.5], [2.5], [3.5]]), torch.tensor([0, 0, 1, 1])
    assert geometry.neural_collapse(x, y, W=torch.tensor([[1.0], [-1.0]]))["nc4"] == 1.0
    assert geometry.neural_collapse(x, y, W=torch.tensor([[-1.0], [1.0]]), b=torch.tensor([0.0, -1.0]))["nc4"] == 0.0


def test_etf_projection_sends_classifier_rows_to_vertices():
    W3 = simplex_etf(3, 10, scale=3.0, seed=8) + torch.randn(10, dtype=torch.float64)  # not centred
    xy = geometry.etf_projection(W3, W3, W3.mean(0))
    scale = xy.norm(dim=1)
    assert torch.allclose(scale, scale[0].expand(3))
    assert torch.allclose(xy / scale[0], geometry.TRIANGLE.T, atol=1e-10)  # row k -> vertex k
    # features at the classifier rows (collapse with a self-dual classifier) land on the same vertices
    g = torch.Generator().manual_seed(9)
    y = torch.randint(0, 3, (30,), generator=g)
    feats = W3[y] + 1e-3 * torch.randn(30, 10, generator=g, dtype=torch.float64)
    p = geometry.etf_projection(W3, feats, W3.mean(0))
    assert torch.allclose(p, xy[y], atol=1e-2)


# -----------------------------------------------------------------------------
# per-head diffusion


def within_seq(x):  # the within-sequence sum of squares of x (N, T, d), written out independently of geometry.py
    xc = x.double() - x.double().mean(1, keepdim=True)
    return xc.square().sum().item()


def diffusion_block(tau, d=6):
    """A one-head Laplacian block whose update is exactly the heat-diffusion step X <- X - tau (I - P) X:
    no norms, values = tokens (W_v = I), output projection -tau I, MLP zero; P = softmax(X Wq^T (X Wk^T)^T / sqrt(d))."""
    from nanolap import Block, Config
    config = Config(n_layer=1, n_head=1, n_embd=d, n_lap=1, qk_norm=False, bias=False, img_size=4, patch_size=2)
    block = Block(config, n_lap=1, drop_path_rate=0.0).double().eval()
    block.norm1 = torch.nn.Identity()
    g = torch.Generator().manual_seed(3)
    w_q = torch.randn(d, d, generator=g, dtype=torch.float64)
    w_k = torch.randn(d, d, generator=g, dtype=torch.float64)
    with torch.no_grad():
        block.attn.qkv.weight.copy_(torch.cat([w_q, w_k, torch.eye(d, dtype=torch.float64)]))
        block.attn.proj.weight.copy_(-tau * torch.eye(d, dtype=torch.float64))
        block.mlp.proj.weight.zero_()
    return block, w_q, w_k


def test_per_head_change_of_an_exact_diffusion_step():
    tau, d = 0.3, 6
    block, w_q, w_k = diffusion_block(tau, d)
    x = torch.randn(5, 7, d, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    P = ((x @ w_q.T) @ (x @ w_k.T).transpose(1, 2) / math.sqrt(d)).softmax(-1)  # (N, T, T), a known graph
    step = x - tau * (x - P @ x)  # one explicit diffusion step on that graph
    U, A, M = geometry.block_updates(block, x)
    assert torch.allclose(x + A + M, step, atol=1e-12) and torch.allclose(U[:, :, 0], step - x, atol=1e-12)
    model = type("Model", (), dict(blocks=[block], config=block.attn, norm=torch.nn.Identity()))  # what update_heads/head_results read
    model.config.graph = "attention"
    stats = [(geometry.VarChange(), geometry.VarChange())]
    geometry.update_heads(model, x[:2], None, stats, geometry.all_tokens)  # streamed in two batches
    geometry.update_heads(model, x[2:], None, stats, geometry.all_tokens)
    layer = geometry.head_results(model, stats)["layers"][0]
    xc = x - x.mean(1, keepdim=True)
    uc = (step - x) - (step - x).mean(1, keepdim=True)
    expected_rho = 2 * (xc * uc).sum().item() / within_seq(x)
    assert layer["laplacian"] == [True]
    assert layer["rho"][0] == pytest.approx(expected_rho, rel=1e-10)
    assert layer["exact"][0] == pytest.approx(within_seq(step) / within_seq(x) - 1, rel=1e-10)
    assert layer["exact"][0] < 0 and layer["rho"][0] < 0  # a diffusion step smooths
    assert layer["block_total"]["exact"] == pytest.approx(layer["exact"][0], rel=1e-10)
    assert layer["mlp"]["exact"] == pytest.approx(0.0, abs=1e-12)


def test_uniform_attention_heads_leave_within_sequence_variance_unchanged():
    """P = 11^T / T: an attention head adds the same vector to every token of a sequence (rho = exact = 0), while a
    Laplacian head subtracts each sequence's mean value and does change it."""
    model = build_model(make_config("vit-tiny", n_lap=[0, 2, 4, 1], graph="uniform", layerscale=0.5)).eval()
    randomise(model, gain=1.0)
    img = torch.randn(6, 1, 28, 28, generator=torch.Generator().manual_seed(1))
    stats = [(geometry.VarChange(), geometry.VarChange()) for _ in model.blocks]
    geometry.update_heads(model, model.embed(img), None, stats, geometry.all_tokens)
    for layer in geometry.head_results(model, stats)["layers"]:
        for rho, exact, lap in zip(layer["rho"], layer["exact"], layer["laplacian"]):
            assert (abs(rho) < 1e-9 and abs(exact) < 1e-9) if not lap else abs(rho) > 1e-6


class ScaledHeads(MixedHeadAttention):
    """An attention module with a forward of its own, as the exercises write theirs: head h outputs (h + 1) P V."""
    def forward(self, x, rope=None, explicit=False, cache=None):
        B, T, C = x.shape
        q, k, v = self.qkv(x).view(B, T, 3, self.n_head, self.head_dim).permute(2, 0, 3, 1, 4)  # each (B, H, T, D)
        y = F.scaled_dot_product_attention(q, k, v)  # (B, H, T, D)
        y = y * torch.arange(1, self.n_head + 1, dtype=y.dtype).view(1, -1, 1, 1)
        return self.proj(y.transpose(1, 2).reshape(B, T, C))


@pytest.mark.parametrize("preset, own_forward", [("vit-tiny", False), ("gpt-tiny", False), ("vit-tiny", True)])
def test_heads_add_up_to_the_attention_sublayer_and_the_block(preset, own_forward):
    """sum_h U_h + bias is the attention sublayer's output, x + A + M the block's, also where the attention module has
    a forward of its own (the heads are read where it hands them to its output projection); the first-order terms of
    the heads add up to the sublayer's, and attention + MLP to the block's exact change."""
    extra = dict(layerscale=0.3) if preset.startswith("vit") else {}
    model = build_model(make_config(preset, n_lap=[0, 1, 3, 4], **extra)).double().eval()  # float64: exact sums
    if own_forward:
        for block in model.blocks:
            block.attn = ScaledHeads(model.config, block.attn.n_lap).double().eval()
    randomise(model, gain=1.0)
    inp = torch.randn(4, 1, 28, 28, dtype=torch.float64) if preset.startswith("vit") else torch.randint(0, 65, (4, 24))
    x, rope = (model.embed(inp), None) if preset.startswith("vit") else model.embed(inp)
    stats = [(geometry.VarChange(), geometry.VarChange()) for _ in model.blocks]
    hidden = geometry.update_heads(model, x, rope, stats, geometry.all_tokens)
    for h, expected in zip(hidden, model.forward_features(inp, all_layers=True), strict=True):
        assert torch.allclose(h, expected, rtol=1e-9, atol=1e-9)
    for block in model.blocks:
        U, A, M = geometry.block_updates(block, x, rope)
        assert torch.allclose(A, block.ls1(block.attn(block.norm1(x), rope)), rtol=1e-9, atol=1e-9)
        assert torch.allclose(x + A + M, block(x, rope), rtol=1e-9, atol=1e-9)
        x = block(x, rope)
    for layer in geometry.head_results(model, stats)["layers"]:
        assert sum(layer["rho"]) == pytest.approx(layer["attention"]["rho"], rel=1e-9, abs=1e-12)
        assert layer["attention"]["exact"] + layer["mlp"]["exact"] == pytest.approx(layer["block_total"]["exact"], rel=1e-9)
        total = layer["attention"]["exact_between"] + layer["mlp"]["exact_between"]
        assert total == pytest.approx(layer["block_total"]["exact_between"], rel=1e-9)


def test_between_sequence_change_against_a_direct_computation():
    g = torch.Generator().manual_seed(2)
    x, u = torch.randn(9, 5, 3, generator=g, dtype=torch.float64), torch.randn(9, 5, 1, 3, generator=g, dtype=torch.float64)
    stats = geometry.VarChange()
    stats.update(x[:4], u[:4])
    stats.update(x[4:], u[4:])
    r = stats.result()

    def between(h):  # the variance of the sequence means about their mean
        m = h.mean(1)
        return (m - m.mean(0)).square().sum().item()
    assert r["exact_between"][0] == pytest.approx(between(x + u[:, :, 0]) / between(x) - 1, rel=1e-10)
    assert r["exact"][0] == pytest.approx(within_seq(x + u[:, :, 0]) / within_seq(x) - 1, rel=1e-10)

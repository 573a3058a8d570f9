"""
Token geometry of nanolap checkpoints: the analyses of section 4 of Zhang & Papyan, "Laplacian Heads Improve
Transformers by Smoothing Token Representations" (2026), defined precisely in the docstrings below.

    python analyze.py out/vit                                    # one run: writes out/vit/analysis/
    python analyze.py out/x.pt                                   # a loose checkpoint: writes out/x-analysis/
    python analyze.py out/gpt --max_samples=200 --layer=2         # tokens after block 2 instead of the final norm
    python analyze.py out/vit-k0 out/vit-k4 --out=out/vit-cmp     # several runs: out/vit-cmp/vit-k0/, .../vit-k4/

Each run directory (ckpt.pt and log.jsonl of a training script) is measured on its own evaluation data, into
analysis.json, summary.md, PNG figures and a RESULT line: ANOVA of token variance and token cosine after every
block, the within-sequence spectrum and the simplex-ETF projection (all kinds), the token PCA scatter and
Neural Collapse (vit; gpt over next-token classes), PCA feature maps (dino), and what every head does to the tokens.
Comparing analysed runs against n_lap, and the sweep's report, are results/report.py's (it needs no checkpoint).
"""

import json
import math
import os
import sys
import textwrap
import time

import torch
import torch.nn.functional as F

import common
import configurator
import nanolap
from common import UsageError
from data import augment, images, text

# ---------------------------------------------------------------- defaults
out = ""  # output folder; "" = RUN/analysis (one run), the runs' common parent + /analysis (several)
max_samples = 1000  # images or text windows per run, a fixed random subset of the validation split: more = steadier
batch_size = 64  # sequences per forward pass; lower it when memory runs out
layer = -1  # tokens of the ANOVA, spectrum, PCA, GPT classes and DINO maps: -1 = after the final norm, k = block k
tokens = "patch"  # ViT/DINO tokens in sequence statistics: 'patch' (patch tokens only) or 'all' (with the CLS token)
seq_len = 0  # GPT window length; 0 = the run's block_size
n_targets = 20  # GPT: the most frequent next-token targets serve as classes (rare ones give noisy class means)
etf_classes = [0, 1, 2]  # ViT, DINO: the three classes of the simplex-ETF projection (GPT: its three most frequent targets)
pca_images = 32  # ViT, GPT: images (text windows) whose tokens are drawn in the PCA scatter
map_images = 8  # DINO: images shown next to their PCA feature maps
device = "auto"  # auto = cuda, else cpu (the float64 statistics do not run on MPS); or cpu, cuda, cuda:N
seed = 0  # which random subset of the validation split is analysed (the same subset for every run)

# ---------------------------------------------------------------- constants
ALPHAS = (0.9, 0.99)  # k_alpha thresholds (the paper reports alpha = 0.99)
ETF_TOKENS = 8  # ViT: tokens per image in the ETF token panel, at the same random positions in every image
FINAL_METRIC = {"vit": ("val_acc", "higher"), "gpt": ("val_loss", "lower"), "dino": ("knn_acc", "higher")}
FRACS = ("within_seq_frac", "within_class_frac", "between_class_frac")
# the fixed 2 x 3 map A from centred 3-simplex coordinates to an equilateral triangle: column k is the vertex of
# class k (at 90, 210 and 330 degrees); the columns sum to 0, so the all-ones direction is dropped
TRIANGLE = torch.tensor([[0.0, -math.sqrt(3) / 2, math.sqrt(3) / 2], [1.0, -0.5, -0.5]], dtype=torch.float64)

# ---------------------------------------------------------------- metrics
# Pure functions, each next to a streaming accumulator giving the same numbers (float64, shifted by the first batch's
# mean to keep the sums well conditioned). Tokens h (N, T, d): N sequences of T tokens h_it, labels y (N,).

def _fractions(total, **parts):
    """Variance parts and their fractions of the total (None where the total is 0)."""
    return {"total_var": float(total), **{k: v for name, value in parts.items() for k, v in (
        (f"{name}_var", float(value)), (f"{name}_frac", float(value / total) if total > 0 else None))}}

def anova(h, y):
    """Three-way ANOVA of token variance (the exact form is ours; it is exact when every sequence has the same T):
        TotalVar = mean_it |h_it - mu_G|^2 = WithinSeqVar + WithinClassVar + BetweenClassVar,
        WithinSeqVar = mean_it |h_it - mu_i|^2, WithinClassVar = mean_i |mu_i - mu_yi|^2,
        BetweenClassVar = mean_i |mu_yi - mu_G|^2,
    mu_i = mean_t h_it (the sequence mean), mu_c = the mean of the mu_i of class c, mu_G = the mean of all tokens;
    reported as parts and fractions of TotalVar. After every block, the WithinSeqVar fraction is the layerwise
    within-sequence collapse (GPT windows carry no label: one class, so only that share is reported)."""
    h = h.double()
    mu_i, mu_G = h.mean(1), h.mean((0, 1))  # (N, d) sequence means, (d,) the mean of all tokens
    classes, inverse = y.unique(return_inverse=True)
    mu_y = torch.stack([mu_i[y == c].mean(0) for c in classes])[inverse]  # (N, d): mu_c of each sequence's class
    return _fractions((h - mu_G).square().sum(-1).mean(), within_seq=(h - mu_i[:, None]).square().sum(-1).mean(),
                      within_class=(mu_i - mu_y).square().sum(-1).mean(),
                      between_class=(mu_y - mu_G).square().sum(-1).mean())

class AnovaStats:
    """Streaming anova(): token count and sums, the within-sequence sum of squares, and per class the count, sum and
    sum of squared norms of the sequence means."""
    def __init__(self, num_classes):
        self.C = num_classes
        self.shift = None
        self.n_seq = 0
        self.n_tok = 0
    def update(self, h, y):
        h, y = h.detach().double(), y.to(h.device)
        if self.shift is None:
            d, kw = h.shape[-1], dict(dtype=torch.float64, device=h.device)
            self.shift = h.reshape(-1, d).mean(0)
            self.tok_sum = torch.zeros(d, **kw)
            self.tok_sumsq = torch.zeros((), **kw)
            self.within_seq = 0.0
            self.count = torch.zeros(self.C, **kw)  # per class: sequences, sum of |mu_i|^2, sum of mu_i
            self.mu_sumsq = torch.zeros(self.C, **kw)
            self.mu_sum = torch.zeros(self.C, d, **kw)
        h = h - self.shift
        mu_i = h.mean(1)  # (B, d)
        self.n_seq, self.n_tok = self.n_seq + h.shape[0], self.n_tok + h.shape[0] * h.shape[1]
        self.tok_sum, self.tok_sumsq = self.tok_sum + h.sum((0, 1)), self.tok_sumsq + h.square().sum()
        self.within_seq += (h - mu_i[:, None]).square().sum()
        self.count.index_add_(0, y, torch.ones_like(mu_i[:, 0]))
        self.mu_sum.index_add_(0, y, mu_i)
        self.mu_sumsq.index_add_(0, y, mu_i.square().sum(-1))
    def result(self):
        seen = self.count > 0
        count, mu_c = self.count[seen], self.mu_sum[seen] / self.count[seen, None]
        mu_G = self.tok_sum / self.n_tok
        return _fractions(self.tok_sumsq / self.n_tok - mu_G.square().sum(), within_seq=self.within_seq / self.n_tok,
                          within_class=(self.mu_sumsq[seen] - count * mu_c.square().sum(-1)).sum() / self.n_seq,
                          between_class=(count * (mu_c - mu_G).square().sum(-1)).sum() / self.n_seq)

class AnovaViews:
    """The ANOVA (parts and fractions) of the last block's tokens x seen through the final norm in two more ways:
    without the norm's learned affine (every token only standardised), and, with a classifier head, split between the
    head's row space (the directions its logits read) and the orthogonal complement, after the full final norm. The
    fractions of one view can move because its within-sequence part moves or because the rest does: compare the
    parts. Which view the paper's figure shows is not stated there; most likely the final norm's output with its affine
    (its ViTs are timm's, whose forward_features ends with that norm), i.e. layerwise' "norm" entry."""
    def __init__(self, model, num_classes):
        self.norm = model.norm
        self.stats = {}
        if getattr(model.norm, "weight", None) is not None:  # a LayerNorm with an affine to remove
            self.stats["norm_without_affine"] = AnovaStats(num_classes)
        self.bases = {}
        if model.config.num_classes:
            W = model.head.weight.detach().double()  # (C, d)
            _, s, Vh = torch.linalg.svd(W, full_matrices=True)
            rank = int((s > s.max() * 1e-8).sum())
            self.bases = {"classifier_rows": Vh[:rank].T, "classifier_complement": Vh[rank:].T}  # (d, r), (d, d - r)
            self.stats.update({name: AnovaStats(num_classes) for name in self.bases})
    def update(self, x, y):
        if "norm_without_affine" in self.stats:
            self.stats["norm_without_affine"].update(F.layer_norm(x, x.shape[-1:], eps=self.norm.eps), y)
        normed = self.norm(x).double()
        for name, basis in self.bases.items():
            self.stats[name].update(normed @ basis.to(normed.device), y)  # coordinates in the subspace
    def result(self):
        return {name: stats.result() for name, stats in self.stats.items()}

def seq_cosine(h):
    """Mean pairwise cosine similarity of the tokens inside each sequence, (N, T, d) -> (N,): the mean over t != t'
    of cos(h_it, h_it'); its mean over sequences is the second collapse curve. With unit vectors u_t,
    |sum_t u_t|^2 = sum_t |u_t|^2 + sum_{t != t'} cos(h_t, h_t'), so no T x T matrix is formed."""
    u, T = F.normalize(h.double(), dim=-1), h.shape[1]
    return (u.sum(1).square().sum(-1) - u.square().sum((1, 2))) / (T * (T - 1))

def seq_spectrum(h):
    """Spectrum of within-sequence centred tokens, (N, T, d) -> (N, min(T, d)): per sequence i, X~_i = X_i minus its
    mean token, and the eigenvalues lambda_1 >= lambda_2 >= ... of X~_i^T X~_i (its rank is at most T - 1), from the
    smaller Gram matrix (X~ X~^T when T < d: the same non-zero eigenvalues; eigvalsh is faster than an SVD)."""
    x = h.double() - h.double().mean(1, keepdim=True)
    gram = x @ x.transpose(1, 2) if x.shape[1] < x.shape[2] else x.transpose(1, 2) @ x
    return torch.linalg.eigvalsh(gram).flip(-1).clamp(min=0)

def k_alpha(lam, alpha):
    """Per sequence, the smallest k whose top-k eigenvalues reach a fraction alpha of their sum, (N, r) -> (N,): the
    principal components one sequence's tokens need; reported as the mean over sequences."""
    frac = lam.cumsum(-1) / lam.sum(-1, keepdim=True)
    return ((frac < alpha - 1e-12).sum(-1) + 1).clamp(max=lam.shape[-1])  # the slack absorbs rounding at alpha = 1

class SpectrumStats:
    """Streaming mean and population std over sequences of each lambda_j, and the mean k_alpha per alpha."""
    def __init__(self, alphas=ALPHAS):
        self.alphas = alphas
        self.n = 0
        self.sum = 0.0
        self.sumsq = 0.0
        self.k_sum = {a: 0.0 for a in alphas}
    def update(self, h):
        lam = seq_spectrum(h.detach())
        self.n = self.n + len(lam)
        self.sum = self.sum + lam.sum(0)
        self.sumsq = self.sumsq + lam.square().sum(0)
        for a in self.alphas:
            self.k_sum[a] += k_alpha(lam, a).double().sum()
    def result(self):
        mean, meansq = self.sum.cpu() / self.n, self.sumsq.cpu() / self.n
        std = (meansq - mean.square()).clamp(min=0).sqrt()
        return {"lambda_mean": mean.tolist(), "lambda_std": std.tolist(), "n_sequences": self.n,
                **{f"k_{a}": float(self.k_sum[a] / self.n) for a in self.alphas}}

def class_anova(x, y):
    """Two-way ANOVA of samples x (n, d) with labels y: TotalVar = mean |x - m|^2 = WithinClassVar (mean |x - mu_y|^2)
    + BetweenClassVar (mean |mu_y - m|^2), m the mean of all samples, mu_c the mean of class c. The LM form (ours):
    a GPT token's class is its next-token target, over the positions whose target is one of the n_targets most
    frequent; more Laplacian heads are expected to shrink the within-class share."""
    return {k: v for k, v in anova(x[:, None], y).items() if not k.startswith("within_seq")}  # one-token sequences

def nc_metrics(means, sigma_w, W=None):
    """Neural Collapse NC1-NC3 (Han, Papyan, Donoho 2022) from the class means mu_c (C, d), the within-class
    covariance Sigma_W = mean_n (h_n - mu_yn)(h_n - mu_yn)^T (d, d) and optionally the classifier rows w_c (C, d).
    With mu_G the mean of the class means, M the rows mu_c - mu_G and Sigma_B = M^T M / C:
        NC1 = Tr(Sigma_W Sigma_B^+) / C                              (within-class variability)
        NC2 equinorm = std_c |mu_c - mu_G| / mean_c |mu_c - mu_G|    (unbiased std, as Papyan's code; also of |w_c|)
        NC2 equiangularity = mean_{c != c'} |cos(mu_c - mu_G, mu_c' - mu_G) + 1/(C-1)|   (also of the w_c)
        NC3 = | W / |W|_F - M / |M|_F |_F^2                            (self-duality of classifier and class means)
    All tend to 0 under Neural Collapse."""
    C = means.shape[0]
    if C < 2:
        raise UsageError(f"Neural Collapse metrics need at least two classes, the analysed samples have {C}; "
                         f"raise --max_samples (GPT: --n_targets)")
    M = means.double() - means.double().mean(0)  # (C, d)
    # Sigma_B = U diag(s^2 / C) U^T on its range (U, s of M^T), so NC1 = sum_k u_k^T Sigma_W u_k / s_k^2
    U, s, _ = torch.linalg.svd(M.T, full_matrices=False)
    U, s = U[:, s > s.max() * 1e-8], s[s > s.max() * 1e-8]  # the range of M^T
    out = {"nc1": ((U.T @ sigma_w.double() @ U).diagonal() / s.square()).sum().item()}
    out.update(nc2_equinorm=_equinorm(M), nc2_equiangular=_equiangular(F.normalize(M, dim=1)))
    if W is not None:
        W = W.double()
        out.update(nc2_equinorm_w=_equinorm(W), nc2_equiangular_w=_equiangular(F.normalize(W, dim=1)),
                   nc3=(W / W.norm() - M / M.norm()).square().sum().item())
    return out

def _equinorm(rows):  # NC2: std / mean of the row norms
    return (rows.norm(dim=1).std() / rows.norm(dim=1).mean()).item()

def _equiangular(units):  # NC2: mean |cos + 1/(C-1)| over pairs of different unit rows
    C = len(units)
    off = ~torch.eye(C, dtype=torch.bool)
    return ((units @ units.T)[off] + 1 / (C - 1)).abs().mean().item()

def neural_collapse(x, y, W=None, b=None):
    """NC1-NC3 (nc_metrics) and NC4 of features x (n, d) with labels y; only the classes present count (W, b indexed
    alike). NC4 = the fraction of samples whose classifier argmax_c (w_c . h + b_c) differs from the nearest class
    mean argmin_c |h - mu_c|. ViT: the pooled features (the head's input: CLS token or mean of patch tokens) and the
    means of the analysed tokens, both after the final norm, with the trained head as classifier."""
    x = x.double()
    classes, inverse = y.unique(return_inverse=True)
    means = torch.stack([x[y == c].mean(0) for c in classes])
    dev = x - means[inverse]
    W = None if W is None else W[classes]
    out = nc_metrics(means, dev.T @ dev / len(x), W)
    if W is not None:
        logits = x @ W.double().T + (0 if b is None else b[classes].double())
        out["nc4"] = (logits.argmax(1) != torch.cdist(x, means).argmin(1)).double().mean().item()
    return dict(out, n_classes=len(classes), n_samples=len(x))

class ClassStats(AnovaStats):
    """Streaming class_anova() and the NC1-NC3 of neural_collapse() of samples x (n, d) with labels y, without keeping
    them (GPT next-token classes): AnovaStats of one-token sequences (each mu_i = x_i) plus the scatter sum x^T x."""
    def update(self, x, y):
        if len(x):
            super().update(x[:, None], y)
            x = x.detach().double() - self.shift
            self.scatter = getattr(self, "scatter", 0) + x.T @ x
    def anova(self):  # one-token sequences: no within-sequence part
        return {k: v for k, v in self.result().items() if not k.startswith("within_seq")}
    def neural_collapse(self, W=None):
        count = self.count.cpu()
        seen = count > 0
        mu = self.mu_sum.cpu()[seen] / count[seen, None]  # shifted
        count = count[seen]
        sigma_w = (self.scatter.cpu() - (mu.T * count) @ mu) / self.n_seq
        out = nc_metrics(mu + self.shift.cpu(), sigma_w, None if W is None else W[seen])
        return dict(out, n_classes=int(seen.sum()), n_samples=self.n_seq)

def etf_projection(W3, x, center):
    """Simplex-ETF projection (Fisher, Meng, Papyan 2024), x (n, d) -> (n, 2): h -> A Q (h - center), Q = U V^T the
    polar factor (thin SVD) of the classifier rows W3 (3, d) of three classes centred by their mean, A = TRIANGLE.
    The classifier rows land on the vertices; under collapse the classes form tight clusters there. ViT: the pooled
    features, token means and tokens of the images of the --etf_classes, centred by the mean of their class means."""
    U, _, Vh = torch.linalg.svd(W3.double() - W3.double().mean(0), full_matrices=False)  # U (3, 3), Vh (3, d)
    return (x.double() - center.double()) @ (U @ Vh).T @ TRIANGLE.T

def pca_2d(x):
    """PCA scatter: the rows of x (n, d), centred, on their top two principal components, and the explained variance
    ratios of the two. ViT: the analysed tokens (at --layer) of the first --pca_images images, coloured by class."""
    x = x.double() - x.double().mean(0)
    _, s, Vh = torch.linalg.svd(x, full_matrices=False)
    return x @ Vh[:2].T, (s[:2].square() / s.square().sum()).tolist()

def pca_rgb(patches, grid):
    """DINO PCA feature map (DINOv2 style): PCA of one image's patch tokens (N, d) at --layer after centring; the top
    three components, each min-max scaled to [0, 1], are the RGB colour of its patch: (h, w, 3)."""
    x = patches.double() - patches.double().mean(0)
    c = x @ torch.linalg.svd(x, full_matrices=False)[2][:3].T  # (N, <= 3)
    c = F.pad(c, (0, 3 - c.shape[1]))
    lo, hi = c.min(0).values, c.max(0).values
    return ((c - lo) / (hi - lo).clamp(min=1e-12)).reshape(*grid, 3)

# ---------------------------------------------------------------- per-head diffusion
# Head h of a block adds U_h to the residual stream X: its output P_h V_h (a Laplacian head: (I - P_h) V_h) through
# its slice of the output projection (and LayerScale). The heads' U_h plus the projection bias are the attention
# sublayer's output A; the MLP then adds M to X + A. Each is scored by what it does to the block input's variance.


class VarChange:
    """Streaming change that K updates u (B, T, K, d) make to the within- and between-sequence variance of tokens:
        rho_k   = 2 <X_c, U_k,c> / |X_c|^2                 first order (X_c: tokens centred per sequence)
        exact_k = WSV(X + U_k) / WSV(X) - 1 = (2 <X_c, U_k,c> + |U_k,c|^2) / |X_c|^2
    negative = the update smooths (pulls each sequence's tokens together), positive = it sharpens. The between-sequence
    part (TotalVar - WithinSeqVar: the sequence means, centred by their global mean) gets the same two numbers. The
    updates act on `base` (default x), and x sets the scale: the MLP acts on X + A, scored against the block input X,
    so that a block's exact change is its attention's plus its MLP's."""
    def __init__(self):
        self.n = 0
    def update(self, x, u, base=None):
        x, u = x.double(), u.double()
        base = x if base is None else base.double()
        bc = base - base.mean(1, keepdim=True)
        uc = u - u.mean(1, keepdim=True)  # (B, T, K, d)
        m_x = x.mean(1)  # sequence means (B, d), (B, d), (B, K, d)
        m_b = base.mean(1)
        m_u = u.mean(1)
        if self.n == 0:  # shifts keep the between-sequence sums well conditioned; they cancel in every difference
            self.shifts = (m_x[0], m_b[0], m_u[0])
            self.sums = dict.fromkeys(("xx", "xu", "uu", "mxx", "mx", "mbu", "mb", "mu", "muu"), 0.0)
        m_x = m_x - self.shifts[0]
        m_b = m_b - self.shifts[1]
        m_u = m_u - self.shifts[2]
        s = self.sums
        s["xx"] += (x - x.mean(1, keepdim=True)).square().sum()
        s["xu"] += torch.einsum("btd,btkd->k", bc, uc)
        s["uu"] += uc.square().sum((0, 1, 3))
        s["mxx"] += m_x.square().sum()
        s["mx"] += m_x.sum(0)
        s["mbu"] += torch.einsum("bd,bkd->k", m_b, m_u)
        s["mb"] += m_b.sum(0)
        s["mu"] += m_u.sum(0)  # (K, d)
        s["muu"] += m_u.square().sum((0, 2))
        self.n += len(x)
    def result(self):
        s, n = self.sums, self.n
        between_x = s["mxx"] - s["mx"].square().sum() / n  # n * BetweenSeqVar of x (equal T)
        cross = s["mbu"] - s["mu"] @ s["mb"] / n  # (K,)
        between_u = s["muu"] - s["mu"].square().sum(-1) / n
        return {"rho": _relative(2 * s["xu"], s["xx"]), "exact": _relative(2 * s["xu"] + s["uu"], s["xx"]),
                "rho_between": _relative(2 * cross, between_x),
                "exact_between": _relative(2 * cross + between_u, between_x)}

def _relative(change, scale):  # change (K,) / scale, as a list; None where the scale is 0 (no variance to change)
    return (change / scale).tolist() if scale > 0 else [None] * len(change)

def head_weights(block):
    """A weight-only hint per head: the symmetric part S_h of its value-output map M_h = diag(g) Wv_h^T Wo_h^T diag(l)
    (d x d; g the pre-attention norm's gain, l LayerScale's), as its smallest and largest eigenvalue and
    tr(S_h) / sum |eig(S_h)| in [-1, 1] (-1: negative definite, so a Laplacian head's v_t - sum_j P_tj v_j points
    against x_t: diffusion-like). It is a hint, not the test: M_h has rank head_dim << d, so S_h is silent on most
    directions and its sign on the others need not be where the tokens lie, and I - P is not positive semidefinite when
    attention is concentrated (P near a permutation); rho_h measures the change on the actual tokens."""
    attn = block.attn
    C = attn.proj.weight.shape[0]
    H = attn.n_head
    D = attn.head_dim
    K = attn.n_kv_head  # grouped-query attention: query head h reads value head h // (H / K)
    w_v = attn.qkv.weight[-K * D:].double().view(K, D, C).repeat_interleave(H // K, dim=0)  # the value rows, head by head
    w_o = attn.proj.weight.double().view(C, H, D)
    gain = getattr(block.norm1, "weight", None)
    gain = torch.ones(C, dtype=torch.float64) if gain is None else gain.double().cpu()
    scale = block.ls1.gamma.double().cpu() if isinstance(block.ls1, nanolap.LayerScale) else torch.ones(C, dtype=torch.float64)
    out = []
    for h in range(H):
        M = gain[:, None] * (w_v[h].T.cpu() @ w_o[:, h].T.cpu()) * scale[None, :]  # (d, d)
        eig = torch.linalg.eigvalsh((M + M.T) / 2)
        out.append({"eig_min": eig[0].item(), "eig_max": eig[-1].item(), "trace_ratio": (eig.sum() / eig.abs().sum()).item()})
    return out


# ---------------------------------------------------------------- forward passes

def pick_layer(hs, layer):  # hs = [after block 1, ..., after block L, final norm]; layer -1 or 1..L
    return hs[-1] if layer == -1 else hs[layer - 1]

def update_layers(hs, y, anovas, cos_sums, spec, layer):  # one batch: ANOVA, cosine after each block, spectrum at layer
    for l, h in enumerate(hs):
        anovas[l].update(h, y)
        cos_sums[l] += seq_cosine(h).sum()
    spec.update(pick_layer(hs, layer))

def layerwise(anovas, cos_sums, n):
    return {"layer": [str(l) for l in range(1, len(anovas))] + ["norm"],
            "within_seq_frac": [a["within_seq_frac"] for a in anovas], "cosine": [float(c / n) for c in cos_sums]}

def etf_positions(T):  # the ETF panel's ETF_TOKENS token positions, the same in every image and run
    return images.fixed_subset(T, ETF_TOKENS, 0).sort().values

def patch_tokens(h):  # (B, 1 + N, ...) -> (B, N, ...): without the CLS token
    return h[:, 1:]

def all_tokens(h):
    return h

@torch.no_grad()
def block_updates(block, x, rope=None):
    """What one block (eval mode) adds to its input x (B, T, d): every head's U_h (B, T, H, d), its output through
    its columns of the output projection times LayerScale; the attention sublayer's output A = sum_h U_h + the
    projection bias (times LayerScale), (B, T, d); and the MLP's update M of x + A. The block's output is x + A + M."""
    attn, C = block.attn, x.shape[-1]
    y = attn.heads(block.norm1(x), rope)  # (B, T, H, D)
    U = torch.einsum("bthe,dhe->bthd", y, attn.proj.weight.view(C, attn.n_head, attn.head_dim))  # (B, T, H, d)
    bias = attn.proj.bias if attn.proj.bias is not None else torch.zeros(C, device=x.device)
    if isinstance(block.ls1, nanolap.LayerScale):
        U, bias = U * block.ls1.gamma, bias * block.ls1.gamma
    A = U.sum(2) + bias  # (B, T, d)
    return U, A, block.ls2(block.mlp(block.norm2(x + A)))

def update_heads(model, x, rope, stats, select):
    """One batch of the per-head analysis, block by block from the embedded tokens x; stats: one (VarChange of the
    heads, the attention sublayer and the whole block on the block's input, VarChange of the MLP) per block; select
    picks the analysed tokens (dim 1). Returns what forward_features(all_layers=True) returns, [after block 1, ...,
    after block L, final norm], built from the same updates (x + A + M), so that the blocks run once per batch."""
    hidden = []
    for block, (on_input, on_mlp) in zip(model.blocks, stats):
        U, A, M = block_updates(block, x, rope)
        on_input.update(select(x), select(torch.cat([U, A[:, :, None], (A + M)[:, :, None]], dim=2)))
        on_mlp.update(select(x), select(M)[:, :, None], base=select(x + A))
        x = x + A + M
        hidden.append(x)
    return hidden + [model.norm(x)]

def head_results(model, stats):
    """analysis.json's "heads": per block, every head's rho / exact change (and the between-sequence pair), which
    heads are Laplacian, the attention sublayer, the MLP, the whole block, and the weight-only hint per head."""
    layers = []
    for l, (block, (on_input, on_mlp)) in enumerate(zip(model.blocks, stats)):
        r = on_input.result()
        mlp = on_mlp.result()
        H = block.attn.n_head
        layers.append({"block": l + 1, "laplacian": [h >= H - block.attn.n_lap for h in range(H)],
                       **{key: values[:H] for key, values in r.items()},
                       "attention": {key: values[H] for key, values in r.items()},
                       "mlp": {key: values[0] for key, values in mlp.items()},
                       "block_total": {key: values[H + 1] for key, values in r.items()},
                       "weights": head_weights(block)})
    return {"graph": model.config.graph, "layers": layers}

def head_means(heads):
    """Per block, the mean rho of its Laplacian heads and of its attention heads (None where a block has none)."""
    out = {"laplacian": [], "attention": []}
    for layer in heads["layers"]:
        for kind, want in (("laplacian", True), ("attention", False)):
            rhos = [rho for rho, lap in zip(layer["rho"], layer["laplacian"]) if lap == want and rho is not None]
            out[kind].append(sum(rhos) / len(rhos) if rhos else None)
    return out

@torch.no_grad()
def image_pass(model, x, y, num_classes, mean, std, layer, patch_only, n_keep, batch_size, device):
    """Stream the statistics of images x (N, C, H, W) uint8, normalised as in training ((x / 255 - mean) / std):
    ANOVA and cosine after every block, the spectrum at `layer`, the per-head analysis; the ANOVA of the last block's
    tokens under other views (anova_views); the pooled features and, with a head, token means and ETF_TOKENS tokens per
    image (final norm); the tokens at `layer` of the first n_keep images (DINO: patch tokens)."""
    L = model.config.n_layer
    cls_head = model.config.num_classes > 0
    sel = patch_tokens if patch_only else all_tokens
    layer_anova = [AnovaStats(num_classes) for _ in range(L + 1)]
    cos_sum = [0.0] * (L + 1)
    spec = SpectrumStats()
    head_stats = [(VarChange(), VarChange()) for _ in range(L)]
    views = AnovaViews(model, num_classes)
    mean = torch.tensor(mean, device=device).view(1, -1, 1, 1)
    std = torch.tensor(std, device=device).view(1, -1, 1, 1)
    keep = dict(kept=[], shown=[], pooled=[], **(dict(seq_means=[], tokens=[]) if cls_head else {}))
    for s in (slice(i, i + batch_size) for i in range(0, len(x), batch_size)):
        img = (augment.to_unit(x[s].to(device), model.config.img_size) - mean) / std
        hs = update_heads(model, model.embed(img), None, head_stats, sel)  # L + 1 tensors (B, 1 + N, d)
        update_layers([sel(h) for h in hs], y[s], layer_anova, cos_sum, spec, layer)
        views.update(sel(hs[-2]), y[s])
        h = pick_layer(hs, layer)
        keep["pooled"].append(model.pool(hs[-1]).double().cpu())
        if cls_head:
            keep["seq_means"].append(sel(hs[-1]).double().mean(1).cpu())
            keep["tokens"].append(sel(hs[-1])[:, etf_positions(sel(hs[-1]).shape[1])].double().cpu())
        left = n_keep - sum(len(k) for k in keep["kept"])
        if left > 0:
            keep["kept"].append((sel(h) if cls_head else h[:, 1:])[:left].float().cpu())
            keep["shown"].append(x[s][:left])
    layers = [a.result() for a in layer_anova]
    return {"layerwise": dict(layerwise(layers, cos_sum, len(x)), anova=layers), "anova": pick_layer(layers, layer),
            "anova_views": dict(views.result(), last_block=layers[-2], final_norm=layers[-1]),
            "spectrum": spec.result(), "heads": head_results(model, head_stats)}, {k: torch.cat(v) for k, v in keep.items()}

@torch.no_grad()
def gpt_pass(model, x, targets, layer, n_targets, n_keep, batch_size, device):
    """Stream within-window collapse after every block, the spectrum and the next-token-class statistics at `layer`
    (classes: the n_targets most frequent targets of the windows x (n, T)). Returns the results, those targets, and
    the tokens at `layer` of the first n_keep windows and the final norm's tokens of the three most frequent targets,
    with their targets."""
    L, V = model.config.n_layer, model.config.vocab_size
    counts = torch.bincount(targets.reshape(-1), minlength=V)
    top = counts.argsort(descending=True)[:min(n_targets, int(counts.count_nonzero()))]  # targets that occur
    cls_of = torch.full((max(V, int(targets.max()) + 1),), -1, dtype=torch.long)
    cls_of[top] = torch.arange(len(top))
    layer_anova = [AnovaStats(1) for _ in range(L + 1)]
    cos_sum = [0.0] * (L + 1)
    spec = SpectrumStats()
    cls = ClassStats(len(top))
    head_stats = [(VarChange(), VarChange()) for _ in range(L)]
    keep = dict(kept=[], kept_targets=[], etf=[], etf_targets=[])
    for s in (slice(i, i + batch_size) for i in range(0, len(x), batch_size)):
        hs = update_heads(model, *model.embed(x[s].to(device)), head_stats, all_tokens)  # L + 1 tensors (B, T, d)
        update_layers(hs, torch.zeros(len(x[s]), dtype=torch.long), layer_anova, cos_sum, spec, layer)  # one class
        h = pick_layer(hs, layer)
        c = cls_of[targets[s].reshape(-1)]
        cls.update(h.reshape(-1, h.shape[-1])[c.to(device) >= 0], c[c >= 0])
        left = n_keep - sum(len(k) for k in keep["kept"])
        keep["kept"].append(h[:max(left, 0)].float().cpu())
        keep["kept_targets"].append(targets[s][:max(left, 0)])
        top3 = torch.isin(targets[s], top[:3])  # (B, T): the positions of the ETF panel
        keep["etf"].append(hs[-1][top3.to(device)].double().cpu())
        keep["etf_targets"].append(targets[s][top3])
    nc = cls.neural_collapse()
    return {"layerwise": layerwise([a.result() for a in layer_anova], cos_sum, len(x)),
            "anova": dict(cls.anova(), n_classes=nc["n_classes"], n_tokens=cls.n_seq,
                          target_share=counts[top].sum().item() / targets.numel()),
            "nc": {k: nc[k] for k in ("nc1", "nc2_equinorm", "nc2_equiangular")}, "spectrum": spec.result(),
            "heads": head_results(model, head_stats)}, top.tolist(), {k: torch.cat(v) for k, v in keep.items()}


# ---------------------------------------------------------------- figures

def pyplot():  # matplotlib on first use: --help and the tests of the metrics do without it
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    return plt

def save_figure(fig, path):
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    pyplot().close(fig)
    return os.path.basename(path)

LOOK_FOR = {  # the one line each figure carries: what to look for, and which way the paper predicts
    "anova": "look for: the paper predicts a smaller within-sequence share and a larger between-class share with more "
             "Laplacian heads",
    "anova_classes": "look for: the paper predicts a smaller within-class share of next-token classes with more "
                     "Laplacian heads",
    "collapse": "look for: lower share and higher cosine = a sequence's tokens closer together (smoother); the paper "
                "predicts smoother with more Laplacian heads",
    "spectrum": "look for: a faster fall = fewer directions (smaller $k_{0.99}$); the paper predicts fewer with more "
                "Laplacian heads",
    "etf": "look for: Neural Collapse (each class's features shrink to their class mean, and the three means spread out "
           "evenly)\n= three tight clusters at the triangle's vertices",
    "pca": "look for: one colour per cluster = tokens grouped by class",
    "pca_maps": "look for: one object in one colour; the paper predicts cleaner object segments with more Laplacian heads",
    "heads": "first order throughout: a block's $\\rho_h$ add up to its attention bar (exact changes: summary.md)\n"
             "look for: a diffusion step smooths (blue, negative); the paper's reading predicts blue Laplacian heads",
}

def fig_anova(rows, labels, keys, title, xlabel, path):  # stacked bars: rows[i][key] for each key, one bar per label
    fig, ax = pyplot().subplots(figsize=(6.8, 3.9))
    bottom = [0.0] * len(labels)
    for key, color in zip(keys, ("#4c72b0", "#dd8452", "#55a868")[-len(keys):]):
        vals = [r[key] or 0.0 for r in rows]
        ax.bar(range(len(labels)), vals, bottom=bottom, color=color, label=key[:-5].replace("_", "-"))
        bottom = [b + v for b, v in zip(bottom, vals)]
    ax.set_xticks(range(len(labels)), labels, rotation=30 if any(" " in k for k in labels) else 0)
    ax.set(xlabel=xlabel, ylabel="share of the token variance\n(part / TotalVar)", ylim=(0, 1), title=title)
    ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.0, 1.0))
    fig.suptitle(LOOK_FOR["anova" if "within_seq_frac" in keys else "anova_classes"], fontsize=7)
    return save_figure(fig, path)

def fig_collapse(curves, labels, title, path):  # curves: [(label, colour, layerwise dict)]
    fig, ax = pyplot().subplots(1, 2, figsize=(9.5, 3.9))
    ylabels = ("within-sequence share of variance\n(WithinSeqVar / TotalVar)", "mean cosine similarity of\na sequence's tokens")
    for a, key, yl in zip(ax, ("within_seq_frac", "cosine"), ylabels):
        for name, color, lw in curves:
            a.plot(range(len(lw[key])), lw[key], "o-", ms=4, color=color, label=name)
        a.set(xticks=range(len(labels)), xticklabels=labels, xlabel="after block", ylabel=yl)
        a.grid(alpha=0.3)
    if curves[0][0]:  # several runs: which curve is which
        ax[0].legend(fontsize=7)
    fig.suptitle(f"{title}\n{LOOK_FOR['collapse']}", fontsize=9)
    return save_figure(fig, path)

def fig_spectrum(curves, title, path, spec=None):  # curves: [(label, colour, lambda_mean)]; spec: one run's
    fig, ax = pyplot().subplots(figsize=(6.0, 4.2))
    for label, color, lam in curves:
        lam = torch.tensor(lam)
        keep = lam > lam[0] * 1e-12  # the centred rank is at most T - 1: drop the zero tail from the log plot
        ax.plot(torch.arange(1, len(lam) + 1)[keep], lam[keep], color=color, label=label)
    if spec:
        j = torch.arange(1, len(lam) + 1)[keep]
        mean = lam[keep]
        std = torch.tensor(spec["lambda_std"])[keep]
        ax.fill_between(j, (mean - std).clamp(min=mean.min().item() * 0.5), mean + std, alpha=0.25, color="C0",
                        label="band: mean $\\pm$ std over sequences\n(lower edge clamped above 0: log scale)")
        for a, ls in zip(ALPHAS, ("--", ":")):
            ax.axvline(spec[f"k_{a}"], color="k", ls=ls, lw=1, label=f"$k_{{{a}}}$ = {spec[f'k_{a}']:.1f}: the fewest "
                       f"directions that hold {a:.0%} of\na sequence's variance (mean over sequences)")
    ax.set(xscale="log", yscale="log", xlabel="principal direction j of a sequence's centred tokens",
           ylabel="variance along it ($\\lambda_j$)", title=title)
    ax.legend(fontsize=7)
    fig.suptitle(LOOK_FOR["spectrum"], fontsize=7)
    return save_figure(fig, path)

def fig_scatter(panels, names, classes, title, path, axes_labels, look_for):  # panels: [(title, xy, y, triangle)]
    plt = pyplot()
    width = 4.4 * len(panels) + 1.8 * (len(panels) == 1)
    text = "\n".join(textwrap.fill(line, int(width * 13)) for line in f"{title}\n{look_for}".split("\n"))  # 9-point
    fig, axes = plt.subplots(1, len(panels), figsize=(width, 3.6 + 0.15 * text.count("\n")), squeeze=False)
    for ax, (sub, xy, y, tri) in zip(axes[0], panels):
        if tri is not None:
            ax.fill(tri[:, 0], tri[:, 1], fill=False, ls="--", color="black", lw=1, zorder=3)  # above the points
        for k, c in enumerate(classes):
            ax.scatter(xy[y == c, 0], xy[y == c, 1], s=5, alpha=0.6, color=plt.cm.tab10(k),
                       label=names[c] if names else str(c))
        ax.set(title=sub if "\n" in sub else "\n".join(textwrap.wrap(sub, 34)), xlabel=axes_labels[0], ylabel=axes_labels[1],
               aspect="auto" if tri is None else "equal", adjustable="datalim")
        ax.legend(fontsize=7, markerscale=3, loc="upper left", bbox_to_anchor=(1.0, 1.0) if tri is None else None)
    fig.suptitle(text, fontsize=9)
    return save_figure(fig, path)

def fig_pca(kept, labels, names, where, seqs, title, path):  # kept (n, T, d), labels (n, T): the 10 most frequent drawn
    n, T, d = kept.shape
    xy, ratio = pca_2d(kept.reshape(-1, d))
    classes, counts = labels.unique(return_counts=True)
    shown = classes[counts.argsort(descending=True)[:10]].sort().values.tolist()
    note = f", {len(shown)} of {len(classes)} classes shown" if len(shown) < len(classes) else ""
    return fig_scatter([(f"tokens ({where}) of {n} {seqs}{note}", xy, labels.reshape(-1), None)], names, shown, title, path,
                       (f"first principal component ({ratio[0]:.0%} of the variance)",
                        f"second principal component ({ratio[1]:.0%})"), LOOK_FOR["pca"])

def fig_heads(heads, title, path):
    """Left: rho_h of every head (rows) in every block (columns), diverging colours centred on 0, Laplacian heads
    marked L; right: the same first-order change by the attention sublayer (its heads' sum), the MLP and the block."""
    plt = pyplot()
    layers = heads["layers"]
    rho = torch.tensor([[math.nan if r is None else r for r in layer["rho"]] for layer in layers]).T  # (H, L)
    H, L = rho.shape
    limit = max(float(rho.nan_to_num().abs().max()), 1e-12)
    fig, (ax, bars) = plt.subplots(1, 2, figsize=(4.0 + 0.9 * L + 0.3 * H, 1.6 + 0.45 * H),
                                 gridspec_kw=dict(width_ratios=[1.2, 1]))
    image = ax.imshow(rho.numpy(), cmap="RdBu_r", vmin=-limit, vmax=limit, aspect="auto")
    for l, layer in enumerate(layers):
        for h, lap in enumerate(layer["laplacian"]):
            ax.text(l, h, f"{'L' if lap else 'A'}\n{rho[h, l]:+.2g}", ha="center", va="center", fontsize=7)
    ax.set(xticks=range(L), xticklabels=[str(layer["block"]) for layer in layers], yticks=range(H), xlabel="block",
           ylabel="head (A attention, L Laplacian)", title="per-head first-order change $\\rho_h$")
    fig.colorbar(image, ax=ax, label="blue: smooths, red: sharpens")
    width = 0.27
    for k, (part, color) in enumerate((("attention", "#4c72b0"), ("mlp", "#dd8452"), ("block_total", "#55a868"))):
        values = [layer[part]["rho"] or 0.0 for layer in layers]
        bars.bar([l + (k - 1) * width for l in range(L)], values, width, color=color, label=part.replace("_total", ""))
    bars.axhline(0, color="k", lw=0.8)
    bars.set(xticks=range(L), xticklabels=[str(layer["block"]) for layer in layers], xlabel="block", ylabel="first-order "
             "change $\\rho$ of\nwithin-sequence variance", title="sublayers (negative: smoother)")
    bars.legend(fontsize=7)
    fig.suptitle(f"{title}\n{LOOK_FOR['heads']}", fontsize=8)
    return save_figure(fig, path)

def fig_pca_maps(kept, shown, grid, title, path):
    fig, axes = pyplot().subplots(2, len(kept), figsize=(1.4 * len(kept) + 0.6, 3.3), squeeze=False)
    for a, b, patches, img in zip(*axes, kept, shown):
        a.imshow(img[0] if len(img) == 1 else img.permute(1, 2, 0), cmap="gray", vmin=0, vmax=255)  # RGB: no cmap
        b.imshow(pca_rgb(patches, grid).numpy(), interpolation="nearest")
        a.axis("off"), b.axis("off")
    fig.suptitle(title + "\nimages (top), top-3 PCs of their patch tokens as RGB (bottom)\n" + LOOK_FOR["pca_maps"],
                 fontsize=8)
    return save_figure(fig, path)


# ---------------------------------------------------------------- one run: its classifier analyses, analysis.json and summary.md

def classifier_analyses(model, extra, y, names, classes, res, title, out_dir):
    """NC1-NC4 with the trained head, on the pooled features and token means; the ETF projection of those and of tokens."""
    W, b = (None if p is None else p.detach().double().cpu() for p in (model.head.weight, model.head.bias))
    feats = {"pooled": "pooled = CLS token" if model.config.pooling == "cls" else "pooled = mean of patch tokens",
             "seq_means": f"seq_means = mean of the {res['settings']['tokens']}"}
    if feats["pooled"].endswith("patch tokens") and res["settings"]["tokens"] == "patch tokens only":
        del feats["seq_means"]  # the very features that are pooled: measured and drawn once
    res["nc"] = {k: dict(features=f"{sub}, final norm", **neural_collapse(extra[k], y, W, b)) for k, sub in feats.items()}
    W3, m = W[classes], torch.isin(y, torch.tensor(classes))
    res["etf"], panels = {"classes": classes, "classifier_rows_2d": etf_projection(W3, W3, W3.mean(0)).tolist()}, []
    tokens = f"tokens = {extra['tokens'].shape[1]} per image ({res['settings']['tokens']})"
    for key, sub in [*feats.items(), ("tokens", tokens)]:
        x, yy = extra[key][m].flatten(0, -2), y[m].repeat_interleave(extra[key].shape[1] if key == "tokens" else 1)
        xy, res["etf"][key], triangle = etf_panel(W3, x, yy, classes)
        panels.append((sub.replace(" = ", " =\n", 1), xy, yy, triangle))  # the name, then what it is
    return [fig_etf(panels, names, classes, title, "an image's features (tokens: a token's)",
                    "the three classes' classifier rows", out_dir)]

def etf_panel(W3, x, y, classes):
    """The ETF projection of features x (n, d) with labels y among the three classes, centred by the mean of their class
    means: the points (n, 2); the class means (3, 2) and vertex_dist, the points' mean distance to their class's vertex
    in vertex radii (0: on the vertices); and the triangle of the panel, its vertices at the mean class radius."""
    xy = etf_projection(W3, x, torch.stack([x[y == c].mean(0) for c in classes]).mean(0))
    means = torch.stack([xy[y == c].mean(0) for c in classes])  # (3, 2)
    r = means.norm(dim=1).mean()  # the mean class radius
    at = (y[:, None] == torch.tensor(classes)).double() @ TRIANGLE.T  # (n, 2): each point's class vertex at radius 1
    return xy, {"class_means_2d": means.tolist(), "vertex_dist": (xy / r - at).norm(dim=1).mean().item()}, TRIANGLE.T * r

def fig_etf(panels, names, classes, title, points, plane, out_dir):  # panels as fig_scatter's
    return fig_scatter(panels, names, classes, f"{title}\neach point: {points}, seen in the plane of {plane}\n(triangle: "
                       "the simplex ETF, at the mean class radius)", os.path.join(out_dir, "etf.png"),
                       ("first axis of that plane", "second axis"), LOOK_FOR["etf"])

def final_metric(run_dir, kind):  # the last value of the run's headline metric in log.jsonl
    key = FINAL_METRIC[kind][0]
    path = os.path.join(run_dir, common.LOG)
    found = {"value": None, "step": None}
    for line in open(path) if os.path.isfile(path) else []:
        try:
            rec = json.loads(line)
        except json.JSONDecodeError:
            continue  # a line cut short by an interrupted run
        if isinstance(rec, dict) and isinstance(rec.get(key), (int, float)):
            found = {"value": float(rec[key]), "step": rec.get("step")}
    return {"name": key, **found}

def lap_label(n_lap):  # (x position, label): the count, or for a per-layer list its mean and the list
    n = n_lap if isinstance(n_lap, int) else n_lap[0] if len(set(n_lap)) == 1 else None
    mean = float(n) if n is not None else sum(n_lap) / len(n_lap)
    return mean, str(n) if n is not None else f"{mean:g} {list(n_lap)}"

def _clean(obj):  # JSON-safe: tensors to lists, NaN and inf to null
    obj = obj.tolist() if isinstance(obj, torch.Tensor) else obj
    if isinstance(obj, dict):
        return {str(k): _clean(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_clean(v) for v in obj]
    return None if isinstance(obj, float) and not math.isfinite(obj) else obj

def writable_out(out):
    """Make the --out folder and prove it writable, failing in one line that names the option."""
    try:
        os.makedirs(out, exist_ok=True)
        with open(os.path.join(out, ".write-test"), "w"):
            pass
        os.remove(os.path.join(out, ".write-test"))
    except OSError as e:
        raise UsageError(f"--out={out} cannot be written ({e.strerror or e}); choose another --out") from None
    return out

def write_outputs(obj, summary, out_dir):  # analysis.json (strict JSON) and summary.md, each written atomically
    with common.atomic_write(os.path.join(out_dir, common.ANALYSIS)) as f:
        f.write(json.dumps(_clean(obj), indent=1, allow_nan=False).encode())
    with common.atomic_write(os.path.join(out_dir, common.SUMMARY)) as f:
        f.write(summary.encode())

def fmt(v, spec=".3f"):  # a number for a table, n/a for None
    return "n/a" if v is None else format(v, spec)


def run_summary(res):
    s = res["settings"]
    a = res["anova"]
    fm = res["final_metric"]
    lw = res["layerwise"]["within_seq_frac"]
    lines = [f"# {res['run']}: {res['kind']}, n_lap = {res['n_lap_label']} of {res['n_head']} heads", "",
             f"Final {fm['name']} from log.jsonl: {fmt(fm['value'], '.4f')} (step {fm['step']}).", "",
             f"Settings: {s['n_samples']} sequences of the validation split, layer {s['layer']} "
             f"(-1 = final norm), tokens: {s['tokens']}.", "", "| quantity | value |", "|---|---|"]
    lines += [f"| ANOVA {key.replace('_', ' ')} | {fmt(a[key])} |" for key in FRACS if key in a]
    lines += [f"| within-seq share after block 1 -> last block | {fmt(lw[0])} -> {fmt(lw[-2])} |"]
    lines += [f"| k_{al} (mean over sequences) | {res['spectrum'][f'k_{al}']:.1f} |" for al in ALPHAS]
    for key, nc in ({"next-token classes": res["nc"]} if res["kind"] == "gpt" else res.get("nc", {})).items():
        lines += [f"| {m} ({key}) | {v if m == 'features' else format(v, '.4g')} |" for m, v in nc.items()
                  if m.startswith(("nc", "features")) and not (m.endswith("_w") and key == "seq_means")]  # W's metrics once
    return "\n".join(lines + views_lines(res) + heads_lines(res["heads"]) + ["", "Figures: " + ", ".join(res["figures"]), ""])

def views_lines(res):  # summary.md: the absolute ANOVA parts of the last block's tokens under each view
    views = res.get("anova_views")
    if not views:
        return []
    lines = ["", "Absolute parts (the fractions above are these divided by their total):", "",
             "| tokens | within-seq var | between-seq var (total − within-seq) | within-seq share |", "|---|---|---|---|"]
    for name, v in views.items():
        lines.append(f"| {name.replace('_', ' ')} | {v['within_seq_var']:.4g} | {v['total_var'] - v['within_seq_var']:.4g} "
                     f"| {fmt(v['within_seq_frac'])} |")
    return lines

def heads_lines(heads):  # summary.md: per block, the mean rho of each kind of head and the sublayers' exact changes
    means = head_means(heads)
    lines = ["", "Per-head analysis: relative change of the block input's within-sequence variance (negative = the "
             "update smooths the tokens), first order (rho) for heads, exact for sublayers (attention + MLP = block):", "",
             "| block | Laplacian heads, mean rho | attention heads, mean rho | attention | MLP | block |",
             "|---|---|---|---|---|---|"]
    for layer, lap, att in zip(heads["layers"], means["laplacian"], means["attention"]):
        exact = [fmt(layer[part]["exact"], "+.4f") for part in ("attention", "mlp", "block_total")]
        lines.append(f"| {layer['block']} | {fmt(lap, '+.4f')} | {fmt(att, '+.4f')} | " + " | ".join(exact) + " |")
    return lines


# ---------------------------------------------------------------- run

def checked_checkpoints(paths, config):
    """[(ckpt.pt path, what the analysis needs of it)] for the run directories or checkpoints given, each checked
    against the options before any work (the optimiser state is dropped at once). Raises UsageError."""
    missing = [p for p in paths if not os.path.exists(p)]
    if missing or not paths:
        raise UsageError(f"{missing[0]}: no such run directory, checkpoint or config file" if missing else "give one or "
                         "more run directories (each with ckpt.pt and log.jsonl): python analyze.py out/vit [out/vit-k4 ...]")
    etf = config["etf_classes"]
    if len(etf) != 3 or len(set(etf)) != 3 or not all(isinstance(c, int) and c >= 0 for c in etf):
        raise UsageError(f"--etf_classes={etf}: give three different class indices, e.g. --etf_classes=[0,1,2]")
    configurator.check_options(config, at_least={1: ["max_samples", "batch_size"], 2: ["n_targets"]},
                                choices={"tokens": ("patch", "all")})
    ckpts = []
    for p in paths:
        path = p if p.endswith(".pt") else os.path.join(p, common.CHECKPOINT)
        ckpt = common.load_checkpoint(path)
        if ckpt.get("kind") not in FINAL_METRIC or not {"model", "model_config"} <= set(ckpt):
            raise UsageError(f"{path}: not a checkpoint of the training scripts (kind {ckpt.get('kind')!r}, expected one "
                             f"of {sorted(FINAL_METRIC)}, with model and model_config)")
        mc = ckpt["model_config"]
        if config["layer"] != -1 and not 1 <= config["layer"] <= mc["n_layer"]:
            raise UsageError(f"--layer={config['layer']}: use -1 (final norm) or a block number from 1 to {mc['n_layer']}")
        if ckpt["kind"] == "gpt" and config["seq_len"] > mc["block_size"]:
            raise UsageError(f"--seq_len={config['seq_len']} is longer than the model's block_size={mc['block_size']}")
        kept = ("kind", "model_config", "model", "config", "step", "classes", "mean", "std")
        ckpts.append((path, {k: ckpt[k] for k in kept if k in ckpt}))
    return ckpts

def analyze_run(path, ckpt, out_dir, config, device):
    """One run: its evaluation data, one streaming pass (metrics and per-head analysis), its figures, analysis.json and
    summary.md in out_dir. Returns the analysis (a dict, as analysis.json holds it)."""
    kind = ckpt["kind"]
    cfg = ckpt.get("config", {})
    run_dir = os.path.dirname(path) if os.path.basename(path) == common.CHECKPOINT else path  # loose: no log of its own
    layer = config["layer"]
    where = "final norm" if layer == -1 else f"after block {layer}"  # the tokens analysed
    name = run_name(path)
    model = common.load_model(ckpt).to(device).eval()
    x_lap, label = lap_label(model.config.n_lap)
    res = {"run": run_dir, "kind": kind, "n_lap": model.config.n_lap, "n_lap_mean": x_lap, "n_lap_label": label,
           "n_head": model.config.n_head, "seed": cfg.get("seed"), "step": ckpt.get("step"),
           "final_metric": final_metric(run_dir, kind), "train_config": cfg}
    title = f"{name} ({kind}, n_lap={label})"
    t0 = time.time()
    print(f"analysing {path}: {kind}, n_lap={label}, {model.num_params() / 1e6:.2f}M params, on {device}", flush=True)
    data_dir, dataset = cfg.get("data_dir", "data"), cfg.get("dataset")
    if kind == "gpt":
        T = config["seq_len"] or cfg.get("block_size") or model.config.block_size
        x, targets = text.load_windows(data_dir, dataset, T, config["max_samples"], cfg.get("holdout", 0.0))
        r, top, extra = gpt_pass(model, x, targets, layer, config["n_targets"], config["pca_images"],
                                 config["batch_size"], device)
        res.update(r)
        ids = sorted(set(top + extra["kept_targets"].unique().tolist()))  # the classes of the ANOVA and the figures
        names = dict(zip(ids, text.token_names(data_dir, dataset, ids)))
        res["anova"].update(targets=top, target_names=[names[t] for t in top])
        res["settings"] = dict(layer=layer, tokens="all positions of each window", seq_len=T, n_samples=len(x),
                               n_targets=config["n_targets"], dataset=dataset, pca_windows=len(extra["kept"]))
        anova_fig = fig_anova([res["anova"]], ["all positions"], FRACS[1:], f"next-token classes: top "
                              f"{res['anova']['n_classes']} targets, NC1 = {res['nc']['nc1']:.3g}\n{title}",
                              where, os.path.join(out_dir, "anova.png"))
    else:
        x, y, names, mean, std = images.eval_images(ckpt, config["max_samples"], config["seed"])
        etf = config["etf_classes"]
        if kind == "vit" and not set(etf) <= set(y.tolist()):  # before the long pass
            raise UsageError(f"--etf_classes={etf}: not every class occurs among the {len(y)} analysed "
                             f"images; choose others or raise --max_samples")
        n_keep = config["pca_images"] if kind == "vit" else config["map_images"]
        r, extra = image_pass(model, x, y, max(int(y.max()) + 1, model.config.num_classes), mean, std, layer,
                              config["tokens"] == "patch", n_keep, config["batch_size"], device)
        res.update(r)
        tokens = "patch tokens only" if config["tokens"] == "patch" else "patch tokens and the CLS token"
        res["settings"] = dict(layer=layer, tokens=tokens, n_samples=len(x), dataset=dataset,
                               normalisation=dict(mean=mean, std=std))
        lw = res["layerwise"]
        anova_fig = fig_anova(lw["anova"], lw["layer"], FRACS, title, "after block", os.path.join(out_dir, "anova.png"))
    collapse = fig_collapse([(None, "C0", res["layerwise"])], res["layerwise"]["layer"], title,
                            os.path.join(out_dir, "collapse.png"))
    spectrum = fig_spectrum([("mean $\\lambda_j$", "C0", res["spectrum"]["lambda_mean"])], title,
                            os.path.join(out_dir, "spectrum.png"), res["spectrum"])
    figs = [spectrum, collapse, anova_fig] if kind == "gpt" else [collapse, anova_fig, spectrum]
    figs.append(fig_heads(res["heads"], title, os.path.join(out_dir, "heads.png")))
    if kind == "vit":
        per_token = y[:len(extra["kept"]), None].expand(-1, extra["kept"].shape[1])
        figs.append(fig_pca(extra["kept"], per_token, names, where, "images", title, os.path.join(out_dir, "pca.png")))
        res["settings"]["pca_images"] = len(extra["kept"])
        figs += classifier_analyses(model, extra, y, names, config["etf_classes"], res, title, out_dir)
    elif kind == "gpt":  # the classes: next tokens; the ETF plane: the output layer's rows of the three most frequent
        figs.append(fig_pca(extra["kept"], extra["kept_targets"], names, where, "windows, coloured by next token",
                            title, os.path.join(out_dir, "pca.png")))
        if len(top) >= 3:  # (--n_targets=2 draws no ETF panel)
            W3 = model.lm_head.weight.detach().double().cpu()[top[:3]]
            xy, panel, triangle = etf_panel(W3, extra["etf"], extra["etf_targets"], top[:3])
            res["etf"] = dict(classes=top[:3], classifier_rows_2d=etf_projection(W3, W3, W3.mean(0)).tolist(), tokens=panel)
            figs.append(fig_etf([("tokens, final norm", xy, extra["etf_targets"], triangle)], names, top[:3], title,
                                "a token (its class: the next token)", "the output layer's rows of the three most "
                                "frequent next tokens", out_dir))
    else:  # DINO has no classifier: the ETF plane is that of the three classes' means
        grid = (x.shape[-2] // model.config.patch_size, x.shape[-1] // model.config.patch_size)
        figs.append(fig_pca_maps(extra["kept"], extra["shown"], grid, title, os.path.join(out_dir, "pca_maps.png")))
        res["settings"]["map_images"] = len(extra["kept"])
        etf = config["etf_classes"]
        m = torch.isin(y, torch.tensor(etf))
        if set(etf) <= set(y.tolist()):  # else no ETF panel (a figure DINO's other analyses do not need)
            W3 = torch.stack([extra["pooled"][y == c].mean(0) for c in etf])
            xy, panel, triangle = etf_panel(W3, extra["pooled"][m], y[m], etf)
            res["etf"] = dict(classes=etf, pooled=panel)
            figs.append(fig_etf([("pooled features, final norm", xy, y[m], triangle)], names, etf, title,
                                "an image's pooled features (no classifier)", "the three classes' means", out_dir))
    res["figures"] = figs
    res["out_dir"] = out_dir
    write_outputs(res, run_summary(res), out_dir)
    print(f"{name}: {len(x)} sequences, {time.time() - t0:.1f}s; wrote {out_dir}: analysis.json, summary.md, "
          f"{', '.join(figs)}", flush=True)
    return res

def is_run_path(arg):  # a positional argument naming a run: a folder, a .pt file, or a missing path (a mistyped run)
    return not arg.startswith("-") and (os.path.isdir(arg) or arg.endswith(".pt") or not os.path.exists(arg))

def run_name(path):  # a run's ckpt.pt is named by its folder, a loose checkpoint (out/x.pt) by its stem
    if os.path.basename(path) != common.CHECKPOINT:
        return os.path.splitext(os.path.basename(path))[0]
    return os.path.basename(os.path.normpath(os.path.dirname(path))) or os.path.dirname(path)

def run_folders(ckpts, out):
    """The output folder of each run: out itself for one run, out/<run name> (made unique) for several."""
    if len(ckpts) == 1:
        return [out]
    folders = []
    for path, _ in ckpts:
        name = run_name(path)
        sub = next(s for s in [name] + [f"{name}-{n}" for n in range(2, len(ckpts) + 2)]
                   if os.path.join(out, s) not in folders)
        folders.append(os.path.join(out, sub))
    return folders

if __name__ == "__main__":
    config, _ = configurator.configure(globals(), [a for a in sys.argv[1:] if not is_run_path(a)])
    paths = [a for a in sys.argv[1:] if is_run_path(a)]
    ckpts = checked_checkpoints(paths, config)
    run_device = common.resolve_device("cpu" if device == "auto" and not torch.cuda.is_available() else device)
    if run_device == "mps":
        raise UsageError("--device=mps: the statistics need float64, which MPS lacks; use --device=cpu")
    parent = os.path.commonpath([os.path.abspath(os.path.dirname(p)) for p, _ in ckpts])
    default_out = os.path.join(parent, "analysis") if len(ckpts) == 1 or parent != os.getcwd() else "out-analysis"
    if len(ckpts) == 1 and os.path.basename(ckpts[0][0]) != common.CHECKPOINT:  # a loose checkpoint: beside it
        default_out = os.path.join(parent, run_name(ckpts[0][0]) + "-analysis")
    out_root = writable_out(out or default_out)
    print("analyze.py settings: " + " ".join(f"{k}={v!r}" for k, v in {**config, "device": run_device}.items()),
          flush=True)
    folders = run_folders(ckpts, out_root)
    results = [analyze_run(path, ckpt, writable_out(folder), config, run_device) for (path, ckpt), folder in zip(ckpts, folders)]
    if len(results) == 1:  # one run: its RESULT line
        r = results[0]
        nc1 = r["nc"]["nc1"] if r["kind"] == "gpt" else r.get("nc", {}).get("pooled", {}).get("nc1")
        common.write_result(out_root, kind=r["kind"], n_lap=r["n_lap"],
                             within_seq_frac=fmt(pick_layer(r["layerwise"]["within_seq_frac"], layer), ".4f"),
                             **{f"k_{a}": f"{r['spectrum'][f'k_{a}']:.2f}" for a in ALPHAS},
                             **({} if nc1 is None else {"nc1": f"{nc1:.4g}"}), out=out_root)
    else:  # several: how to compare them (results/report.py reads the analyses just written)
        print("compare them: python results/report.py " + " ".join(folders) + f" --out={out_root}")
        common.write_result(out_root, runs=len(results), out=out_root)

"""
The token geometry of nanolap models: the measures of section 4 of Zhang & Papyan, "Laplacian Heads Improve
Transformers by Smoothing Token Representations" (2026), each defined precisely in its docstring, and what every head
does to the tokens. analyze.py measures trained runs with them, results/report.py and results/verdict.py compare the
runs, and exercises/check.py checks the exercises against them.
"""

import math

import torch
import torch.nn.functional as F

import nanolap
from common import UsageError

# ---------------------------------------------------------------- constants
ALPHAS = (0.9, 0.99)  # k_alpha thresholds (the paper reports alpha = 0.99)
# the metric each kind of run is judged by, as its log.jsonl names it, and which way is better
FINAL_METRIC = {"vit": ("val_acc", "higher"), "gpt": ("val_loss", "lower"), "dino": ("knn_acc", "higher")}
FRACS = ("within_seq_frac", "within_class_frac", "between_class_frac")  # the ANOVA's shares of the token variance
# the fixed 2 x 3 map A from centred 3-simplex coordinates to an equilateral triangle: column k is the vertex of
# class k (at 90, 210 and 330 degrees); the columns sum to 0, so the all-ones direction is dropped
TRIANGLE = torch.tensor([[0.0, -math.sqrt(3) / 2, math.sqrt(3) / 2], [1.0, -0.5, -0.5]], dtype=torch.float64)

# ---------------------------------------------------------------- metrics
# Pure functions, each next to a streaming accumulator giving the same numbers (float64, shifted by the first batch's
# mean to keep the sums well conditioned). Tokens h (N, T, d): N sequences of T tokens h_it, labels y (N,).

def _fractions(total, **parts):
    """Variance parts and their fractions of the total (None where the total is 0)."""
    out = {"total_var": float(total)}
    for name, value in parts.items():
        out[f"{name}_var"] = float(value)
        out[f"{name}_frac"] = float(value / total) if total > 0 else None
    return out

def anova(h, y):
    """Three-way ANOVA of token variance (the exact form is ours; it is exact when every sequence has the same T):
        TotalVar = mean_it |h_it - mu_G|^2 = WithinSeqVar + WithinClassVar + BetweenClassVar,
        WithinSeqVar = mean_it |h_it - mu_i|^2, WithinClassVar = mean_i |mu_i - mu_yi|^2,
        BetweenClassVar = mean_i |mu_yi - mu_G|^2,
    mu_i = mean_t h_it (the sequence mean), mu_c = the mean of the mu_i of class c, mu_G = the mean of all tokens;
    reported as parts and fractions of TotalVar. After every block, the WithinSeqVar fraction is the layerwise
    within-sequence collapse (GPT windows carry no label: one class, so only that share is reported)."""
    h = h.double()
    mu_i = h.mean(1)  # (N, d) sequence means
    mu_G = h.mean((0, 1))  # (d,) the mean of all tokens
    classes, inverse = y.unique(return_inverse=True)
    mu_y = torch.stack([mu_i[y == c].mean(0) for c in classes])[inverse]  # (N, d): mu_c of each sequence's class
    return _fractions((h - mu_G).square().sum(-1).mean(), within_seq=(h - mu_i[:, None]).square().sum(-1).mean(),
                      within_class=(mu_i - mu_y).square().sum(-1).mean(),
                      between_class=(mu_y - mu_G).square().sum(-1).mean())

class AnovaStats:
    """Streaming anova(): token count and sums, the within-sequence sum of squares, and per class the count, sum and
    sum of squared norms of the sequence means."""
    def __init__(self, num_classes):
        self.num_classes = num_classes
        self.shift = None
        self.n_seq = 0
        self.n_tok = 0
    def update(self, h, y):
        h = h.detach().double()
        y = y.to(h.device)
        if self.shift is None:
            d = h.shape[-1]
            kw = dict(dtype=torch.float64, device=h.device)
            self.shift = h.reshape(-1, d).mean(0)
            self.tok_sum = torch.zeros(d, **kw)
            self.tok_sumsq = torch.zeros((), **kw)
            self.within_seq = 0.0
            self.count = torch.zeros(self.num_classes, **kw)  # per class: sequences, sum of |mu_i|^2, sum of mu_i
            self.mu_sumsq = torch.zeros(self.num_classes, **kw)
            self.mu_sum = torch.zeros(self.num_classes, d, **kw)
        h = h - self.shift
        mu_i = h.mean(1)  # (B, d)
        self.n_seq += h.shape[0]
        self.n_tok += h.shape[0] * h.shape[1]
        self.tok_sum = self.tok_sum + h.sum((0, 1))
        self.tok_sumsq = self.tok_sumsq + h.square().sum()
        self.within_seq += (h - mu_i[:, None]).square().sum()
        self.count.index_add_(0, y, torch.ones_like(mu_i[:, 0]))
        self.mu_sum.index_add_(0, y, mu_i)
        self.mu_sumsq.index_add_(0, y, mu_i.square().sum(-1))
    def result(self):
        seen = self.count > 0
        count = self.count[seen]
        mu_c = self.mu_sum[seen] / count[:, None]
        mu_G = self.tok_sum / self.n_tok
        return _fractions(self.tok_sumsq / self.n_tok - mu_G.square().sum(), within_seq=self.within_seq / self.n_tok,
                          within_class=(self.mu_sumsq[seen] - count * mu_c.square().sum(-1)).sum() / self.n_seq,
                          between_class=(count * (mu_c - mu_G).square().sum(-1)).sum() / self.n_seq)

def seq_cosine(h):
    """Mean pairwise cosine similarity of the tokens inside each sequence, (N, T, d) -> (N,): the mean over t != t'
    of cos(h_it, h_it'); its mean over sequences is the second collapse curve. With unit vectors u_t,
    |sum_t u_t|^2 = sum_t |u_t|^2 + sum_{t != t'} cos(h_t, h_t'), so no T x T matrix is formed."""
    u = F.normalize(h.double(), dim=-1)
    T = h.shape[1]
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
        self.k_sum = {alpha: 0.0 for alpha in alphas}
    def update(self, h):
        lam = seq_spectrum(h.detach())
        self.n = self.n + len(lam)
        self.sum = self.sum + lam.sum(0)
        self.sumsq = self.sumsq + lam.square().sum(0)
        for alpha in self.alphas:
            self.k_sum[alpha] += k_alpha(lam, alpha).double().sum()
    def result(self):
        mean = self.sum.cpu() / self.n
        meansq = self.sumsq.cpu() / self.n
        std = (meansq - mean.square()).clamp(min=0).sqrt()
        return {"lambda_mean": mean.tolist(), "lambda_std": std.tolist(), "n_sequences": self.n,
                **{f"k_{alpha}": float(self.k_sum[alpha] / self.n) for alpha in self.alphas}}

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
    kept = s > s.max() * 1e-8  # the range of M^T
    U = U[:, kept]
    s = s[kept]
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
        x = x.double()
        u = u.double()
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
        sums = self.sums
        sums["xx"] += (x - x.mean(1, keepdim=True)).square().sum()
        sums["xu"] += torch.einsum("btd,btkd->k", bc, uc)
        sums["uu"] += uc.square().sum((0, 1, 3))
        sums["mxx"] += m_x.square().sum()
        sums["mx"] += m_x.sum(0)
        sums["mbu"] += torch.einsum("bd,bkd->k", m_b, m_u)
        sums["mb"] += m_b.sum(0)
        sums["mu"] += m_u.sum(0)  # (K, d)
        sums["muu"] += m_u.square().sum((0, 2))
        self.n += len(x)
    def result(self):
        sums = self.sums
        n = self.n
        between_x = sums["mxx"] - sums["mx"].square().sum() / n  # n * BetweenSeqVar of x (equal T)
        cross = sums["mbu"] - sums["mu"] @ sums["mb"] / n  # (K,)
        between_u = sums["muu"] - sums["mu"].square().sum(-1) / n
        return {"rho": _relative(2 * sums["xu"], sums["xx"]),
                "exact": _relative(2 * sums["xu"] + sums["uu"], sums["xx"]),
                "rho_between": _relative(2 * cross, between_x),
                "exact_between": _relative(2 * cross + between_u, between_x)}

def _relative(change, scale):  # change (K,) / scale, as a list; None where the scale is 0 (no variance to change)
    return (change / scale).tolist() if scale > 0 else [None] * len(change)

def patch_tokens(h):  # (B, 1 + N, ...) -> (B, N, ...): without the CLS token
    return h[:, 1:]

def all_tokens(h):
    return h

@torch.no_grad()
def block_updates(block, x, rope=None):
    """What one block (eval mode) adds to its input x (B, T, d): every head's U_h (B, T, H, d), its output through
    its columns of the output projection times LayerScale; the attention sublayer's output A = sum_h U_h + the
    projection bias (times LayerScale), (B, T, d); and the MLP's update M of x + A. The block's output is x + A + M.
    The heads' outputs are read where the attention module hands them to its output projection, so that any module
    with a `proj` is measured by what its own forward computes (an exercise's heads too)."""
    attn = block.attn
    C = x.shape[-1]
    heads = []

    def read_heads(proj, args):  # the output projection's input: every head's output side by side, (B, T, H * D)
        heads.append(args[0])
    hook = attn.proj.register_forward_pre_hook(read_heads)
    attn(block.norm1(x), rope)
    hook.remove()
    y = heads[0].unflatten(-1, (attn.n_head, attn.head_dim))  # (B, T, H, D)
    U = torch.einsum("bthe,dhe->bthd", y, attn.proj.weight.view(C, attn.n_head, attn.head_dim))  # (B, T, H, d)
    bias = attn.proj.bias if attn.proj.bias is not None else torch.zeros(C, device=x.device)
    if isinstance(block.ls1, nanolap.LayerScale):
        U = U * block.ls1.gamma
        bias = bias * block.ls1.gamma
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
    heads are Laplacian, the attention sublayer, the MLP and the whole block."""
    layers = []
    for number, (block, (on_input, on_mlp)) in enumerate(zip(model.blocks, stats), start=1):
        changes = on_input.result()  # per update: the H heads, the attention sublayer, the whole block
        mlp = on_mlp.result()
        H = block.attn.n_head
        layers.append({"block": number, "laplacian": [h >= H - block.attn.n_lap for h in range(H)],
                       **{key: values[:H] for key, values in changes.items()},
                       "attention": {key: values[H] for key, values in changes.items()},
                       "mlp": {key: values[0] for key, values in mlp.items()},
                       "block_total": {key: values[H + 1] for key, values in changes.items()}})
    return {"graph": model.config.graph, "layers": layers}

def head_means(heads):
    """Per block, the mean rho of its Laplacian heads and of its attention heads (None where a block has none)."""
    out = {"laplacian": [], "attention": []}
    for layer in heads["layers"]:
        for kind, want in (("laplacian", True), ("attention", False)):
            rhos = [rho for rho, lap in zip(layer["rho"], layer["laplacian"]) if lap == want and rho is not None]
            out[kind].append(sum(rhos) / len(rhos) if rhos else None)
    return out

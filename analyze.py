"""
Token geometry of nanolap checkpoints: the analyses of section 4 of the paper (definitions in
PAPER.md section 3), as numbers (analysis.json), figures (PNG) and a short summary.md.

    python analyze.py out/vit                        # one run: writes out/vit/analysis/
    python analyze.py out/vit-k0-s0 out/vit-k4-s0 out/vit-k0-s1 ... --out=out/compare_vit

Each run directory holds ckpt.pt (the shared checkpoint contract: kind, model_config, model, config)
and log.jsonl. The kind decides what is measured, on the evaluation data the run used:

  vit   PCA of last-layer tokens; ANOVA of token variance (within sequence / within class / between
        class) after every block; mean pairwise cosine of tokens inside an image per block; the
        spectrum of within-image centred tokens; Neural Collapse NC1-NC4 of the pooled features and
        of the token means, with the trained head as classifier; the simplex-ETF projection.
  gpt   spectrum of within-window centred tokens (mean/std of lambda_j, k_alpha); next-token-class
        ANOVA and NC1 over the most frequent targets; within-sequence collapse after every block.
  dino  PCA RGB feature maps of the patch tokens next to the images; spectrum and k_alpha; ANOVA and
        collapse after every block (the evaluation images carry labels).

Given several runs, it also draws the paper's comparisons against the number of Laplacian heads:
final metric from log.jsonl (mean +- std over seeds), ANOVA stacked bars, k_alpha, overlaid spectra
and overlaid layerwise collapse curves.

Memory stays bounded: every statistic is a streaming accumulator (counts, sums, scatter matrices in
float64) updated batch by batch, and its result equals the all-in-memory formula next to it (the tests
check this). Only one pooled vector per image (for NC4) and the few tokens drawn in figures are kept.
"""

import json
import math
import os
import sys
import time

import torch
import torch.nn.functional as F

from nanolap import UsageError, load_checkpoint, load_model, parse_args, run_main

# -----------------------------------------------------------------------------
# default settings: override with --key=value, or a config file of `key = value` lines

_before = set(globals())
out = ""  # output directory; "" = RUN/analysis for one run, COMMON_PARENT/analysis for several
max_samples = 1000  # images or text windows per run: a fixed random subset of the validation split
batch_size = 64  # sequences per forward pass
layer = -1  # tokens of the PCA, spectrum, ANOVA, GPT next-token stats, DINO maps: -1 = final norm, k = block k
tokens = "patch"  # ViT/DINO tokens in sequence statistics: 'patch' (patch tokens only) or 'all' (with CLS)
seq_len = 0  # GPT window length; 0 = the run's block_size
n_targets = 20  # GPT: the most frequent next-token targets serve as classes
etf_classes = [0, 1, 2]  # ViT: the three classes of the simplex-ETF projection
pca_images = 32  # ViT: images whose tokens are drawn in the PCA scatter
map_images = 8  # DINO: images shown next to their PCA feature maps
device = "auto"  # 'auto' = cuda if available, else cpu
seed = 0  # which random subset of the validation split is analysed
DEFAULTS = {k: v for k, v in globals().items() if k not in _before and k != "_before"}

ALPHAS = (0.9, 0.99)  # k_alpha thresholds (the paper reports alpha = 0.99)
FINAL_METRIC = {"vit": ("val_acc", "higher"), "gpt": ("val_loss", "lower"), "dino": ("knn_acc", "higher")}

# -----------------------------------------------------------------------------
# metrics: pure functions (tensors in, numbers out), each next to a streaming accumulator that gives
# the same numbers. Tokens h are (N, T, d): N sequences of T tokens; labels y are (N,) class indices.


def _fractions(total, **parts):
    """Variance parts and their fractions of the total (None where the total is 0)."""
    out = {"total_var": float(total)}
    for name, value in parts.items():
        out[f"{name}_var"] = float(value)
        out[f"{name}_frac"] = float(value / total) if total > 0 else None
    return out


def anova(h, y):
    """Three-way ANOVA of token variance (PAPER.md section 3; the exact form is ours, exact for equal T):
    TotalVar = mean_it |h_it - mu_G|^2 = WithinSeq + WithinClass + BetweenClass with
    WithinSeq = mean_it |h_it - mu_i|^2, WithinClass = mean_i |mu_i - mu_yi|^2, BetweenClass = mean_i |mu_yi - mu_G|^2,
    mu_i the sequence mean, mu_c the mean of the mu_i of class c, mu_G the mean of all tokens."""
    h = h.double()
    mu_i = h.mean(1)  # (N, d)
    mu_G = h.reshape(-1, h.shape[-1]).mean(0)  # (d,)
    classes, inverse = y.unique(return_inverse=True)
    mu_c = torch.stack([mu_i[y == c].mean(0) for c in classes])  # (C, d)
    mu_y = mu_c[inverse]  # (N, d)
    total = (h - mu_G).square().sum(-1).mean()
    return _fractions(total, within_seq=(h - mu_i[:, None]).square().sum(-1).mean(),
                      within_class=(mu_i - mu_y).square().sum(-1).mean(),
                      between_class=(mu_y - mu_G).square().sum(-1).mean())


class AnovaStats:
    """Streaming anova(): token count and sums, the within-sequence sum of squares, and per class the
    count, sum and sum of squared norms of the sequence means. float64 on the tokens' device, shifted by the
    first batch's mean (the shift leaves every variance unchanged and keeps the sums well conditioned)."""

    def __init__(self, num_classes):
        self.C, self.shift, self.n_seq, self.n_tok = num_classes, None, 0, 0

    def update(self, h, y):
        h = h.detach().double()
        y = y.to(h.device)
        if self.shift is None:
            d, kw = h.shape[-1], dict(dtype=torch.float64, device=h.device)
            self.shift = h.reshape(-1, d).mean(0)
            self.tok_sum, self.tok_sumsq, self.within_seq = torch.zeros(d, **kw), torch.zeros((), **kw), 0.0
            self.count, self.mu_sum = torch.zeros(self.C, **kw), torch.zeros(self.C, d, **kw)
            self.mu_sumsq = torch.zeros(self.C, **kw)
        h = h - self.shift
        mu_i = h.mean(1)  # (B, d)
        self.n_seq, self.n_tok = self.n_seq + h.shape[0], self.n_tok + h.shape[0] * h.shape[1]
        self.tok_sum += h.sum((0, 1))
        self.tok_sumsq += h.square().sum()
        self.within_seq += (h - mu_i[:, None]).square().sum()
        self.count.index_add_(0, y, torch.ones_like(mu_i[:, 0]))
        self.mu_sum.index_add_(0, y, mu_i)
        self.mu_sumsq.index_add_(0, y, mu_i.square().sum(-1))

    def result(self):
        seen = self.count > 0
        count, mu_c = self.count[seen], self.mu_sum[seen] / self.count[seen, None]
        mu_G = self.tok_sum / self.n_tok
        total = self.tok_sumsq / self.n_tok - mu_G.square().sum()
        within_class = (self.mu_sumsq[seen] - count * mu_c.square().sum(-1)).sum() / self.n_seq
        between = (count * (mu_c - mu_G).square().sum(-1)).sum() / self.n_seq
        return _fractions(total, within_seq=self.within_seq / self.n_tok, within_class=within_class,
                          between_class=between)


def seq_cosine(h):
    """Mean cosine similarity over pairs t != t' of tokens in each sequence: (N, T, d) -> (N,).
    With unit vectors u_t, |sum_t u_t|^2 = sum_t |u_t|^2 + sum_{t != t'} cos(h_t, h_t'), so no T x T matrix."""
    u = F.normalize(h.double(), dim=-1)
    T = h.shape[1]
    return (u.sum(1).square().sum(-1) - u.square().sum((1, 2))) / (T * (T - 1))


class MeanStats:
    """Streaming mean of per-sequence values."""

    def __init__(self):
        self.sum, self.n = 0.0, 0

    def update(self, values):
        self.sum, self.n = self.sum + values.double().sum(), self.n + values.numel()

    def result(self):
        return float(self.sum / self.n)


def seq_spectrum(h):
    """Eigenvalues lambda_1 >= lambda_2 >= ... of X~_i^T X~_i, X~_i the tokens of sequence i centred by their
    mean: (N, T, d) -> (N, min(T, d)). Computed from the smaller Gram matrix (X~ X~^T when T < d, same non-zero
    eigenvalues) in float64: batched eigvalsh is many times faster than batched SVD on a CPU."""
    x = h.double()
    x = x - x.mean(1, keepdim=True)
    gram = x @ x.transpose(1, 2) if x.shape[1] < x.shape[2] else x.transpose(1, 2) @ x
    return torch.linalg.eigvalsh(gram).flip(-1).clamp(min=0)


def k_alpha(lam, alpha):
    """Per sequence, the smallest k whose top-k eigenvalues reach a fraction alpha of their sum: (N, r) -> (N,).
    (The 1e-12 slack absorbs rounding of the cumulative sum when alpha = 1.)"""
    frac = lam.cumsum(-1) / lam.sum(-1, keepdim=True)
    return ((frac < alpha - 1e-12).sum(-1) + 1).clamp(max=lam.shape[-1])


class SpectrumStats:
    """Streaming mean and std (over sequences) of each lambda_j, and mean k_alpha."""

    def __init__(self, alphas=ALPHAS):
        self.alphas, self.n, self.sum, self.sumsq = alphas, 0, 0.0, 0.0
        self.k_sum = {a: 0.0 for a in alphas}

    def update(self, h):
        lam = seq_spectrum(h.detach())
        self.n += lam.shape[0]
        self.sum, self.sumsq = self.sum + lam.sum(0), self.sumsq + lam.square().sum(0)
        for a in self.alphas:
            self.k_sum[a] += k_alpha(lam, a).double().sum()

    def result(self):
        mean, meansq = self.sum.cpu() / self.n, self.sumsq.cpu() / self.n
        std = (meansq - mean.square()).clamp(min=0).sqrt()  # population std over sequences
        out = {"lambda_mean": mean.tolist(), "lambda_std": std.tolist(), "n_sequences": self.n}
        out.update({f"k_{a}": float(self.k_sum[a] / self.n) for a in self.alphas})
        return out


def class_anova(x, y):
    """Two-way ANOVA of samples x (n, d) with labels y (LM: a token's class is its next-token target;
    ours): TotalVar = mean |x - m|^2 = WithinClass (mean |x - mu_y|^2) + BetweenClass (mean |mu_y - m|^2)."""
    x = x.double()
    classes, inverse = y.unique(return_inverse=True)
    mu_c = torch.stack([x[y == c].mean(0) for c in classes])
    m = x.mean(0)
    return _fractions((x - m).square().sum(-1).mean(), within_class=(x - mu_c[inverse]).square().sum(-1).mean(),
                      between_class=(mu_c[inverse] - m).square().sum(-1).mean())


def nc_metrics(means, sigma_w, W=None):
    """NC1-NC3 (Han, Papyan, Donoho 2022) from class means (C, d), within-class covariance Sigma_W (d, d)
    and optionally the classifier rows W (C, d) of the same classes. All tend to 0 under Neural Collapse.
    NC2 uses the unbiased std, as Papyan's reference code does."""
    C = means.shape[0]
    if C < 2:
        raise UsageError(f"Neural Collapse metrics need at least two classes, the analysed samples have {C}; "
                         f"raise --max_samples (GPT: --n_targets)")
    M = means.double() - means.double().mean(0)  # (C, d): centred by the mean of class means
    # NC1 = Tr(Sigma_W Sigma_B^+) / C with Sigma_B = M^T M / C = U diag(s^2 / C) U^T on its range
    U, s, _ = torch.linalg.svd(M.T, full_matrices=False)
    keep = s > s.max() * 1e-8
    U, s = U[:, keep], s[keep]
    out = {"nc1": ((U.T @ sigma_w.double() @ U).diagonal() / s.square()).sum().item()}

    def equinorm(rows):
        n = rows.norm(dim=1)
        return (n.std() / n.mean()).item()

    def equiangular(rows):
        u = F.normalize(rows, dim=1)
        off = ~torch.eye(C, dtype=torch.bool)
        return ((u @ u.T)[off] + 1 / (C - 1)).abs().mean().item()

    out.update(nc2_equinorm=equinorm(M), nc2_equiangular=equiangular(M))
    if W is not None:
        W = W.double()
        out.update(nc2_equinorm_w=equinorm(W), nc2_equiangular_w=equiangular(W),
                   nc3=(W / W.norm() - M / M.norm()).square().sum().item())
    return out


def nc4(x, means, W, b=None):
    """Fraction of samples where the classifier's argmax differs from the nearest class mean."""
    logits = x.double() @ W.double().T + (0 if b is None else b.double())
    nearest = torch.cdist(x.double(), means.double()).argmin(1)
    return (logits.argmax(1) != nearest).double().mean().item()


def neural_collapse(x, y, W=None, b=None):
    """NC1-NC4 of features x (n, d) with labels y. Only the classes present are used (W, b indexed alike)."""
    x = x.double()
    classes, inverse = y.unique(return_inverse=True)
    means = torch.stack([x[y == c].mean(0) for c in classes])
    dev = x - means[inverse]
    W = None if W is None else W[classes]
    out = nc_metrics(means, dev.T @ dev / len(x), W)
    if W is not None:
        out["nc4"] = nc4(x, means, W, None if b is None else b[classes])
    out["n_classes"], out["n_samples"] = len(classes), len(x)
    return out


class ClassStats:
    """Streaming per-class counts and sums, total sum of squares and scatter matrix of samples (n, d):
    gives class_anova() and the NC1-NC3 of neural_collapse() without keeping the samples."""

    def __init__(self, num_classes):
        self.C, self.shift, self.n = num_classes, None, 0

    def update(self, x, y):
        x = x.detach().double()
        y = y.to(x.device)
        if self.shift is None:
            d, kw = x.shape[-1], dict(dtype=torch.float64, device=x.device)
            self.shift = x.mean(0) if len(x) else torch.zeros(d, **kw)
            self.count, self.sum = torch.zeros(self.C, **kw), torch.zeros(self.C, d, **kw)
            self.sumsq, self.scatter = torch.zeros((), **kw), torch.zeros(d, d, **kw)
        x = x - self.shift
        self.n += len(x)
        self.count.index_add_(0, y, torch.ones_like(x[:, 0]))
        self.sum.index_add_(0, y, x)
        self.sumsq += x.square().sum()
        self.scatter += x.T @ x

    def _to_cpu(self):
        for k in ("shift", "count", "sum", "sumsq", "scatter"):
            setattr(self, k, getattr(self, k).cpu())

    def _means(self):
        self._to_cpu()
        seen = self.count > 0
        return seen, self.count[seen], self.sum[seen] / self.count[seen, None]  # shifted means

    def anova(self):
        _, count, mu = self._means()
        m = self.sum.sum(0) / self.n
        return _fractions(self.sumsq / self.n - m.square().sum(),
                          within_class=(self.sumsq - (count * mu.square().sum(-1)).sum()) / self.n,
                          between_class=(count * (mu - m).square().sum(-1)).sum() / self.n)

    def neural_collapse(self, W=None):
        seen, count, mu = self._means()
        sigma_w = (self.scatter - (mu.T * count) @ mu) / self.n
        out = nc_metrics(mu + self.shift, sigma_w, None if W is None else W[seen])
        out["n_classes"], out["n_samples"] = int(seen.sum()), self.n
        return out


# the fixed 2 x 3 map from centred 3-simplex coordinates to an equilateral triangle: column k is the vertex
# of class k (at 90, 210 and 330 degrees); the columns sum to 0, so the all-ones direction is dropped
TRIANGLE = torch.tensor([[0.0, -math.sqrt(3) / 2, math.sqrt(3) / 2], [1.0, -0.5, -0.5]], dtype=torch.float64)


def etf_projection(W3, x, center):
    """Simplex-ETF projection (Fisher, Meng, Papyan 2024): x (n, d) -> A Q (x - center), (n, 2), with Q = U V^T
    the polar factor of the centred classifier rows W3 (3, d). Under collapse the classes sit at the vertices."""
    Wc = W3.double() - W3.double().mean(0)
    U, _, Vh = torch.linalg.svd(Wc, full_matrices=False)  # U (3, 3), Vh (3, d)
    return (x.double() - center.double()) @ (U @ Vh).T @ TRIANGLE.T


def pca_2d(x):
    """Coordinates of the rows of x (n, d) on their top two principal components, and the explained ratios."""
    x = x.double() - x.double().mean(0)
    _, s, Vh = torch.linalg.svd(x, full_matrices=False)
    return x @ Vh[:2].T, (s[:2].square() / s.square().sum()).tolist()


def pca_rgb(patches, grid):
    """DINOv2-style map: the top three principal components of one image's patch tokens (N, d), each
    min-max scaled to [0, 1], as the RGB colour of its patch: (h, w, 3)."""
    x = patches.double() - patches.double().mean(0)
    _, _, Vh = torch.linalg.svd(x, full_matrices=False)
    c = x @ Vh[:3].T  # (N, <=3)
    c = F.pad(c, (0, 3 - c.shape[1]))
    lo, hi = c.min(0).values, c.max(0).values
    return ((c - lo) / (hi - lo).clamp(min=1e-12)).reshape(*grid, 3)

# -----------------------------------------------------------------------------
# data: the evaluation split each run used


def normalize_images(x, mean, std, img_size=None):
    """uint8 (B, C, H, W) -> float, as train_vit.normalise does at evaluation: scale to [0, 1], resize to the
    model's img_size (bilinear, antialiased) when it differs, then per channel (x - mean) / std."""
    x = x.float() / 255
    if img_size and x.shape[-1] != img_size:
        x = F.interpolate(x, size=(img_size, img_size), mode="bilinear", antialias=True)
    mean = torch.tensor(mean, dtype=torch.float32, device=x.device).view(1, -1, 1, 1)
    std = torch.tensor(std, dtype=torch.float32, device=x.device).view(1, -1, 1, 1)
    return (x - mean) / std


def subset(n, k, seed):
    """A fixed random subset of k of n indices (sorted), the same for every run analysed with this seed."""
    g = torch.Generator().manual_seed(seed)
    return torch.randperm(n, generator=g)[:k].sort().values


def load_eval_images(kind, ckpt, max_samples, seed):
    """The validation images a ViT or DINO run was evaluated on, a fixed random subset of at most max_samples:
    (x uint8 (N, C, H, W), y int64 (N,), class names or None, mean, std). The normalisation statistics are
    the ones the run stored in its checkpoint when it did (train_vit.py does), else the dataset's."""
    cfg = ckpt.get("config", {})
    if kind == "dino":  # train_dino's k-NN images, normalised with its training statistics as its probes do
        import train_dino
        data = train_dino.load_dataset({**train_dino.DEFAULTS, **cfg})
        x, y = train_dino.load_eval_images(cfg, data=data)
        idx = subset(len(x), min(max_samples, len(x)), seed)
        x, y, names, mean, std = x[idx], y[idx], data.get("classes"), data["mean"], data["std"]
    elif cfg.get("dataset") == "imagefolder":  # ImageNet-style folders: decode only the subset
        from train_vit import IMAGENET_MEAN, IMAGENET_STD, imagefolder_datasets
        _, val = imagefolder_datasets(cfg["data_dir"], ckpt["model_config"]["img_size"])
        idx = subset(len(val), min(max_samples, len(val)), seed).tolist()
        x, y = torch.stack([val[i][0] for i in idx]), torch.tensor([val.targets[i] for i in idx])
        names, mean, std = val.classes, IMAGENET_MEAN, IMAGENET_STD
    else:
        from train_vit import load_images
        data = load_images(cfg["dataset"], cfg.get("data_dir", "data"))
        x, y = data["val"]
        idx = subset(len(x), min(max_samples, len(x)), seed)
        x, y, names, mean, std = x[idx], y[idx], data["classes"], data["mean"], data["std"]
    return x, y.long(), ckpt.get("classes", names), ckpt.get("mean", mean), ckpt.get("std", std)


def load_windows(cfg, T, max_samples):
    """Up to max_samples non-overlapping windows of T + 1 tokens, evenly spread over the validation split."""
    from train_gpt import load_tokens
    data = load_tokens(cfg.get("data_dir", "data"), cfg["dataset"], "val")
    n = min(max_samples, (len(data) - 1) // T)
    if n < 1:
        raise UsageError(f"the validation split of {cfg['dataset']!r} has {len(data)} tokens, fewer than one window "
                         f"of seq_len+1 = {T + 1}; pass a smaller --seq_len")
    starts = [i * (len(data) - T - 1) // max(n - 1, 1) for i in range(n)]
    return torch.stack([torch.from_numpy(data[s: s + T + 1].astype("int64")) for s in starts])  # (n, T + 1)


def token_names(cfg, ids):
    """Readable names of token ids for the JSON (the run's tokenizer); the ids themselves when it is unavailable."""
    try:
        from train_gpt import get_tokenizer, load_meta
        tok = get_tokenizer(load_meta(cfg.get("data_dir", "data"), cfg["dataset"]))
        return [repr(tok.decode([i])) for i in ids]
    except Exception:  # names are a nicety (GPT-2 BPE needs tiktoken's downloaded vocabulary); ids are exact
        return [str(i) for i in ids]

# -----------------------------------------------------------------------------
# forward passes: one batched no-grad sweep per run, every statistic streamed


class Progress:
    def __init__(self, name, total):
        self.name, self.total, self.t0, self.last = name, total, time.time(), 0.0

    def __call__(self, done):
        now = time.time()
        if now - self.last > 5 or done == self.total:
            self.last = now
            print(f"{self.name}: {done}/{self.total} sequences, {now - self.t0:.1f}s", flush=True)


def layer_name(layer):
    return "final norm" if layer == -1 else f"after block {layer}"


def pick_layer(hs, layer):
    """hs = [after block 1, ..., after block L, final norm]; layer -1 is the final norm, k in 1..L block k."""
    return hs[-1] if layer == -1 else hs[layer - 1]


@torch.no_grad()
def image_pass(model, kind, x, y, num_classes, mean, std, opt, dev, name):
    """Stream every image statistic over the evaluation subset; returns the raw results and figure material."""
    L, cls_head = model.config.n_layer, kind == "vit" and model.config.num_classes > 0
    sel = (lambda h: h[:, 1:]) if opt["tokens"] == "patch" else (lambda h: h)
    layer_anova = [AnovaStats(num_classes) for _ in range(L + 1)]
    layer_cos = [MeanStats() for _ in range(L + 1)]
    spec = SpectrumStats()
    pooled, seq_means, kept, shown = [], [], [], []
    progress = Progress(name, len(x))
    for i in range(0, len(x), opt["batch_size"]):
        xb, yb = x[i: i + opt["batch_size"]], y[i: i + opt["batch_size"]]
        img = normalize_images(xb.to(dev), mean, std, model.config.img_size if kind == "vit" else None)
        hs = model.forward_features(img, all_layers=True)  # L + 1 tensors (B, 1 + N, d)
        for l, h in enumerate(hs):
            layer_anova[l].update(sel(h), yb)
            layer_cos[l].update(seq_cosine(sel(h)))
        h = pick_layer(hs, opt["layer"])
        spec.update(sel(h))
        if cls_head:
            pooled.append(model.pool(hs[-1]).double().cpu())
            seq_means.append(sel(hs[-1]).double().mean(1).cpu())
        n_keep = (opt["pca_images"] if kind == "vit" else opt["map_images"]) - sum(len(k) for k in kept)
        if n_keep > 0:
            kept.append((sel(h) if kind == "vit" else h[:, 1:])[:n_keep].float().cpu())
            shown.append(xb[:n_keep])
        progress(min(i + opt["batch_size"], len(x)))
    layers = [a.result() for a in layer_anova]
    res = {"layerwise": {"layer": [str(l) for l in range(1, L + 1)] + ["norm"],
                         "within_seq_frac": [a["within_seq_frac"] for a in layers],
                         "cosine": [c.result() for c in layer_cos], "anova": layers},
           "anova": pick_layer(layers, opt["layer"]), "spectrum": spec.result()}
    extra = {"kept": torch.cat(kept), "shown": torch.cat(shown)}
    if cls_head:
        extra.update(pooled=torch.cat(pooled), seq_means=torch.cat(seq_means))
    return res, extra


@torch.no_grad()
def gpt_pass(model, windows, opt, dev, name):
    """Stream within-window collapse per block, the spectrum and next-token-class statistics of one layer."""
    L, V = model.config.n_layer, model.config.vocab_size
    targets = windows[:, 1:]
    counts = torch.bincount(targets.reshape(-1), minlength=V)
    top = counts.argsort(descending=True)[:opt["n_targets"]]
    top = top[counts[top] > 0]
    cls_of = torch.full((max(V, int(targets.max()) + 1),), -1, dtype=torch.long)
    cls_of[top] = torch.arange(len(top))
    layer_anova = [AnovaStats(1) for _ in range(L + 1)]
    layer_cos = [MeanStats() for _ in range(L + 1)]
    spec, cls = SpectrumStats(), ClassStats(len(top))
    progress = Progress(name, len(windows))
    for i in range(0, len(windows), opt["batch_size"]):
        idx, tgt = windows[i: i + opt["batch_size"], :-1], targets[i: i + opt["batch_size"]]
        hs = model.forward_features(idx.to(dev), all_layers=True)
        zeros = torch.zeros(len(idx), dtype=torch.long)  # no sequence labels: only the within-sequence share counts
        for l, h in enumerate(hs):
            layer_anova[l].update(h, zeros)
            layer_cos[l].update(seq_cosine(h))
        h = pick_layer(hs, opt["layer"])
        spec.update(h)
        c = cls_of[tgt.reshape(-1)]
        cls.update(h.reshape(-1, h.shape[-1])[c.to(dev) >= 0], c[c >= 0])
        progress(min(i + opt["batch_size"], len(windows)))
    layers = [a.result() for a in layer_anova]
    nc = cls.neural_collapse()
    return {"layerwise": {"layer": [str(l) for l in range(1, L + 1)] + ["norm"],
                          "within_seq_frac": [a["within_seq_frac"] for a in layers],
                          "cosine": [c.result() for c in layer_cos]},
            "anova": dict(cls.anova(), n_classes=nc["n_classes"], n_tokens=cls.n,
                          target_share=counts[top].sum().item() / targets.numel()),
            "nc": {"nc1": nc["nc1"], "nc2_equinorm": nc["nc2_equinorm"], "nc2_equiangular": nc["nc2_equiangular"]},
            "spectrum": spec.result()}, top.tolist()

# -----------------------------------------------------------------------------
# figures


def _plt():
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    return plt


def _save(fig, path):
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    _plt().close(fig)
    return os.path.basename(path)


def _as_image(x):  # uint8 (C, H, W) -> what imshow wants
    return x[0].numpy() if x.shape[0] == 1 else x.permute(1, 2, 0).numpy()


def fig_collapse(res, title, path):
    plt = _plt()
    lw = res["layerwise"]
    fig, ax = plt.subplots(1, 2, figsize=(9, 3.4))
    x = range(len(lw["layer"]))
    ax[0].plot(x, lw["within_seq_frac"], "o-")
    ax[0].set(ylabel="WithinSeqVar / TotalVar", title="within-sequence variance share", ylim=(0, 1.02))
    ax[1].plot(x, lw["cosine"], "o-", color="C1")
    ax[1].set(ylabel="mean pairwise cosine", title="token similarity inside a sequence")
    for a in ax:
        a.set_xticks(list(x), lw["layer"])
        a.set_xlabel("after block")
        a.grid(alpha=0.3)
    fig.suptitle(title, fontsize=10)
    return _save(fig, path)


def fig_anova_layers(res, title, path):
    plt = _plt()
    lw = res["layerwise"]
    parts = [("within_seq", "within sequence"), ("within_class", "within class"), ("between_class", "between class")]
    fig, ax = plt.subplots(figsize=(5.5, 3.4))
    bottom = [0.0] * len(lw["layer"])
    for (key, label), color in zip(parts, ("#4c72b0", "#dd8452", "#55a868")):
        vals = [a[f"{key}_frac"] or 0.0 for a in lw["anova"]]
        ax.bar(lw["layer"], vals, bottom=bottom, label=label, color=color)
        bottom = [b + v for b, v in zip(bottom, vals)]
    ax.set(xlabel="after block", ylabel="fraction of total variance", ylim=(0, 1), title=title)
    ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.0, 1.0))
    return _save(fig, path)


def fig_spectrum(spec, title, path):
    plt = _plt()
    mean, std = torch.tensor(spec["lambda_mean"]), torch.tensor(spec["lambda_std"])
    keep = mean > mean[0] * 1e-12  # the centred rank is at most T - 1: drop the zero tail from the log plot
    j = torch.arange(1, len(mean) + 1)[keep]
    mean, std = mean[keep], std[keep]
    fig, ax = plt.subplots(figsize=(5.5, 3.6))
    ax.plot(j, mean, color="C0", label="mean $\\lambda_j$")
    ax.fill_between(j, (mean - std).clamp(min=mean.min().item() * 0.5), mean + std, alpha=0.25, color="C0",
                    label="$\\pm$ std over sequences")
    for a, ls in zip(ALPHAS, ("--", ":")):
        ax.axvline(spec[f"k_{a}"], color="k", ls=ls, lw=1, label=f"$k_{{{a}}}$ = {spec[f'k_{a}']:.1f}")
    ax.set(xscale="log", yscale="log", xlabel="j", ylabel="$\\lambda_j$ of within-sequence centred tokens",
           title=title)
    ax.legend(fontsize=8)
    return _save(fig, path)


def fig_pca(kept, labels, names, where, title, path):
    plt = _plt()
    n, T, d = kept.shape
    xy, ratio = pca_2d(kept.reshape(-1, d))
    lab = labels[:n].repeat_interleave(T)
    classes, counts = lab.unique(return_counts=True)
    shown = classes[counts.argsort(descending=True)[:10]].sort().values.tolist()  # ten colours stay readable
    fig, ax = plt.subplots(figsize=(6.2, 4.4))
    for k, c in enumerate(shown):
        m = lab == c
        ax.scatter(xy[m, 0], xy[m, 1], s=4, alpha=0.6, color=plt.cm.tab10(k), label=names[c] if names else str(c))
    note = f", {len(shown)} of {len(classes)} classes shown" if len(shown) < len(classes) else ""
    ax.set(xlabel=f"PC1 ({ratio[0]:.0%})", ylabel=f"PC2 ({ratio[1]:.0%})",
           title=f"{title}\ntokens ({where}) of {n} images{note}")
    ax.legend(fontsize=7, markerscale=3, loc="upper left", bbox_to_anchor=(1.0, 1.0))
    return _save(fig, path)


def fig_etf(panels, names, classes, title, path):
    """panels: [(subtitle, projected features (n, 2), labels (n,))] of the three chosen classes."""
    plt = _plt()
    fig, axes = plt.subplots(1, len(panels), figsize=(4.4 * len(panels), 4.2), squeeze=False)
    for ax, (sub, xy, y) in zip(axes[0], panels):
        radius = torch.stack([xy[y == c].mean(0) for c in classes]).norm(dim=1).mean().item()
        tri = TRIANGLE.T * radius
        ax.fill(tri[:, 0], tri[:, 1], fill=False, ls="--", color="gray", lw=1)
        for k, c in enumerate(classes):
            m = y == c
            ax.scatter(xy[m, 0], xy[m, 1], s=6, alpha=0.6, color=plt.cm.tab10(k), label=names[c] if names else str(c))
        ax.set_aspect("equal")
        ax.set_title(sub, fontsize=9)
        ax.legend(fontsize=7, markerscale=3)
    fig.suptitle(title + "\n(triangle: classifier directions, vertices scaled to the mean class radius)", fontsize=9)
    return _save(fig, path)


def fig_lm_anova(res, title, path):
    plt = _plt()
    a = res["anova"]
    fig, ax = plt.subplots(figsize=(4.2, 3.4))
    ax.bar(["within class", "between class"], [a["within_class_frac"] or 0, a["between_class_frac"] or 0],
           color=["#dd8452", "#55a868"])
    ax.set(ylabel="fraction of total variance", ylim=(0, 1),
           title=f"next-token classes: top {a['n_classes']} targets\nNC1 = {res['nc']['nc1']:.3g}")
    fig.suptitle(title, fontsize=9)
    return _save(fig, path)


def fig_pca_maps(kept, shown, grid, title, path):
    plt = _plt()
    n, per_row = len(kept), 4
    rows = math.ceil(n / per_row)
    fig, axes = plt.subplots(rows, 2 * per_row, figsize=(2 * per_row * 1.3, rows * 1.45), squeeze=False)
    for ax in axes.flat:
        ax.axis("off")
    for i in range(n):
        a, b = axes[i // per_row, 2 * (i % per_row)], axes[i // per_row, 2 * (i % per_row) + 1]
        img = _as_image(shown[i])
        a.imshow(img, cmap="gray", vmin=0, vmax=255) if img.ndim == 2 else a.imshow(img)
        b.imshow(pca_rgb(kept[i], grid).numpy(), interpolation="nearest")
    fig.suptitle(title + "   (image | top-3 PCs of its patch tokens as RGB)", fontsize=9)
    return _save(fig, path)

# -----------------------------------------------------------------------------
# one run


def final_metric(run_dir, kind):
    """The last value of the run's headline metric in log.jsonl (ViT val_acc, GPT val_loss, DINO knn_acc)."""
    key, _ = FINAL_METRIC[kind]
    found = None
    path = os.path.join(run_dir, "log.jsonl")
    if os.path.isfile(path):
        with open(path) as f:
            for line in f:
                try:
                    rec = json.loads(line)
                except json.JSONDecodeError:
                    continue  # a line cut short by an interrupted run
                if isinstance(rec, dict) and isinstance(rec.get(key), (int, float)):
                    found = {"name": key, "value": float(rec[key]), "step": rec.get("step")}
    return found or {"name": key, "value": None, "step": None}


def lap_label(n_lap):
    """(x position, label): the count itself, or for a per-layer list its mean and the list."""
    if isinstance(n_lap, int):
        return float(n_lap), str(n_lap)
    if len(set(n_lap)) == 1:
        return float(n_lap[0]), str(n_lap[0])
    mean = sum(n_lap) / len(n_lap)
    return mean, f"{mean:g} {list(n_lap)}"


def analyze_run(run, opt, out_dir, dev):
    """Load the run's checkpoint and evaluation data, stream the statistics, draw, write analysis.json."""
    path = run if run.endswith(".pt") else os.path.join(run, "ckpt.pt")
    ckpt = load_checkpoint(path)
    kind = ckpt.get("kind")
    if kind not in FINAL_METRIC:
        raise UsageError(f"{path}: unknown checkpoint kind {kind!r}; expected one of {sorted(FINAL_METRIC)} "
                         f"(checkpoints written by train_vit.py, train_gpt.py or train_dino.py)")
    cfg = ckpt.get("config", {})
    model = load_model(ckpt).to(dev).eval()
    if opt["layer"] != -1 and not 1 <= opt["layer"] <= model.config.n_layer:
        raise UsageError(f"--layer={opt['layer']}: use -1 (final norm) or a block number from 1 to "
                         f"{model.config.n_layer}")
    run_dir = os.path.dirname(path)
    name = os.path.basename(os.path.normpath(run_dir)) or run_dir
    n_lap = model.config.n_lap
    x_lap, label = lap_label(n_lap)
    res = {"run": run_dir, "kind": kind, "n_lap": n_lap, "n_lap_mean": x_lap, "n_lap_label": label,
           "n_head": model.config.n_head, "seed": cfg.get("seed"), "step": ckpt.get("step"),
           "final_metric": final_metric(run_dir, kind), "train_config": cfg}
    title = f"{name} ({kind}, n_lap={label})"
    os.makedirs(out_dir, exist_ok=True)
    figs = []
    print(f"analysing {path}: {kind}, n_lap={label}, {model.num_params() / 1e6:.2f}M params, on {dev}", flush=True)

    if kind == "gpt":
        T = opt["seq_len"] or cfg.get("block_size") or model.config.block_size
        if T > model.config.block_size:
            raise UsageError(f"--seq_len={T} is longer than the model's block_size={model.config.block_size}")
        windows = load_windows(cfg, T, opt["max_samples"])
        r, top = gpt_pass(model, windows, opt, dev, name)
        res.update(r)
        res["anova"]["targets"] = top
        res["anova"]["target_names"] = token_names(cfg, top)
        res["settings"] = dict(layer=opt["layer"], tokens="all positions of each window", seq_len=T,
                               n_samples=len(windows), n_targets=opt["n_targets"], dataset=cfg.get("dataset"))
        figs.append(fig_spectrum(res["spectrum"], title, os.path.join(out_dir, "spectrum.png")))
        figs.append(fig_collapse(res, title, os.path.join(out_dir, "collapse.png")))
        figs.append(fig_lm_anova(res, title, os.path.join(out_dir, "anova.png")))
    else:
        x, y, names, mean, std = load_eval_images(kind, ckpt, opt["max_samples"], opt["seed"])
        num_classes = max(int(y.max()) + 1, model.config.num_classes)
        r, extra = image_pass(model, kind, x, y, num_classes, mean, std, opt, dev, name)
        res.update(r)
        res["settings"] = dict(layer=opt["layer"], tokens="patch tokens only" if opt["tokens"] == "patch"
                               else "patch tokens and the CLS token", n_samples=len(x), dataset=cfg.get("dataset"),
                               normalisation=dict(mean=mean, std=std))
        figs.append(fig_collapse(res, title, os.path.join(out_dir, "collapse.png")))
        figs.append(fig_anova_layers(res, title, os.path.join(out_dir, "anova.png")))
        figs.append(fig_spectrum(res["spectrum"], title, os.path.join(out_dir, "spectrum.png")))
        if kind == "vit":
            figs.append(fig_pca(extra["kept"], y, names, layer_name(opt["layer"]), title,
                                os.path.join(out_dir, "pca.png")))
            res["settings"]["pca_images"] = len(extra["kept"])
            if "pooled" in extra:
                figs += classifier_analyses(model, extra, y, names, opt, res, title, out_dir)
        else:
            grid = (x.shape[-2] // model.config.patch_size, x.shape[-1] // model.config.patch_size)
            figs.append(fig_pca_maps(extra["kept"], extra["shown"], grid, title, os.path.join(out_dir, "pca_maps.png")))
            res["settings"]["map_images"] = len(extra["kept"])
    res["figures"], res["out_dir"] = figs, out_dir
    write_json(res, os.path.join(out_dir, "analysis.json"))
    with open(os.path.join(out_dir, "summary.md"), "w") as f:
        f.write(run_summary(res))
    print(f"wrote {out_dir}: analysis.json, summary.md, {', '.join(figs)}", flush=True)
    return res


def classifier_analyses(model, extra, y, names, opt, res, title, out_dir):
    """NC1-NC4 with the trained head, on the pooled features and on the token means; the ETF projection."""
    W, b = model.head.weight.detach().double().cpu(), model.head.bias
    b = None if b is None else b.detach().double().cpu()
    pooling = "CLS token" if model.config.pooling == "cls" else "mean of patch tokens"
    res["nc"] = {"pooled": dict(neural_collapse(extra["pooled"], y, W, b), features=f"pooled ({pooling}), final norm"),
                 "seq_means": dict(neural_collapse(extra["seq_means"], y, W, b),
                                   features=f"mean of the {res['settings']['tokens']}, final norm")}
    classes = opt["etf_classes"]
    if not set(classes) <= set(y.tolist()):
        raise UsageError(f"--etf_classes={classes}: not every class occurs among the {len(y)} analysed images; "
                         f"choose others or raise --max_samples")
    W3, m = W[classes], torch.isin(y, torch.tensor(classes))
    res["etf"] = {"classes": classes, "classifier_rows_2d": etf_projection(W3, W3, W3.mean(0)).tolist()}
    panels = []
    for key, sub in (("pooled", f"pooled features ({pooling})"), ("seq_means", "token means")):
        x, yy = extra[key][m], y[m]
        xy = etf_projection(W3, x, torch.stack([x[yy == c].mean(0) for c in classes]).mean(0))
        res["etf"][key] = {"class_means_2d": [xy[yy == c].mean(0).tolist() for c in classes]}
        panels.append((sub, xy, yy))
    return [fig_etf(panels, names, classes, title, os.path.join(out_dir, "etf.png"))]


def _clean(obj):
    """JSON-safe: tensors to lists, NaN and inf to null."""
    if isinstance(obj, dict):
        return {str(k): _clean(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_clean(v) for v in obj]
    if isinstance(obj, torch.Tensor):
        return _clean(obj.tolist())
    if isinstance(obj, float) and not math.isfinite(obj):
        return None
    return obj


def write_json(obj, path):
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        json.dump(_clean(obj), f, indent=1, allow_nan=False)
    os.replace(tmp, path)


def _fmt(v, spec=".3f"):
    return "n/a" if v is None else format(v, spec)


def run_summary(res):
    s, a, sp = res["settings"], res["anova"], res["spectrum"]
    fm = res["final_metric"]
    lines = [f"# {res['run']}: {res['kind']}, n_lap = {res['n_lap_label']} of {res['n_head']} heads", "",
             f"Final {fm['name']} from log.jsonl: {_fmt(fm['value'], '.4f')} (step {fm['step']}).", "",
             f"Settings: {s['n_samples']} sequences of the validation split, layer {s['layer']} "
             f"(-1 = final norm), tokens: {s['tokens']}.", "", "| quantity | value |", "|---|---|"]
    for key in ("within_seq_frac", "within_class_frac", "between_class_frac"):
        if key in a:
            lines.append(f"| ANOVA {key.replace('_', ' ')} | {_fmt(a[key])} |")
    lines.append(f"| within-seq share after block 1 -> last block | "
                 f"{_fmt(res['layerwise']['within_seq_frac'][0])} -> {_fmt(res['layerwise']['within_seq_frac'][-2])} |")
    lines += [f"| k_{al} (mean over sequences) | {sp[f'k_{al}']:.1f} |" for al in ALPHAS]
    names = dict(nc1="NC1", nc2_equinorm="NC2 equinorm of class means", nc2_equinorm_w="NC2 equinorm of W",
                 nc2_equiangular="NC2 equiangularity of class means", nc2_equiangular_w="NC2 equiangularity of W",
                 nc3="NC3 self-duality", nc4="NC4 classifier vs nearest class mean")
    for key, nc in ({"next-token classes": res["nc"]} if res["kind"] == "gpt" else res.get("nc", {})).items():
        lines += [f"| {label} ({key}) | {nc[m]:.4g} |" for m, label in names.items()
                  if m in nc and not (m.endswith("_w") and key == "seq_means")]  # W's own metrics once
    lines += ["", "Figures: " + ", ".join(res["figures"]), ""]
    return "\n".join(lines)

# -----------------------------------------------------------------------------
# several runs: the comparison figures against the number of Laplacian heads


def _mean_std(values):
    v = torch.tensor([x for x in values if x is not None], dtype=torch.float64)
    if len(v) == 0:
        return None, None, 0
    return v.mean().item(), (v.std().item() if len(v) > 1 else 0.0), len(v)


def _mean_curve(curves):
    """Mean of several runs' curves (lists); runs of different sizes are cut to the shortest."""
    n = min(len(c) for c in curves)
    return torch.tensor([[v if v is not None else float("nan") for v in c[:n]] for c in curves],
                        dtype=torch.float64).mean(0)


def compare(results, out_dir, kind):
    """Group runs of one kind by n_lap (seeds pooled), write comparison figures and numbers."""
    plt = _plt()
    groups = {}
    for r in results:
        groups.setdefault(r["n_lap_label"], []).append(r)
    order = sorted(groups, key=lambda k: (groups[k][0]["n_lap_mean"], k))
    xs = [groups[k][0]["n_lap_mean"] for k in order]
    if len(set(xs)) < len(xs):  # two per-layer lists with the same mean: plot them side by side instead
        xs = list(range(len(order)))
    cmap = plt.cm.viridis
    top = max(r["n_head"] for r in results)
    color = {k: cmap(groups[k][0]["n_lap_mean"] / max(top, 1) * 0.9) for k in order}
    p = f"compare_{kind}_"
    figs, table = [], []
    metric, better = FINAL_METRIC[kind]
    part_keys = [k for k in ("within_seq_frac", "within_class_frac", "between_class_frac") if k in results[0]["anova"]]
    for k in order:
        g = groups[k]
        row = {"n_lap": k, "n_lap_mean": g[0]["n_lap_mean"], "runs": [r["run"] for r in g],
               "seeds": [r["seed"] for r in g]}
        row[metric] = dict(zip(("mean", "std", "n"), _mean_std(r["final_metric"]["value"] for r in g)))
        for key in part_keys + [f"k_{a}" for a in ALPHAS]:
            vals = [(r["anova"] if key in r["anova"] else r["spectrum"])[key] for r in g]
            row[key] = dict(zip(("mean", "std", "n"), _mean_std(vals)))
        table.append(row)

    # final metric vs n_lap
    fig, ax = plt.subplots(figsize=(5, 3.6))
    pts = [(x, row[metric]) for x, row in zip(xs, table) if row[metric]["mean"] is not None]
    if pts:
        ax.errorbar([x for x, _ in pts], [m["mean"] for _, m in pts], yerr=[m["std"] for _, m in pts], fmt="o-",
                    capsize=3)
    ax.set(xlabel="Laplacian heads per layer", ylabel=f"final {metric} ({better} is better)",
           title=f"{kind}: {metric} vs n_lap (mean $\\pm$ std over seeds)")
    ax.set_xticks(xs, order, rotation=30 if any(" " in k for k in order) else 0)
    ax.grid(alpha=0.3)
    figs.append(_save(fig, os.path.join(out_dir, p + "metric.png")))

    # ANOVA stacked bars vs n_lap
    fig, ax = plt.subplots(figsize=(6.2, 3.6))
    bottom = [0.0] * len(order)
    for key, c in zip(part_keys, ("#4c72b0", "#dd8452", "#55a868")[-len(part_keys):]):
        vals = [row[key]["mean"] or 0.0 for row in table]
        ax.bar(range(len(order)), vals, bottom=bottom, color=c, label=key[:-5].replace("_", " "))
        bottom = [b + v for b, v in zip(bottom, vals)]
    ax.set_xticks(range(len(order)), order, rotation=30 if any(" " in k for k in order) else 0)
    ax.set(xlabel="Laplacian heads per layer", ylabel="fraction of total variance", ylim=(0, 1),
           title=f"{kind}: ANOVA, {layer_name(results[0]['settings']['layer'])}"
           + (", next-token classes" if kind == "gpt" else ""))
    ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.0, 1.0))
    figs.append(_save(fig, os.path.join(out_dir, p + "anova.png")))

    # k_alpha vs n_lap
    fig, ax = plt.subplots(figsize=(5, 3.6))
    for a, mk in zip(ALPHAS, ("o-", "s--")):
        ax.errorbar(xs, [row[f"k_{a}"]["mean"] for row in table], yerr=[row[f"k_{a}"]["std"] for row in table],
                    fmt=mk, capsize=3, label=f"$k_{{{a}}}$")
    ax.set_xticks(xs, order, rotation=30 if any(" " in k for k in order) else 0)
    ax.set(xlabel="Laplacian heads per layer", ylabel="principal components needed",
           title=f"{kind}: k_alpha of within-sequence centred tokens")
    ax.legend(fontsize=8)
    ax.grid(alpha=0.3)
    figs.append(_save(fig, os.path.join(out_dir, p + "kalpha.png")))

    # spectra overlaid (mean over seeds)
    fig, ax = plt.subplots(figsize=(5.5, 3.8))
    for k in order:
        lam = _mean_curve([r["spectrum"]["lambda_mean"] for r in groups[k]])
        lam = lam[lam > lam[0] * 1e-12]
        ax.plot(range(1, len(lam) + 1), lam, color=color[k], label=f"n_lap={k}")
    ax.set(xscale="log", yscale="log", xlabel="j", ylabel="mean $\\lambda_j$", title=f"{kind}: spectra")
    ax.legend(fontsize=7)
    figs.append(_save(fig, os.path.join(out_dir, p + "spectra.png")))

    # layerwise collapse overlaid
    fig, ax = plt.subplots(1, 2, figsize=(9.5, 3.6))
    for k in order:
        g = groups[k]
        for a, key in zip(ax, ("within_seq_frac", "cosine")):
            vals = _mean_curve([r["layerwise"][key] for r in g])
            a.plot(range(len(vals)), vals, "o-", ms=3, color=color[k], label=f"n_lap={k}")
    labels = max((r["layerwise"]["layer"] for r in results), key=len)
    for a, yl in zip(ax, ("WithinSeqVar / TotalVar", "mean pairwise cosine")):
        a.set_xticks(range(len(labels)), labels)
        a.set(xlabel="after block", ylabel=yl)
        a.grid(alpha=0.3)
    ax[0].legend(fontsize=7)
    fig.suptitle(f"{kind}: layerwise within-sequence collapse", fontsize=10)
    figs.append(_save(fig, os.path.join(out_dir, p + "collapse.png")))
    return {"kind": kind, "metric": metric, "groups": table, "figures": figs}


# settings that do not change what a run learns (paths, logging, hardware), ignored when comparing runs
OPERATIONAL = {"out_dir", "data_dir", "resume", "device", "dtype", "compile", "num_workers", "log_interval",
               "eval_interval", "ckpt_interval", "stop_at_step", "max_steps", "eval_only", "sample_from"}


def differing_settings(configs):
    """Training settings, other than n_lap and seed, that all the compared runs record but set differently."""
    keys = set.intersection(*(set(c) for c in configs)) - OPERATIONAL - {"n_lap", "seed"}
    return sorted(k for k in keys if len({repr(c[k]) for c in configs}) > 1)

# -----------------------------------------------------------------------------
# main


def main(argv=None):
    argv = sys.argv[1:] if argv is None else argv
    for a in argv:
        if not a.startswith("--") and not os.path.exists(a):
            raise UsageError(f"{a}: no such run directory, checkpoint or config file")
    runs = [a for a in argv if not a.startswith("--") and (os.path.isdir(a) or a.endswith(".pt"))]
    opt = parse_args(DEFAULTS, [a for a in argv if a not in runs])
    if not runs:
        raise UsageError("give one or more run directories (each with ckpt.pt and log.jsonl): "
                         "python analyze.py out/vit [out/vit-k4 ...] [--key=value ...]")
    if opt["tokens"] not in ("patch", "all"):
        raise UsageError(f"--tokens={opt['tokens']!r}: use 'patch' (patch tokens only) or 'all' (with the CLS token)")
    classes = opt["etf_classes"]
    if len(classes) != 3 or len(set(classes)) != 3 or not all(isinstance(c, int) and c >= 0 for c in classes):
        raise UsageError(f"--etf_classes={classes}: give three different class indices, e.g. --etf_classes=[0,1,2]")
    for key, least in (("max_samples", 1), ("batch_size", 1), ("n_targets", 2)):
        if opt[key] < least:
            raise UsageError(f"--{key}={opt[key]}: must be at least {least}")
    dev = ("cuda" if torch.cuda.is_available() else "cpu") if opt["device"] == "auto" else opt["device"]
    out_root = opt["out"]
    if not out_root:
        parent = os.path.commonpath([os.path.abspath(os.path.dirname(r) if r.endswith(".pt") else r) for r in runs])
        out_root = (os.path.join(parent, "analysis") if len(runs) == 1 or parent != os.getcwd()
                    else "out-analysis")
    print("analyze.py settings: " + " ".join(f"{k}={v!r}" for k, v in {**opt, "device": dev}.items()), flush=True)

    results, used = [], set()
    for run in runs:
        sub = out_root
        if len(runs) > 1:  # one folder per run under the comparison folder
            base = os.path.basename(os.path.normpath(os.path.dirname(run) if run.endswith(".pt") else run))
            sub, n = base, 1
            while sub in used:
                n, sub = n + 1, f"{base}-{n + 1}"
            used.add(sub)
            sub = os.path.join(out_root, sub)
        results.append(analyze_run(run, opt, sub, dev))
    if len(runs) == 1:
        r = results[0]
        within_seq = pick_layer(r["layerwise"]["within_seq_frac"], opt["layer"])
        nc1 = r["nc"]["nc1"] if r["kind"] == "gpt" else r.get("nc", {}).get("pooled", {}).get("nc1")
        print(f"RESULT kind={r['kind']} n_lap={r['n_lap_label'].replace(' ', '')} "
              f"within_seq_frac={_fmt(within_seq, '.4f')} "
              f"k_0.9={r['spectrum']['k_0.9']:.2f} k_0.99={r['spectrum']['k_0.99']:.2f}"
              + (f" nc1={nc1:.4g}" if nc1 is not None else "") + f" out={out_root}")
        return

    comparisons = []
    for kind in sorted({r["kind"] for r in results}):
        group = [r for r in results if r["kind"] == kind]
        if len(group) < 2:
            print(f"only one {kind} run: no {kind} comparison")
            continue
        c = compare(group, out_root, kind)
        c["differing_settings"] = differing_settings([r["train_config"] for r in group])
        if c["differing_settings"]:
            print(f"note: the {kind} runs also differ in {', '.join(c['differing_settings'])}; "
                  f"the comparison groups them by n_lap only")
        comparisons.append(c)
    write_json({"runs": results, "comparisons": comparisons}, os.path.join(out_root, "analysis.json"))
    with open(os.path.join(out_root, "summary.md"), "w") as f:
        f.write(compare_summary(comparisons, results))
    print(f"wrote {out_root}: analysis.json, summary.md, " + ", ".join(f for c in comparisons for f in c["figures"]))
    print(f"RESULT runs={len(results)} comparisons={','.join(c['kind'] for c in comparisons) or 'none'} out={out_root}")


def compare_summary(comparisons, results):
    lines = ["# Comparison over n_lap", ""]
    for c in comparisons:
        keys = [k for k in ("within_seq_frac", "within_class_frac", "between_class_frac") if k in c["groups"][0]]
        lines += [f"## {c['kind']} ({sum(len(g['runs']) for g in c['groups'])} runs)", ""]
        if c["differing_settings"]:
            lines += [f"Note: these runs also differ in {', '.join(c['differing_settings'])}.", ""]
        lines += ["| n_lap | runs | " + c["metric"] + " | " + " | ".join(keys) + " | k_0.9 | k_0.99 |",
                  "|---" * (5 + len(keys)) + "|"]
        for g in c["groups"]:
            ms = lambda d: ("n/a" if d["mean"] is None else f"{d['mean']:.4g}" if d["n"] == 1
                            else f"{d['mean']:.4g} +- {d['std']:.2g}")
            lines.append(f"| {g['n_lap']} | {len(g['runs'])} | {ms(g[c['metric']])} | "
                         + " | ".join(ms(g[k]) for k in keys) + f" | {ms(g['k_0.9'])} | {ms(g['k_0.99'])} |")
        lines += ["", "Figures: " + ", ".join(c["figures"]), ""]
    lines += ["Per-run analyses (analysis.json, summary.md, figures): "
              + ", ".join(f"{os.path.basename(r['out_dir'])}/" for r in results), ""]
    return "\n".join(lines)


if __name__ == "__main__":
    run_main(main)

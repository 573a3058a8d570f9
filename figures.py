"""
The figures of the token geometry, and the files beside them: what analyze.py draws and writes for one run, and
results/report.py and results/verdict.py for runs compared. Every figure is a PNG with labelled axes and one line
saying what to look for (LOOK_FOR).
"""

import json
import math
import os
import textwrap

import torch
import torch.nn.functional as F

import common
import geometry
from common import UsageError

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
    for axis, key, ylabel in zip(ax, ("within_seq_frac", "cosine"), ylabels):
        for name, color, layers in curves:
            axis.plot(range(len(layers[key])), layers[key], "o-", ms=4, color=color, label=name)
        axis.set(xticks=range(len(labels)), xticklabels=labels, xlabel="after block", ylabel=ylabel)
        axis.grid(alpha=0.3)
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
        for alpha, style in zip(geometry.ALPHAS, ("--", ":")):
            k = spec[f"k_{alpha}"]
            ax.axvline(k, color="k", ls=style, lw=1, label=f"$k_{{{alpha}}}$ = {k:.1f}: the fewest directions that "
                       f"hold {alpha:.0%} of\na sequence's variance (mean over sequences)")
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
    for top, bottom, patches, img in zip(*axes, kept, shown):
        top.imshow(img[0] if len(img) == 1 else img.permute(1, 2, 0), cmap="gray", vmin=0, vmax=255)  # RGB: no cmap
        bottom.imshow(pca_rgb(patches, grid).numpy(), interpolation="nearest")
        top.axis("off")
        bottom.axis("off")
    fig.suptitle(title + "\nimages (top), top-3 PCs of their patch tokens as RGB (bottom)\n" + LOOK_FOR["pca_maps"],
                 fontsize=8)
    return save_figure(fig, path)

def fig_etf(panels, names, classes, title, points, plane, out_dir):  # panels as fig_scatter's
    return fig_scatter(panels, names, classes, f"{title}\neach point: {points}, seen in the plane of {plane}\n(triangle: "
                       "the simplex ETF, at the mean class radius)", os.path.join(out_dir, "etf.png"),
                       ("first axis of that plane", "second axis"), LOOK_FOR["etf"])

# the PCA behind the token scatter and the DINO feature maps

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
    lo = c.min(0).values
    hi = c.max(0).values
    return ((c - lo) / (hi - lo).clamp(min=1e-12)).reshape(*grid, 3)

# ---------------------------------------------------------------- the files: analysis.json and summary.md

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

"""
The figures of the token geometry, and the files beside them: what analyze.py draws and writes for one run, and
results/report.py and results/verdict.py for runs compared. Every figure is a PNG with labelled axes and one line
saying what to look for (LOOK_FOR). The training curves read log.jsonl (read_log) and draw a run in front of the
committed runs of its recipe (same_recipe, the rule by which the report compares runs).
"""

import glob
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
    "curves": "shaded: min-max over the seeds, thin line: their mean; look for: the run (black) inside the band of its "
              "recipe, and where the bands of different n_lap part",
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

def fig_random_stacks(curves, title, path):  # exercise 4: curves {(n_lap, residual): share after each layer}
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(6, 4))
    for (n_lap, residual), curve in curves.items():  # markers tell apart the curves that lie on top of each other
        name = f"{'Laplacian' if n_lap else 'attention'} heads, {'x + attn(x)' if residual else 'attn(x)'}"
        ax.semilogy(curve, ("C1" if n_lap else "C0") + ("--" if residual else "-"), marker="x" if residual else "o",
                    markersize=7 if residual else 4, markevery=max(1, len(curve) // 12),
                    fillstyle="none" if residual else "full", label=name)
    depth = max(len(curve) for curve in curves.values()) - 1
    ax.annotate("both Laplacian stacks stay near 1", (depth, 1.0), xytext=(0, -14), textcoords="offset points",
                ha="right", va="top", color="C1")
    ax.set(xlabel="layer L (0: the random input tokens)", ylabel="WithinSeqVar / TotalVar", title=title)
    ax.legend()
    ax.grid(alpha=0.3)
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    save_figure(fig, path)
    return path

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

# ---------------------------------------------------------------- training curves: a run beside the committed runs of its recipe

RESULTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results")  # the committed runs: <set>/<run>/
# settings that do not change what a run learns (paths, logging, hardware), ignored when comparing runs
OPERATIONAL = {"out_dir", "data_dir", "resume", "device", "dtype", "compile", "compile_model", "num_workers",
               "log_interval", "eval_interval", "ckpt_interval", "stop_at_step", "max_steps", "eval_only", "sample_from",
               "cpu_procs", "cpu_threads"}
# how the processes split one global batch (batch_size is per process): runs of one recipe may set these differently
BATCH_SPLIT = ("batch_size", "grad_accum", "total_batch_size")
# the curves against the step: the losses, then each kind's headline validation metric (results/report.py's)
CURVE_LOSSES = ("train_loss", "val_loss")
CURVE_METRIC = {"vit": "val_acc", "gpt": "val_bpb", "dino": "knn_acc"}

def is_number(value):  # a finite int or float of a log record (None: JSON's null, or a NaN that read_log turned to None)
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)

def read_log(run_dir):
    """The records of run_dir/log.jsonl in the order of their steps, read as every version of the scripts wrote them:
    NaN and Infinity (DINO's step 0 before the logs became strict JSON) read as None, as null does, a line cut short by
    an interrupted run is skipped, DINO's older `loss` is `train_loss`, and a step logged twice (DINO's final probes) is
    one record, whose numbers win over None. [] without a log."""
    path = os.path.join(run_dir, common.LOG)
    by_step = {}
    for line in open(path) if os.path.isfile(path) else []:
        try:
            record = json.loads(line, parse_constant=lambda token: None)
        except json.JSONDecodeError:
            continue
        if isinstance(record, dict) and isinstance(record.get("step"), int):
            if "loss" in record and "train_loss" not in record:
                record["train_loss"] = record.pop("loss")
            merged = by_step.setdefault(record["step"], {})
            merged.update({k: v for k, v in record.items() if v is not None or k not in merged})
    return [by_step[step] for step in sorted(by_step)]

def differing_settings(configs, ignored=()):
    """Training settings, other than n_lap, seed and `ignored`, that all the compared runs record but set differently."""
    keys = set.intersection(*(set(c) for c in configs)) - OPERATIONAL - {"n_lap", "seed"} - set(ignored)
    return sorted(k for k in keys if len({repr(c[k]) for c in configs}) > 1)

def data_per_step(log):
    """What one optimizer step consumes, read off a log: tokens (GPT) or epochs (ViT, DINO) per step, at the last record
    that says (the most digits); None before one does. Runs of one recipe agree on it when their global batches agree."""
    for record in reversed(log):
        for key in ("tokens", "epoch"):
            if record["step"] > 0 and is_number(record.get(key)) and record[key] > 0:
                return record[key] / record["step"]
    return None

def in_present_terms(config):
    """A run's options as the scripts name them now: a run from before --holdout trained on the whole training split,
    and DINO's lr was a rate per 256 images, scaled to its batch_size, then global (its clip_grad was grad_clip)."""
    config = dict(config)
    config.setdefault("holdout", 0.0)
    if "teacher_temp" in config and "clip_grad" not in config:
        config["lr"] = config["lr"] * config["batch_size"] / 256
        config["clip_grad"] = config.pop("grad_clip", None)
    return config

def same_recipe(config, log, other_config, other_log):
    """Whether two runs (options and log.jsonl records) trained one recipe: the same options apart from n_lap, seed,
    the operational ones and how processes split the global batch, by the report's rule (differing_settings: an
    option, or a GPT's corpus, that one run does not record compares with any; older runs in_present_terms), and the
    same global batch (data_per_step; unknown before a step is logged)."""
    settings = []
    for c, records in ((config, log), (other_config, other_log)):
        corpus = [r["corpus"] for r in records if r.get("corpus", "unknown") != "unknown"]
        settings.append(dict(in_present_terms(c), **({"corpus": corpus[-1]} if corpus else {})))
    if differing_settings(settings, BATCH_SPLIT):
        return False
    mine = data_per_step(log)
    theirs = data_per_step(other_log)
    return mine is None or theirs is None or math.isclose(mine, theirs, rel_tol=1e-3)

def reference_runs(kind, config, log, root=RESULTS):
    """{set: {n_lap label: [log]}} of the committed runs root/<set>/<run>/ (their options: analysis.json's
    train_config) of this kind that trained the recipe of the run with these options and log (same_recipe)."""
    if not config:  # a checkpoint without its options: nothing to compare
        return {}
    sets = {}
    for path in sorted(glob.glob(os.path.join(glob.escape(root), "*", "*", common.ANALYSIS))):
        with open(path) as f:
            analysis = json.load(f)
        run_dir = os.path.dirname(path)
        other_log = read_log(run_dir)
        if analysis.get("kind") == kind and same_recipe(config, log, analysis.get("train_config", {}), other_log):
            runs = sets.setdefault(os.path.basename(os.path.dirname(run_dir)), {})
            runs.setdefault(analysis["n_lap_label"], []).append(other_log)
    return sets

def curve_band(logs, key):
    """{steps, mean, min, max} of `key` over the logs (seeds), at the steps where every log holds a number for it."""
    values = [{r["step"]: r[key] for r in log if is_number(r.get(key))} for log in logs]
    steps = sorted(set.intersection(*(set(v) for v in values))) if values else []
    seeds = [[v[step] for v in values] for step in steps]
    return {"steps": steps, "mean": [sum(s) / len(s) for s in seeds], "min": [min(s) for s in seeds],
            "max": [max(s) for s in seeds]}

def fig_curves(kind, run, bands, title, path):
    """curves.png: against the optimizer step, the training and validation losses, the validation metric CURVE_METRIC
    and (thin, narrow) the learning rate. run: (label, log), drawn in black, or None; bands: [(label, colour, logs)],
    each curve's mean over the logs (thin) and min-max band (shaded) behind the run. The y-axes fit the steps after 0:
    an untrained model's step 0 would flatten the rest (its points leave the top or the bottom)."""
    fig, axes = pyplot().subplots(1, 3, figsize=(12.5, 4.0), gridspec_kw=dict(width_ratios=[3, 3, 2]))
    metric = CURVE_METRIC[kind]
    for ax, keys in zip(axes, (CURVE_LOSSES, (metric,))):
        shown = []  # the values after step 0, which set the y-axis
        for key, style in zip(keys, ("-", "--")):
            for label, colour, logs in bands:
                band = curve_band(logs, key)
                if band["steps"]:
                    ax.fill_between(band["steps"], band["min"], band["max"], color=colour, alpha=0.25, lw=0)
                    ax.plot(band["steps"], band["mean"], style, color=colour, lw=1, label=f"{key}, {label}")
                    after_0 = [i for i, step in enumerate(band["steps"]) if step > 0]
                    shown += [band["min"][i] for i in after_0] + [band["max"][i] for i in after_0]
            points = [(r["step"], r[key]) for r in (run[1] if run else []) if is_number(r.get(key))]
            if points:
                ax.plot(*zip(*points), style, color="k", lw=1.5, marker="o", ms=2.5, label=f"{key}, {run[0]}")
                shown += [value for step, value in points if step > 0]
        if shown:
            margin = 0.05 * (max(shown) - min(shown)) or 0.05 * abs(max(shown)) or 0.05
            ax.set_ylim(min(shown) - margin, max(shown) + margin)
        ax.set(xlabel="optimizer step", ylabel="loss" if keys == CURVE_LOSSES else metric)
        ax.grid(alpha=0.3)
        if ax.lines:
            ax.legend(fontsize=7)
    lr_log = run[1] if run else bands[0][2][0] if bands else []  # one seed's: the schedule is the recipe's
    points = [(r["step"], r["lr"]) for r in lr_log if is_number(r.get("lr"))]
    if points:
        axes[2].plot(*zip(*points), color="0.4", lw=0.8)
    else:
        axes[2].text(0.5, 0.5, "no lr in log.jsonl", ha="center", va="center", transform=axes[2].transAxes)
    axes[2].set(xlabel="optimizer step", ylabel="learning rate (at each logged step)")
    fig.suptitle(f"{title}\n{LOOK_FOR['curves']}", fontsize=9)
    return save_figure(fig, path)

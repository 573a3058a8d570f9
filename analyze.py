"""
Token geometry of nanolap checkpoints: the analyses of section 4 of Zhang & Papyan, "Laplacian Heads Improve
Transformers by Smoothing Token Representations" (2026). geometry.py defines the measures of the tokens in its
docstrings and figures.py draws them; this command runs trained checkpoints through them, and adds two readings of
the model's own parameters (AnovaViews, head_weights).

    python analyze.py out/vit                                    # one run: writes out/vit/analysis/
    python analyze.py out/x.pt                                   # a loose checkpoint: writes out/x-analysis/
    python analyze.py out/gpt --max_samples=200 --layer=2         # tokens after block 2 instead of the final norm
    python analyze.py out/vit-k0 out/vit-k4 --out=out/vit-cmp     # several runs: out/vit-cmp/vit-k0/, .../vit-k4/

Each run directory (ckpt.pt and log.jsonl of a training script) is measured on its own evaluation data, into
analysis.json, summary.md, PNG figures and a RESULT line: ANOVA of token variance and token cosine after every
block, the within-sequence spectrum and the simplex-ETF projection (all kinds), the token PCA scatter and
Neural Collapse (vit; gpt over next-token classes), PCA feature maps (dino), and what every head does to the tokens.
Is the run normal? curves.png draws its log.jsonl in front of the committed seeds of its recipe (results/<set>/), and
one line says whether its end metric lies inside their range. Comparing analysed runs against n_lap, and the sweep's
report, are results/report.py's (it needs no checkpoint).
"""

import os
import sys
import time

import torch
import torch.nn.functional as F

import common
import configurator
import figures
import geometry
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
references = figures.RESULTS  # curves.png: committed runs <set>/<run>/ of the run's recipe drawn behind it; "" = none

# ---------------------------------------------------------------- constants
ETF_TOKENS = 8  # ViT: tokens per image in the ETF token panel, at the same random positions in every image

# ---------------------------------------------------------------- what the model's own parts add
# geometry.py measures the tokens; these two read the model's parameters: its final norm and classifier (AnovaViews),
# its heads' value and output weights (head_weights)

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
            self.stats["norm_without_affine"] = geometry.AnovaStats(num_classes)
        self.bases = {}
        if model.config.num_classes:
            W = model.head.weight.detach().double()  # (C, d)
            _, singular_values, Vh = torch.linalg.svd(W, full_matrices=True)
            rank = int((singular_values > singular_values.max() * 1e-8).sum())
            self.bases = {"classifier_rows": Vh[:rank].T, "classifier_complement": Vh[rank:].T}  # (d, r), (d, d - r)
            self.stats.update({name: geometry.AnovaStats(num_classes) for name in self.bases})
    def update(self, x, y):
        if "norm_without_affine" in self.stats:
            self.stats["norm_without_affine"].update(F.layer_norm(x, x.shape[-1:], eps=self.norm.eps), y)
        normed = self.norm(x).double()
        for name, basis in self.bases.items():
            self.stats[name].update(normed @ basis.to(normed.device), y)  # coordinates in the subspace
    def result(self):
        return {name: stats.result() for name, stats in self.stats.items()}

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

def heads_with_weights(model, stats):
    """analysis.json's "heads": geometry.head_results, and in every block the weight-only hint of each head."""
    heads = geometry.head_results(model, stats)
    for layer, block in zip(heads["layers"], model.blocks):
        layer["weights"] = head_weights(block)
    return heads

# ---------------------------------------------------------------- forward passes

def pick_layer(hs, layer):  # hs = [after block 1, ..., after block L, final norm]; layer -1 or 1..L
    return hs[-1] if layer == -1 else hs[layer - 1]

def update_layers(hs, y, anovas, cos_sums, spec, layer):  # one batch: ANOVA, cosine after each block, spectrum at layer
    for l, h in enumerate(hs):
        anovas[l].update(h, y)
        cos_sums[l] += geometry.seq_cosine(h).sum()
    spec.update(pick_layer(hs, layer))

def layerwise(anovas, cos_sums, n):
    return {"layer": [str(l) for l in range(1, len(anovas))] + ["norm"],
            "within_seq_frac": [anova["within_seq_frac"] for anova in anovas],
            "cosine": [float(c / n) for c in cos_sums]}

def etf_positions(T):  # the ETF panel's ETF_TOKENS token positions, the same in every image and run
    return images.fixed_subset(T, ETF_TOKENS, 0).sort().values

def batches(n, batch_size):  # slices of one batch each over n samples
    return (slice(i, i + batch_size) for i in range(0, n, batch_size))

@torch.no_grad()
def image_pass(model, x, y, num_classes, mean, std, layer, patch_only, n_keep, batch_size, device):
    """Stream the statistics of images x (N, C, H, W) uint8, normalised as in training ((x / 255 - mean) / std):
    ANOVA and cosine after every block, the spectrum at `layer`, the per-head analysis; the ANOVA of the last block's
    tokens under other views (anova_views); the pooled features and, with a head, token means and ETF_TOKENS tokens per
    image (final norm); the tokens at `layer` of the first n_keep images (DINO: patch tokens)."""
    L = model.config.n_layer
    cls_head = model.config.num_classes > 0
    sel = geometry.patch_tokens if patch_only else geometry.all_tokens
    layer_anova = [geometry.AnovaStats(num_classes) for _ in range(L + 1)]
    cos_sum = [0.0] * (L + 1)
    spec = geometry.SpectrumStats()
    head_stats = [(geometry.VarChange(), geometry.VarChange()) for _ in range(L)]
    views = AnovaViews(model, num_classes)
    mean = torch.tensor(mean, device=device).view(1, -1, 1, 1)
    std = torch.tensor(std, device=device).view(1, -1, 1, 1)
    keep = dict(kept=[], shown=[], pooled=[], **(dict(seq_means=[], tokens=[]) if cls_head else {}))
    for batch in batches(len(x), batch_size):
        img = (augment.to_unit(x[batch].to(device), model.config.img_size) - mean) / std
        hs = geometry.update_heads(model, model.embed(img), None, head_stats, sel)  # L + 1 tensors (B, 1 + N, d)
        update_layers([sel(h) for h in hs], y[batch], layer_anova, cos_sum, spec, layer)
        views.update(sel(hs[-2]), y[batch])
        h = pick_layer(hs, layer)
        keep["pooled"].append(model.pool(hs[-1]).double().cpu())
        if cls_head:
            keep["seq_means"].append(sel(hs[-1]).double().mean(1).cpu())
            keep["tokens"].append(sel(hs[-1])[:, etf_positions(sel(hs[-1]).shape[1])].double().cpu())
        left = n_keep - sum(len(k) for k in keep["kept"])
        if left > 0:
            keep["kept"].append((sel(h) if cls_head else h[:, 1:])[:left].float().cpu())
            keep["shown"].append(x[batch][:left])
    layers = [stats.result() for stats in layer_anova]
    res = {"layerwise": dict(layerwise(layers, cos_sum, len(x)), anova=layers), "anova": pick_layer(layers, layer),
           "anova_views": dict(views.result(), last_block=layers[-2], final_norm=layers[-1]),
           "spectrum": spec.result(), "heads": heads_with_weights(model, head_stats)}
    return res, {k: torch.cat(v) for k, v in keep.items()}

@torch.no_grad()
def gpt_pass(model, x, targets, layer, n_targets, n_keep, batch_size, device):
    """Stream within-window collapse after every block, the spectrum and the next-token-class statistics at `layer`
    (classes: the n_targets most frequent targets of the windows x (n, T)). Returns the results, those targets, and
    the tokens at `layer` of the first n_keep windows and the final norm's tokens of the three most frequent targets,
    with their targets."""
    L = model.config.n_layer
    V = model.config.vocab_size
    counts = torch.bincount(targets.reshape(-1), minlength=V)
    top = counts.argsort(descending=True)[:min(n_targets, int(counts.count_nonzero()))]  # targets that occur
    class_of_target = torch.full((max(V, int(targets.max()) + 1),), -1, dtype=torch.long)
    class_of_target[top] = torch.arange(len(top))
    layer_anova = [geometry.AnovaStats(1) for _ in range(L + 1)]
    cos_sum = [0.0] * (L + 1)
    spec = geometry.SpectrumStats()
    class_stats = geometry.ClassStats(len(top))
    head_stats = [(geometry.VarChange(), geometry.VarChange()) for _ in range(L)]
    keep = dict(kept=[], kept_targets=[], etf=[], etf_targets=[])
    for batch in batches(len(x), batch_size):
        tokens, rope = model.embed(x[batch].to(device))
        hs = geometry.update_heads(model, tokens, rope, head_stats, geometry.all_tokens)  # L + 1 tensors (B, T, d)
        update_layers(hs, torch.zeros(len(x[batch]), dtype=torch.long), layer_anova, cos_sum, spec, layer)  # one class
        h = pick_layer(hs, layer)
        classes = class_of_target[targets[batch].reshape(-1)]  # each position's class, -1 for a rarer target
        class_stats.update(h.reshape(-1, h.shape[-1])[classes.to(device) >= 0], classes[classes >= 0])
        left = n_keep - sum(len(k) for k in keep["kept"])
        keep["kept"].append(h[:max(left, 0)].float().cpu())
        keep["kept_targets"].append(targets[batch][:max(left, 0)])
        top3 = torch.isin(targets[batch], top[:3])  # (B, T): the positions of the ETF panel
        keep["etf"].append(hs[-1][top3.to(device)].double().cpu())
        keep["etf_targets"].append(targets[batch][top3])
    nc = class_stats.neural_collapse()
    res = {"layerwise": layerwise([stats.result() for stats in layer_anova], cos_sum, len(x)),
           "anova": dict(class_stats.anova(), n_classes=nc["n_classes"], n_tokens=class_stats.n_seq,
                         target_share=counts[top].sum().item() / targets.numel()),
           "nc": {k: nc[k] for k in ("nc1", "nc2_equinorm", "nc2_equiangular")}, "spectrum": spec.result(),
           "heads": heads_with_weights(model, head_stats)}
    return res, top.tolist(), {k: torch.cat(v) for k, v in keep.items()}

# ---------------------------------------------------------------- one run: its classifier analyses and ETF panels

def classifier_analyses(model, extra, y, names, classes, res, title, out_dir):
    """NC1-NC4 with the trained head, on the pooled features and token means; the ETF projection of those and of tokens."""
    W = model.head.weight.detach().double().cpu()
    b = None if model.head.bias is None else model.head.bias.detach().double().cpu()
    feats = {"pooled": "pooled = CLS token" if model.config.pooling == "cls" else "pooled = mean of patch tokens",
             "seq_means": f"seq_means = mean of the {res['settings']['tokens']}"}
    if feats["pooled"].endswith("patch tokens") and res["settings"]["tokens"] == "patch tokens only":
        del feats["seq_means"]  # the very features that are pooled: measured and drawn once
    res["nc"] = {k: dict(features=f"{sub}, final norm", **geometry.neural_collapse(extra[k], y, W, b))
                 for k, sub in feats.items()}
    W3 = W[classes]
    chosen = torch.isin(y, torch.tensor(classes))  # the images of the three classes
    res["etf"] = {"classes": classes, "classifier_rows_2d": geometry.etf_projection(W3, W3, W3.mean(0)).tolist()}
    panels = []
    tokens = f"tokens = {extra['tokens'].shape[1]} per image ({res['settings']['tokens']})"
    for key, sub in [*feats.items(), ("tokens", tokens)]:
        x = extra[key][chosen].flatten(0, -2)
        labels = y[chosen].repeat_interleave(extra[key].shape[1] if key == "tokens" else 1)
        xy, res["etf"][key], triangle = etf_panel(W3, x, labels, classes)
        panels.append((sub.replace(" = ", " =\n", 1), xy, labels, triangle))  # the name, then what it is
    return [figures.fig_etf(panels, names, classes, title, "an image's features (tokens: a token's)",
                            "the three classes' classifier rows", out_dir)]

def etf_panel(W3, x, y, classes):
    """The ETF projection of features x (n, d) with labels y among the three classes, centred by the mean of their class
    means: the points (n, 2); the class means (3, 2) and vertex_dist, the points' mean distance to their class's vertex
    in vertex radii (0: on the vertices); and the triangle of the panel, its vertices at the mean class radius."""
    xy = geometry.etf_projection(W3, x, torch.stack([x[y == c].mean(0) for c in classes]).mean(0))
    means = torch.stack([xy[y == c].mean(0) for c in classes])  # (3, 2)
    radius = means.norm(dim=1).mean()  # the mean class radius
    vertices = geometry.TRIANGLE.T  # (3, 2) at radius 1
    at = (y[:, None] == torch.tensor(classes)).double() @ vertices  # (n, 2): each point's class vertex
    panel = {"class_means_2d": means.tolist(), "vertex_dist": (xy / radius - at).norm(dim=1).mean().item()}
    return xy, panel, vertices * radius

def final_metric(run_dir, kind):  # the run's headline metric at the last step that logs it (None: NaN there)
    key = geometry.FINAL_METRIC[kind][0]
    found = [r for r in figures.read_log(run_dir) if key in r]
    value = found[-1][key] if found else None
    return {"name": key, "value": float(value) if figures.is_number(value) else None,
            "step": found[-1]["step"] if found else None}

def run_curves(run_dir, kind, cfg, n_lap, title, out_dir, references):
    """curves.png: the run's log.jsonl against steps in front of the committed runs of its recipe in `references`
    (figures.reference_runs), of the set with the most seeds at its n_lap: their band at its n_lap, else the set's
    bands at each of its n_lap; and one line: whether the run's end metric lies inside the range of those seeds.
    (None, None) without a log (a loose checkpoint)."""
    log = figures.read_log(run_dir)
    if not log:
        return None, None
    sets = figures.reference_runs(kind, cfg, log, references) if references else {}
    path = os.path.join(out_dir, "curves.png")
    machine = log[-1].get("machine")  # floats differ by machine
    run = (f"this run, {machine}" if machine else "this run", log)
    if not sets:
        alone = f"the run alone: no run in {references or '(no --references)'} trained its recipe"
        return figures.fig_curves(kind, run, [], f"{title}\n{alone}", path), f"curves.png: {alone}"
    name = max(sets, key=lambda s: (len(sets[s].get(n_lap, [])), sum(map(len, sets[s].values()))))
    groups = {n_lap: sets[name][n_lap]} if n_lap in sets[name] else sets[name]
    bands = [(f"{name}, n_lap={k}: {len(logs)} seeds", f"C{i}", logs) for i, (k, logs) in enumerate(groups.items())]
    figure = figures.fig_curves(kind, run, bands, f"{title} in front of the committed runs of its recipe:\n"
                                + ", ".join(label for label, _, _ in bands), path)
    if n_lap not in groups:
        return figure, f"curves.png: {name} holds this recipe at n_lap {', '.join(groups)}, not {n_lap}: no range to compare"
    key = figures.CURVE_METRIC[kind]
    band = figures.curve_band(groups[n_lap], key)
    ends = [r for r in log if figures.is_number(r.get(key)) and r["step"] in band["steps"]]
    if not ends:
        return figure, f"curves.png: no {key} of this run at a step that {name}'s seeds logged"
    end = ends[-1]
    i = band["steps"].index(end["step"])
    low = band["min"][i]
    high = band["max"][i]
    where = "inside" if low <= end[key] <= high else "below" if end[key] < low else "above"
    return figure, (f"curves.png: {key} {end[key]:.4f} at step {end['step']} lies {where} the range of {name}'s "
                    f"{len(groups[n_lap])} seeds at n_lap={n_lap}, {low:.4f} to {high:.4f} (mean {band['mean'][i]:.4f})")

def lap_label(n_lap):  # (x position, label): the count, or for a per-layer list its mean and the list
    n = n_lap if isinstance(n_lap, int) else n_lap[0] if len(set(n_lap)) == 1 else None
    mean = float(n) if n is not None else sum(n_lap) / len(n_lap)
    return mean, str(n) if n is not None else f"{mean:g} {list(n_lap)}"

# ---------------------------------------------------------------- summary.md

def run_summary(res):
    settings = res["settings"]
    anova = res["anova"]
    final = res["final_metric"]
    within_seq = res["layerwise"]["within_seq_frac"]
    lines = [f"# {res['run']}: {res['kind']}, n_lap = {res['n_lap_label']} of {res['n_head']} heads", "",
             f"Final {final['name']} from log.jsonl: {figures.fmt(final['value'], '.4f')} (step {final['step']}).", "",
             f"Settings: {settings['n_samples']} sequences of the validation split, layer {settings['layer']} "
             f"(-1 = final norm), tokens: {settings['tokens']}.", "", "| quantity | value |", "|---|---|"]
    lines += [f"| ANOVA {key.replace('_', ' ')} | {figures.fmt(anova[key])} |"
              for key in geometry.FRACS if key in anova]
    lines += [f"| within-seq share after block 1 -> last block | {figures.fmt(within_seq[0])} -> "
              f"{figures.fmt(within_seq[-2])} |"]
    lines += [f"| k_{alpha} (mean over sequences) | {res['spectrum'][f'k_{alpha}']:.1f} |" for alpha in geometry.ALPHAS]
    for key, nc in ({"next-token classes": res["nc"]} if res["kind"] == "gpt" else res.get("nc", {})).items():
        lines += [f"| {m} ({key}) | {v if m == 'features' else format(v, '.4g')} |" for m, v in nc.items()
                  if m.startswith(("nc", "features")) and not (m.endswith("_w") and key == "seq_means")]  # W's metrics once
    figure_lines = ["", "Figures: " + ", ".join(res["figures"]), ""]
    return "\n".join(lines + views_lines(res) + heads_lines(res["heads"]) + figure_lines)

def views_lines(res):  # summary.md: the absolute ANOVA parts of the last block's tokens under each view
    views = res.get("anova_views")
    if not views:
        return []
    lines = ["", "Absolute parts (the fractions above are these divided by their total):", "",
             "| tokens | within-seq var | between-seq var (total − within-seq) | within-seq share |", "|---|---|---|---|"]
    for name, v in views.items():
        lines.append(f"| {name.replace('_', ' ')} | {v['within_seq_var']:.4g} | {v['total_var'] - v['within_seq_var']:.4g} "
                     f"| {figures.fmt(v['within_seq_frac'])} |")
    return lines

def heads_lines(heads):  # summary.md: per block, the mean rho of each kind of head and the sublayers' exact changes
    means = geometry.head_means(heads)
    lines = ["", "Per-head analysis: relative change of the block input's within-sequence variance (negative = the "
             "update smooths the tokens), first order (rho) for heads, exact for sublayers (attention + MLP = block):", "",
             "| block | Laplacian heads, mean rho | attention heads, mean rho | attention | MLP | block |",
             "|---|---|---|---|---|---|"]
    for layer, lap, att in zip(heads["layers"], means["laplacian"], means["attention"]):
        rhos = [figures.fmt(lap, "+.4f"), figures.fmt(att, "+.4f")]
        exact = [figures.fmt(layer[part]["exact"], "+.4f") for part in ("attention", "mlp", "block_total")]
        lines.append(f"| {layer['block']} | " + " | ".join(rhos + exact) + " |")
    return lines

# ---------------------------------------------------------------- run

def checked_checkpoints(paths, config):
    """[(ckpt.pt path, what the analysis needs of it)] for the run directories or checkpoints given, each checked
    against the options before any work (the optimizer state is dropped at once). Raises UsageError."""
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
        if ckpt.get("kind") not in geometry.FINAL_METRIC or not {"model", "model_config"} <= set(ckpt):
            raise UsageError(f"{path}: not a checkpoint of the training scripts (kind {ckpt.get('kind')!r}, expected one "
                             f"of {sorted(geometry.FINAL_METRIC)}, with model and model_config)")
        model_config = ckpt["model_config"]
        if config["layer"] != -1 and not 1 <= config["layer"] <= model_config["n_layer"]:
            raise UsageError(f"--layer={config['layer']}: use -1 (final norm) or a block number from 1 to "
                             f"{model_config['n_layer']}")
        if ckpt["kind"] == "gpt" and config["seq_len"] > model_config["block_size"]:
            raise UsageError(f"--seq_len={config['seq_len']} is longer than the model's "
                             f"block_size={model_config['block_size']}")
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
    data_dir = cfg.get("data_dir", "data")
    dataset = cfg.get("dataset")
    if kind == "gpt":
        T = config["seq_len"] or cfg.get("block_size") or model.config.block_size
        x, targets = text.load_windows(data_dir, dataset, T, config["max_samples"], cfg.get("holdout", 0.0))
        measured, top, extra = gpt_pass(model, x, targets, layer, config["n_targets"], config["pca_images"],
                                 config["batch_size"], device)
        res.update(measured)
        ids = sorted(set(top + extra["kept_targets"].unique().tolist()))  # the classes of the ANOVA and the figures
        names = dict(zip(ids, text.token_names(data_dir, dataset, ids)))
        res["anova"].update(targets=top, target_names=[names[t] for t in top])
        res["settings"] = dict(layer=layer, tokens="all positions of each window", seq_len=T, n_samples=len(x),
                               n_targets=config["n_targets"], dataset=dataset, pca_windows=len(extra["kept"]))
        classes = f"next-token classes: top {res['anova']['n_classes']} targets, NC1 = {res['nc']['nc1']:.3g}"
        anova_fig = figures.fig_anova([res["anova"]], ["all positions"], geometry.FRACS[1:], f"{classes}\n{title}",
                                      where, os.path.join(out_dir, "anova.png"))
    else:
        x, y, names, mean, std = images.eval_images(ckpt, config["max_samples"], config["seed"])
        etf = config["etf_classes"]
        if kind == "vit" and not set(etf) <= set(y.tolist()):  # before the long pass
            raise UsageError(f"--etf_classes={etf}: not every class occurs among the {len(y)} analysed "
                             f"images; choose others or raise --max_samples")
        n_keep = config["pca_images"] if kind == "vit" else config["map_images"]
        measured, extra = image_pass(model, x, y, max(int(y.max()) + 1, model.config.num_classes), mean, std, layer,
                              config["tokens"] == "patch", n_keep, config["batch_size"], device)
        res.update(measured)
        tokens = "patch tokens only" if config["tokens"] == "patch" else "patch tokens and the CLS token"
        res["settings"] = dict(layer=layer, tokens=tokens, n_samples=len(x), dataset=dataset,
                               normalisation=dict(mean=mean, std=std))
        layers = res["layerwise"]
        anova_fig = figures.fig_anova(layers["anova"], layers["layer"], geometry.FRACS, title, "after block",
                                      os.path.join(out_dir, "anova.png"))
    collapse = figures.fig_collapse([(None, "C0", res["layerwise"])], res["layerwise"]["layer"], title,
                                    os.path.join(out_dir, "collapse.png"))
    spectrum = figures.fig_spectrum([("mean $\\lambda_j$", "C0", res["spectrum"]["lambda_mean"])], title,
                                    os.path.join(out_dir, "spectrum.png"), res["spectrum"])
    figs = [spectrum, collapse, anova_fig] if kind == "gpt" else [collapse, anova_fig, spectrum]
    figs.append(figures.fig_heads(res["heads"], title, os.path.join(out_dir, "heads.png")))
    if kind == "vit":
        per_token = y[:len(extra["kept"]), None].expand(-1, extra["kept"].shape[1])
        figs.append(figures.fig_pca(extra["kept"], per_token, names, where, "images", title,
                                    os.path.join(out_dir, "pca.png")))
        res["settings"]["pca_images"] = len(extra["kept"])
        figs += classifier_analyses(model, extra, y, names, config["etf_classes"], res, title, out_dir)
    elif kind == "gpt":  # the classes: next tokens; the ETF plane: the output layer's rows of the three most frequent
        figs.append(figures.fig_pca(extra["kept"], extra["kept_targets"], names, where,
                                    "windows, coloured by next token", title, os.path.join(out_dir, "pca.png")))
        if len(top) >= 3:  # (--n_targets=2 draws no ETF panel)
            W3 = model.lm_head.weight.detach().double().cpu()[top[:3]]
            xy, panel, triangle = etf_panel(W3, extra["etf"], extra["etf_targets"], top[:3])
            rows = geometry.etf_projection(W3, W3, W3.mean(0)).tolist()
            res["etf"] = dict(classes=top[:3], classifier_rows_2d=rows, tokens=panel)
            figs.append(figures.fig_etf([("tokens, final norm", xy, extra["etf_targets"], triangle)], names, top[:3],
                                        title, "a token (its class: the next token)", "the output layer's rows of the "
                                        "three most frequent next tokens", out_dir))
    else:  # DINO has no classifier: the ETF plane is that of the three classes' means
        grid = (x.shape[-2] // model.config.patch_size, x.shape[-1] // model.config.patch_size)
        figs.append(figures.fig_pca_maps(extra["kept"], extra["shown"], grid, title,
                                         os.path.join(out_dir, "pca_maps.png")))
        res["settings"]["map_images"] = len(extra["kept"])
        etf = config["etf_classes"]
        chosen = torch.isin(y, torch.tensor(etf))  # the images of the three classes
        if set(etf) <= set(y.tolist()):  # else no ETF panel (a figure DINO's other analyses do not need)
            W3 = torch.stack([extra["pooled"][y == c].mean(0) for c in etf])
            xy, panel, triangle = etf_panel(W3, extra["pooled"][chosen], y[chosen], etf)
            res["etf"] = dict(classes=etf, pooled=panel)
            figs.append(figures.fig_etf([("pooled features, final norm", xy, y[chosen], triangle)], names, etf, title,
                                        "an image's pooled features (no classifier)", "the three classes' means",
                                        out_dir))
    curves, curves_line = run_curves(run_dir, kind, cfg, label, title, out_dir, config["references"])
    figs += [curves] if curves else []
    res["figures"] = figs
    res["out_dir"] = out_dir
    figures.write_outputs(res, run_summary(res), out_dir)
    print(f"{name}: {len(x)} sequences, {time.time() - t0:.1f}s; wrote {out_dir}: analysis.json, summary.md, "
          f"{', '.join(figs)}", flush=True)
    if curves_line:
        print(curves_line, flush=True)
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
        sub = next(candidate for candidate in [name] + [f"{name}-{n}" for n in range(2, len(ckpts) + 2)]
                   if os.path.join(out, candidate) not in folders)
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
    out_root = figures.writable_out(out or default_out)
    print("analyze.py settings: " + " ".join(f"{k}={v!r}" for k, v in {**config, "device": run_device}.items()),
          flush=True)
    folders = run_folders(ckpts, out_root)
    results = [analyze_run(path, ckpt, figures.writable_out(folder), config, run_device)
               for (path, ckpt), folder in zip(ckpts, folders)]
    if len(results) == 1:  # one run: its RESULT line
        result = results[0]
        nc1 = result["nc"]["nc1"] if result["kind"] == "gpt" else result.get("nc", {}).get("pooled", {}).get("nc1")
        within_seq_frac = pick_layer(result["layerwise"]["within_seq_frac"], layer)
        common.write_result(out_root, kind=result["kind"], n_lap=result["n_lap"],
                             within_seq_frac=figures.fmt(within_seq_frac, ".4f"),
                             **{f"k_{alpha}": f"{result['spectrum'][f'k_{alpha}']:.2f}" for alpha in geometry.ALPHAS},
                             **({} if nc1 is None else {"nc1": f"{nc1:.4g}"}), out=out_root)
    else:  # several: how to compare them (results/report.py reads the analyses just written)
        print("compare them: python results/report.py " + " ".join(folders) + f" --out={out_root}")
        common.write_result(out_root, runs=len(results), out=out_root)

"""
The comparisons over n_lap and the sweep's report, from the artefacts that analyze.py and the training scripts
leave (analysis.json and result.txt): no checkpoint, model or data is read, so the report redraws in seconds.

    python results/report.py                         # results/summary.md and results/figures/ from results/<set>/<run>/
    python results/report.py out/cmp/vit-k0 out/cmp/vit-k4 --out=out/cmp   # compare runs that analyze.py analysed

A comparison groups its runs by n_lap (seeds pooled): every metric as mean +- std over seeds, the effect of the
largest n_lap against n_lap = 0 with its standard error and whether the seeds separate, Spearman's trend over every
n_lap value, the per-head means, and figures against n_lap. The sweep's report does this for each set
(results/<set>/), draws its training curves (the band over seeds of n_lap 0 against 4; analyze.py draws a run in front
of its set's), writes summary.md, and draws the README's headline figure. It opens summary.md with the verdict
on every claim of the paper (results/verdict.py), whose figures go to results/figures/verdict/. The statistics
themselves (means, effects, p-values, intervals, Holm's correction, the rule's words) are results/stats.py's.
"""

import fnmatch
import glob
import json
import math
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # the repo root
import common  # noqa: E402
import configurator  # noqa: E402
import figures  # noqa: E402
import geometry  # noqa: E402
import stats  # noqa: E402  (results/stats.py, beside this file)
import verdict  # noqa: E402  (results/verdict.py, beside this file)
from common import UsageError  # noqa: E402

# ---------------------------------------------------------------- options
out = ""  # output folder; "" = the results folder itself (the sweep's report), or the compared runs' common parent
results = os.path.dirname(os.path.abspath(__file__))  # the sweep's folder of <set>/<run>/ artefacts (no runs given)

# ---------------------------------------------------------------- constants
# Runs record the machine they trained on (result.txt's machine=); for the sweep's runs made before they did, this
# file of the results folder says which machine trained which run ("set/run" patterns), from the commits and logs
MACHINES = "machines.json"
# the end metrics of a run's result.txt; the first is the headline figure's
END_METRICS = {"vit": ("val_acc", "val_loss"), "gpt": ("val_bpb", "val_loss"),
               "dino": ("knn_acc", "linear_acc", "seg_miou")}

# ---------------------------------------------------------------- summaries over runs: curves, seeds, settings, corpora

def _mean_curve(curves):  # the mean of several runs' curves, cut to the shortest
    n = min(len(c) for c in curves)
    return torch.tensor([[math.nan if v is None else v for v in c[:n]] for c in curves], dtype=torch.float64).mean(0).tolist()

def seeds_note(counts):  # what a comparison's error bars stand for: the runs (seeds) behind each of its points
    n = f"{min(counts)}" if min(counts) == max(counts) else f"{min(counts)}-{max(counts)}"
    return "1 seed per point, no spread" if max(counts) == 1 else f"mean +- std over {n} seeds per point"

def one_corpus(results, name):
    """Refuse runs of different corpora: a GPT's RESULT line names its corpus (corpus=gutenberg-1a2b3c4d); a run without
    one (before the name was kept, or not a GPT) is unknown and compares with any."""
    corpora = sorted({c for c in (common.read_result(r["run"]).get("corpus") for r in results) if c and c != "unknown"})
    if len(corpora) > 1:
        raise UsageError(f"the {name} runs trained on different corpora ({', '.join(corpora)}): their losses do not compare")

# ---------------------------------------------------------------- figures against n_lap

def fig_errorbars(xs, ticks, series, ylabel, title, path, ax=None):  # series: [(label, [{"mean", "std"} per x])]
    # ax: a panel of a larger figure, not saved here
    fig, ax = (ax.figure, ax) if ax else figures.pyplot().subplots(figsize=(5, 3.6))
    for (label, points), fmt in zip(series, ("o-", "s--", "^:", "d-.", "v-", "x--") * len(series)):
        pts = [(x, s) for x, s in zip(xs, points) if s["mean"] is not None]
        ax.errorbar([x for x, _ in pts], [s["mean"] for _, s in pts], yerr=[s["std"] for _, s in pts], fmt=fmt,
                    capsize=3, label=label)
    ax.set_xticks(xs, ticks, rotation=30 if any(" " in k for k in ticks) else 0)
    ax.set(xlabel="Laplacian heads per layer", ylabel=ylabel, title=title)
    if len(series) > 1:
        ax.legend(fontsize=8)
    ax.grid(alpha=0.3)
    return path and figures.save_figure(fig, path)

def fig_set_curves(name, runs, dest):
    """figures/<set>/curves.png: the set's training curves (figures.fig_curves, as analyze.py draws a run in front of
    them), the mean and min-max band over seeds of its fewest and of its most Laplacian heads (n_lap 0 against 4)."""
    groups = {}
    for r in sorted(runs, key=lambda r: r["n_lap_mean"]):
        groups.setdefault(r["n_lap_label"], []).append(figures.read_log(r["run"]))
    order = list(groups)
    ends = order if len(order) < 3 else [order[0], order[-1]]  # a ladder's ends: n_lap 0 against 4
    bands = [(f"n_lap={k}: {len(groups[k])} seeds", f"C{i}", groups[k]) for i, k in enumerate(ends)]
    path = os.path.join("figures", name, "curves.png")
    figures.fig_curves(runs[0]["kind"], None, bands, f"{name}: training curves over seeds", os.path.join(dest, path))
    return path

def fig_head_means(table, color, title, path):
    """compare()'s per-head figure: per block, the mean rho of the Laplacian heads (solid) and of the attention heads
    (dashed) of each n_lap group, mean +- std over its seeds."""
    fig, ax = figures.pyplot().subplots(figsize=(5.6, 3.8))
    for row in table:
        for kind, style in (("laplacian", "o-"), ("attention", "s--")):
            per_block = list(zip(*[m[kind] for m in row["head_means"]]))  # blocks x seeds
            points = [stats.mean_std(values) for values in per_block]
            pts = [(l + 1, s) for l, s in enumerate(points) if s["mean"] is not None]
            if pts:
                ax.errorbar([p for p, _ in pts], [s["mean"] for _, s in pts], yerr=[s["std"] for _, s in pts], fmt=style,
                            capsize=3, color=color[row["n_lap"]], label=f"n_lap={row['n_lap']}: {kind} heads")
    ax.axhline(0, color="k", lw=0.8)
    ax.set(xlabel="block", ylabel="mean first-order change $\\rho$\n(negative: the heads smooth)", title=title)
    ax.legend(fontsize=7)
    ax.grid(alpha=0.3)
    return figures.save_figure(fig, path)

def _point(comparison, point, key):  # mean +- std of `key` in the group at point (x, label); mean None: no point there
    found = [g for g in comparison["groups"] if (g["n_lap_mean"], g["n_lap"]) == point]
    return stats.mean_std(found[0]["values"][key]) if found else {"mean": None}

def fig_headline(sets, path):
    """The README's figure, a column per paradigm: its headline end metric (END_METRICS' first; top) and the
    within-sequence share of the patch tokens (GPT: the within-class share of next-token classes; bottom) against n_lap,
    mean +- std over seeds. Sets of the first set's recipe at other lengths (vit_long) are series of their own,
    labelled with their epochs; a second set of the same recipe and length (vit_amd: the same runs on another
    machine) and sets of other recipes (vit_cls, dino_scenes) are left out."""
    kinds = [k for k in END_METRICS if any(c["kind"] == k for c in sets.values())]
    fig, axes = figures.pyplot().subplots(2, len(kinds), figsize=(4.8 * len(kinds), 7.4), squeeze=False)
    for kind, col in zip(kinds, axes.T):
        same = [c for c in sets.values() if c["kind"] == kind]
        same = [c for c in same  # one recipe
                if set(figures.differing_settings([same[0]["config"], c["config"]])) <= {"epochs"}]
        by_length = {}
        for c in same:
            by_length.setdefault(c["label"], c)  # the first set of each length
        same = sorted(by_length.values(), key=lambda c: c["config"].get("epochs") or 0)  # the legend by length
        points = sorted({(g["n_lap_mean"], g["n_lap"]) for c in same for g in c["groups"]})  # (x, label) of every set
        bars = seeds_note([len(g["runs"]) for c in same for g in c["groups"]]).replace("+-", "$\\pm$")
        share = (("within_class (next-token)", "within-class share of next-token classes") if kind == "gpt" else
                 ("within_seq (patch)", "within-sequence share of patch tokens"))
        head = END_METRICS[kind][0]
        better = "lower" if head in ("val_bpb", "val_loss") else "higher"
        for ax, (key, what) in zip(col, [(head, f"{head} ({better} is better)"), share]):
            series = [(c["label"] if len(same) > 1 else None, [_point(c, p, key) for p in points]) for c in same]
            fig_errorbars(*zip(*points), series, what, f"{kind}: {what}\n({bars})", None, ax)
    return figures.save_figure(fig, path)

# ---------------------------------------------------------------- comparisons of several runs, and the sweep's report

def compare(results, out_dir, prefix, name):
    """Runs of one kind grouped by n_lap (seeds pooled): final metric, ANOVA fractions and k_alpha as mean +- std
    (unbiased) and the lists of the runs' metrics ("metrics", None left out) per group, and five figures against n_lap,
    saved in out_dir as prefix + metric.png etc. (prefix may name a folder) and titled with name."""
    kind, layer = results[0]["kind"], results[0]["settings"]["layer"]
    one_corpus(results, name)
    where = "final norm" if layer == -1 else f"after block {layer}"
    results = sorted(results, key=lambda r: (r["n_lap_mean"], r["n_lap_label"]))  # the groups in the order of n_lap
    groups = {k: [r for r in results if r["n_lap_label"] == k] for k in dict.fromkeys(r["n_lap_label"] for r in results)}
    order = list(groups)
    xs = [g[0]["n_lap_mean"] for g in groups.values()]
    xs = xs if len(set(xs)) == len(xs) else list(range(len(order)))  # two lists with one mean: side by side
    n_head = max(r["n_head"] for r in results)
    color = {k: figures.pyplot().cm.viridis(groups[k][0]["n_lap_mean"] / n_head * 0.9) for k in order}
    metric, better = geometry.FINAL_METRIC[kind]
    parts = [k for k in geometry.FRACS if k in results[0]["anova"]]
    table = [{"n_lap": k, "n_lap_mean": g[0]["n_lap_mean"], "runs": [r["run"] for r in g],
              "seeds": [r["seed"] for r in g], metric: stats.mean_std(r["final_metric"]["value"] for r in g),
              **{key: stats.mean_std((r["anova"] if key in r["anova"] else r["spectrum"])[key] for r in g)
                 for key in parts + [f"k_{a}" for a in geometry.ALPHAS]},
              "values": {m: [r["metrics"][m] for r in g if r["metrics"][m] is not None] for m in g[0]["metrics"]},
              "head_means": [geometry.head_means(r["heads"]) for r in g if "heads" in r],
              "heads": [r["heads"] for r in g if "heads" in r and all("exact" in l for l in r["heads"]["layers"])],
              "machines": [r.get("machine", "unrecorded") for r in g], "run_metrics": [r["metrics"] for r in g],
              "run_views": [_run_views(r) for r in g]}
             for k, g in groups.items()]
    curves = [(f"n_lap={k}", color[k], {key: _mean_curve([r["layerwise"][key] for r in g])
                                         for key in ("within_seq_frac", "cosine")}) for k, g in groups.items()]
    spread = seeds_note([len(g["runs"]) for g in table])  # what the error bars stand for, in their figures' titles
    bars, path = "\n(" + spread.replace("+-", "$\\pm$") + ")", os.path.join(out_dir, prefix)
    os.makedirs(os.path.dirname(path), exist_ok=True)
    figs = [fig_errorbars(xs, order, [(None, [row[metric] for row in table])], f"final {metric} ({better} is better)",
                          f"{name}: {metric} vs n_lap{bars}", path + "metric.png"),
            figures.fig_anova([{k: row[k]["mean"] for k in parts} for row in table], order, parts,
                              f"{name}: ANOVA, {where}" + (", next-token classes" if kind == "gpt" else ""),
                              "Laplacian heads per layer", path + "anova.png"),
            fig_errorbars(xs, order, [(f"$k_{{{a}}}$", [row[f"k_{a}"] for row in table]) for a in geometry.ALPHAS],
                          "principal components needed", f"{name}: k_alpha of within-sequence centred tokens{bars}",
                          path + "kalpha.png"),
            figures.fig_spectrum([(f"n_lap={k}", color[k], _mean_curve([r["spectrum"]["lambda_mean"] for r in g]))
                          for k, g in groups.items()], f"{name}: mean spectra", path + "spectra.png"),
            figures.fig_collapse(curves, max((r["layerwise"]["layer"] for r in results), key=len),
                         f"{name}: layerwise within-sequence collapse", path + "collapse.png")]
    with_heads = [row for row in table if row["head_means"]]  # runs analysed before the per-head pass have none
    if with_heads:
        figs.append(fig_head_means(with_heads, color, f"{name}: per-head change of within-sequence variance{bars}",
                                   path + "heads.png"))
    differ = figures.differing_settings([r["train_config"] for r in results])
    if differ:
        print(f"note: the {name} runs also differ in {', '.join(differ)}; the comparison groups them by n_lap only")
    return {"name": name, "kind": kind, "where": where, "metric": metric, "groups": table, "differing_settings": differ,
            "spread": spread, "figures": [os.path.join(os.path.dirname(prefix), f) for f in figs]}  # paths in out_dir

def run_metrics(a, result, a_all=None):
    """What a comparison tabulates of a run, from its analysis a, its RESULT line's values and (ViT, DINO) optionally
    the analysis a_all of all its tokens: the end metrics (END_METRICS; geometry.FINAL_METRIC's from log.jsonl where
    result lacks it), the ANOVA fractions (at the analysed layer) of the patch tokens (GPT: of next-token classes) and of all
    tokens (with CLS), the within-sequence share after the last block, NC1 (ViT: of the pooled features), k_0.99; the
    absolute within- and between-sequence parts after the last block and the within-sequence share under the other
    views (analyze.py's AnovaViews); the mean rho of the Laplacian and of the attention heads over blocks. None where
    the analysis predates a quantity."""
    fm = a["final_metric"]
    nc = a.get("nc", {})
    kind = a["kind"]
    ends = {fm["name"]: fm["value"], **{k: float(v) for k, v in result.items() if k in END_METRICS[kind]}}
    m = {k: ends.get(k) for k in END_METRICS[kind]}
    cls = "CLS" in a["settings"].get("tokens", "")  # a itself is of all tokens (--tokens=all)
    sources = [("next-token", a)] if kind == "gpt" else [("patch", None if cls else a), ("all", a if cls else a_all)]
    for label, b in sources:
        fracs = geometry.FRACS[1:] if kind == "gpt" else geometry.FRACS[::2]
        m.update({f"{f[:-5]} ({label})": b and b["anova"].get(f) for f in fracs})
    m.update({"within_seq after last block": a["layerwise"]["within_seq_frac"][-2],  # [-1]: the final norm
              "nc1": nc.get("nc1", nc.get("pooled", {}).get("nc1")), "k_0.99": a["spectrum"]["k_0.99"]})
    views = a.get("anova_views", {})
    last = views.get("last_block", {})
    m["within_seq_var (last block)"] = last.get("within_seq_var")
    m["between_seq_var (last block)"] = last["total_var"] - last["within_seq_var"] if last else None
    for name in ("norm_without_affine", "classifier_rows", "classifier_complement"):
        m[f"within_seq ({name.replace('_', ' ')})"] = views.get(name, {}).get("within_seq_frac")
    means = geometry.head_means(a["heads"]) if "heads" in a else {"laplacian": [], "attention": []}
    for kind, per_block in means.items():
        rhos = [r for r in per_block if r is not None]
        m[f"rho of {kind} heads (mean)"] = sum(rhos) / len(rhos) if rhos else None
    return m

def compare_summary(comparisons, intro, verdict_text=()):
    """summary.md of compare()'s sets: the verdict's lines (verdict.verdict_lines) if any, then per set the runs' metrics as
    mean ± std over seeds per n_lap, and the effect of the largest n_lap against n_lap = 0."""
    lines = ["# Comparison over n_lap", "", intro] + (["", *verdict_text] if verdict_text else [])
    for c in comparisons:
        groups = c["groups"]
        g0 = c["groups"][0]
        g1 = c["groups"][-1]
        keys = [k for k in g0["values"] if any(g["values"][k] for g in groups)]
        lines += ["", f"## {c['name']} ({c['kind']}, ANOVA at the {c['where']})", ""] + (
            [f"Note: these runs also differ in {', '.join(c['differing_settings'])}.", ""] if c["differing_settings"] else [])
        lines += [machines_line(groups), ""]
        lines += [f"| n_lap | runs | {' | '.join(keys)} |", "|---" * (len(keys) + 2) + "|"]
        lines += [f"| {g['n_lap']} | {len(g['runs'])} | "
                  + " | ".join(stats.mean_std_text(stats.mean_std(g["values"][k])) for k in keys) + " |" for g in groups]
        if len(groups) < 2 or g0["n_lap_mean"] != 0:
            lines += ["", "No effect table: it needs runs with n_lap = 0 and with more Laplacian heads."]
        else:
            lines += ["", f"| n_lap = {g1['n_lap']} − n_lap = 0 | difference | std. error | sign | separated | "
                      "p (within machines) |", "|---" * 6 + "|"]
            for k in [k for k in keys if g0["values"][k] and g1["values"][k]]:
                diff, se, apart = stats.effect(g0["values"][k], g1["values"][k])
                sign = "+" if diff > 0 else "−" if diff < 0 else "0"
                separated = "n/a (one run)" if apart is None else "yes" if apart else "no"
                p = stats.permutation_p(_machine_pairs(g0, k), _machine_pairs(g1, k))
                lines.append(f"| {k} | {diff:+.4g} | {figures.fmt(se, '.2g')} | {sign} | {separated} | {p:.3g} |")
            n0, n1 = len(g0["runs"]), len(g1["runs"])
            lines += ["", f"difference = mean(n_lap = {g1['n_lap']}) − mean(n_lap = 0); std. error = sqrt(s0²/n0 + "
                      "s1²/n1), s the unbiased std (n/a with one seed); separated = yes when every seed of one group "
                      f"lies strictly beyond every seed of the other. With {n0} + {n1} seeds an exact permutation "
                      f"test's smallest two-sided p is 2 / C({n0 + n1}, {n0}) = "
                      f"{min(1, 2 / math.comb(n0 + n1, n0)):.2g}: 'separated' is the most these seeds can show. "
                      "p (within machines): the exact permutation p of the difference, exchanging n_lap labels only "
                      "between runs of one machine (stats.permutation_p); where a set mixes machines, its floor is "
                      "higher."]
        if len(groups) > 2:
            lines += trend_lines(groups, keys)
        if any(g["head_means"] for g in groups):  # the n_lap values with per-head numbers
            lines += group_heads_lines([g for g in groups if g["head_means"]])
            if any(g["heads"] for g in groups):  # per-head analyses that hold the exact changes
                lines += exact_change_lines([g for g in groups if g["heads"]])
        if len(groups) > 1 and groups[0]["n_lap_mean"] == 0:
            lines += paired_parts_lines(groups[0], groups[-1])
        lines += ["", "Figures: " + ", ".join(c["figures"])]
    return "\n".join(lines + [""])

def _machine_pairs(group, key):  # (value, machine) of the group's runs that have the metric
    return [(m[key], machine) for m, machine in zip(group["run_metrics"], group["machines"]) if m[key] is not None]

def machines_line(groups):  # summary.md: which machine trained which seeds of a set
    return "Machines: " + verdict.machine_seeds([pair for g in groups for pair in zip(g["machines"], g["seeds"])])

def exact_change_lines(groups):
    """summary.md: per n_lap and block, the exact relative change WSV(X + U) / WSV(X) - 1 of the block input's
    within-sequence variance by one head alone (mean over its Laplacian, then its attention heads), by the attention
    sublayer, by the MLP and by the whole block, mean ± std over seeds: beside the first-order rho above."""
    n_blocks = max(len(h["layers"]) for g in groups for h in g["heads"])
    lines = ["", "Exact change of the block input's within-sequence variance, WSV(X + U) / WSV(X) − 1, per block, "
             "mean ± std over seeds:", "",
             "| n_lap | update (exact change) | " + " | ".join(f"block {l + 1}" for l in range(n_blocks)) + " |",
             "|---" * (n_blocks + 2) + "|"]
    for g in groups:
        rows = {f"one {kind} head (mean)": [_head_exact(h, kind == "Laplacian") for h in g["heads"]]
                for kind in ("Laplacian", "attention")}
        for part, label in (("attention", "attention sublayer"), ("mlp", "MLP"), ("block_total", "block")):
            rows[label] = [[layer[part]["exact"] for layer in h["layers"]] for h in g["heads"]]
        for label, per_run in rows.items():
            lines += block_row(g["n_lap"], label, per_run, n_blocks)
    return lines

def paired_parts_lines(g0, g1):
    """summary.md: seed by seed, the within-sequence variance and the between-sequence part of the tokens before the
    final norm (after the last block) and after it, at n_lap = 0 and at the group g1's n_lap (runs with both views)."""
    parts = {}
    for g in (g0, g1):
        for seed, m in zip(g["seeds"], g["run_views"]):
            if m:
                parts.setdefault(seed, {})[g["n_lap"]] = m
    pairs = [(seed, p) for seed, p in sorted(parts.items()) if len(p) == 2]
    if not pairs:
        return []
    lines = ["", f"Seed by seed, n_lap = 0 → {g1['n_lap']}: within-sequence variance and between-sequence part before "
             "the final norm and after it:", "", "| seed | within, before | between, before | within, after | "
             "between, after |", "|---" * 5 + "|"]
    for seed, p in pairs:
        a, b = p[g0["n_lap"]], p[g1["n_lap"]]
        cells = [f"{a[view][part]:.4g} → {b[view][part]:.4g}" for view in ("last_block", "final_norm")
                 for part in ("within", "between")]
        lines.append(f"| {seed} | " + " | ".join(cells) + " |")
    return lines

def _run_views(a):  # the within-sequence variance and between-sequence part before and after the final norm
    views = a.get("anova_views", {})
    if "last_block" not in views or "final_norm" not in views:
        return None
    return {view: {"within": views[view]["within_seq_var"],
                   "between": views[view]["total_var"] - views[view]["within_seq_var"]}
            for view in ("last_block", "final_norm")}

def _head_exact(heads, laplacian):  # per block, the mean exact change of one kind of head (None where a block has none)
    means = []
    for layer in heads["layers"]:
        exact = [e for e, lap in zip(layer["exact"], layer["laplacian"]) if lap == laplacian and e is not None]
        means.append(sum(exact) / len(exact) if exact else None)
    return means

def trend_lines(groups, keys):  # summary.md: Spearman's trend over every n_lap value of a set
    lines = ["", "| trend over all n_lap values | Spearman's rank correlation | permutation p | runs |", "|---|---|---|---|"]
    for k in keys:
        xs = [g["n_lap_mean"] for g in groups for _ in g["values"][k]]
        ys = [v for g in groups for v in g["values"][k]]
        if len(set(ys)) > 1 and len(set(xs)) > 1:
            r, p = stats.spearman_trend(xs, ys)
            lines.append(f"| {k} | {r:+.3f} | {p:.4f} | {len(ys)} |")
    return lines + ["", "Spearman's correlation of each metric with n_lap over every run of the set (ties: mean ranks); "
                    "p: the share of 10,000 random pairings (seed 0) with at least the observed |correlation|."]

def group_heads_lines(groups):  # summary.md: per n_lap and block, the mean rho of each kind of head over seeds
    n_blocks = max(len(m["laplacian"]) for g in groups for m in g["head_means"])
    lines = ["", "Per-head analysis: mean first-order change rho of the block input's within-sequence variance "
             "(negative = the heads smooth), per block, mean ± std over seeds:", "",
             "| n_lap | heads (first-order change ρ) | " + " | ".join(f"block {l + 1}" for l in range(n_blocks)) + " |",
             "|---" * (n_blocks + 2) + "|"]
    for g in groups:
        for kind in ("laplacian", "attention"):
            lines += block_row(g["n_lap"], kind, [m[kind] for m in g["head_means"]], n_blocks)
    return lines

def block_row(n_lap, label, per_run, n_blocks):
    """summary.md: one row of a per-block table, mean ± std over the runs' per-block values (None: none), or no row."""
    per_block = [stats.mean_std([r[l] for r in per_run if l < len(r)]) for l in range(n_blocks)]
    if all(s["mean"] is None for s in per_block):
        return []
    cells = ["n/a" if s["mean"] is None else f"{s['mean']:+.4f}" + (f" ± {s['std']:.4f}" if s["n"] > 1 else "")
             for s in per_block]
    return [f"| {n_lap} | {label} | " + " | ".join(cells) + " |"]

def _read_json(folder, name):  # folder/name as JSON, None without the file
    path = os.path.join(folder, name)
    return json.load(open(path)) if os.path.isfile(path) else None

def collect_runs(root):
    """{set: [run]} of the folders root/<set>/<run>/ with analysis.json and result.txt: a run is its analysis.json with
    "run" = the folder and "metrics" = run_metrics() of it, its result.txt and analysis_all.json (all tokens)."""
    if not os.path.isdir(root):
        raise UsageError(f"--results={root}: no such folder; give the folder of results/sweep.sh's artefacts")
    sets = {}
    recorded = (_read_json(root, MACHINES) or {}).get("machines", {})
    for d in sorted(os.path.dirname(p) for p in glob.glob(os.path.join(glob.escape(root), "*", "*", common.RESULT))):
        a = _read_json(d, common.ANALYSIS)
        if a is not None:
            result = common.read_result(d)
            m = run_metrics(a, result, _read_json(d, "analysis_all.json"))
            name = os.path.relpath(d, root)
            machine = result.get("machine") or recorded_machine(recorded, name)
            sets.setdefault(os.path.dirname(name), []).append(dict(a, run=d, metrics=m, machine=machine))
    if not sets:
        raise UsageError(f"--results={root}: no run folders <set>/<run>/ with analysis.json and result.txt; give the "
                         f"folder of results/sweep.sh's artefacts once a run has been collected there")
    return sets

def recorded_machine(recorded, name):
    """The machine that trained the run `name` (set/run) by the results folder's machines.json, "unrecorded" if none."""
    return next((machine for machine, patterns in recorded.items() if any(fnmatch.fnmatch(name, p) for p in patterns)),
                "unrecorded")

def write_report(root, dest, command):
    """The sweep's report: compare() of each set of root/<set>/<run>/ (figures in dest/figures/<set>/), summary.md and
    the headline figure, from the saved artefacts alone; its intro names the command that made it."""
    collected, sets = collect_runs(root), {}
    figures.writable_out(dest)
    for name, runs in collected.items():
        cfg = runs[0]["train_config"]
        sets[name] = dict(compare(runs, dest, os.path.join("figures", name, ""), name), config=cfg,
                          label=f"{cfg['epochs']} epochs" if cfg.get("epochs") else name)
    chosen = verdict.verdict_sets(collected)
    verdict_figs = verdict.verdict_figures(collected, chosen, dest)
    verdict_text = verdict.verdict_lines(*verdict.verdict_rows(collected), verdict.verdict_sets_line(collected, chosen),
                                         verdict_figs, collected, chosen)
    verdict_text += verdict.fair_lines(*verdict.fair_rows(collected, root), root)
    intro = (f"`{command}`: end metrics from each run's result.txt, the rest from its "
             "analysis.json (analysis_all.json: all tokens, with CLS); mean ± std (unbiased) over seeds.")
    with common.atomic_write(os.path.join(dest, common.SUMMARY)) as f:
        f.write(compare_summary(sets.values(), intro, verdict_text).encode())
    # the verdict's sets (six_*) have figures of their own; their uniform-graph arms (uniform_*, n_lap 4 alone) are no
    # ladder over n_lap, and uniform_vit_cls_ls12, sorted before vit, would set the ViT column's recipe
    ladders = {name: c for name, c in sets.items() if not name.startswith(("six_", "uniform_", "tuned_", "lap2"))}
    headline = fig_headline(ladders, os.path.join(dest, "figures", "headline.png"))
    written = [f for c in sets.values() for f in c["figures"]] + verdict_figs
    written += [fig_set_curves(name, runs, dest) for name, runs in collected.items()]
    written += [common.SUMMARY, os.path.join("figures", headline)]
    print("\n".join(f"wrote {os.path.join(dest, f)}" for f in written))
    common.write_result(dest, sets=",".join(sets), runs=sum(map(len, collected.values())), out=os.path.relpath(dest))

def compare_runs(results, out):
    """Several runs: the comparisons over n_lap of each kind with two or more runs, in out."""
    groups = {kind: [r for r in results if r["kind"] == kind] for kind in sorted({r["kind"] for r in results})}
    for kind in [kind for kind, group in groups.items() if len(group) < 2]:
        print(f"only one {kind} run: no {kind} comparison")
    for r in results:
        result = common.read_result(r["run"])
        r["metrics"] = run_metrics(r, result)
        r["machine"] = result.get("machine", "unrecorded")
    comparisons = [compare(group, out, f"compare_{kind}_", kind) for kind, group in groups.items() if len(group) > 1]
    intro = ("End metrics from each run's result.txt (else its log.jsonl), the rest from its analysis; mean ± std "
             "(unbiased) over seeds. Per-run analyses (analysis.json, summary.md, figures): "
             + ", ".join(f"{os.path.basename(os.path.normpath(r['run']))}/" for r in results) + ".")
    figures.write_outputs({"runs": results, "comparisons": comparisons}, compare_summary(comparisons, intro), out)
    print(f"wrote {out}: analysis.json, summary.md, " + ", ".join(f for c in comparisons for f in c["figures"]))
    return comparisons

def analysed_runs(folders):
    """The analysis of each folder given: its analysis.json, or its analysis/analysis.json (analyze.py's default)."""
    found = []
    for folder in folders:
        paths = [p for p in (os.path.join(folder, common.ANALYSIS), os.path.join(folder, "analysis", common.ANALYSIS))
                 if os.path.isfile(p)]
        analysis = _read_json(*os.path.split(paths[0])) if paths else None
        if not analysis or analysis.get("kind") not in geometry.FINAL_METRIC:
            raise UsageError(f"{folder}: no analysis.json of a run here (nor in {folder}/analysis/); analyse the run "
                             f"first: python analyze.py {folder}")
        found.append(analysis)
    return found

if __name__ == "__main__":
    config, _ = configurator.configure(globals(), [a for a in sys.argv[1:] if a.startswith("-")])
    folders = [a for a in sys.argv[1:] if not a.startswith("-")]
    if folders:  # compare analysed runs
        parent = os.path.commonpath([os.path.abspath(f) for f in folders])
        dest = figures.writable_out(out or (os.path.join(parent, "compare") if parent != os.getcwd() else "out-compare"))
        comparisons = compare_runs(analysed_runs(folders), dest)
        kinds = ",".join(c["kind"] for c in comparisons) or "none"
        common.write_result(dest, runs=len(folders), out=dest, comparisons=kinds)
    else:  # the sweep's report
        default = results == os.path.dirname(os.path.abspath(__file__))
        write_report(results, out or results, "python results/report.py" + ("" if default else f" --results={results}"))

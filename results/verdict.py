"""
The verdict: every claim of the paper, decided from the sweep's artefacts, and the reviewers' question whether a
Laplacian head needs the attention graph. CLAIMS lists each claim once with the metrics that measure it
(VERDICT_METRICS: which way is better, the paper's way, the margin of "no difference"), the regime of the paper's own
setting and the other regimes; VERDICT_SETS names the set of runs for each regime, UNIFORM_SETS the uniform-graph arm
beside two of them. The primary family is results/PLAN.md's table (primary_family): each claim on the paper's regime,
n_lap = 4 against n_lap = 0, and the attention graph against the uniform graph at n_lap = 4 (GRAPH_ROWS), with Holm's
correction over it; the claims on the other regimes are exploratory rows with p uncorrected. Every row has its 95%
interval and exact permutation p within machines, in words that follow one rule (stats.verdict_words).
results/report.py writes its tables at the top of summary.md and its figures to results/figures/verdict/.
"""

import os

import torch

import common
import figures
import geometry
import stats  # results/stats.py, beside this file
import tuning  # results/tuning.py, beside this file

# ---------------------------------------------------------------- constants
# The verdict's sets, one per regime: the six-seed set trained on one machine kind, and the three-seed set it repeats,
# which stands in while the first is not in the results folder. The verdict reads the first of each pair it finds,
# whatever its seeds: a six-seed set belongs in results/ once it is complete
VERDICT_SETS = {"vit_mean": ("six_vit_default", "vit_default"),  # mean pooling, 18 epochs: the CPU default
                "vit_cls": ("six_vit_cls", "vit_cls_amd"),  # CLS token, 4 epochs
                "vit_cls_ls": ("six_vit_cls_ls12", "vit_cls_ls12"),  # CLS token + LayerScale 1e-6, 12 epochs
                "gpt": ("six_gpt", "gpt_amd"),  # 1000 steps
                "dino": ("six_dino", "dino_amd")}  # 1.5 epochs
VIT_SETS = ("vit_mean", "vit_cls", "vit_cls_ls")
PCA_MAP_SETS = ("dino_scenes",)  # DINO on larger images (8 x 8 patches): its PCA maps are drawn beside the verdict's
# The GPT and DINO sets whose seed pair keeps the token PCA and ETF scatter (the verdict's six-seed sets keep none)
SCATTER_SETS = ("gpt_amd", "dino_amd")
# The paper's ViT follows DeiT-III (a CLS token, LayerScale 1e-6, long training): vit_cls_ls is its regime here, and the
# other ViT regimes (mean pooling; CLS without LayerScale, 4 epochs) explore
PAPER_VIT = "vit_cls_ls"
OTHER_VITS = ("vit_mean", "vit_cls")
# The paper's claims, each listed once: (the claim, the metrics that measure it, the regime of the paper's own setting,
# the other regimes). A metric on the paper's regime is a row of the primary family (n_lap 4 against 0), which Holm's
# correction over that family alone decides; on the other regimes it is an exploratory row. The family's size is
# fixed in results/PLAN.md before the seeds that decide it trained: at twelve seeds a side its 24 rows can be decided
# (6 + 6 runs of one machine allow p = 2/924, enough for at most 23 rows: 23 x 2/924 = 0.0498 < 0.05; six of each
# group on each of two machines allow 2/924^2). "Some oversmoothing is beneficial" is no comparison of its own: see
# oversmoothing_lines
CLAIMS = [("Laplacian heads raise accuracy", ("val_acc",), PAPER_VIT, OTHER_VITS),
          ("Laplacian heads lower the LM's loss", ("val_bpb",), "gpt", ()),
          ("Laplacian heads raise DINO's probe accuracy", ("knn_acc", "linear_acc"), "dino", ()),
          ("the within-sequence share falls", ("within-sequence share",), PAPER_VIT, OTHER_VITS),
          ("the between-class share rises", ("between-class share",), PAPER_VIT, OTHER_VITS),
          ("within-class ≫ between-class at n_lap 0, about equal with many Laplacian heads",
           ("within-class / between-class",), PAPER_VIT, OTHER_VITS),
          ("layerwise within-sequence collapse", ("within-sequence share, last block", "cosine, last block"),
           PAPER_VIT, OTHER_VITS),
          ("Neural Collapse", ("NC1", "NC2 equinorm", "NC2 equiangular", "NC3", "NC4"), PAPER_VIT, OTHER_VITS),
          ("simplex-ETF geometry", ("ETF vertex distance",), PAPER_VIT, OTHER_VITS),
          ("linguistic collapse", ("within-class share (next token)", "NC1 (next token)"), "gpt", ()),
          ("faster spectral decay", ("k_0.9", "k_0.99"), "gpt", ("dino",)),
          ("DINO segments objects better", ("seg_miou",), "dino", ())]
# The reviewers' question, rows 21-24 of the primary family: does a Laplacian head need the attention graph? Each
# (metric, regime): the regime's n_lap 4 runs (the attention graph) against its uniform-graph arm's (UNIFORM_SETS: the
# regime's recipe with --graph=uniform, n_lap 4 only, where every Laplacian head subtracts its sequence's mean)
GRAPH_CLAIM = "the attention graph matters to a Laplacian head"
GRAPH_ROWS = [("val_acc", PAPER_VIT), ("val_bpb", "gpt"), ("within-sequence share", PAPER_VIT),
              ("within-sequence share", "gpt")]
UNIFORM_SETS = {PAPER_VIT: "uniform_vit_cls_ls12", "gpt": "uniform_gpt"}
# The fair verdict (results/PLAN.md, section of 7 December 2026). The tuned family: rows 1-20 again, each arm at the
# factor of its learning rates that the search chose (tuning.py): an arm at factor 1 reads its regime's six_* set, an
# arm at another factor its TUNED_SETS set. The mixed graph family: n_lap 2 of 4, the attention graph (MIXED_SETS'
# first set) against the same with the Laplacian heads alone on the uniform graph (its second, --graph=lap_uniform)
TUNED_SETS = {PAPER_VIT: "tuned_vit_cls_ls12", "gpt": "tuned_gpt", "dino": "tuned_dino"}
MIXED_CLAIM = "the attention graph matters to Laplacian heads beside attention heads"
MIXED_SETS = {PAPER_VIT: ("lap2_vit_cls_ls12", "lap2u_vit_cls_ls12"), "gpt": ("lap2_gpt", "lap2u_gpt")}
MIXED_ROWS = GRAPH_ROWS  # the same metrics on the same recipes as rows 21-24
AGAINST_N_LAP_0 = "n_lap 0"  # a primary row's `against` for the paper's claims: the same set's n_lap 0 runs
# Per metric: (which way is better, the paper's way, the margin X of "no difference larger than X"). Better None:
# geometry, which has no better way (its words are "raises" and "lowers"). X a number: absolute; "10%": a tenth of
# the mean of the comparison's first group (n_lap 0; the uniform graph), for quantities whose scale differs between
# sets. Why these margins: MARGIN_REASONS
VERDICT_METRICS = {
    "val_acc": ("higher", "higher", 0.005),
    "val_bpb": ("lower", "lower", 0.01),
    "knn_acc": ("higher", "higher", 0.005),
    "linear_acc": ("higher", "higher", 0.005),
    "within-sequence share": (None, "lower", 0.02),
    "between-class share": (None, "higher", 0.02),
    "within-class / between-class": (None, "lower, to about 1", "10%"),
    "within-sequence share, last block": (None, "lower", 0.02),
    "cosine, last block": (None, "higher", 0.02),
    "NC1": (None, "lower", "10%"),
    "NC2 equinorm": (None, "lower", "10%"),
    "NC2 equiangular": (None, "lower", "10%"),
    "NC3": (None, "lower", "10%"),
    "NC4": (None, "lower", 0.005),
    "ETF vertex distance": (None, "lower", "10%"),
    "within-class share (next token)": (None, "lower", 0.02),
    "NC1 (next token)": (None, "lower", "10%"),
    "k_0.9": (None, "lower", "10%"),
    "k_0.99": (None, "lower", "10%"),
    "seg_miou": ("higher", "higher", 0.005)}
MARGIN_REASONS = [
    "accuracies, NC4 and mIoU 0.005 (half a point: below every gain the paper reports, 1 to 1.9 points, and the size "
    "of the gains the three-seed sets showed)",
    "bits per byte 0.01 (a hundredth of a bit per character, 0.4% of the loss: one n_lap step of the gpt set, n_lap 0 "
    "→ 2, +0.009)",
    "shares of the variance and cosines 0.02 (two hundredths of the total: a sixth of the largest move the three-seed "
    "sets showed, −0.124 with LayerScale, and far below the paper's 'sharp' fall)",
    "ratios, NC1-NC3, the ETF vertex distance and k_alpha 10% of the n_lap 0 mean (half the paper's change of k_0.99, "
    "547.7 → 430.4, −21%)"]

# ---------------------------------------------------------------- the rows and their tables

def verdict_metrics(r):
    """The verdict's metrics (VERDICT_METRICS' keys) of one collected run, None where its analysis has none: the end
    metrics; the within-sequence and between-class shares of the patch tokens at the final norm and the ratio of
    the within- to the between-class part (GPT: the within-class share of next-token classes, and the within-sequence
    share of a window's tokens at the final norm, the last point of its layerwise curve); the within-sequence share and
    the cosine after the last block; NC1-NC4 and the ETF vertex distance of the features the head reads (GPT: NC1 of
    next-token classes); k_alpha."""
    values = {k: v for k, v in r["metrics"].items() if k in VERDICT_METRICS}  # the end metrics (run_metrics)
    anova = r["anova"]
    nc = r.get("nc") or {}
    if r["kind"] == "gpt":
        values["within-class share (next token)"] = anova.get("within_class_frac")
        values["NC1 (next token)"] = nc.get("nc1")
        values["within-sequence share"] = r["layerwise"]["within_seq_frac"][-1]  # all of a window's tokens: no CLS
    else:
        values["within-sequence share"] = r["metrics"].get("within_seq (patch)")
        values["between-class share"] = r["metrics"].get("between_class (patch)")
        values["within-class / between-class"] = anova["within_class_frac"] / anova["between_class_frac"]
    values["within-sequence share, last block"] = r["layerwise"]["within_seq_frac"][-2]  # [-1]: the final norm
    values["cosine, last block"] = r["layerwise"]["cosine"][-2]
    pooled = nc.get("pooled", {})
    for name, key in (("NC1", "nc1"), ("NC2 equinorm", "nc2_equinorm"), ("NC2 equiangular", "nc2_equiangular"),
                      ("NC3", "nc3"), ("NC4", "nc4")):
        values[name] = pooled.get(key)
    values["ETF vertex distance"] = ((r.get("etf") or {}).get("pooled") or {}).get("vertex_dist")
    for a in geometry.ALPHAS:
        values[f"k_{a}"] = r["spectrum"].get(f"k_{a}")
    return values

def verdict_sets(collected):
    """{regime: set} of VERDICT_SETS: the first set of each pair that the results folder holds."""
    found = {}
    for regime, names in VERDICT_SETS.items():
        present = [name for name in names if name in collected]
        if present:
            found[regime] = present[0]
    return found

def at_n_lap(runs, n_lap):  # the runs of one n_lap label
    return [r for r in runs if r["n_lap_label"] == n_lap]

def by_n_lap(runs):  # [(n_lap, its runs)] for n_lap 0 and 4
    return [(k, at_n_lap(runs, k)) for k in ("0", "4")]

def primary_family():
    """The primary family, row by row as results/PLAN.md's table lists it: (claim, metric, regime, against). Rows 1-20:
    each claim's metrics on the paper's regime, against = AGAINST_N_LAP_0; rows 21-24 (GRAPH_ROWS): against = the
    regime's uniform-graph set."""
    rows = [(claim, metric, regime, AGAINST_N_LAP_0) for claim, metrics, regime, _ in CLAIMS for metric in metrics]
    return rows + [(GRAPH_CLAIM, metric, regime, UNIFORM_SETS[regime]) for metric, regime in GRAPH_ROWS]

def tuned_family():
    """The tuned family as results/PLAN.md's table lists it: rows 1-20 of the primary family on TUNED_SETS."""
    return [(claim, metric, regime, against) for claim, metric, regime, against in primary_family()
            if against == AGAINST_N_LAP_0]

def mixed_family():
    """The mixed graph family as results/PLAN.md's table lists it: (claim, metric, regime, against)."""
    return [(MIXED_CLAIM, metric, regime, MIXED_SETS[regime][1]) for metric, regime in MIXED_ROWS]

def tuned_arms(collected, root):
    """{regime: (runs at n_lap 0, runs at n_lap 4, the factors, why)} of the tuned family: each arm's runs at the
    factor the search chose (tuning.choices), from the six_* set at factor 1, else from TUNED_SETS; the runs are
    None while the search or the tuned set is not complete."""
    chosen = tuning.choices(root)
    arms = {}
    for regime, tuned in TUNED_SETS.items():
        recipe = VERDICT_SETS[regime][0]
        factors = [chosen[recipe, n_lap][0] for n_lap in ("0", "4")]
        runs = []
        for n_lap, factor in zip(("0", "4"), factors):
            source = recipe if factor == "1" else tuned
            found = at_n_lap(collected.get(source, []), n_lap) if factor else []
            runs.append(found if len(found) == 12 else None)
        why = "; ".join(f"n_lap {n}: {chosen[recipe, n][1]}" for n in ("0", "4"))
        arms[regime] = (*runs, factors, why)
    return arms

def family_rows(pairs):
    """Rows of one family from [(claim, metric, set, against, runs A, runs B)]: verdict_row, Holm over the rows
    present, the detectable difference and the rule's words."""
    rows = []
    for claim, metric, name, against, runs_a, runs_b in pairs:
        row = verdict_row(metric, runs_a, runs_b) if runs_a and runs_b else None
        if row:
            rows.append(dict(row, claim=claim, set=name, against=against))
    return decide_family(rows)

def decide_family(rows):
    """A family's rows decided together: Holm's correction over them, the smallest difference each detects with 80%
    power at the family's size, and the rule's words from the corrected p."""
    for row, corrected in zip(rows, stats.holm([row["p"] for row in rows])):
        row["holm"] = corrected
        row["detectable"] = stats.detectable_difference(row["se"], row["df"], len(rows))
        row["words"] = stats.verdict_words(row["diff"], row["low"], row["high"], corrected, row["better"], row["margin"])
    return rows

def fair_rows(collected, root):
    """The tuned family's rows (each arm at its chosen factor) and the mixed graph family's (group A: the uniform graph
    for the Laplacian heads, B: the attention graph, both at n_lap 2), each a family of its own."""
    arms = tuned_arms(collected, root)
    tuned = family_rows([(claim, metric, TUNED_SETS[regime], against, arms[regime][0], arms[regime][1])
                         for claim, metric, regime, against in tuned_family()])
    mixed = family_rows([(claim, metric, MIXED_SETS[regime][0], against, at_n_lap(collected.get(against, []), "2"),
                          at_n_lap(collected.get(MIXED_SETS[regime][0], []), "2"))
                         for claim, metric, regime, against in mixed_family()])
    for row in mixed:
        row["paper"] = "—"
    return tuned, mixed, arms

def verdict_rows(collected):
    """The verdict's rows (verdict_row): the primary family (primary_family) on verdict_sets, each row present where its
    sets are, with Holm's correction over the rows present and the smallest difference each detects with 80% power
    (stats.detectable_difference); and the exploratory rows (each claim's metrics on the other regimes), with their p
    uncorrected; each with the rule's words (stats.verdict_words). A row compares group A (`against`: the set's n_lap
    0 runs, or the uniform-graph set's) with group B (the set's n_lap 4 runs): diff = mean(B) - mean(A)."""
    chosen = verdict_sets(collected)
    primary, exploratory = [], []
    for claim, metric, regime, against in primary_family():
        if regime not in chosen or (against != AGAINST_N_LAP_0 and against not in collected):
            continue
        runs = collected[chosen[regime]]
        group_a = at_n_lap(runs, "0") if against == AGAINST_N_LAP_0 else at_n_lap(collected[against], "4")
        row = verdict_row(metric, group_a, at_n_lap(runs, "4"))
        if row:  # None: a metric the set's analyses lack
            if claim == GRAPH_CLAIM:
                row["paper"] = "—"  # the paper has no uniform-graph arm
            primary.append(dict(row, claim=claim, set=chosen[regime], against=against))
    for claim, metrics, _, other_regimes in CLAIMS:
        for metric in metrics:
            for regime in [g for g in other_regimes if g in chosen]:
                row = verdict_row(metric, *[runs for _, runs in by_n_lap(collected[chosen[regime]])])
                if row:
                    exploratory.append(dict(row, claim=claim, set=chosen[regime], against=AGAINST_N_LAP_0))
    decide_family(primary)
    for row in exploratory:
        row["words"] = stats.verdict_words(row["diff"], row["low"], row["high"], row["p"], row["better"], row["margin"],
                                           primary=False)
    return primary, exploratory

def verdict_row(metric, runs_a, runs_b):
    """Group B's runs against group A's in one metric: the means, the difference mean(B) - mean(A) with its 95%
    interval (welch_interval) and that interval's standard error and degrees of freedom, the exact permutation p
    within machines, the smallest p those runs allow (floor), the margin, the machines; None where a group has no
    value."""
    groups = [[(verdict_metrics(r).get(metric), r["machine"], r["seed"]) for r in runs] for runs in (runs_a, runs_b)]
    groups = [[run for run in g if run[0] is not None] for g in groups]
    if not all(groups):
        return None
    v0, v1 = ([v for v, _, _ in g] for g in groups)
    pairs0, pairs1 = ([(v, machine) for v, machine, _ in g] for g in groups)
    # the smallest p these runs allow: that of every group B run above every group A run
    ranks0 = [(i, machine) for i, (_, machine) in enumerate(pairs0)]
    ranks1 = [(len(pairs0) + i, machine) for i, (_, machine) in enumerate(pairs1)]
    better, paper, margin = VERDICT_METRICS[metric]
    mean0 = stats.mean_std(v0)
    if isinstance(margin, str):  # a share of group A's mean
        margin = float(margin.rstrip("%")) / 100 * abs(mean0["mean"])
    diff, low, high = stats.welch_interval(v0, v1)
    se, df = stats.welch_se_df(v0, v1)
    machines_a, machines_b = (machine_seeds([(machine, seed) for _, machine, seed in g]) for g in groups)
    return dict(metric=metric, better=better, paper=paper, margin=margin, mean0=mean0, mean1=stats.mean_std(v1),
                diff=diff, low=low, high=high, se=se, df=df, p=stats.permutation_p(pairs0, pairs1),
                floor=stats.permutation_p(ranks0, ranks1),
                machines=machines_a if machines_a == machines_b else f"A: {machines_a}; B: {machines_b}")

def machine_seeds(pairs):  # "machine (seeds 0, 1, 2); ..." of (machine, seed) pairs
    seeds = {}
    for machine, seed in pairs:
        seeds.setdefault(machine, set()).add(seed)
    return "; ".join(f"{machine} (seeds {', '.join(map(str, sorted(s)))})" for machine, s in sorted(seeds.items()))

def verdict_lines(primary, exploratory, sets_line, figures, collected, chosen):
    """summary.md's verdict: the primary family's table and the exploratory rows' table, how they were computed, the
    rule, the margins, the oversmoothing claim, the reviewers' question."""
    lines = ["## Verdict: every claim of the paper, n_lap = 4 against n_lap = 0; the attention graph against the "
             "uniform graph", "", sets_line, ""]
    if not primary + exploratory:
        return lines + ["None of the verdict's sets is in this results folder."]
    m = len(primary)
    lines += [f"Primary family (results/PLAN.md): one comparison per claim and metric of the paper, each on the set of "
              f"the paper's own regime ({_set_names(primary)}; the ViT's is DeiT-III's recipe: a CLS token, LayerScale "
              f"1e-6, 12 epochs), n_lap = 4 against n_lap = 0, and the attention graph against the uniform graph at "
              f"n_lap = 4 where a uniform-graph set is here ({', '.join(UNIFORM_SETS.values())}); m = {m} rows, "
              f"decided by Holm's correction over these {m} alone:", ""]
    lines += verdict_table(primary, primary=True)
    lines += ["", f"Exploratory rows: the same claims on the other regimes ({_set_names(exploratory)}), outside the "
              "primary family: their p is not corrected, and their words name no way:", ""]
    lines += verdict_table(exploratory, primary=False)
    floors = sorted(r["floor"] for r in primary) or [1.0]
    allowed = f"{floors[0]:.3g}" + (f" to {floors[-1]:.3g}" if floors[-1] > floors[0] else "")
    lines += ["", "A, B: a primary row compares group A (against: the set's n_lap 0 runs, or a uniform-graph set's "
              "runs, --graph=uniform at n_lap 4) with group B (the set's n_lap 4 runs, on the attention graph); an "
              "exploratory row n_lap 0 with n_lap 4. B − A, 4 − 0: the difference of means; its 95% interval by "
              "Student's t with Welch's degrees of freedom (diff ± t · sqrt(s0²/n0 + s1²/n1), the unbiased std s; t "
              "computed exactly). p: the exact permutation p of the difference, exchanging group labels only between "
              "runs of one machine. Holm p: Holm's step-down correction over the m = "
              f"{m} rows of the primary family (the i-th smallest p times {m} − i + 1, never below a smaller p's, at "
              f"most 1). detectable (80%): the smallest |B − A| the design detects with 80% power at the row's "
              f"observed spread, (t_(1 − α/(2m)) + t_0.8) · se with α = 0.05, m = {m} (Bonferroni's level α/m, Holm's "
              "first and strictest step) and se = sqrt(s0²/n0 + s1²/n1) and the degrees of freedom of the row's Welch "
              "interval: the usual normal-theory approximation, the effect against which 'undecided' and 'no "
              "difference larger than X' read. The smallest p a row's runs allow (every B run beyond every A run) is "
              "2 / C(n0 + n1, n0) where one machine trained them all (3 + 3 runs 0.1, 6 + 6 runs 0.0022); where "
              "several did, 1 or 2 over the product of each machine's C(n_m, k_m) (its n_m runs, k_m of them B's): "
              "six runs of each group on each of two machines allow 2 / 924² = 2.3e-06. The primary rows' runs allow "
              f"p down to {allowed}, so no Holm p there can be below {m} × {floors[0]:.3g} = "
              f"{min(1.0, m * floors[0]):.3g}.",
              "", "The rule: a primary row reads 'helps' or 'hurts' (end metrics, by their better way) or 'raises' or "
              "'lowers' (geometry, which has no better way) only where its Holm p is below 0.05; an exploratory row "
              "whose uncorrected p is below 0.05 reads 'differs at uncorrected p=…, exploratory', never 'helps', "
              "'hurts', 'raises' or 'lowers'; any other row reads 'no difference larger than X' where its 95% "
              "interval lies inside ±X, otherwise 'undecided'. In the rows of 'the attention graph matters' 'helps' "
              "means that the attention graph gives the better value. paper: the way the paper finds the metric "
              "moving with Laplacian heads (—: the paper has no uniform-graph arm).",
              "", "Margins X: " + "; ".join(MARGIN_REASONS) + ".", "",
              "Metrics: the shares are of the patch tokens' variance at the final norm (ANOVA; the GPT's "
              "within-sequence share: of a window's tokens); 'last block': before the final norm; NC1-NC4 and the "
              "ETF vertex distance are of the features the head reads (the mean of the patch tokens, or the CLS "
              "token); the GPT's other shares and NC1 are of next-token classes; val_loss is val_bpb × ln 2 for "
              "these character-level runs (one byte per character), so only val_bpb is tested."]
    lines += oversmoothing_lines(primary)
    lines += views_lines(collected, chosen)
    lines += graph_lines(primary)
    return lines + ["", "Figures: " + ", ".join(figures)]

def verdict_table(rows, primary, b="set, n_lap = 4"):
    """The verdict's rows as a table: the claim, metric, set, (a primary family:) what it is compared against, the
    machines, the means, the difference with its interval, p (a primary family: Holm's p and the detectable
    difference), the paper's way, the margin X and the rule's words. b: what group B is."""
    if primary:
        header = (f"| claim | metric | set | against | machine (seeds) | A: against | B: {b} | "
                  "B − A [95% interval] | p | Holm p | detectable (80%) | paper | X | verdict |")
    else:
        header = ("| claim | metric | set | machine (seeds) | n_lap = 0 | n_lap = 4 | 4 − 0 [95% interval] | "
                  "p (uncorrected) | paper | X | reading |")
    columns = header.count(" | ") + 1
    lines = [header, "|---" * columns + "|"]
    for r in rows:
        interval = "n/a" if r["low"] is None else f"[{r['low']:+.4g}, {r['high']:+.4g}]"
        against = f" {r['against']} |" if primary else ""
        p = f"{r['p']:.3g} | {r['holm']:.3g} | {figures.fmt(r['detectable'], '.3g')}" if primary else f"{r['p']:.3g}"
        lines.append(f"| {r['claim']} | {r['metric']} | {r['set']} |{against} {r['machines']} | "
                     f"{stats.mean_std_text(r['mean0'])} | {stats.mean_std_text(r['mean1'])} | {r['diff']:+.4g} "
                     f"{interval} | {p} | {r['paper']} | {r['margin']:.4g} | {r['words']} |")
    return lines

def _set_names(rows):  # the sets of the rows, each once, in their order
    return ", ".join(dict.fromkeys(r["set"] for r in rows))

def oversmoothing_lines(rows):
    """summary.md: "some oversmoothing is beneficial", read from two primary rows of a set (no comparison of its own):
    it holds where the within-sequence share is decided lower and the accuracy decided higher, is contradicted where
    either is decided the other way, and finds no gain where the share is lower and accuracy bounded."""
    rows = [r for r in rows if r.get("claim") != GRAPH_CLAIM]  # n_lap 4 against 0, not the graph against the uniform one
    words = {(r["set"], r["metric"]): r["words"].split(" (decided")[0] for r in rows}  # the way alone
    sets = [r["set"] for r in rows if r["metric"] == "within-sequence share" and (r["set"], "val_acc") in words]
    lines = ["", "'Some oversmoothing is beneficial', read from two rows of the primary family (no comparison of its "
             "own): it holds where the within-sequence share is decided lower and val_acc decided higher; it is "
             "contradicted where either is decided the other way; smoother without a gain where the share is decided "
             "lower and val_acc has no difference larger than X; otherwise undecided.", "",
             "| set | within-sequence share | val_acc | some oversmoothing is beneficial |", "|---|---|---|---|"]
    for name in sets:
        share, acc = words[name, "within-sequence share"], words[name, "val_acc"]
        if (share, acc) == ("lowers", "helps"):
            holds = "holds"
        elif share == "raises" or acc == "hurts":
            holds = "contradicted"
        elif share == "lowers" and acc.startswith("no difference"):
            holds = "smoother without a gain"
        else:
            holds = "undecided"
        lines.append(f"| {name} | {share} | {acc} | {holds} |")
    return lines

def views_lines(collected, chosen):
    """summary.md: where the tokens are read. The within-sequence share is the within-sequence variance over the total;
    per set of the paper's ViT regime and the GPT (where its analyses keep the variances), the within- and
    between-sequence variance (total minus within) after
    the last block (before the final norm) and at the final norm, n_lap 0 and 4, mean ± std over seeds, and in how many
    seeds (paired by seed) n_lap 4's value is the larger. Descriptive: no test, no word of direction."""
    lines = ["", "Where the tokens are read: the within-sequence share is within / (within + between). Per view, the "
             "within- and between-sequence variance and the share, n_lap = 0 and 4, mean ± std over seeds; 'n_lap 4 "
             "larger': in how many seeds (paired) the n_lap 4 run's value is the larger. Descriptive, no test.", "",
             "| set | view | quantity | n_lap = 0 | n_lap = 4 | n_lap 4 larger |", "|---|---|---|---|---|---|"]
    for regime in (PAPER_VIT, "gpt"):
        if regime not in chosen:
            continue
        runs = {n: {r["seed"]: r["layerwise"]["anova"] for r in at_n_lap(collected[chosen[regime]], n)
                    if "anova" in r["layerwise"]} for n in "04"}  # the GPT's analyses keep the shares alone
        seeds = sorted(set(runs["0"]) & set(runs["4"]))
        for view, index in (("after the last block (before the final norm)", -2), ("at the final norm", -1)):
            for quantity in ("within-sequence variance", "between-sequence variance", "within-sequence share"):
                v0 = [view_value(runs["0"][s][index], quantity) for s in seeds]
                v4 = [view_value(runs["4"][s][index], quantity) for s in seeds]
                if not seeds:
                    continue
                larger = sum(b > a for a, b in zip(v0, v4))
                lines.append(f"| {chosen[regime]} | {view} | {quantity} | {stats.mean_std_text(stats.mean_std(v0))} | "
                             f"{stats.mean_std_text(stats.mean_std(v4))} | {larger} of {len(seeds)} |")
    return lines

def view_value(anova, quantity):  # one quantity of views_lines from one layer's ANOVA
    if quantity == "within-sequence variance":
        return anova["within_seq_var"]
    if quantity == "between-sequence variance":
        return anova["total_var"] - anova["within_seq_var"]
    return anova["within_seq_frac"]

def graph_answer(primary):
    """The reviewers' question answered by results/PLAN.md's rule from the primary rows of GRAPH_CLAIM: "the graph
    matters" where one of them is decided (its Holm p below 0.05); "the graph does not matter beyond X" where every
    one of GRAPH_ROWS is here and reads "no difference larger than X"; otherwise "undecided"."""
    rows = [r for r in primary if r["claim"] == GRAPH_CLAIM]
    if any(r["holm"] < stats.ALPHA for r in rows):
        return "the graph matters"
    if len(rows) == len(GRAPH_ROWS) and all(r["words"].startswith("no difference larger than") for r in rows):
        return "the graph does not matter beyond X"
    return "undecided"

def graph_lines(primary):
    """summary.md: the reviewers' question, its rows of the primary family and the answer (graph_answer)."""
    rows = [r for r in primary if r["claim"] == GRAPH_CLAIM]
    lines = ["", "The ICLR reviewers' question, 'does a Laplacian head need the attention graph?', answered from the "
             f"primary family's rows of '{GRAPH_CLAIM}' (results/PLAN.md's rows 21-24) by PLAN.md's rule: 'the graph "
             "matters' where one of them is decided; 'the graph does not matter beyond X' where all four read 'no "
             "difference larger than X' (each with its own X); otherwise undecided.", ""]
    if rows:
        lines += ["| metric | set | against | B − A | verdict |", "|---|---|---|---|---|"]
        lines += [f"| {r['metric']} | {r['set']} | {r['against']} | {r['diff']:+.4g} | {r['words']} |" for r in rows]
        lines += [""]
    missing = "" if rows else (f" (none of its rows is here: {' and '.join(UNIFORM_SETS.values())} are not in this "
                               "results folder)")
    return lines + [f"Answer: {graph_answer(primary)}{missing}."]

def verdict_sets_line(collected, chosen):  # summary.md: each regime's verdict set (GPT: its corpus), the uniform arms
    parts = []
    for regime, names in VERDICT_SETS.items():
        if regime not in chosen:
            parts.append(f"{regime}: none of {', '.join(names)} here")
            continue
        name = chosen[regime]
        note = "" if name == names[0] else f", standing in for {names[0]}"
        if regime == "gpt":
            corpora = sorted({common.read_result(r["run"]).get("corpus", "unrecorded") for r in collected[name]})
            note += f", corpus {', '.join(corpora)}"
        parts.append(f"{regime}: {name}{note}")
    uniform = [name for name in UNIFORM_SETS.values() if name in collected]
    parts.append("uniform graph: " + (", ".join(uniform) or f"none of {', '.join(UNIFORM_SETS.values())} here"))
    return "Verdict sets (VERDICT_SETS in results/verdict.py): " + "; ".join(parts) + "."

def fair_lines(tuned, mixed, arms, root):
    """summary.md: the learning-rate search's table, the tuned family (or what it waits for) and the mixed graph
    family with the answer to the reviewers' question by results/PLAN.md's rule."""
    search = tuning.table_lines(root)
    lines = ["", *search, ""] if search else [""]
    lines += ["### The tuned family: rows 1-20, each arm at the factor of its learning rates that the search chose", "",
              "results/PLAN.md (7 December 2026): an arm at factor 1 keeps its twelve-seed runs (six_*), an arm at "
              "another factor trains seeds 0-11 at it (tuned_*); Holm's correction over the rows present, apart from "
              "the first family. Arms per regime:", ""]
    for regime, (runs0, runs4, factors, why) in arms.items():
        state = "both at 1: the twelve-seed rows are the tuned rows" if factors == ["1", "1"] else (
            "runs complete" if runs0 and runs4 else "waiting for runs")
        lines.append(f"- {TUNED_SETS[regime]}: n_lap 0 × {factors[0] or '?'}, n_lap 4 × {factors[1] or '?'} "
                     f"({why}); {state}.")
    lines += [""] + (verdict_table(tuned, primary=True) if tuned else ["No row of the tuned family is complete yet."])
    lines += ["", "### The mixed graph family: does a Laplacian head beside attention heads need its attention graph?", "",
              "results/PLAN.md (7 December 2026): n_lap 2 of 4 heads Laplacian, group A with the Laplacian heads alone "
              "on the uniform graph (--graph=lap_uniform: value minus the sequence's mean, the GPT's running mean; "
              "the two attention heads keep softmax; no queries or keys for the Laplacian heads: the ViT 189,130 "
              "parameters against 205,770, the GPT 742,400 against 807,936), group B on the attention graph; seeds "
              "0-23 a side; Holm's correction over these rows alone.", ""]
    lines += verdict_table(mixed, primary=True, b="set, n_lap = 2") if mixed else ["No row of it is here yet."]
    return lines + ["", f"Answer: {mixed_answer(mixed)}."]

def mixed_answer(rows):
    """The reviewers' question where attention heads remain, by results/PLAN.md's rule: decided where a row is decided,
    "not beyond X" where all four rows are here and bounded, else undecided."""
    decided = [r for r in rows if r["holm"] < stats.ALPHA]
    if decided:
        said = ", ".join(f"{r['metric']} ({r['set']}: {r['words']})" for r in decided)
        return f"a Laplacian head beside attention heads needs its attention graph: {said}"
    if len(rows) == len(MIXED_ROWS) and all(r["words"].startswith("no difference larger than") for r in rows):
        return "a Laplacian head beside attention heads does not need its attention graph beyond each row's X"
    return "undecided" + ("" if len(rows) == len(MIXED_ROWS) else f" ({len(rows)} of {len(MIXED_ROWS)} rows here)")

# ---------------------------------------------------------------- the verdict's figures

def verdict_figures(collected, chosen, dest):
    """The verdict's figures in dest/figures/verdict/, n_lap 0 against 4: the ViT's ETF class means, each paradigm's
    within-sequence PCA spectrum, and one seed's per-run figures (run_pair) one above the other: DINO's PCA maps,
    and where the run folders keep them the token PCA and ETF scatter. Returns their paths in dest."""
    if not chosen:
        return []
    folder = os.path.join(dest, "figures", "verdict")
    os.makedirs(folder, exist_ok=True)
    figures = []
    vit_sets = [chosen[g] for g in VIT_SETS if g in chosen]
    if vit_sets and all(r.get("etf") for name in vit_sets for r in collected[name]):
        panels = [(name, by_n_lap(collected[name])) for name in vit_sets]
        figures.append(fig_etf_means(panels, os.path.join(folder, "etf_means_vit.png")))
    for paradigm, regimes in (("vit", VIT_SETS), ("gpt", ("gpt",)), ("dino", ("dino",))):
        panels = [(chosen[g], by_n_lap(collected[chosen[g]])) for g in regimes if g in chosen]
        if panels:
            figures.append(fig_pca_spectra(panels, paradigm, os.path.join(folder, f"pca_spectrum_{paradigm}.png")))
    dino_sets = [chosen[g] for g in ("dino",) if g in chosen] + [name for name in PCA_MAP_SETS if name in collected]
    scatter_sets = vit_sets + [name for name in SCATTER_SETS if name in collected]
    for png, names in (("pca_maps.png", dino_sets), ("pca.png", scatter_sets), ("etf.png", scatter_sets)):
        for name in names:
            pair = run_pair(collected[name], png)
            if pair:  # analyze.py draws the same images in every run of a dataset: one seed's two runs show them
                figures.append(fig_stack(pair, os.path.join(folder, f"{png[:-4]}_{name}.png")))
    return [os.path.join("figures", "verdict", f) for f in figures]

def run_pair(runs, png):
    """The per-run figure png of the n_lap 0 and the n_lap 4 run of the lowest seed whose run folders both keep it, or
    None. sweep.sh keeps DINO's pca_maps.png; pca.png and etf.png (the paper's token PCA and ETF scatter) stay in
    the run's analysis folder unless copied next to its analysis.json."""
    found = {(r["n_lap_label"], r["seed"]): os.path.join(r["run"], png) for r in runs
             if os.path.isfile(os.path.join(r["run"], png))}
    seeds = sorted(seed for n_lap, seed in found if n_lap == "0" and ("4", seed) in found)
    return [found["0", seeds[0]], found["4", seeds[0]]] if seeds else None

def fig_etf_means(panels, path):
    """Per ViT set (columns), n_lap 0 (top) and 4 (bottom): each seed's three class means of the features the head
    reads (dots) and the three classifier rows (crosses) in the plane of those rows (analysis.json's "etf"), each in
    units of its mean radius, with the triangle where Neural Collapse puts them. The means alone cannot show the
    spread around them: the titles give the vertex distance (the points' mean distance to their vertex, in radii)."""
    plt = figures.pyplot()
    fig, axes = plt.subplots(2, len(panels), figsize=(3.6 * len(panels), 7.2), squeeze=False)
    triangle = geometry.TRIANGLE.T
    for column, (name, groups) in zip(axes.T, panels):
        for ax, (n_lap, runs) in zip(column, groups):
            ax.fill(triangle[:, 0], triangle[:, 1], fill=False, ls="--", color="gray", lw=1)
            for r in runs:
                means = torch.tensor(r["etf"]["pooled"]["class_means_2d"])
                rows = torch.tensor(r["etf"]["classifier_rows_2d"])
                for k, (mean, row) in enumerate(zip(means / means.norm(dim=1).mean(), rows / rows.norm(dim=1).mean())):
                    ax.scatter(*mean.tolist(), s=20, color=plt.cm.tab10(k), label=f"class {r['etf']['classes'][k]}")
                    ax.scatter(*row.tolist(), s=30, marker="x", color=plt.cm.tab10(k))
            distance = stats.mean_std(r["etf"]["pooled"]["vertex_dist"] for r in runs)
            ax.set(aspect="equal", xlim=(-1.25, 1.25), ylim=(-0.8, 1.2), xlabel="classifier rows' plane: axis 1",
                   ylabel="axis 2")
            ax.set_title(f"{name}, n_lap={n_lap}\nvertex distance {stats.mean_std_text(distance)}", fontsize=9)
            ax.grid(alpha=0.3)
    handles, labels = axes[0, 0].get_legend_handles_labels()
    axes[0, 0].legend(handles[:3], labels[:3], fontsize=7)  # the three classes, once
    fig.suptitle("ETF: each seed's class means (dots) and classifier rows (crosses), in radii\n"
                 f"{figures.LOOK_FOR['etf']}", fontsize=8)
    return figures.save_figure(fig, path)

def fig_pca_spectra(panels, paradigm, path):
    """Per set (panels), n_lap 0 against 4: the share of a sequence's variance outside its top j principal directions
    (its within-sequence PCA, analysis.json's mean spectrum), mean over seeds, on a log scale; k_0.9 and k_0.99 are
    read where a sequence's curve crosses 0.1 and 0.01 (they average per-sequence k, the curve is of the mean)."""
    plt = figures.pyplot()
    fig, axes = plt.subplots(1, len(panels), figsize=(max(6.0, 4.4 * len(panels)), 3.8), squeeze=False)
    for ax, (name, groups) in zip(axes[0], panels):
        for (n_lap, runs), style in zip(groups, ("o-", "s--")):
            rest = []
            for r in runs:
                lam = torch.tensor(r["spectrum"]["lambda_mean"], dtype=torch.float64)
                rest.append(1 - lam.cumsum(0) / lam.sum())
            curve = torch.stack(rest).mean(0)
            keep = curve > 1e-3  # k_0.99 is read at 0.01; past the centred rank the rest is 0, off a log plot
            k99 = stats.mean_std(r["spectrum"]["k_0.99"] for r in runs)
            ax.plot(torch.arange(1, len(curve) + 1)[keep].tolist(), curve[keep].tolist(), style, ms=3,
                    label=f"n_lap={n_lap}: $k_{{0.99}}$ = {stats.mean_std_text(k99)}")
        for level in (0.1, 0.01):
            ax.axhline(level, color="gray", lw=0.8, ls=":")
        ax.set(xscale="log", yscale="log", title=name, xlabel="top j principal directions of a sequence's tokens",
               ylabel="share of its variance outside them")
        ax.legend(fontsize=7)
        ax.grid(alpha=0.3)
    fig.suptitle(f"{paradigm}: within-sequence PCA, mean over seeds\n{figures.LOOK_FOR['spectrum']}", fontsize=8)
    return figures.save_figure(fig, path)

def fig_stack(paths, path):
    """PNG figures of one width one above the other, pixel for pixel."""
    plt = figures.pyplot()
    pixels = torch.cat([torch.from_numpy(plt.imread(p)) for p in paths])  # floats k / 255
    plt.imsave(path, pixels.mul(255).round().to(torch.uint8).numpy())
    return os.path.basename(path)

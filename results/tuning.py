"""
The learning-rate search of results/PLAN.md (section of 7 December 2026): each arm (n_lap 0 and 4) of the verdict's
three recipes trained at factors of all its learning rates on the held-out tenth of the training data, the factor
each arm keeps by the plan's rule, and the table summary.md and RESULTS.md give. The trials' artefacts are
results/lr_search/<recipe>-x<factor>/k<n_lap>-s<seed>/ (result.txt, or diverged.txt for a run stopped by a
non-finite loss), written by results/sweep.sh's function `search`. It imports nothing of the repository's.
"""

import glob
import math
import os

# each recipe's selection metric and its better way
RECIPES = {"six_vit_cls_ls12": ("val_acc", "higher"), "six_gpt": ("val_bpb", "lower"), "six_dino": ("knn_acc", "higher")}
SEEDS = {"six_vit_cls_ls12": (100, 101), "six_gpt": (100, 101), "six_dino": (100, 101, 102)}
GRID = ("0.5", "0.71", "1", "1.41", "2")  # the factors 2^(i/2), i = -2..2, as sweep.sh names them
EXTENSION = {"0.5": "0.35", "2": "2.83"}  # one more step beyond an edge, once
N_LAPS = ("0", "4")
FOLDER = "lr_search"

def read_trials(root):
    """{(recipe, n_lap): {factor: {seed: value, or None for a diverged run}}} of root/lr_search/."""
    trials = {}
    for path in sorted(glob.glob(os.path.join(glob.escape(root), FOLDER, "*-x*", "k*-s*"))):
        trial, run = path.split(os.sep)[-2:]
        recipe, factor = trial.rsplit("-x", 1)
        n_lap, seed = run[1:].split("-s")
        if recipe not in RECIPES:
            continue
        result = os.path.join(path, "result.txt")
        if os.path.isfile(result):
            words = dict(w.split("=", 1) for w in open(result).read().split() if "=" in w)
            value = float(words[RECIPES[recipe][0]])
        elif os.path.isfile(os.path.join(path, "diverged.txt")):
            value = None
        else:
            continue
        trials.setdefault((recipe, n_lap), {}).setdefault(factor, {})[int(seed)] = value
    return trials

def mean_metric(runs, recipe):
    """The selection metric's mean over the plan's seeds of one factor; None while a seed is missing; minus or plus
    infinity (the worst) where a run diverged."""
    better = RECIPES[recipe][1]
    if not all(s in runs for s in SEEDS[recipe]):
        return None
    values = [runs[s] for s in SEEDS[recipe]]
    if any(v is None for v in values):
        return -float("inf") if better == "higher" else float("inf")
    return sum(values) / len(values)

def choose(factors, recipe):
    """The plan's rule for one arm, from {factor: {seed: value}}: (chosen factor, or None while trials are missing,
    why). The best mean of the grid; a tie goes to the factor nearer 1; a choice at an edge waits for that side's
    extension and is then made again over the six factors, once."""
    better = RECIPES[recipe][1]
    means = {f: mean_metric(factors.get(f, {}), recipe) for f in GRID}
    missing = sum(s not in factors.get(f, {}) for f in GRID for s in SEEDS[recipe])
    if missing:
        return None, f"{missing} of {len(GRID) * len(SEEDS[recipe])} trials to go"
    best = pick(means, better)
    if best not in EXTENSION:
        return best, "inside the grid"
    step = EXTENSION[best]
    means[step] = mean_metric(factors.get(step, {}), recipe)
    if means[step] is None:
        return None, f"{best} is at the edge: waiting for factor {step}"
    final = pick(means, better)
    return final, f"{best} at the edge; grid extended to {step}" + (", still at the edge" if final == step else "")

def pick(means, better):  # the best mean; a tie to the factor nearer 1: fewer steps 2^(1/2) away from it
    def key(factor):
        value = means[factor] if better == "higher" else -means[factor]
        return value, -abs(round(2 * math.log2(float(factor))))
    return max(means, key=key)

def choices(root):
    """{(recipe, n_lap): (factor or None, why)} for every arm of the plan."""
    trials = read_trials(root)
    return {(recipe, n_lap): choose(trials.get((recipe, n_lap), {}), recipe) for recipe in RECIPES for n_lap in N_LAPS}

def table_lines(root):
    """summary.md's table of the search: per recipe and arm, the mean selection metric of each factor with its seeds,
    and the factor chosen; empty without trials."""
    trials = read_trials(root)
    if not trials:
        return []
    factors = list(GRID) + sorted({f for arm in trials.values() for f in arm} - set(GRID), key=float)
    lines = ["### The learning-rate search (results/PLAN.md, 7 December 2026)", "",
             "Each arm at factors of all its recipe's learning rates, trained on all but the last tenth of the training "
             "data and evaluated on that tenth (--holdout=0.1; the validation data unread), selection seeds "
             + "; ".join(f"{r} {', '.join(map(str, s))}" for r, s in SEEDS.items())
             + ". A cell: the mean selection metric over the seeds trained so far (their count; 'diverged' where a "
             "run stopped on a non-finite loss). Chosen: the plan's rule (the best mean, ties to the factor nearer 1, "
             "one extension at an edge).", "",
             "| recipe | metric | n_lap | " + " | ".join(f"× {f}" for f in factors) + " | chosen |",
             "|---" * (len(factors) + 4) + "|"]
    for recipe, (metric, better) in RECIPES.items():
        for n_lap in N_LAPS:
            arm = trials.get((recipe, n_lap), {})
            cells = [cell(arm.get(f, {})) for f in factors]
            chosen, why = choose(arm, recipe)
            lines.append(f"| {recipe} | {metric} ({better}) | {n_lap} | " + " | ".join(cells)
                         + f" | {chosen or '—'} ({why}) |")
    return lines

def cell(runs):  # one factor's mean over the seeds trained so far, with their count
    if not runs:
        return ""
    if any(v is None for v in runs.values()):
        return "diverged"
    return f"{sum(runs.values()) / len(runs):.4f} ({len(runs)})"

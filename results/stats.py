"""
The statistics of results/report.py's comparisons and verdict, on plain lists of numbers (one per seed): mean and
std, the effect of n_lap with its standard error, the exact permutation p with labels exchanged within a machine,
Spearman's trend, the 95% interval of a difference of means by Student's t with Welch's degrees of freedom, Holm's
step-down correction, and the words of the verdict's rule. It imports nothing of the repository's.
"""

import itertools
import math

import torch

ALPHA = 0.05  # the level below which a p decides a verdict's row, and that of the 95% intervals

# ---------------------------------------------------------------- summaries over seeds: means, effects, trends

def mean_std(values):  # {mean, std (unbiased; 0 for one value), n} of the values that are not None
    v = torch.tensor([x for x in values if x is not None], dtype=torch.float64)
    std = (v.std().item() if len(v) > 1 else 0.0) if len(v) else None  # unbiased
    return dict(mean=v.mean().item() if len(v) else None, std=std, n=len(v))

def mean_std_text(d):  # a mean_std for a table: mean ± std (the std only over several seeds)
    if d["mean"] is None:
        return "n/a"
    return f"{d['mean']:.4g}" + (f" ± {d['std']:.2g}" if d["n"] > 1 else "")

def effect(v0, v1):
    """The difference of means mean(v1) - mean(v0) of two groups of seeds, its standard error sqrt(s0^2/n0 + s1^2/n1)
    (s: the unbiased std; None with one seed in a group) and whether every v1 lies strictly beyond every v0 (None
    with one seed in a group: one run against one says nothing about the spread)."""
    s0, s1 = mean_std(v0), mean_std(v1)
    if min(s0["n"], s1["n"]) < 2:
        return s1["mean"] - s0["mean"], None, None
    se = math.sqrt(s0["std"] ** 2 / s0["n"] + s1["std"] ** 2 / s1["n"])
    return s1["mean"] - s0["mean"], se, min(v1) > max(v0) or max(v1) < min(v0)

def permutation_p(pairs0, pairs1):
    """Exact two-sided permutation p of the difference of means of two groups of (value, machine) pairs, with the labels
    exchanged only between runs of one machine (floats differ between machines, so only those runs are exchangeable):
    the share of all such relabelings whose |difference| reaches the observed one. 3 + 3 runs of one machine: at
    least 2/20 = 0.10; a set that mixes machines as 1 + 1 and 2 + 2 runs: at least 2/12."""
    machines = sorted({m for _, m in pairs0 + pairs1})
    strata = []  # per machine: its values and how many of them are group 1's
    for machine in machines:
        values = [v for v, m in pairs0 + pairs1 if m == machine]
        strata.append((values, sum(m == machine for _, m in pairs1)))
    n0, n1 = len(pairs0), len(pairs1)
    observed = abs(sum(v for v, _ in pairs1) / n1 - sum(v for v, _ in pairs0) / n0)
    hits = total = 0
    for choice in itertools.product(*[itertools.combinations(range(len(v)), k) for v, k in strata]):
        ones = sum(v[i] for (v, _), picked in zip(strata, choice) for i in picked)
        rest = sum(sum(v) for v, _ in strata) - ones
        hits += abs(ones / n1 - rest / n0) >= observed - 1e-12 * max(1.0, observed)
        total += 1
    return hits / total

def spearman_trend(xs, ys, samples=10_000, seed=0):
    """Spearman's rank correlation of ys against xs (ties share their mean rank) over all runs of a set, and its
    two-sided permutation p: the share of `samples` random pairings of the same values (fixed seed) whose |correlation|
    reaches the observed one, counting the observed pairing once: (hits + 1) / (samples + 1)."""
    rx, ry = _ranks(xs), _ranks(ys)
    observed = _correlation(rx, ry[None])[0]
    g = torch.Generator().manual_seed(seed)
    shuffled = torch.stack([ry[torch.randperm(len(ry), generator=g)] for _ in range(samples)])
    hits = (_correlation(rx, shuffled).abs() >= abs(observed) - 1e-12).sum().item()
    return observed.item(), (hits + 1) / (samples + 1)

def _ranks(values):  # ranks 1..n, ties at their mean rank
    v = torch.tensor(values, dtype=torch.float64)
    return torch.tensor([((v < x).sum() + ((v == x).sum() + 1) / 2).item() for x in v], dtype=torch.float64)

def _correlation(x, ys):  # Pearson correlation of x (n,) with each row of ys (k, n)
    x = x - x.mean()
    ys = ys - ys.mean(-1, keepdim=True)
    return (ys @ x) / (ys.norm(dim=-1) * x.norm()).clamp(min=1e-300)

# ---------------------------------------------------------------- the verdict's statistics: interval, Holm, words

def t_quantile(q, df):
    """The q quantile (q > 1/2) of Student's t with df >= 1 degrees of freedom, fractional ones too (Welch's): the
    density integrated from 0 by trapezoids on a grid of step 1e-4, and the grid point where it reaches q - 1/2."""
    x = torch.linspace(0, 100, 1_000_001, dtype=torch.float64)
    log_norm = math.lgamma((df + 1) / 2) - math.lgamma(df / 2) - 0.5 * math.log(df * math.pi)
    density = torch.exp(log_norm - (df + 1) / 2 * torch.log1p(x ** 2 / df))
    mass = torch.cumulative_trapezoid(density, x)  # mass[i] = P(0 < T < x[i + 1])
    return x[torch.searchsorted(mass, q - 0.5) + 1].item()

def welch_interval(v0, v1, level=1 - ALPHA):
    """The difference of means mean(v1) - mean(v0) and its `level` interval by Student's t with Welch's degrees of
    freedom: diff -+ t * se, se = sqrt(s0^2/n0 + s1^2/n1), df = se^4 / ((s0^2/n0)^2/(n0-1) + (s1^2/n1)^2/(n1-1)).
    Returns (diff, low, high); low and high None with one value in a group (no spread to measure)."""
    s0, s1 = mean_std(v0), mean_std(v1)
    diff = s1["mean"] - s0["mean"]
    if min(s0["n"], s1["n"]) < 2:
        return diff, None, None
    a = s0["std"] ** 2 / s0["n"]
    b = s1["std"] ** 2 / s1["n"]
    if a + b == 0:  # every seed gave the same value: no spread, the interval is the point
        return diff, diff, diff
    df = (a + b) ** 2 / (a ** 2 / (s0["n"] - 1) + b ** 2 / (s1["n"] - 1))
    half = t_quantile((1 + level) / 2, df) * math.sqrt(a + b)
    return diff, diff - half, diff + half

def holm(ps):
    """Holm's step-down correction of the p-values ps (in their order): the i-th smallest of m times (m - i + 1),
    made non-decreasing along the sorted order (a p never gets a smaller correction than a smaller p), at most 1."""
    order = sorted(range(len(ps)), key=lambda i: ps[i])
    corrected = [None] * len(ps)
    running = 0.0
    for rank, i in enumerate(order):
        running = max(running, min(1.0, (len(ps) - rank) * ps[i]))
        corrected[i] = running
    return corrected

def verdict_words(diff, low, high, p, better, margin, primary=True):
    """The rule, written once. Below ALPHA, p decides: a primary row's p, corrected by Holm over its family, says which
    way: "helps" or "hurts" (a metric with a better way) and "raises" or "lowers" (geometry); an exploratory row's
    p, uncorrected, says only "differs at uncorrected p=..., exploratory". Else "no difference larger than X" where
    the interval lies inside [-X, X]; else "undecided"."""
    if p < ALPHA and not primary:
        return f"differs at uncorrected p={p:.3g}, exploratory"
    if p < ALPHA:
        if better is None:
            return "raises" if diff > 0 else "lowers"
        return "helps" if (diff > 0) == (better == "higher") else "hurts"
    if low is not None and -margin <= low and high <= margin:
        return f"no difference larger than {margin:.4g}"
    return "undecided"

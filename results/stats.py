"""
The statistics of results/report.py's comparisons and verdict, on plain lists of numbers (one per seed): mean and
std, the effect of n_lap with its standard error, the exact permutation p with labels exchanged within a machine,
Spearman's trend, the 95% interval of a difference of means by Student's t with Welch's degrees of freedom (the t
quantile computed exactly), the smallest difference a design detects with 80% power, Holm's step-down correction,
and the words of the verdict's rule. It imports nothing of the repository's.
"""

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

EXACT_LIMIT = 2_000_000  # relabelings enumerated exactly (12 + 12 runs on two machines: 853,776); beyond, sampled
SAMPLES = 1_000_000  # random relabelings of a sampled permutation p

def permutation_p(pairs0, pairs1):
    """Two-sided permutation p of the difference of means of two groups of (value, machine) pairs, with the labels
    exchanged only between runs of one machine (floats differ between machines, so only those runs are exchangeable):
    the share of all such relabelings whose |difference| reaches the observed one. 3 + 3 runs of one machine: at
    least 2/20 = 0.10; a set that mixes machines as 1 + 1 and 2 + 2 runs: at least 2/12.
    Up to EXACT_LIMIT relabelings, every one is enumerated at once, as group 1's sum: each machine's sums of every
    choice of its group-1 count of its runs (subset_sums), added over the machines in every combination. 12 + 12 runs,
    six of each group on each of two machines: 924 x 924 = 853,776 relabelings, held in memory together. Beyond (24 +
    24 runs of one machine: C(48, 24) = 3.2e13), SAMPLES random relabelings within machines (sampled_permutation_p)."""
    machines = sorted({m for _, m in pairs0 + pairs1})
    values = [[v for v, m in pairs0 + pairs1 if m == machine] for machine in machines]
    picks = [sum(m == machine for _, m in pairs1) for machine in machines]  # group 1's count on each machine
    n0, n1 = len(pairs0), len(pairs1)
    observed = abs(sum(v for v, _ in pairs1) / n1 - sum(v for v, _ in pairs0) / n0)
    if math.prod(math.comb(len(v), k) for v, k in zip(values, picks)) > EXACT_LIMIT:
        return sampled_permutation_p(values, picks, n0, n1, observed)
    ones = torch.zeros(1, dtype=torch.float64)  # group 1's sum under every relabeling of the machines so far
    for machine_values, k in zip(values, picks):
        ones = (ones[:, None] + subset_sums(machine_values, k)[None, :]).flatten()
    differences = ones / n1 - (sum(map(sum, values)) - ones) / n0
    hits = (differences.abs() >= observed - 1e-12 * max(1.0, observed)).sum().item()
    return hits / len(ones)

def sampled_permutation_p(values, picks, n0, n1, observed, seed=0, chunk=100_000):
    """permutation_p by SAMPLES random relabelings within machines (a fixed seed): (hits + 1) / (SAMPLES + 1), the
    observed labelling counted once, so p is never below 1 / (SAMPLES + 1). values: each machine's runs; picks: each
    machine's count of group 1."""
    g = torch.Generator().manual_seed(seed)
    grand = sum(map(sum, values))
    hits = 0
    for start in range(0, SAMPLES, chunk):
        n = min(chunk, SAMPLES - start)
        ones = torch.zeros(n, dtype=torch.float64)
        for machine_values, k in zip(values, picks):
            v = torch.tensor(machine_values, dtype=torch.float64)
            chosen = torch.rand(n, len(v), generator=g).argsort(dim=1)[:, :k]  # (n, k): a random k of this machine's
            ones += v[chosen].sum(dim=1)
        differences = ones / n1 - (grand - ones) / n0
        hits += (differences.abs() >= observed - 1e-12 * max(1.0, observed)).sum().item()
    return (hits + 1) / (SAMPLES + 1)

def subset_sums(values, k):
    """The sum of every choice of k of the values: C(len(values), k) sums, in no particular order. Built one value at a
    time: a choice of j among the first i values either leaves value i out (a choice of j among the first i - 1) or
    takes it (a choice of j - 1 among them, plus value i)."""
    empty = torch.zeros(0, dtype=torch.float64)
    sums = [torch.zeros(1, dtype=torch.float64)] + [empty] * k  # sums[j]: of every choice of j values so far
    for value in values:
        sums = [sums[0]] + [torch.cat([sums[j], sums[j - 1] + value]) for j in range(1, k + 1)]
    return sums[k]

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
    """The q quantile (0 < q < 1) of Student's t with df > 0 degrees of freedom, fractional ones too (Welch's): for
    q > 1/2 the t whose upper tail P(T > t) is 1 - q (t_tail), found by bisection to double precision; t_q = -t_(1-q).
    Exact to some 1e-13 (relative) at the degrees of freedom of a few dozen seeds; lgamma's rounding costs digits as
    df grows (some 1e-11 at df = 1e5)."""
    if q < 0.5:
        return -t_quantile(1 - q, df)
    tail = 1 - q  # the tail is solved for directly: 1 - P(T < t) would lose digits as q nears 1
    low, high = 0.0, 1.0
    while t_tail(high, df) > tail:
        low, high = high, 2 * high
    while high - low > 1e-15 * high:  # t_tail falls as t grows
        middle = (low + high) / 2
        low, high = (middle, high) if t_tail(middle, df) > tail else (low, middle)
    return (low + high) / 2

def t_tail(t, df):
    """P(T > t) of Student's t with df degrees of freedom, t >= 0: I_x(df/2, 1/2) / 2 with x = df / (df + t^2), the
    regularized incomplete beta function (incomplete_beta)."""
    x = df / (df + t * t)
    return incomplete_beta(x, t * t / (df + t * t), df / 2, 0.5) / 2  # 1 - x given as computed, not rounded

def incomplete_beta(x, one_minus_x, a, b):
    """The regularized incomplete beta function I_x(a, b) = B(x; a, b) / B(a, b), by its continued fraction (DLMF
    8.17.22): I_x(a, b) = x^a (1 - x)^b / (a B(a, b)) / (1 + d1 / (1 + d2 / (1 + ...))), with
    d(2m+1) = -(a + m)(a + b + m) x / ((a + 2m)(a + 2m + 1)) and d(2m) = m (b - m) x / ((a + 2m - 1)(a + 2m)).
    The fraction converges fast for x < (a + 1) / (a + b + 2); above that I_x(a, b) = 1 - I_(1-x)(b, a)."""
    if x <= 0:
        return 0.0
    if x > (a + 1) / (a + b + 2):
        return 1 - incomplete_beta(one_minus_x, x, b, a)
    log_front = a * math.log(x) + b * math.log(one_minus_x) - (math.lgamma(a) + math.lgamma(b) - math.lgamma(a + b))
    # Lentz's method: the fraction's value is the product of the factors c * d, each tending to 1
    tiny = 1e-300  # stands in for a denominator that is 0
    fraction, c, d = 1.0, 1.0, 0.0
    for i in range(1, 100_000):
        m = i // 2
        if i % 2:
            term = -(a + m) * (a + b + m) * x / ((a + 2 * m) * (a + 2 * m + 1))
        else:
            term = m * (b - m) * x / ((a + 2 * m - 1) * (a + 2 * m))
        d = 1 / ((1 + term * d) or tiny)
        c = (1 + term / c) or tiny
        fraction *= c * d
        if abs(c * d - 1) < 1e-15:
            return math.exp(log_front) / (a * fraction)
    raise ArithmeticError(f"the incomplete beta fraction did not converge (x={x}, a={a}, b={b})")

def welch_se_df(v0, v1):
    """The standard error se = sqrt(s0^2/n0 + s1^2/n1) of the difference of means of two groups and Welch's degrees
    of freedom df = se^4 / ((s0^2/n0)^2/(n0-1) + (s1^2/n1)^2/(n1-1)), s the unbiased std. (None, None) with one
    value in a group (no spread to measure); df None where no value differs within either group (se = 0)."""
    s0, s1 = mean_std(v0), mean_std(v1)
    if min(s0["n"], s1["n"]) < 2:
        return None, None
    a = s0["std"] ** 2 / s0["n"]
    b = s1["std"] ** 2 / s1["n"]
    if a + b == 0:
        return 0.0, None
    return math.sqrt(a + b), (a + b) ** 2 / (a ** 2 / (s0["n"] - 1) + b ** 2 / (s1["n"] - 1))

def welch_interval(v0, v1, level=1 - ALPHA):
    """The difference of means mean(v1) - mean(v0) and its `level` interval by Student's t with Welch's degrees of
    freedom: diff -+ t * se (welch_se_df). Returns (diff, low, high); low and high None with one value in a group (no
    spread to measure), both diff where every seed gave the same value (no spread: the interval is the point)."""
    diff = mean_std(v1)["mean"] - mean_std(v0)["mean"]
    se, df = welch_se_df(v0, v1)
    if se is None:
        return diff, None, None
    if se == 0:
        return diff, diff, diff
    half = t_quantile((1 + level) / 2, df) * se
    return diff, diff - half, diff + half

def detectable_difference(se, df, m, power=0.8):
    """The smallest |difference of means| a family of m rows detects with `power` at the spread its runs show:
    (t_(1 - ALPHA/(2m)) + t_power) * se, with se and df those of the row's Welch interval (welch_se_df). ALPHA/m is
    Bonferroni's level, Holm's first and strictest step; a true difference of this size lies t_power standard
    errors beyond the two-sided critical value t_(1 - ALPHA/(2m)) * se, so it crosses it with probability `power`:
    the usual normal-theory approximation. None without a standard error (one value in a group), 0 where no value
    differs within either group."""
    if se is None:
        return None
    if df is None:
        return 0.0
    return (t_quantile(1 - ALPHA / (2 * m), df) + t_quantile(power, df)) * se

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
    p, uncorrected, says only "differs at uncorrected p=..., exploratory"; a decided row whose interval lies inside
    [-X, X] adds "(decided, smaller than X)": its way is sure, its size below the margin. Else "no difference larger
    than X" where the interval lies inside [-X, X]; else "undecided"."""
    inside = low is not None and -margin <= low and high <= margin
    if p < ALPHA and not primary:
        return f"differs at uncorrected p={p:.3g}, exploratory"
    if p < ALPHA:
        if better is None:
            way = "raises" if diff > 0 else "lowers"
        else:
            way = "helps" if (diff > 0) == (better == "higher") else "hurts"
        return f"{way} (decided, smaller than {margin:.4g})" if inside else way
    if inside:
        return f"no difference larger than {margin:.4g}"
    return "undecided"

"""results/stats.py and results/report.py: the statistics against hand-computed answers, comparisons of runs that
analyze.py analysed, the sweep's report from saved artefacts (and that the committed results/summary.md is exactly the
report of the committed artefacts), the headline figure, and the layering of the whole repository."""

import glob
import json
import math
import os
import subprocess
import sys

import numpy as np
import pytest
import torch

import figures
import geometry
import report
import stats
import tuning
import verdict
from common import UsageError
from conftest import ROOT, result
from test_analyze import FRACS, fashion_dir, make_run, run_analyze  # noqa: F401 (fashion_dir: a fixture)

SCRIPT = os.path.join(ROOT, "results", "report.py")


def run_report(*argv):
    """`python results/report.py argv` in this process."""
    import runpy
    saved = sys.argv
    sys.argv = [SCRIPT, *argv]
    try:
        return runpy.run_path(SCRIPT, run_name="__main__")
    finally:
        sys.argv = saved


def test_permutation_p_exchanges_labels_only_within_a_machine():
    """by hand: 3 + 3 separated runs of one machine: 2 of C(6, 3) = 20 labelings are as extreme; the same runs with
    seed 0 on another machine (1 + 1 and 2 + 2): 2 of 2 x C(4, 2) = 12; one machine per seed (1 + 1 each): 2 of 8."""
    v0, v1 = [0.1, 0.2, 0.3], [0.4, 0.5, 0.6]
    assert stats.permutation_p([(v, "A") for v in v0], [(v, "A") for v in v1]) == pytest.approx(2 / 20)
    mixed = ["X", "A", "A"]  # seed 0 on machine X, seeds 1-2 on A
    assert stats.permutation_p(list(zip(v0, mixed)), list(zip(v1, mixed))) == pytest.approx(2 / 12)
    assert stats.permutation_p(list(zip(v0, "XYZ")), list(zip(v1, "XYZ"))) == pytest.approx(2 / 8)
    # overlapping groups: the observed |difference| 0.1 of [1, 2, 6] against [3, 4, 5] is reached by 18 of 20 labelings
    ones, twos = [1.0, 2.0, 6.0], [3.0, 4.0, 5.0]
    exact = sum(abs(sum(c) / 3 - (21 - sum(c)) / 3) >= 1 - 1e-9
                for c in __import__("itertools").combinations(ones + twos, 3)) / 20
    assert stats.permutation_p([(v, "A") for v in ones], [(v, "A") for v in twos]) == pytest.approx(exact)


def test_a_sampled_permutation_p_agrees_with_the_exact_one():
    """Beyond EXACT_LIMIT relabelings permutation_p samples them: with the limit lowered to 0, 12 + 12 overlapping runs
    on two machines give within sampling error (3 standard errors of 200,000 samples) the exact p, and so do 6 + 6
    perfectly separated runs of one machine (2/924). 24 + 24 separated runs, sampled at the true limit: see
    test_the_fair_verdict_reads_each_arm_at_its_chosen_factor."""
    g = torch.Generator().manual_seed(1)
    pairs0 = [(v, "M1" if i < 6 else "M2") for i, v in enumerate(torch.randn(12, generator=g).tolist())]
    pairs1 = [(v + 0.5, "M1" if i < 6 else "M2") for i, v in enumerate(torch.randn(12, generator=g).tolist())]
    exact = stats.permutation_p(pairs0, pairs1)
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(stats, "EXACT_LIMIT", 0)
        patch.setattr(stats, "SAMPLES", 200_000)
        sampled = stats.permutation_p(pairs0, pairs1)
        separated = stats.permutation_p([(i, "M1") for i in range(6)], [(10 + i, "M1") for i in range(6)])
    for p, true in ((sampled, exact), (separated, 2 / 924)):
        assert abs(p - true) < 3 * math.sqrt(true * (1 - true) / 200_000)
    assert 0.001 < exact < 0.5  # a p that sampling could miss


def enumerated_permutation_p(pairs0, pairs1):
    """The permutation p of stats.permutation_p, one relabeling at a time (the function it replaced): every choice of
    each machine's group-1 runs among that machine's runs, counted where |difference of means| reaches the observed."""
    import itertools
    machines = sorted({m for _, m in pairs0 + pairs1})
    strata = [([v for v, m in pairs0 + pairs1 if m == machine], sum(m == machine for _, m in pairs1))
              for machine in machines]
    n0, n1 = len(pairs0), len(pairs1)
    observed = abs(sum(v for v, _ in pairs1) / n1 - sum(v for v, _ in pairs0) / n0)
    hits = total = 0
    for choice in itertools.product(*[itertools.combinations(range(len(v)), k) for v, k in strata]):
        ones = sum(v[i] for (v, _), picked in zip(strata, choice) for i in picked)
        rest = sum(sum(v) for v, _ in strata) - ones
        hits += abs(ones / n1 - rest / n0) >= observed - 1e-12 * max(1.0, observed)
        total += 1
    return hits / total


def test_permutation_p_equals_the_enumeration_one_relabeling_at_a_time():
    """stats.permutation_p (every relabeling at once, as sums) against the loop it replaced, on 300 random small
    designs: 1-6 runs a group, 1-3 machines (some holding one group only), integer values (many ties) or floats.
    By hand: machine Y holds only a group-1 run (9), so it exchanges nothing; machine X's 1, 2 and 5 give group 1 each
    of them in turn: differences (5 + 9)/2 - 1.5 = 5.5, (1 + 9)/2 - 3.5 = 1.5, (2 + 9)/2 - 3 = 2.5: p = 1/3."""
    import random
    rng = random.Random(0)
    for _ in range(300):
        machines = "XYZ"[:rng.randint(1, 3)]
        integers = rng.random() < 0.5
        def run():
            return (float(rng.randint(0, 4)) if integers else rng.random(), rng.choice(machines))
        pairs0 = [run() for _ in range(rng.randint(1, 6))]
        pairs1 = [run() for _ in range(rng.randint(1, 6))]
        assert stats.permutation_p(pairs0, pairs1) == enumerated_permutation_p(pairs0, pairs1), (pairs0, pairs1)
    assert stats.permutation_p([(1.0, "X"), (2.0, "X")], [(5.0, "X"), (9.0, "Y")]) == pytest.approx(1 / 3)
    assert sorted(stats.subset_sums([1.0, 2.0, 4.0, 8.0], 2).tolist()) == [3, 5, 6, 9, 10, 12]  # the 6 pairs' sums
    assert stats.subset_sums([1.0, 2.0], 0).tolist() == [0.0] and stats.subset_sums([1.0, 2.0], 2).tolist() == [3.0]


def t4_quantile(q):
    """Student's t with 4 degrees of freedom in closed form: with a = 4q(1 - q), t = 2 sqrt(cos(arccos(sqrt(a)) / 3) /
    sqrt(a) - 1) (for q > 1/2), the root of its cubic CDF solved by the trigonometric method."""
    a = 4 * q * (1 - q)
    return 2 * math.sqrt(math.cos(math.acos(math.sqrt(a)) / 3) / math.sqrt(a) - 1)


def test_t_quantile_against_closed_forms():
    """Exact quantiles of Student's t, to 1e-12 (relative): with 1 degree of freedom t is Cauchy, t_q =
    tan(pi (q - 1/2)); with 2, t_q = (2q - 1) / sqrt(2q(1 - q)); with 4, t4_quantile; below 1/2 the mirror image.
    Tables: t_0.975 at 10 is 2.2281388519862747 (mpmath, 40 digits; 2.228138851964938, as some quote it, is wrong
    from the 11th digit), t_0.8 at 10 0.8790578285505887. Fractional df lies between its neighbours. At large df t
    nears the normal's z = 1.959963984540054 as z + (z^3 + z)/(4 df) + (5z^5 + 16z^3 + 3z)/(96 df^2) (Abramowitz &
    Stegun 26.7.5); at df = 1e5 lgamma's rounding leaves some 1e-11."""
    for q in (0.6, 0.8, 0.975, 0.99, 1 - 0.05 / 48, 0.999999):
        # tan(pi (q - 1/2)) = 1 / tan(pi (1 - q)): the second keeps its digits near the pole (q - 1/2 rounds there)
        assert stats.t_quantile(q, 1) == pytest.approx(1 / math.tan(math.pi * (1 - q)), rel=1e-12, abs=1e-12)
        assert stats.t_quantile(q, 1) == pytest.approx(math.tan(math.pi * (q - 0.5)), rel=1e-9)
        assert stats.t_quantile(q, 2) == pytest.approx((2 * q - 1) / math.sqrt(2 * q * (1 - q)), rel=1e-12, abs=1e-12)
        assert stats.t_quantile(q, 4) == pytest.approx(t4_quantile(q), rel=1e-12, abs=1e-12)
        assert stats.t_quantile(1 - q, 4) == pytest.approx(-t4_quantile(q), rel=1e-12, abs=1e-12)
    assert stats.t_quantile(0.975, 10) == pytest.approx(2.2281388519862747, abs=1e-12)
    assert stats.t_quantile(0.8, 10) == pytest.approx(0.8790578285505887, abs=1e-12)
    assert stats.t_quantile(0.975, 3) > stats.t_quantile(0.975, 3.5) > stats.t_quantile(0.975, 4)
    z, df = 1.959963984540054, 1e5
    expansion = z + (z ** 3 + z) / (4 * df) + (5 * z ** 5 + 16 * z ** 3 + 3 * z) / (96 * df ** 2)
    assert stats.t_quantile(0.975, df) == pytest.approx(expansion, abs=1e-9)
    assert abs(stats.t_quantile(0.975, df) - z) < 3e-5  # (z^3 + z) / (4 df) = 2.4e-5


def test_detectable_difference_by_hand():
    """[0, 1, 2] against [3, 4, 5]: variances 1 and 1, se = sqrt(1/3 + 1/3) = 0.8164966, Welch's df = (2/3)^2 /
    ((1/3)^2 / 2 + (1/3)^2 / 2) = 4. In a family of m = 24 rows: t_(1 - 0.05/48) at df 4 = 7.0956501 (q = 0.99895833,
    a = 4q(1 - q) = 0.00416233, t4_quantile) and t_0.8 = 0.9409646 (a = 0.64), so the design detects with 80% power
    (7.0956501 + 0.9409646) * 0.8164966 = 6.5618684. One value in a group: no se, nothing; no spread: 0."""
    se, df = stats.welch_se_df([0, 1, 2], [3, 4, 5])
    assert (se, df) == (pytest.approx(0.8164966, abs=1e-7), pytest.approx(4))
    assert (t4_quantile(1 - 0.05 / 48), t4_quantile(0.8)) == (pytest.approx(7.0956501, abs=1e-7),
                                                              pytest.approx(0.9409646, abs=1e-7))
    assert stats.detectable_difference(se, df, 24) == pytest.approx(6.5618684, abs=1e-7)
    assert stats.detectable_difference(*stats.welch_se_df([1.0], [2.0, 3.0]), 24) is None
    assert stats.detectable_difference(*stats.welch_se_df([1.0, 1.0], [2.0, 2.0]), 24) == 0.0


def test_welch_interval_by_hand():
    """[0, 1, 2] against [3, 4, 5]: difference 3, both variances 1, se = sqrt(1/3 + 1/3) = 0.8165, Welch's df =
    (2/3)^2 / ((1/3)^2 / 2 + (1/3)^2 / 2) = 4, so 3 -+ 2.7764 * 0.8165 = [0.7331, 5.2669]. [1, 2, 3] against [4, 6, 8]:
    variances 1 and 4, se^2 = 1/3 + 4/3 = 5/3, df = (5/3)^2 / ((1/3)^2 / 2 + (4/3)^2 / 2) = 50/17 = 2.94 (between the
    tables' 2 and 3: t between 3.1824 and 4.3027)."""
    diff, low, high = stats.welch_interval([0, 1, 2], [3, 4, 5])
    assert (diff, low, high) == (pytest.approx(3), pytest.approx(0.7331, abs=3e-4), pytest.approx(5.2669, abs=3e-4))
    diff, low, high = stats.welch_interval([1, 2, 3], [4, 6, 8])
    se = math.sqrt(5 / 3)
    assert diff == pytest.approx(4) and high - diff == pytest.approx(diff - low)
    assert (high - diff) / se == pytest.approx(stats.t_quantile(0.975, 50 / 17))
    assert 3.1824 < (high - diff) / se < 4.3027
    assert stats.welch_interval([1.0], [2.0, 3.0]) == (pytest.approx(1.5), None, None)  # one seed: no spread
    assert stats.welch_interval([1.0, 1.0], [2.0, 2.0]) == (1.0, 1.0, 1.0)  # no spread at all: the point


def test_holm_by_hand():
    """p = 0.01, 0.04, 0.03, 0.005 (m = 4), sorted 0.005, 0.01, 0.03, 0.04 times 4, 3, 2, 1: 0.02, 0.03, 0.06, 0.04,
    the last raised to the 0.06 before it; in the given order 0.03, 0.06, 0.06, 0.02. Capped at 1: 0.5 * 2 = 1."""
    assert stats.holm([0.01, 0.04, 0.03, 0.005]) == pytest.approx([0.03, 0.06, 0.06, 0.02])
    assert stats.holm([0.5, 0.6]) == [1.0, 1.0]
    # 6 + 6 runs of one machine: the smallest exact p is 2 / C(12, 6) = 2/924, and Holm multiplies the smallest p by
    # the number of comparisons m: a family of 23 such rows gives each 23 * 2/924 = 0.0498 < 0.05 (the most rows 6 + 6
    # runs can decide), 24 rows 0.052; the 46 rows of the whole table would give 46 * 2/924 = 0.0996
    assert stats.holm([2 / 924] * 23) == pytest.approx([23 * 2 / 924] * 23) and 23 * 2 / 924 < 0.05
    assert stats.holm([2 / 924] * 24)[0] == pytest.approx(0.0519, abs=1e-4)
    assert stats.holm([2 / 924] * 46)[0] == pytest.approx(0.0996, abs=1e-4)


def test_verdict_words_follow_the_rule():
    """A primary row: helps/hurts by the better way, raises/lowers without one, only below 0.05 after Holm; an
    exploratory row below 0.05 uncorrected: 'differs at uncorrected p=..., exploratory', never a way; else the
    interval against the margin: inside +-X (its ends included) is 'no difference larger than X', else undecided."""
    words = stats.verdict_words
    assert words(+0.01, 0.005, 0.015, 0.01, "higher", 0.005) == "helps"
    assert words(+0.03, 0.02, 0.04, 0.01, "lower", 0.01) == "hurts"  # bits per byte up: worse
    assert words(-0.03, -0.04, -0.02, 0.049, "lower", 0.01) == "helps"
    assert words(-0.1, -0.12, -0.08, 0.01, None, 0.02) == "lowers"
    assert words(+0.1, 0.08, 0.12, 0.01, None, 0.02) == "raises"
    assert words(+0.001, -0.003, 0.005, 0.2, "higher", 0.005) == "no difference larger than 0.005"
    assert words(+0.003, 0.001, 0.005, 0.01, "lower", 0.005) == "hurts (decided, smaller than 0.005)"  # inside +-X
    assert words(-0.3, -0.4, -0.2, 0.01, None, 0.4558) == "lowers (decided, smaller than 0.4558)"
    assert words(+0.002, -0.001, 0.006, 0.2, "higher", 0.005) == "undecided"  # reaches past X
    assert words(+0.01, 0.005, 0.015, 0.05, "higher", 0.005) == "undecided"  # 0.05 is not below 0.05
    assert words(+0.01, None, None, 0.5, "higher", 0.5) == "undecided"  # one seed: no interval
    # exploratory rows: the same numbers name no way
    assert words(+0.1, 0.08, 0.12, 0.01, None, 0.02, primary=False) == "differs at uncorrected p=0.01, exploratory"
    assert words(+0.001, -0.003, 0.005, 0.2, "higher", 0.005, primary=False) == "no difference larger than 0.005"
    assert words(+0.002, -0.001, 0.006, 0.2, "higher", 0.005, primary=False) == "undecided"
    assert words(+0.01, 0.005, 0.015, 0.05, "higher", 0.005, primary=False) == "undecided"


def test_a_separated_primary_row_is_decided_and_the_same_p_exploratory_is_not():
    """By hand: 6 + 6 seeds of one machine, every n_lap 4 value above every n_lap 0 value: p = 2 / C(12, 6) = 2/924 =
    0.00216. In a primary family of 20 such rows Holm gives each 20 * 2/924 = 0.0433 < 0.05: 'helps'. The same row
    outside the family keeps its uncorrected p: 'differs at uncorrected p=0.00216, exploratory'. Its interval:
    0.80-0.85 against 0.90-0.95 in steps of 0.01, both variances 3.5e-4, se = sqrt(7e-4 / 6), Welch's df = 10,
    t_0.975 = 2.2281."""
    v0 = [0.80 + s / 100 for s in range(6)]
    v1 = [0.90 + s / 100 for s in range(6)]
    p = stats.permutation_p([(v, "A") for v in v0], [(v, "A") for v in v1])
    assert p == pytest.approx(2 / 924)
    diff, low, high = stats.welch_interval(v0, v1)
    half = 2.2281 * math.sqrt(7e-4 / 6)
    assert (diff, low, high) == (pytest.approx(0.1), pytest.approx(0.1 - half, abs=2e-5),
                                 pytest.approx(0.1 + half, abs=2e-5))
    corrected = stats.holm([p] * 20)[0]
    assert corrected == pytest.approx(20 * 2 / 924) and corrected < 0.05
    assert stats.verdict_words(diff, low, high, corrected, "higher", 0.005) == "helps"
    assert stats.verdict_words(diff, low, high, p, "higher", 0.005, primary=False) == (
        "differs at uncorrected p=0.00216, exploratory")
    assert stats.verdict_words(diff, low, high, stats.holm([p] * 24)[0], "higher", 0.005) == "undecided"  # 0.052


def test_the_primary_family_is_the_plans_table():
    """results/PLAN.md, committed before the seeds that decide the verdict trained, lists the primary family in a
    table (#, claim, metric, set, against, X): verdict.primary_family is that table row for row, each regime's set
    named by its first name in VERDICT_SETS, each margin as VERDICT_METRICS gives it (a number, or a share "10%")."""
    with open(os.path.join(ROOT, "results", "PLAN.md")) as f:
        section = f.read().split("\n## The primary family")[1].split("\n## ")[0]
    planned = [[cell.strip() for cell in line.strip("|").split("|")] for line in section.splitlines()
               if line.startswith("| ") and line.split("|")[1].strip().isdigit()]
    declared = []
    for number, (claim, metric, regime, against) in enumerate(verdict.primary_family(), 1):
        margin = verdict.VERDICT_METRICS[metric][2]
        declared.append([str(number), claim, metric, verdict.VERDICT_SETS[regime][0], against,
                         margin if isinstance(margin, str) else f"{margin:g}"])
    assert len(planned) == 24 and declared == planned
    for _, metrics, paper, others in verdict.CLAIMS:  # the other regimes' rows are exploratory, never the paper's
        assert paper in verdict.VERDICT_SETS and paper not in others and set(others) <= set(verdict.VERDICT_SETS)


def plan_table(heading):
    """The rows (#, claim, metric, set, against, X) of the table under results/PLAN.md's section `heading`."""
    with open(os.path.join(ROOT, "results", "PLAN.md")) as f:
        section = f.read().split(f"\n## {heading}")[1].split("\n## ")[0]
    return [[cell.strip() for cell in line.strip("|").split("|")] for line in section.splitlines()
            if line.startswith("| ") and line.split("|")[1].strip().isdigit()]


def declared(family, set_of):  # a family's rows as a PLAN.md table writes them
    rows = []
    for number, (claim, metric, regime, against) in enumerate(family, 1):
        margin = verdict.VERDICT_METRICS[metric][2]
        rows.append([str(number), claim, metric, set_of(regime), against, margin if isinstance(margin, str) else f"{margin:g}"])
    return rows


def test_the_fair_verdicts_families_are_the_plans_tables():
    """results/PLAN.md's section of 7 December, committed before its runs, lists the tuned family (rows 1-20 on the
    tuned sets) and the mixed graph family (the attention graph against the Laplacian heads alone on the uniform graph,
    at n_lap 2): verdict.tuned_family and verdict.mixed_family are those tables row for row."""
    assert plan_table("The tuned family") == declared(verdict.tuned_family(), verdict.TUNED_SETS.get)
    assert len(plan_table("The tuned family")) == 20
    assert plan_table("The mixed graph family") == declared(verdict.mixed_family(), lambda g: verdict.MIXED_SETS[g][0])
    assert len(plan_table("The mixed graph family")) == 4


def trials(root, values, recipe="six_gpt", n_lap=0):
    """Fake search trials under root/lr_search: values {factor: [value per seed, None = diverged]}, seeds 100, 101."""
    for factor, per_seed in values.items():
        for seed, value in zip((100, 101, 102), per_seed):
            run = root / "lr_search" / f"{recipe}-x{factor}" / f"k{n_lap}-s{seed}"
            run.mkdir(parents=True)
            if value is None:
                (run / "diverged.txt").write_text("non-finite loss")
            else:
                (run / "result.txt").write_text(f"RESULT n_lap={n_lap} seed={seed} {tuning.RECIPES[recipe][0]}={value}\n")


def test_the_learning_rate_choice_follows_the_plans_rule(tmp_path):
    """The GPT's n_lap 0 arm (bits per byte: lower is better), seeds 100 and 101. A missing seed waits; the best mean
    wins; a tie goes to the factor nearer 1; a diverged run is never chosen; a best at an edge waits for the extension
    and is then chosen again over the six factors."""
    def chosen(values):
        root = tmp_path / str(len(list(tmp_path.iterdir())))
        trials(root, values)
        return tuning.choices(str(root))["six_gpt", "0"]
    grid = {"0.5": [2.30, 2.31], "0.71": [2.28, 2.29], "1": [2.27, 2.28], "1.41": [2.26, 2.27], "2": [2.29, 2.30]}
    assert chosen(grid) == ("1.41", "inside the grid")
    assert chosen(dict(grid, **{"2": [2.29]})) == (None, "1 of 10 trials to go")  # seed 101 of factor 2 missing
    assert chosen(dict(grid, **{"1.41": [2.27, 2.28]})) == ("1", "inside the grid")  # tie with 1
    assert chosen(dict(grid, **{"1": [2.26, 2.27], "1.41": [None, 2.0]})) == ("1", "inside the grid")
    edge = dict(grid, **{"2": [2.20, 2.21]})
    assert chosen(edge) == (None, "2 is at the edge: waiting for factor 2.83")
    assert chosen(dict(edge, **{"2.83": [2.25, 2.25]})) == ("2", "2 at the edge; grid extended to 2.83")
    assert chosen(dict(edge, **{"2.83": [2.1, 2.1]})) == ("2.83", "2 at the edge; grid extended to 2.83, still at the edge")
    lines = tuning.table_lines(str(tmp_path / "0"))
    assert "| six_gpt | val_bpb (lower) | 0 | 2.3050 (2) | 2.2850 (2) | 2.2750 (2) | 2.2650 (2) | 2.2950 (2) | 1.41 " in (
        "\n".join(lines))


def test_the_fair_verdict_reads_each_arm_at_its_chosen_factor(tmp_path, monkeypatch):
    """The tuned family on twelve_seeds: the GPT's n_lap 4 arm chose 0.71 and its tuned runs are 0.2 lower than the
    six_gpt ones, every other arm chose 1; so the GPT's rows compare six_gpt's n_lap 0 runs with tuned_gpt's n_lap 4
    runs and the other rows are the first family's numbers, with Holm over 20 rows. The mixed graph family: lap2u runs
    0.05 below the lap2 runs of their seed (24 a side, one machine: C(48, 24) = 3.2e13 relabelings, sampled): no
    sampled relabeling reaches the observed difference, p = 1 / (samples + 1), every row decided."""
    monkeypatch.setattr(stats, "SAMPLES", 20_000)
    collected = twelve_seeds()
    collected["tuned_gpt"] = [collected_run("gpt", "tuned_gpt", 4, seed, "M2", -0.1 + 0.001 * (seed % 6))
                              for seed in range(12)]
    for recipe in tuning.RECIPES:
        for n_lap in (0, 4):
            best = "0.71" if (recipe, n_lap) == ("six_gpt", 4) else "1"
            values = {f: [0.5 if f == best else 0.6] * 3 for f in tuning.GRID}
            if recipe != "six_gpt":  # higher is better
                values = {f: [1 - v for v in vs] for f, vs in values.items()}
            trials(tmp_path, values, recipe, n_lap)
    for kind, (attention, uniform) in (("vit", verdict.MIXED_SETS["vit_cls_ls"]), ("gpt", verdict.MIXED_SETS["gpt"])):
        collected[attention] = [collected_run(kind, attention, 2, seed, "M3", 0.001 * seed) for seed in range(24)]
        collected[uniform] = [collected_run(kind, uniform, 2, seed, "M3", 0.001 * seed - 0.05) for seed in range(24)]
    tuned, mixed, arms = verdict.fair_rows(collected, str(tmp_path))
    assert arms["gpt"][2] == ["1", "0.71"] and arms["vit_cls_ls"][2] == arms["dino"][2] == ["1", "1"]
    assert len(tuned) == 20
    bpb = next(r for r in tuned if r["metric"] == "val_bpb")
    assert bpb["set"] == "tuned_gpt" and bpb["diff"] == pytest.approx(-0.1) and bpb["words"] == "helps"
    acc = next(r for r in tuned if r["metric"] == "val_acc")
    assert acc["diff"] == pytest.approx(0.1) and acc["holm"] == pytest.approx(20 * 2 / 924 ** 2)
    assert [r["set"] for r in mixed] == ["lap2_vit_cls_ls12", "lap2_gpt", "lap2_vit_cls_ls12", "lap2_gpt"]
    assert all(r["p"] == r["floor"] == 1 / 20_001 for r in mixed)
    assert [r["words"] for r in mixed] == ["helps", "hurts", "lowers", "lowers"]  # every metric 0.05 higher on attention
    answer = verdict.mixed_answer(mixed)
    assert answer.startswith("a Laplacian head beside attention heads needs its attention graph: val_acc")
    lines = verdict.fair_lines(tuned, mixed, arms, str(tmp_path))
    assert "- tuned_gpt: n_lap 0 × 1, n_lap 4 × 0.71 (n_lap 0: inside the grid; n_lap 4: inside the grid); runs complete." in lines
    assert lines[-1] == f"Answer: {answer}."


def test_verdict_rows_from_run_folders(tmp_path):
    """The verdict on fake ViT runs: vit_cls_ls12 (3 + 3 seeds) stands in until six_vit_cls_ls12 is there (6 + 6 seeds,
    one machine), the paper's regime, whose rows are the primary family; six_vit_default's (mean pooling) are
    exploratory. By hand, for six_vit_cls_ls12: val_acc 0.80-0.85 against 0.90-0.95 (steps of 0.01): +0.1,
    separated, p = 2/924; of the 7 primary rows (val_acc, the within-sequence share, the between-class share and
    their ratio, the share and cosine after the last block, NC1: fake_run has no other NC and no ETF), four are
    separated (val_acc, the two shares, the last block's share), so Holm gives the first 7 * 2/924 = 0.01515 and the
    others no less: helps, lowers, raises, lowers. The ratio and cosine are the same at every seed: a point at 0,
    inside their margins. six_vit_default's rows, the same numbers, keep p uncorrected and name no way."""
    def make(set_name, seeds):
        for s in seeds:
            fake_run(tmp_path, "vit", 0, s, dict(val_acc=0.80 + s / 100), 0.30 + s / 100, set_name=set_name)
            fake_run(tmp_path, "vit", 4, s, dict(val_acc=0.90 + s / 100), 0.20 + s / 100, set_name=set_name)
    make("vit_cls_ls12", range(3))
    primary, exploratory = verdict.verdict_rows(report.collect_runs(str(tmp_path)))
    acc = primary[0]
    assert exploratory == [] and len(primary) == 7
    assert (acc["metric"], acc["set"], acc["p"], acc["floor"]) == ("val_acc", "vit_cls_ls12", pytest.approx(0.1), 0.1)
    # 0.80-0.82 against 0.90-0.92: +0.1, both variances 1e-4, se = sqrt(2e-4 / 3), df 4
    assert (acc["low"], acc["high"]) == (pytest.approx(0.1 - 2.7764 * math.sqrt(2e-4 / 3), abs=1e-5),
                                         pytest.approx(0.1 + 2.7764 * math.sqrt(2e-4 / 3), abs=1e-5))
    assert acc["holm"] == pytest.approx(0.7) and acc["words"] == "undecided"  # 7 * 0.1
    make("six_vit_cls_ls12", range(6))
    make("six_vit_default", range(6))
    primary, exploratory = verdict.verdict_rows(report.collect_runs(str(tmp_path)))
    rows = {r["metric"]: r for r in primary}
    assert list(rows) == ["val_acc", "within-sequence share", "between-class share", "within-class / between-class",
                          "within-sequence share, last block", "cosine, last block", "NC1"]
    assert {r["set"] for r in primary} == {"six_vit_cls_ls12"} and rows["val_acc"]["machines"] == (
        "unrecorded (seeds 0, 1, 2, 3, 4, 5)")
    assert rows["val_acc"]["p"] == pytest.approx(2 / 924) and rows["val_acc"]["holm"] == pytest.approx(7 * 2 / 924)
    assert [rows[k]["words"] for k in ("val_acc", "within-sequence share", "between-class share",
                                       "within-sequence share, last block")] == ["helps", "lowers", "raises", "lowers"]
    assert rows["within-class / between-class"]["words"] == "no difference larger than 0.03333"  # 10% of 1/3
    assert rows["cosine, last block"]["words"] == "no difference larger than 0.02"
    # NC1 is 1 + seed against 5 + seed: of the 924 labelings of 1-6 and 5-10, those whose six reach a sum of 45 or
    # more (10, 9, 8, 7 and a 6 and a 5: 4 ways; and 6, 6: 1) or 21 or less (the mirror: 5) reach |+4|: p = 10/924;
    # fifth smallest of 7, Holm's step-down multiplies it by 7 - 4 = 3: 0.0325, below 0.05
    assert rows["NC1"]["p"] == pytest.approx(10 / 924) and rows["NC1"]["holm"] == pytest.approx(3 * 10 / 924)
    assert rows["NC1"]["words"] == "raises"
    # the same runs as exploratory rows (vit_mean): the same p, uncorrected, and no way named
    explored = {r["metric"]: r for r in exploratory}
    assert list(explored) == list(rows) and {r["set"] for r in exploratory} == {"six_vit_default"}
    assert "holm" not in explored["val_acc"] and explored["val_acc"]["p"] == rows["val_acc"]["p"]
    assert explored["val_acc"]["words"] == "differs at uncorrected p=0.00216, exploratory"
    assert explored["NC1"]["words"] == "differs at uncorrected p=0.0108, exploratory"
    assert explored["cosine, last block"]["words"] == "no difference larger than 0.02"
    lines = verdict.verdict_lines(primary, exploratory, "sets", [], {}, {})
    assert "m = 7 rows, decided by Holm's correction over these 7 alone:" in lines[4]
    assert sum(line.startswith("| claim |") for line in lines) == 2
    assert "| p | Holm p |" in lines[6] and "| p (uncorrected) |" in lines[6 + 2 + 7 + 3]
    assert "| six_vit_cls_ls12 | lowers | helps | holds |" in verdict.oversmoothing_lines(primary)
    assert "six_vit_default" not in "".join(verdict.oversmoothing_lines(primary))
    cases = {("lowers", "helps"): "holds", ("raises", "helps"): "contradicted", ("undecided", "hurts"): "contradicted",
             ("lowers", "no difference larger than 0.005"): "smoother without a gain", ("lowers", "undecided"): "undecided"}
    graph = [dict(r, claim=verdict.GRAPH_CLAIM, words="helps" if r["metric"] == "val_acc" else "raises")
             for r in primary if r["metric"] in ("val_acc", "within-sequence share")]  # as rows 21 and 23 would read
    assert verdict.oversmoothing_lines(primary + graph)[-1] == "| six_vit_cls_ls12 | lowers | helps | holds |"
    flat = [dict(r, words="no difference larger than 0.005") if r["metric"] == "val_acc" else r for r in primary]
    assert verdict.oversmoothing_lines(flat + graph)[-1:] == [  # one row, read from n_lap 4 against 0 alone
        "| six_vit_cls_ls12 | lowers | no difference larger than 0.005 | smoother without a gain |"]
    for (share, acc), expected in cases.items():
        two = [dict(set="s", metric="within-sequence share", words=share), dict(set="s", metric="val_acc", words=acc)]
        assert verdict.oversmoothing_lines(two)[-1] == f"| s | {share} | {acc} | {expected} |"


def collected_run(kind, set_name, n_lap, seed, machine, x):
    """A run as report.collect_runs yields it (its analysis.json with "run", "metrics" = report.run_metrics and
    "machine") whose every verdict metric is a constant plus x (the ratio within- / between-class: (0.1 + 3x) / (0.1 +
    x); the shares of the variance within a sequence: 0.8 - x)."""
    end = {"vit": {"val_acc": 0.89 + x}, "gpt": {"val_bpb": 2.26 + x},
           "dino": {"knn_acc": 0.71 + x, "linear_acc": 0.75 + x, "seg_miou": 0.1 + x}}[kind]
    nc = {"vit": {"pooled": {"nc1": 0.4 + x, "nc2_equinorm": 0.2 + x, "nc2_equiangular": 0.1 + x, "nc3": 0.4 + x,
                             "nc4": 0.02 + x}},
          "gpt": {"nc1": 4.5 + x}, "dino": {}}[kind]
    anova = ({"within_class_frac": 0.7 + x, "between_class_frac": 0.3 - x} if kind == "gpt" else
             {"within_seq_frac": 0.8 - x, "within_class_frac": 0.1 + 3 * x, "between_class_frac": 0.1 + x})
    a = dict(run=f"{set_name}/k{n_lap}-s{seed}", kind=kind, n_lap=n_lap, n_lap_label=str(n_lap), seed=seed,
             final_metric={"name": geometry.FINAL_METRIC[kind][0], "value": list(end.values())[0], "step": 10},
             settings={"layer": -1}, anova=anova, nc=nc,
             etf={"pooled": {"vertex_dist": 0.2 + x}} if kind == "vit" else {},
             layerwise={"within_seq_frac": [0.9, 0.85 - x, 0.8 - x], "cosine": [0.1, 0.2 + x, 0.3]},
             spectrum={"k_0.9": 27 + x, "k_0.99": 64 + x})
    return dict(a, metrics=report.run_metrics(a, end), machine=machine)


def twelve_seeds(uniform_shift=None):
    """The verdict's sets at twelve seeds a side as results/PLAN.md plans them, as report.collect_runs yields them:
    six_vit_cls_ls12, six_gpt and six_dino, n_lap 0 and 4, seeds 0-5 on machine M1 and 6-11 on M2, x = 0.001 *
    (seed mod 6) at n_lap 0 and 0.1 more at n_lap 4; and per uniform-graph set named in uniform_shift, its n_lap 4 runs
    of seeds 0-11, all on M2 (they train beside seeds 6-11), x = the attention graph's plus the shift (a function of
    the seed)."""
    collected = {}
    for kind, name in (("vit", "six_vit_cls_ls12"), ("gpt", "six_gpt"), ("dino", "six_dino")):
        collected[name] = [collected_run(kind, name, n_lap, seed, "M1" if seed < 6 else "M2",
                                         0.001 * (seed % 6) + (0.1 if n_lap else 0.0))
                           for n_lap in (0, 4) for seed in range(12)]
    for name, shift in (uniform_shift or {}).items():
        kind = "gpt" if name == "uniform_gpt" else "vit"
        collected[name] = [collected_run(kind, name, 4, seed, "M2", 0.1 + 0.001 * (seed % 6) + shift(seed))
                           for seed in range(12)]
    return collected


def test_the_verdict_at_twelve_seeds_on_two_machines():
    """The whole path on synthetic collected runs (twelve_seeds). By hand: each n_lap row is 12 + 12 runs, six of each
    n_lap on each machine, every n_lap 4 run above its machine's n_lap 0 runs: of the 924 x 924 relabelings within
    machines, the observed and its mirror reach |diff|: p = 2 / 924^2 = 2.34e-06, also the smallest p these runs
    allow. With both uniform-graph sets the family has 24 rows and Holm multiplies that p by m = 24.
    The reviewers' rule: the uniform sets' runs equal to the attention graph's (diff 0, spread 0.0018 a group, 95%
    interval +-0.0015, inside every X): 'the graph does not matter beyond X'; the GPT's uniform runs 0.05 lower: rows
    22 and 24 decided, 'the graph matters'. There M1 holds attention runs alone and exchanges nothing, and M2's 6
    attention and 12 uniform runs are relabeled C(18, 6) = 18564 ways, of which only the observed reaches |diff|: p =
    1/18564, and Holm, the 21st-24th smallest of 24, multiplies it by 24 - 20 = 4. The ViT's uniform set alone: 22
    rows, undecided (not all four rows bounded)."""
    def same(seed):
        return 0.0

    primary, exploratory = verdict.verdict_rows(twelve_seeds({"uniform_vit_cls_ls12": same, "uniform_gpt": same}))
    assert [(r["claim"], r["metric"], r["set"], r["against"]) for r in primary] == [
        (claim, metric, verdict.VERDICT_SETS[regime][0], against)
        for claim, metric, regime, against in verdict.primary_family()]
    assert len(primary) == 24
    for r in primary[:20]:
        assert (r["p"], r["floor"]) == (pytest.approx(2 / 924 ** 2), pytest.approx(2 / 924 ** 2))
        assert r["holm"] == pytest.approx(24 * 2 / 924 ** 2) and r["machines"] == (
            "M1 (seeds 0, 1, 2, 3, 4, 5); M2 (seeds 6, 7, 8, 9, 10, 11)")
    for r in primary:
        assert r["detectable"] == pytest.approx(stats.detectable_difference(r["se"], r["df"], 24))
    graph = primary[20:]
    assert [r["words"] for r in graph] == ["no difference larger than 0.005", "no difference larger than 0.01",
                                           "no difference larger than 0.02", "no difference larger than 0.02"]
    assert all(r["p"] == 1 and abs(r["diff"]) < 1e-12 and r["paper"] == "—" for r in graph)
    assert graph[0]["machines"] == ("A: M2 (seeds 0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11); "
                                    "B: M1 (seeds 0, 1, 2, 3, 4, 5); M2 (seeds 6, 7, 8, 9, 10, 11)")
    assert verdict.graph_answer(primary) == "the graph does not matter beyond X"
    lines = verdict.verdict_lines(primary, exploratory, "sets", [], {}, {})
    assert "m = 24 rows, decided by Holm's correction over these 24 alone:" in lines[4]
    assert sum(line.startswith("| the attention graph matters") for line in lines) == 4
    assert lines[-3] == "Answer: the graph does not matter beyond X."
    table = lines[6:6 + 2 + 24]
    assert all(line.count("|") == 15 for line in table)  # 14 cells a row, the header's and the rule's too
    text = next(line for line in lines if line.startswith("A, B:"))
    assert ("The primary rows' runs allow p down to 2.34e-06 to 5.39e-05, so no Holm p there can be below 24 × "
            "2.34e-06 = 5.62e-05.") in text  # the graph rows' floor: 1/18564, below
    # exploratory: DINO's k_0.9 and k_0.99, the same separation, uncorrected and naming no way
    assert [(r["metric"], r["set"], r["words"]) for r in exploratory] == [
        (k, "six_dino", "differs at uncorrected p=2.34e-06, exploratory") for k in ("k_0.9", "k_0.99")]
    assert all("holm" not in r and "detectable" not in r for r in exploratory)

    primary, _ = verdict.verdict_rows(twelve_seeds({"uniform_vit_cls_ls12": same, "uniform_gpt": lambda s: -0.05}))
    graph = {(r["metric"], r["set"]): r for r in primary[20:]}
    bpb, share = graph["val_bpb", "six_gpt"], graph["within-sequence share", "six_gpt"]
    assert (bpb["diff"], share["diff"]) == (pytest.approx(0.05), pytest.approx(-0.05))  # attention - uniform
    assert bpb["p"] == pytest.approx(1 / 18564) and bpb["holm"] == pytest.approx(4 / 18564)
    assert (bpb["words"], share["words"]) == ("hurts", "lowers")  # bits per byte higher on the attention graph
    assert graph["val_acc", "six_vit_cls_ls12"]["words"] == "no difference larger than 0.005"
    assert verdict.graph_answer(primary) == "the graph matters"
    assert verdict.graph_lines(primary)[-1] == "Answer: the graph matters."

    primary, _ = verdict.verdict_rows(twelve_seeds({"uniform_vit_cls_ls12": same}))
    assert len(primary) == 22 and primary[20]["holm"] == pytest.approx(1.0)
    assert [r["words"] for r in primary[20:]] == ["no difference larger than 0.005", "no difference larger than 0.02"]
    assert verdict.graph_answer(primary) == "undecided"


def test_the_reviewers_answer_follows_the_plans_rule():
    """'the graph matters' where one of the four rows is decided (Holm p below 0.05), whatever the others read; 'does
    not matter beyond X' only where all four are here and bounded; else undecided (a row undecided, or rows missing)."""
    def rows(*words):
        return [dict(claim=verdict.GRAPH_CLAIM, metric=metric, set="s", against="u", diff=0.0, words=w,
                     holm=0.01 if w in ("helps", "hurts", "raises", "lowers") else 0.5)
                for (metric, _), w in zip(verdict.GRAPH_ROWS, words)]
    bounded = "no difference larger than 0.02"
    other = [dict(claim="Neural Collapse", holm=0.001, words="raises")]  # a decided row of another claim counts not
    assert verdict.graph_answer(other + rows("undecided", "hurts", "undecided", bounded)) == "the graph matters"
    all_bounded = rows(bounded, bounded, bounded, bounded)
    assert verdict.graph_answer(other + all_bounded) == "the graph does not matter beyond X"
    assert verdict.graph_answer(other + rows(bounded, "undecided", bounded, bounded)) == "undecided"
    assert verdict.graph_answer(other + rows(bounded, bounded, bounded)) == "undecided"  # row 24 missing
    assert verdict.graph_answer(other) == "undecided"
    lines = verdict.graph_lines(rows("undecided", "hurts", "undecided", bounded))
    assert lines[-3:] == ["| within-sequence share | s | u | +0 | no difference larger than 0.02 |", "",
                          "Answer: the graph matters."]
    assert verdict.graph_lines(other)[-1] == ("Answer: undecided (none of its rows is here: uniform_vit_cls_ls12 and "
                                              "uniform_gpt are not in this results folder).")


def test_verdict_maps_show_the_same_images():
    """The side-by-side DINO PCA maps are one seed's n_lap 0 and 4 figures: analyze.py draws the same images in both,
    so the images' panels (the figure's upper part, under the title) are the same pixels; the title and the maps
    below differ."""
    from matplotlib.image import imread
    collected = report.collect_runs(os.path.join(ROOT, "results"))
    chosen = verdict.verdict_sets(collected)
    for name in [chosen["dino"], *verdict.PCA_MAP_SETS]:
        a, b = (imread(path) for path in verdict.run_pair(collected[name], "pca_maps.png"))
        height = a.shape[0]
        same = (a == b).all(axis=(1, 2))
        assert a.shape == b.shape and same[int(0.15 * height):int(0.5 * height)].all(), name
        assert not same.all()


def test_run_pair_and_stack(tmp_path):
    """A per-run figure of one seed's n_lap 0 and 4 runs (the lowest seed with both), one above the other pixel for
    pixel; no pair, no figure."""
    from matplotlib.image import imread, imsave
    runs = []
    for n_lap, seed, level in ((0, 1, 10), (4, 1, 200), (0, 2, 50), (4, 0, 90)):  # seed 1 alone has both
        folder = tmp_path / f"k{n_lap}-s{seed}"
        folder.mkdir()
        imsave(folder / "pca.png", np.full((3, 5, 3), level, dtype=np.uint8))
        runs.append(dict(run=str(folder), n_lap_label=str(n_lap), seed=seed))
    pair = verdict.run_pair(runs, "pca.png")
    assert pair == [str(tmp_path / "k0-s1" / "pca.png"), str(tmp_path / "k4-s1" / "pca.png")]
    verdict.fig_stack(pair, str(tmp_path / "stacked.png"))
    stacked = (imread(tmp_path / "stacked.png")[..., :3] * 255).round()
    assert stacked.shape == (6, 5, 3) and (stacked[:3] == 10).all() and (stacked[3:] == 200).all()
    assert verdict.run_pair(runs, "etf.png") is None


def test_recorded_machine_reads_the_results_folders_record():
    recorded = {"Intel_Xeon": ["vit/*", "vit_deit/k*-s0"], "AMD_EPYC": ["vit_deit/k*-s2"]}
    assert report.recorded_machine(recorded, "vit/k3-s1") == "Intel_Xeon"
    assert report.recorded_machine(recorded, "vit_deit/k4-s0") == "Intel_Xeon"
    assert report.recorded_machine(recorded, "vit_deit/k4-s2") == "AMD_EPYC"
    assert report.recorded_machine(recorded, "vit_deit/k4-s1") == "unrecorded"


def test_every_committed_run_has_a_machine():
    """each run in results/ names its machine: in its RESULT line, or in results/machines.json for the older ones"""
    unknown = [name for name, runs in report.collect_runs(os.path.join(ROOT, "results")).items()
               for r in runs if r["machine"] == "unrecorded"]
    assert unknown == []


def test_effect_calls_nothing_separated_with_one_run_per_side():
    assert stats.effect([0.1, 0.2, 0.3], [0.4, 0.5, 0.6])[2] is True
    assert stats.effect([0.1, 0.5, 0.3], [0.4, 0.2, 0.6])[2] is False
    assert stats.effect([0.1], [0.9]) == (pytest.approx(0.8), None, None)  # dino_scenes: one seed each


def test_spearman_trend():
    r, p = stats.spearman_trend([0, 0, 0, 4, 4, 4], [0.1, 0.2, 0.3, 0.4, 0.5, 0.6])
    assert r == pytest.approx(math.sqrt(27 / 35))  # ranks 1..6 against two tied groups: r = 0.878
    assert p == pytest.approx(2 / math.comb(6, 3), abs=0.02)  # the two extreme splits of 20
    r, p = stats.spearman_trend([0, 1, 2, 3, 4], [5, 4, 3, 2, 1])
    assert r == pytest.approx(-1.0) and p < 0.03  # 2 of 120 orderings are as extreme
    assert stats.spearman_trend([0, 1, 2, 3], [1, 3, 2, 4])[0] == pytest.approx(0.8)


def test_seeds_note():
    """What the error bars of a comparison stand for, from the number of runs behind each point."""
    assert report.seeds_note([1, 1, 1]) == "1 seed per point, no spread"
    assert report.seeds_note([3, 3]) == "mean +- std over 3 seeds per point"
    assert report.seeds_note([2, 1, 3]) == "mean +- std over 1-3 seeds per point"


@pytest.mark.slow
def test_comparison_over_runs(tmp_path, fashion_dir, capsys, figure_texts):
    runs = [make_run(tmp_path / f"vit-k{k}-s{s}", "vit", n_lap=k, seed=s, metric=0.6 + 0.1 * k + 0.01 * s,
                     dataset="fashion_mnist", data_dir=fashion_dir) for k, s in ((0, 0), (0, 1), (4, 0))]
    runs.append(make_run(tmp_path / "vit-list", "vit", n_lap=[1, 3], dataset="fashion_mnist", data_dir=fashion_dir))
    out = tmp_path / "cmp"
    run_analyze(*runs, "--max_samples=20", "--batch_size=20", f"--out={out}")
    assert "compare them: python results/report.py " in capsys.readouterr().out
    run_report(*[str(out / os.path.basename(r)) for r in runs], f"--out={out}")
    figs = [f"compare_vit_{n}.png" for n in ("metric", "anova", "kalpha", "spectra", "collapse", "heads")]
    for f in figs:
        assert os.path.getsize(out / f) > 1000
    for r in runs:  # one folder of per-run analyses each
        assert os.path.isfile(out / os.path.basename(r) / "analysis.json")
    res = json.loads((out / "analysis.json").read_text())
    c = res["comparisons"][0]
    assert c["kind"] == "vit" and c["figures"] == figs and len(res["runs"]) == 4
    groups = {g["n_lap"]: g for g in c["groups"]}
    assert list(groups) == ["0", "2 [1, 3]", "4"]  # ordered by the mean number of Laplacian heads
    assert groups["0"]["val_acc"]["mean"] == pytest.approx(0.605) and groups["0"]["val_acc"]["n"] == 2
    assert groups["0"]["val_acc"]["std"] == pytest.approx(np.std([0.6, 0.61], ddof=1))
    assert groups["0"]["seeds"] == [0, 1] and c["differing_settings"] == []
    assert groups["4"]["val_acc"] == {"mean": pytest.approx(1.0), "std": 0.0, "n": 1}
    for g in groups.values():
        assert sum(g[k]["mean"] for k in FRACS) == pytest.approx(1.0)
    assert result(capsys.readouterr().out) == {"runs": "4", "comparisons": "vit", "out": str(out)}
    md = (out / "summary.md").read_text()  # the table of the report: end metrics (here log.jsonl's), effect of n_lap
    assert "## vit (vit, ANOVA at the final norm)" in md and "| 0 | 2 | 0.605 ± 0.0071 |" in md
    assert "| val_acc | +0.395 | n/a | + | n/a (one run) |" in md and "Figures: " + ", ".join(figs) in md
    assert c["spread"] == "mean +- std over 1-2 seeds per point" and c["groups"][0]["values"]["val_acc"] == [0.6, 0.61]
    for f in ("compare_vit_metric.png", "compare_vit_kalpha.png"):
        assert figure_texts[f]["titles"][0].endswith("\n(mean $\\pm$ std over 1-2 seeds per point)"), figure_texts[f]
    one_seed = [make_run(tmp_path / f"one-k{k}", "vit", n_lap=k, dataset="fashion_mnist", data_dir=fashion_dir)
                for k in (0, 4)]
    run_analyze(*one_seed, "--max_samples=20", f"--out={tmp_path / 'cmp1'}")
    run_report(*[str(tmp_path / "cmp1" / os.path.basename(r)) for r in one_seed], f"--out={tmp_path / 'cmp1'}")
    assert figure_texts["compare_vit_metric.png"]["titles"][0] == "vit: val_acc vs n_lap\n(1 seed per point, no spread)"
    # settings that differ besides n_lap and seed are reported; paths, seeds and keys not all runs record are not
    configs = [dict(lr=1e-3, seed=0, out_dir="a", epochs=5), dict(lr=2e-3, seed=1, out_dir="b", epochs=5, extra=1)]
    assert figures.differing_settings(configs) == ["lr"]


def fake_run(root, kind, n_lap, seed, result, frac, epochs=6, rho=None, set_name=None):
    """A run folder of results/sweep.sh (epochs=18: of vit_long): result.txt, log.jsonl and an analysis.json with the
    fields analyze.py writes (a 2-block model), its final-norm within_seq_frac (GPT: within_class_frac) = frac;
    analysis_all.json with frac / 2 (ViT, DINO). rho: per block, every head's rho (else no per-head numbers, as
    in a run analysed before the per-head pass). set_name: the run's set, if not kind (or vit_long)."""
    d = root / (set_name or ("vit_long" if epochs == 18 else kind)) / f"k{n_lap}-s{seed}"
    d.mkdir(parents=True)
    def analysis(frac):
        anova = ({"within_class_frac": frac, "between_class_frac": 1 - frac} if kind == "gpt" else
                 {"within_seq_frac": frac, "within_class_frac": (1 - frac) / 4, "between_class_frac": 3 * (1 - frac) / 4})
        nc = {"vit": {"pooled": {"nc1": 1.0 + n_lap + seed}}, "gpt": {"nc1": 2.0}, "dino": {}}[kind]
        return dict(run=str(d), kind=kind, n_lap=n_lap, n_lap_mean=float(n_lap), n_lap_label=str(n_lap), n_head=4, seed=seed,
                    step=10, final_metric={"name": geometry.FINAL_METRIC[kind][0], "value": 0.5, "step": 10},
                    train_config=dict(seed=seed, n_lap=n_lap, epochs=epochs, out_dir=str(d)), settings={"layer": -1},
                    anova=anova, nc=nc, spectrum={"lambda_mean": [4.0, 2.0, 1.0, 0.0], "k_0.9": 2.0, "k_0.99": 3.0 + seed},
                    layerwise={"layer": ["1", "2", "norm"], "within_seq_frac": [0.9, 0.8 - n_lap / 10, frac],
                               "cosine": [0.1, 0.2, 0.3]},
                    **({} if rho is None else {"heads": {"graph": "attention", "layers": [
                        {"block": l + 1, "rho": [r] * 4, "laplacian": [h >= 4 - n_lap for h in range(4)]}
                        for l, r in enumerate(rho)]}}))
    (d / "analysis.json").write_text(json.dumps(analysis(frac)))
    if kind != "gpt":
        (d / "analysis_all.json").write_text(json.dumps(analysis(frac / 2)))
    (d / "log.jsonl").write_text(json.dumps({"step": 10, **result}) + "\n")
    (d / "result.txt").write_text("RESULT " + " ".join(f"{k}={v}" for k, v in result.items()) + f" n_lap={n_lap}\n")


def test_runs_of_different_corpora_are_not_compared(tmp_path):
    """GPT runs name their corpus in the RESULT line; one without it (the committed runs, all on the Gutenberg corpus)
    compares with any."""
    for n_lap, corpus in ((0, "gutenberg-1a2b3c4d"), (2, "gutenberg-1a2b3c4d"), (4, None)):
        fake_run(tmp_path, "gpt", n_lap, 0, dict(val_bpb=2.2, **({"corpus": corpus} if corpus else {})), 0.6)
    runs = [{"run": str(d)} for d in sorted((tmp_path / "gpt").iterdir())]
    report.one_corpus(runs, "gpt")
    fake_run(tmp_path, "gpt", 1, 0, dict(val_bpb=2.0, corpus="tinyshakespeare-5f6e7d8c"), 0.6)
    with pytest.raises(UsageError, match=r"^the gpt runs trained on different corpora \(gutenberg-1a2b3c4d, "
                                         r"tinyshakespeare-5f6e7d8c\): their losses do not compare$"):
        report.one_corpus(runs + [{"run": str(tmp_path / "gpt" / "k1-s0")}], "gpt")


@pytest.mark.slow  # ten seconds: every figure of four sets
def test_report_from_saved_artefacts(tmp_path):
    """the report as a user runs it: summary.md's mean +- std and effect table (one metric separated, one overlapping),
    the figures; a folder without runs is a one-line error."""
    root = tmp_path / "results"
    vit = {0: ([0.80, 0.82], [0.50, 0.40], [0.30, 0.34]), 4: ([0.85, 0.86], [0.45, 0.42], [0.20, 0.22])}
    for k, (acc, loss, frac) in vit.items():  # val_acc separated (+), val_loss overlapping (-)
        for s in (0, 1):
            fake_run(root, "vit", k, s, dict(val_acc=acc[s], val_loss=loss[s]), frac[s])
            fake_run(root, "vit", k, s, dict(val_acc=acc[s] + 0.05, val_loss=loss[s]), frac[s], epochs=18)
    for s, rho in ((0, [-0.1, -0.3]), (1, [-0.2, -0.5])):  # a set whose n_lap 4 runs alone have per-head numbers
        fake_run(root, "vit", 0, s, dict(val_acc=0.8, val_loss=0.5), 0.3, set_name="vit_deep")
        fake_run(root, "vit", 4, s, dict(val_acc=0.8, val_loss=0.5), 0.2, rho=rho, set_name="vit_deep")
    for k, bpb in ((0, 2.2), (2, 2.1)):
        fake_run(root, "gpt", k, 0, dict(val_loss=bpb / 1.4, val_bpb=bpb), 0.6)
        fake_run(root, "dino", k, 0, dict(knn_acc=0.7, linear_acc=0.75, seg_miou=0.1), 0.5)
    (root / "figures").mkdir()  # folders without runs are passed over
    p = subprocess.run([sys.executable, SCRIPT, f"--results={root}"], cwd=tmp_path, capture_output=True, text=True,
                       timeout=300)
    assert p.returncode == 0, p.stderr[-2000:]
    assert result(p.stdout) == {"sets": "dino,gpt,vit,vit_deep,vit_long", "runs": "16", "out": "results"}  # relative
    figures = [f"figures/{s}/{f}.png" for s in ("dino", "gpt", "vit", "vit_deep", "vit_long")
               for f in ("metric", "anova", "kalpha", "spectra", "collapse")]
    figures += ["figures/vit_deep/heads.png", "figures/headline.png"]
    curves = [f"figures/{s}/curves.png" for s in ("dino", "gpt", "vit", "vit_deep", "vit_long")]  # beside, not in summary.md
    for f in figures + curves + ["summary.md"]:
        assert f"wrote {root / f}" in p.stdout.splitlines() and os.path.getsize(root / f) > 500, f
    md = (root / "summary.md").read_text()

    def ms(v):
        return f"{np.mean(v):.4g} ± {np.std(v, ddof=1):.2g}"

    vit_md = md.split("## vit (")[1].split("## ")[0]
    assert (f"| 0 | 2 | {ms(vit[0][0])} | {ms(vit[0][1])} | {ms(vit[0][2])} | " in vit_md and
            f"| 4 | 2 | {ms(vit[4][0])} | {ms(vit[4][1])} | {ms(vit[4][2])} | " in vit_md)
    se = [math.sqrt(np.var(vit[0][i], ddof=1) / 2 + np.var(vit[4][i], ddof=1) / 2) for i in (0, 1)]
    assert f"| val_acc | +0.045 | {se[0]:.2g} | + | yes |" in vit_md
    assert f"| val_loss | -0.015 | {se[1]:.2g} | − | no |" in vit_md  # 0.45, 0.42 lie inside 0.40-0.50
    assert "| within_seq after last block | -0.4 | 0 | − | yes |" in vit_md
    assert "2 + 2 seeds an exact permutation test's smallest two-sided p is 2 / C(4, 2) = 0.33" in vit_md
    assert "Figures: " + ", ".join(f for f in figures if f.startswith("figures/vit/")) in vit_md
    gpt_md = md.split("## gpt (")[1].split("## ")[0]
    assert "| 0 | 1 | 2.2 | " in gpt_md and "within_class (next-token)" in gpt_md and "(patch)" not in gpt_md
    assert "| val_bpb | -0.1 | n/a | − | n/a (one run) |" in gpt_md  # one seed each: no standard error, no separation
    assert "nc1" not in md.split("## dino (")[1].split("## ")[0]  # no NC for DINO
    deep_md = md.split("## vit_deep (")[1].split("## ")[0]  # the per-head table of the runs that have the numbers
    assert "| 4 | laplacian | -0.1500 ± 0.0707 | -0.4000 ± 0.1414 |" in deep_md and "| 0 | attention |" not in deep_md
    assert "Per-head analysis" not in vit_md
    assert f"`python results/report.py --results={root}`: end metrics" in md  # the command that made it
    assert "None of the verdict's sets is in this results folder." in md and not (root / "figures" / "verdict").exists()
    # no runs, no folder, a folder without an analysis to compare: one-line errors
    (tmp_path / "empty").mkdir()
    p = subprocess.run([sys.executable, SCRIPT, "--results=empty"], cwd=tmp_path, capture_output=True, text=True,
                       timeout=120)
    assert p.returncode == 1 and p.stderr.startswith("error: --results=empty: no run folders") and "Traceback" not in p.stderr
    assert len(p.stderr.strip().splitlines()) == 1
    with pytest.raises(UsageError, match="no such folder"):
        run_report(f"--results={tmp_path / 'typo'}")
    with pytest.raises(UsageError, match="no analysis.json of a run here .* analyse the run first: python analyze.py"):
        run_report(str(tmp_path / "empty"), str(root / "vit" / "k0-s0"))


@pytest.mark.slow  # half a minute: every figure of the committed sets
def test_committed_summary_is_the_report_of_the_committed_artefacts(tmp_path):
    """results/summary.md, where RESULTS.md's tables come from, and every figure of results/figures/ are exactly what
    the report makes of the committed run folders, byte for byte (with the matplotlib that drew the committed
    figures: another version may place a pixel differently): an artefact added or changed without regenerating
    the report fails here. Byte for byte holds on any CPU: the report's floats reach these files only as a few
    printed digits and as pixels, where a last-bit difference does not show (torch's scalar kernels,
    ATEN_CPU_CAPABILITY=default, rewrite them all byte for byte)."""
    p = subprocess.run([sys.executable, SCRIPT, f"--out={tmp_path}"], cwd=ROOT,
                       capture_output=True, text=True, timeout=600)
    assert p.returncode == 0, p.stderr[-2000:]
    with open(os.path.join(ROOT, "results", "summary.md")) as f:
        committed = f.read()
    assert (tmp_path / "summary.md").read_text() == committed
    results = os.path.join(ROOT, "results")
    drawn = sorted(os.path.relpath(f, tmp_path) for f in glob.glob(f"{tmp_path}/figures/**/*.png", recursive=True))
    kept = sorted(os.path.relpath(f, results) for f in glob.glob(f"{results}/figures/**/*.png", recursive=True))
    assert drawn == kept
    for f in drawn:
        with open(os.path.join(results, f), "rb") as png:
            assert (tmp_path / f).read_bytes() == png.read(), f


def test_results_md_quotes_the_verdict_of_summary_md():
    """RESULTS.md's verdict tables are results/summary.md's, row for row and digit for digit: a report run on new
    artefacts without RESULTS.md following it fails here."""
    def verdict_rows(path):
        with open(os.path.join(ROOT, path)) as f:
            section = f.read().split("\n## Verdict")[1].split("\n## ")[0]
        return [line for line in section.splitlines() if line.startswith("|")]
    quoted = verdict_rows("RESULTS.md")
    assert len(quoted) >= 2 + 20 and quoted == verdict_rows("results/summary.md")


def test_headline_figure(tmp_path, figure_texts):
    """A column per paradigm present (vit, gpt, dino order), the headline metric on top and the within-sequence share
    (GPT: within-class share of next-token classes) below; a ViT set of the same recipe at another length is a series
    labelled with its epochs; sets of other recipes (CLS pooling, DINO on the scenes) stay out."""
    def group(k, n, values):
        return dict(n_lap=str(k), n_lap_mean=float(k), runs=["run"] * n, values=values)

    def vit(epochs, ks, pooling="mean"):
        return dict(kind="vit", label=f"{epochs} epochs", config=dict(
            dataset="fashion_mnist", epochs=epochs, pooling=pooling, seed=0), groups=[
            group(k, 3, {"val_acc": [0.8 + k / 100] * 3, "within_seq (patch)": [0.3 - k / 50] * 3}) for k in ks])

    gpt = dict(kind="gpt", label="gpt", config=dict(dataset="shakespeare_char"), groups=[
        group(k, 1, {"val_bpb": [2.2 - k / 20], "within_class (next-token)": [0.7]}) for k in (0, 2)])

    def dino(dataset):
        return dict(kind="dino", label=dataset, config=dict(dataset=dataset), groups=[
            group(k, 1, {"knn_acc": [0.7], "within_seq (patch)": [0.9]}) for k in (0, 4)])

    report.fig_headline({"dino": dino("fashion_mnist"), "dino_scenes": dino("scenes"), "gpt": gpt,
                          "vit": vit(6, (0, 2, 4)), "vit_amd": vit(6, (0, 4)), "vit_cls": vit(6, (0, 4), "cls"),
                          "vit_long": vit(18, (0, 4))},
                         str(tmp_path / "headline.png"))
    t = figure_texts["headline.png"]
    three, one = "(mean $\\pm$ std over 3 seeds per point)", "(1 seed per point, no spread)"
    assert t["titles"] == [f"vit: val_acc (higher is better)\n{three}", f"gpt: val_bpb (lower is better)\n{one}",
                           f"dino: knn_acc (higher is better)\n{one}",
                           f"vit: within-sequence share of patch tokens\n{three}",
                           f"gpt: within-class share of next-token classes\n{one}",
                           f"dino: within-sequence share of patch tokens\n{one}"]
    assert t["legend"] == ["6 epochs", "18 epochs"] * 2  # one series per length, in both panels; GPT, DINO: none

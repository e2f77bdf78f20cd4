"""Paired comparisons of two settings measured on the same items (prompts, text windows).

Each test returns a ``PairedTest`` whose ``outcome`` is one of ``IMPROVES``, ``HURTS`` or ``NO_DIFFERENCE``:
the two-sided test at level ``alpha`` rejects "no difference" and the effect points up or down. "Better"
is oriented by the caller (``higher_is_better``), so a claim can map the outcome directly onto its verdict.
Formulas: the book's methods page (book/methods.md).

- ``mcnemar_exact``: pass/fail per item under both settings. Only discordant items carry information:
  b items pass only under the first setting, c only under the second; under "no difference" c ~ Bin(b + c, 1/2),
  and the two-sided p-value is min(1, 2 P(X <= min(b, c))).
- ``paired_bootstrap``: a number per item under both settings; the percentile interval of the mean paired
  difference, resampling items with replacement; "no difference" is rejected when the (1 - alpha) interval
  excludes 0, i.e. when twice the smaller share of resampled means on either side of 0 (the p-value) is
  below alpha.
- ``paired_runs``: the same over items, for scores from several runs (seeds) of each setting: the bootstrap of
  the items' run means, its interval widened, for pass/fail scores, to contain the Agresti-Min interval of the
  pooled (run, item) pairs, so that a handful of changed items cannot yield a near-zero-width interval.
"""
from __future__ import annotations

import dataclasses
import math

import numpy as np

IMPROVES, HURTS, NO_DIFFERENCE = "improves", "hurts", "no difference"
OUTCOMES = (IMPROVES, HURTS, NO_DIFFERENCE)


@dataclasses.dataclass(frozen=True)
class PairedTest:
    test: str
    n: int                  # paired items
    effect: float           # second minus first, in the direction where positive is better
    p_value: float          # two-sided
    alpha: float
    outcome: str            # IMPROVES / HURTS / NO_DIFFERENCE (of the second setting against the first)
    detail: dict = dataclasses.field(default_factory=dict)

    def summary(self) -> str:
        return f"{self.outcome} ({self.test}, n={self.n}, effect {self.effect:+.4g}, p={self.p_value:.3g})"


def _outcome(effect: float, p_value: float, alpha: float) -> str:
    if p_value < alpha and effect > 0:
        return IMPROVES
    if p_value < alpha and effect < 0:
        return HURTS
    return NO_DIFFERENCE


def _check_alpha(alpha: float) -> None:
    if not 0 < alpha < 1:
        raise ValueError(f"alpha must lie in (0, 1), got {alpha!r}")


def binomial_two_sided(k: int, n: int) -> float:
    """Exact two-sided p-value of k successes in n fair coin flips: min(1, 2 P(X <= min(k, n - k)))."""
    if n == 0:
        return 1.0
    low = min(k, n - k)
    tail = sum(math.comb(n, i) for i in range(low + 1)) / 2 ** n
    return min(1.0, 2 * tail)


def mcnemar_exact(first, second, alpha: float) -> PairedTest:
    """Exact McNemar test of pass/fail outcomes ``first`` and ``second`` (bool per item, same items, same
    order). Effect: pass rate of ``second`` minus that of ``first``; IMPROVES means ``second`` passes more."""
    _check_alpha(alpha)
    a, b_ = np.asarray(first, dtype=bool), np.asarray(second, dtype=bool)
    if a.shape != b_.shape or a.ndim != 1:
        raise ValueError(f"paired outcomes need two 1-d arrays of one length, got {a.shape} and {b_.shape}")
    only_first = int((a & ~b_).sum())
    only_second = int((~a & b_).sum())
    n = len(a)
    effect = (only_second - only_first) / n if n else 0.0
    p = binomial_two_sided(only_second, only_first + only_second)
    return PairedTest("exact McNemar", n, effect, p, alpha, _outcome(effect, p, alpha),
                      {"only_first": only_first, "only_second": only_second,
                       "rate_first": float(a.mean()) if n else float("nan"),
                       "rate_second": float(b_.mean()) if n else float("nan")})


def paired_bootstrap(first, second, alpha: float, higher_is_better: bool = True, resamples: int = 10_000,
                     seed: int = 0) -> PairedTest:
    """Paired percentile bootstrap of the mean difference ``second - first`` (one number per item).

    With ``higher_is_better=False`` (a loss) the effect is ``first - second``, so IMPROVES always means
    ``second`` is better."""
    _check_alpha(alpha)
    x, y = np.asarray(first, dtype=float), np.asarray(second, dtype=float)
    if x.shape != y.shape or x.ndim != 1 or len(x) < 2:
        raise ValueError(f"paired values need two 1-d arrays of one length >= 2, got {x.shape} and {y.shape}")
    diff = (y - x) if higher_is_better else (x - y)
    rng = np.random.default_rng(seed)
    means = diff[rng.integers(0, len(diff), size=(resamples, len(diff)))].mean(1)
    low, high = np.quantile(means, [alpha / 2, 1 - alpha / 2])
    p = min(1.0, 2 * min((means <= 0).mean(), (means >= 0).mean()))
    effect = float(diff.mean())
    return PairedTest("paired bootstrap", len(diff), effect, float(p), alpha, _outcome(effect, p, alpha),
                      {"interval": (float(low), float(high)), "resamples": resamples,
                       "mean_first": float(x.mean()), "mean_second": float(y.mean())})


def paired_runs(first, second, alpha: float, higher_is_better: bool = True, resamples: int = 10_000,
                seed: int = 0) -> PairedTest:
    """Two settings scored on the same items in the same runs (seeds): ``first`` and ``second`` hold one row per
    run, one column per item. The paired bootstrap over items of each item's run mean, so that the interval carries
    the spread between items and between runs.

    With pass/fail scores and few items that change, the bootstrap's percentile interval shrinks toward a point
    (no item changes: [0, 0]) and would claim more than the count of pairs allows. For 0/1 scores the interval is
    therefore widened to contain the Agresti-Min interval of the pooled (run, item) pairs, and the p-value is the
    larger of the bootstrap's and the exact McNemar test's on those pairs."""
    x, y = np.atleast_2d(np.asarray(first, dtype=float)), np.atleast_2d(np.asarray(second, dtype=float))
    if x.shape != y.shape:
        raise ValueError(f"paired runs need two arrays of one shape (runs, items), got {x.shape} and {y.shape}")
    test = paired_bootstrap(x.mean(0), y.mean(0), alpha, higher_is_better, resamples, seed)
    binary = np.isin(x, (0, 1)).all() and np.isin(y, (0, 1)).all()
    if not binary:
        return dataclasses.replace(test, detail={**test.detail, "runs": len(x)})
    worse, better = (x, y) if higher_is_better else (y, x)
    pooled = mcnemar_exact(worse.ravel(), better.ravel(), alpha)
    exact = agresti_min_interval(pooled.detail["only_first"], pooled.detail["only_second"], pooled.n, 1 - alpha)
    low, high = min(test.detail["interval"][0], exact[0]), max(test.detail["interval"][1], exact[1])
    p = max(test.p_value, pooled.p_value)
    outcome = IMPROVES if low > 0 and p < alpha else HURTS if high < 0 and p < alpha else NO_DIFFERENCE
    return dataclasses.replace(test, p_value=p, outcome=outcome,
                               detail={**test.detail, "interval": (low, high), "runs": len(x),
                                       "bootstrap_interval": test.detail["interval"], "pooled_pairs": pooled.n,
                                       "only_first": pooled.detail["only_first"],
                                       "only_second": pooled.detail["only_second"]})


def min_pairs_to_decide(alpha: float) -> int:
    """The fewest paired items an exact McNemar test needs to reach ``alpha`` at all (all of them discordant
    and one way): 6 at alpha = 0.05."""
    n = 1
    while binomial_two_sided(0, n) >= alpha:
        n += 1
    return n


def agresti_min_interval(only_first: int, only_second: int, n: int, level: float) -> tuple[float, float]:
    """Interval for the difference of two paired pass rates (second minus first): the adjusted Wald interval of
    Agresti & Min (2005), which adds 1/2 to each of the four cells of the paired table (n -> n + 2)."""
    from statistics import NormalDist
    z = NormalDist().inv_cdf(0.5 + level / 2)
    b, c, m = only_first + 0.5, only_second + 0.5, n + 2
    diff = (c - b) / m
    se = math.sqrt(max((b + c) - (c - b) ** 2 / m, 0.0)) / m
    return max(-1.0, diff - z * se), min(1.0, diff + z * se)


def paired_effect(test: PairedTest, seeds: int, paper_direction: int = +1, scale: float = 1.0,
                  units: str = "") -> "Effect":
    """The ``Effect`` of a paired test, oriented so that positive is the paper's direction.

    ``paper_direction=+1`` when the paper says the second setting is better (the test's positive effect),
    -1 when it says it is worse; ``scale`` converts units (100 for rates in points)."""
    from ..core.claims import Effect
    if paper_direction not in (1, -1):
        raise ValueError(f"paper_direction must be +1 or -1, got {paper_direction!r}")
    level = 1 - test.alpha
    if test.test == "paired bootstrap":
        low, high = test.detail["interval"]
        name = "paired bootstrap over items"
        if "pooled_pairs" in test.detail:          # paired_runs on pass/fail scores
            name += ", widened to the pooled pairs' Agresti-Min interval"
    else:
        low, high = agresti_min_interval(test.detail["only_first"], test.detail["only_second"], test.n, level)
        name = "exact McNemar, Agresti-Min interval"
    ends = sorted((paper_direction * low * scale, paper_direction * high * scale))
    return Effect(paper_direction * test.effect * scale, ends[0], ends[1], level, name, test.n, seeds, units)


def effect_in_points(test: PairedTest, paper_direction: int = +1) -> "Effect":
    """A paired test of rates on one seed (an exact McNemar on prompts or questions), as its effect in percentage
    points; ``paper_direction=-1`` when the paper says the second setting is worse. The text OutRo chapter scores its
    pass/fail comparisons this way."""
    return paired_effect(test, seeds=1, paper_direction=paper_direction, scale=100, units="pt")

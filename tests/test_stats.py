"""Paired tests: exact McNemar against scipy's binomial test, the three-way decision, the paired bootstrap."""
import numpy as np
import pytest

from sinkbook.measures.stats import (HURTS, IMPROVES, NO_DIFFERENCE, binomial_two_sided, mcnemar_exact,
                                     paired_bootstrap)


def _pairs(both, only_first, only_second, neither):
    first = [True] * both + [True] * only_first + [False] * only_second + [False] * neither
    second = [True] * both + [False] * only_first + [True] * only_second + [False] * neither
    return first, second


@pytest.mark.parametrize("only_first,only_second", [(0, 0), (0, 1), (1, 9), (9, 1), (3, 4), (0, 7), (12, 30),
                                                    (25, 25), (40, 17)])
def test_mcnemar_equals_scipy_binomial_test_on_the_discordant_pairs(only_first, only_second):
    stats = pytest.importorskip("scipy.stats")
    first, second = _pairs(11, only_first, only_second, 20)
    got = mcnemar_exact(first, second, alpha=0.05)
    n = only_first + only_second
    want = 1.0 if n == 0 else stats.binomtest(only_second, n, 0.5, alternative="two-sided").pvalue
    assert got.p_value == pytest.approx(want, rel=1e-12, abs=1e-15)
    assert got.n == len(first)
    assert got.effect == pytest.approx((only_second - only_first) / len(first))
    assert got.detail["only_first"] == only_first and got.detail["only_second"] == only_second


def test_mcnemar_three_way_decision():
    assert mcnemar_exact(*_pairs(10, 0, 8, 10), alpha=0.05).outcome == IMPROVES     # p = 2/256
    assert mcnemar_exact(*_pairs(10, 8, 0, 10), alpha=0.05).outcome == HURTS
    assert mcnemar_exact(*_pairs(10, 2, 5, 10), alpha=0.05).outcome == NO_DIFFERENCE
    assert mcnemar_exact(*_pairs(10, 0, 0, 10), alpha=0.05).outcome == NO_DIFFERENCE
    # 6 of 6 discordant pairs one way: p = 2/64 = 0.03125, a decision at 0.05 but not at 0.01
    assert mcnemar_exact(*_pairs(3, 0, 6, 3), alpha=0.05).outcome == IMPROVES
    assert mcnemar_exact(*_pairs(3, 0, 6, 3), alpha=0.01).outcome == NO_DIFFERENCE
    # concordant items do not move the p-value, only the effect size
    assert (mcnemar_exact(*_pairs(0, 1, 9, 0), alpha=0.05).p_value
            == mcnemar_exact(*_pairs(100, 1, 9, 100), alpha=0.05).p_value)


def test_binomial_two_sided_is_symmetric_and_capped():
    assert binomial_two_sided(0, 0) == 1.0
    assert binomial_two_sided(5, 10) == 1.0
    assert binomial_two_sided(2, 10) == binomial_two_sided(8, 10)
    assert binomial_two_sided(0, 5) == pytest.approx(2 / 32)


def test_paired_bootstrap_decides_by_the_sign_of_a_consistent_shift():
    rng = np.random.default_rng(0)
    base = rng.normal(4.0, 0.3, size=12)
    lower = base - 0.05 + rng.normal(0, 0.005, size=12)
    noisy = base + rng.normal(0, 0.2, size=12)
    assert paired_bootstrap(base, lower, alpha=0.05, higher_is_better=False).outcome == IMPROVES
    assert paired_bootstrap(base, lower, alpha=0.05, higher_is_better=True).outcome == HURTS
    assert paired_bootstrap(base, noisy, alpha=0.05).outcome == NO_DIFFERENCE
    loss = paired_bootstrap(base, lower, alpha=0.05, higher_is_better=False)
    assert loss.effect == pytest.approx(float((base - lower).mean()))
    assert loss.detail["interval"][0] > 0 and loss.p_value < 0.05
    assert paired_bootstrap(base, lower, 0.05, seed=3).p_value == paired_bootstrap(base, lower, 0.05, seed=3).p_value


def test_bad_inputs_give_clear_errors():
    with pytest.raises(ValueError, match="alpha"):
        mcnemar_exact([True], [False], alpha=1.5)
    with pytest.raises(ValueError, match="one length"):
        mcnemar_exact([True, False], [True], alpha=0.05)
    with pytest.raises(ValueError, match="one length"):
        paired_bootstrap([1.0], [2.0], alpha=0.05)


def test_paired_runs_bootstraps_the_run_means_and_never_narrows_below_the_pooled_pairs():
    from sinkbook.measures.stats import agresti_min_interval, paired_bootstrap, paired_runs
    rng = np.random.default_rng(0)
    first = rng.integers(0, 2, size=(3, 100)).astype(float)
    # no answer changes: the bootstrap alone gives [0, 0]; the pooled 300 pairs cannot exclude about 0.65 pt
    same = paired_runs(first, first.copy(), 0.05)
    assert paired_bootstrap(first.mean(0), first.mean(0), 0.05).detail["interval"] == (0.0, 0.0)
    assert same.detail["interval"] == pytest.approx(agresti_min_interval(0, 0, 300, 0.95))
    assert same.detail["interval"][0] < -0.006 and same.outcome == "no difference"
    # one question lost in one run: still no difference at 300 pairs
    one = first.copy()
    one[0, np.flatnonzero(first[0])[0]] = 0
    lost = paired_runs(first, one, 0.05)
    assert lost.effect == pytest.approx(-1 / 300) and lost.detail["interval"][1] > 0 and lost.outcome == "no difference"
    # many changes, all one way: the interval contains both and the outcome is decided
    better = np.ones_like(first)
    many = paired_runs(first, better, 0.05)
    (low, high), (boot_low, boot_high) = many.detail["interval"], many.detail["bootstrap_interval"]
    assert low <= boot_low and high >= boot_high and low > 0.35 and many.outcome == "improves"
    worse = paired_runs(better, first, 0.05, higher_is_better=False)       # a loss: lower is better
    assert worse.outcome == "improves" and worse.effect == pytest.approx(1 - first.mean())
    # scores that are not pass/fail are the plain bootstrap of the run means
    losses = rng.normal(size=(3, 50))
    shifted = losses + rng.normal(0.1, 0.5, size=losses.shape)
    plain = paired_runs(losses, shifted, 0.05)
    assert plain.detail["interval"] == pytest.approx(
        paired_bootstrap(losses.mean(0), shifted.mean(0), 0.05).detail["interval"])
    with pytest.raises(ValueError, match="one shape"):
        paired_runs(first, first[:, :10], 0.05)

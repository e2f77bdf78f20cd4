"""The verdict of a statistical claim at every boundary (issue 22): holds / does not hold / inconclusive."""
import pytest

from sinkbook.core.claims import INCONCLUSIVE, NOT_COMPARABLE, Effect, Interest, decide, statistical
from sinkbook.measures.stats import agresti_min_interval, mcnemar_exact, paired_bootstrap, paired_effect

INTEREST = Interest(2.0, "ours: a test value", "pt")


def effect(low, high):
    return Effect((low + high) / 2, low, high, 0.95, "synthetic", 100, 3, "pt")


@pytest.mark.parametrize("low, high, verdict", [
    (0.1, 5.0, True),            # above zero
    (0.0, 5.0, INCONCLUSIVE),    # touching zero is not above it
    (0.1, 1.0, True),            # above zero, wholly below the effect of interest: holds in direction
    (-3.0, 1.9, False),          # excludes the effect of interest
    (-3.0, 2.0, INCONCLUSIVE),   # touching the effect of interest does not exclude it
    (-5.0, -1.0, False),         # opposite sign
    (-1.0, 3.0, INCONCLUSIVE),   # spans both
])
def test_decide_boundaries(low, high, verdict):
    assert decide(effect(low, high), INTEREST)[0] == verdict


def test_smaller_than_interest_is_said():
    holds, caveat = decide(effect(0.1, 1.0), INTEREST)
    assert holds is True and "smaller than the effect of interest" in caveat


def test_inconclusive_says_what_could_be_detected():
    e = effect(-1.0, 3.0)
    holds, caveat = decide(e, INTEREST)
    assert holds == INCONCLUSIVE and f"{e.detectable:.3g}" in caveat
    assert e.detectable == pytest.approx((1.959964 + 0.841621) * 4.0 / (2 * 1.959964), rel=1e-5)


@pytest.mark.parametrize("low, high, verdict", [(-1.9, 1.0, True), (-2.0, 1.0, INCONCLUSIVE),
                                                (-5.0, -2.1, False), (-5.0, -2.0, INCONCLUSIVE)])
def test_non_inferiority(low, high, verdict):
    assert decide(effect(low, high), Interest(2.0, "paper: 2.3 pt", "pt", non_inferiority=True))[0] == verdict


def test_bad_interest_and_effect_refused():
    with pytest.raises(ValueError, match="positive"):
        Interest(0.0, "ours: zero")
    with pytest.raises(ValueError, match="source"):
        Interest(1.0, "made up")
    with pytest.raises(ValueError, match="low <= high"):
        Effect(0.0, 1.0, -1.0, 0.95, "t", 10, 1)
    with pytest.raises(ValueError, match="finite"):
        Effect(float("nan"), 0.0, 1.0, 0.95, "t", 10, 1)


def test_statistical_claim_carries_numbers_and_precondition():
    c = statistical("x_up", "paper", "x goes up", "+1 pt", effect(-1.0, 3.0), INTEREST)
    assert c.holds == INCONCLUSIVE and c.label == INCONCLUSIVE
    assert c.effect["low"] == -1.0 and c.interest["value"] == 2.0 and "detectable" in c.effect
    off = statistical("x_up", "paper", "x goes up", "+1 pt", effect(0.5, 3.0), INTEREST, precondition=(False, "no"))
    assert off.holds == NOT_COMPARABLE and off.why_not_comparable == "no"


def test_paired_effect_orientation_and_mcnemar_interval():
    first = [True] * 30 + [False] * 70
    second = [True] * 50 + [False] * 50        # 20 discordant, all towards second
    t = mcnemar_exact(first, second, 0.05)
    up = paired_effect(t, seeds=1, scale=100, units="pt")
    down = paired_effect(t, seeds=1, paper_direction=-1, scale=100, units="pt")
    assert up.estimate == pytest.approx(20.0) and up.low > 0
    assert down.estimate == pytest.approx(-20.0) and down.high < 0
    assert (down.low, down.high) == pytest.approx((-up.high, -up.low))
    low, high = agresti_min_interval(0, 20, 100, 0.95)
    assert low < 0.2 < high
    b = paired_bootstrap([1.0, 2, 3, 4, 5], [2.0, 3, 4, 5, 7], 0.05)
    e = paired_effect(b, seeds=2)
    assert (e.low, e.high) == pytest.approx(b.detail["interval"])


def test_a_difference_that_rounds_to_zero_is_never_printed_negative():
    from sinkbook.core.claims import signed
    assert signed(-0.0) == "+0" and signed(-0.04, ".1f") == "+0.0" and signed(-0.06, ".1f") == "-0.1"
    assert signed(0.5) == "+0.5" and "[+0, " in Effect(0.5, -0.0, 1.0, 0.95, "t", 10, 1).text()

"""The one claim model of the book, and the findings that chapters return.

A **claim** compares something a paper states with what we computed. Its ``kind`` says what kind of evidence
it is, so the book never adds up unlike things:

- ``measured``: measured here, on a model we ran (a real model, or one we trained);
- ``recomputed``: recomputed from the paper's own published tables;
- ``math``: a numerical check of a derivation on synthetic instances.

``holds`` is True, False, "inconclusive" or "not comparable". A claim is not comparable when its precondition
is missing (no sink in the baseline it is about, a task at its floor): it is then neither counted as holding nor
as failing. A **statistical** claim (a comparison of sampled scores: items, seeds, windows) carries an ``Effect``
(estimate, interval, test, items, seeds; positive = the paper's direction) and an ``Interest`` (the smallest
effect that would count as the paper's at our scale, fixed beside its rule before any result is read), and
``decide`` gives its verdict: holds when the interval lies on the paper's side of zero, does not hold when it
excludes the effect of interest, inconclusive otherwise (the claim then says what this sample could have
detected). Equivalence testing against a smallest effect of interest: Lakens, Scheel & Isager (2018). ``must_hold`` marks checks whose failure means our code is wrong (an exact identity, a bound that
is a theorem); the results writer raises ``MustHoldFailed`` when one fails. ``origin`` is "paper" for a claim
the paper makes and "ours" for a question or a constant that is ours (the book says so).

A **rule** is written once and used for both the verdict and its wording: ``Rule.at_most(0.05, "share")``
gives the text "share <= 0.05" and the test, so a printed verdict cannot disagree with ``holds``.

A **finding** is what a chapter's analysis function returns: its table, figures, claims and any further
measured sentences (notes). Its verdict lines are derived from its claims.
"""
from __future__ import annotations

import dataclasses
import math
import re
from typing import Any, Callable

NOT_COMPARABLE = "not comparable"
INCONCLUSIVE = "inconclusive"
VERDICTS = ("holds", "does not hold", INCONCLUSIVE, NOT_COMPARABLE)
POWER = 0.8                # the power at which a statistical claim reports the smallest effect it could detect
KINDS = ("measured", "recomputed", "math")
ORIGINS = ("paper", "ours")
_ID = re.compile(r"^[a-z][a-z0-9_]*$")


class MustHoldFailed(AssertionError):
    """A check that must hold whatever the papers say failed: the code computing it is wrong."""


class MissingEffect(ValueError):
    """A claim decided by a paired test was built without its effect and effect of interest (use ``statistical``)."""


def slug(text: str) -> str:
    """A snake_case id fragment from a model spec or label: 'smollm2-135m-instruct' -> 'smollm2_135m_instruct'."""
    out = re.sub(r"[^a-z0-9]+", "_", str(text).lower()).strip("_")
    return out if out and out[0].isalpha() else f"x{out}"


def _fmt(value: float) -> str:
    return f"{value:g}" if isinstance(value, (int, float)) else str(value)


@dataclasses.dataclass(frozen=True)
class Rule:
    """A verdict rule: its wording and its test, defined together."""
    text: str
    test: Callable[[Any], bool]

    def __call__(self, value) -> bool:
        return bool(self.test(value))

    @classmethod
    def at_most(cls, limit: float, what: str = "ours") -> "Rule":
        return cls(f"{what} <= {_fmt(limit)}", lambda v: v <= limit)

    @classmethod
    def at_least(cls, limit: float, what: str = "ours") -> "Rule":
        return cls(f"{what} >= {_fmt(limit)}", lambda v: v >= limit)

    @classmethod
    def above(cls, limit: float, what: str = "ours") -> "Rule":
        return cls(f"{what} > {_fmt(limit)}", lambda v: v > limit)

    @classmethod
    def below(cls, limit: float, what: str = "ours") -> "Rule":
        return cls(f"{what} < {_fmt(limit)}", lambda v: v < limit)

    @classmethod
    def between(cls, low: float, high: float, what: str = "ours") -> "Rule":
        return cls(f"{_fmt(low)} <= {what} <= {_fmt(high)}", lambda v: low <= v <= high)

    @classmethod
    def close_to(cls, target: float, tolerance: float, what: str = "ours", why: str = "") -> "Rule":
        text = f"|{what} - {_fmt(target)}| <= {_fmt(tolerance)}" + (f" ({why})" if why else "")
        return cls(text, lambda v: abs(v - target) <= tolerance + 1e-12)

    @classmethod
    def true(cls, text: str) -> "Rule":
        """The value is already the verdict (a bool); ``text`` says what it tests."""
        return cls(text, lambda v: bool(v))


@dataclasses.dataclass
class Claim:
    id: str
    kind: str
    source: str            # paper and section/table, e.g. "VL paper, Table 5"; "ours" for our own questions
    statement: str         # what is claimed, in our words
    paper_value: Any       # number or short text as published
    our_value: Any         # what we computed
    rule: str              # the verdict rule, written before looking at the result
    holds: bool | str      # True / False / "inconclusive" / "not comparable"
    must_hold: bool = False
    origin: str = "paper"
    why_not_comparable: str = ""
    effect: dict | None = None      # statistical claims: Effect.as_dict()
    interest: dict | None = None    # statistical claims: Interest.as_dict()
    caveat: str = ""                # e.g. "smaller than the effect of interest", "could have detected >= 3.1 pt"

    def __post_init__(self):
        if not _ID.match(self.id):
            raise ValueError(f"claim id {self.id!r} must be snake_case (lower-case letters, digits, _)")
        if self.kind not in KINDS:
            raise ValueError(f"claim {self.id!r}: kind must be one of {', '.join(KINDS)}, got {self.kind!r}")
        if self.origin not in ORIGINS:
            raise ValueError(f"claim {self.id!r}: origin must be one of {', '.join(ORIGINS)}, got {self.origin!r}")
        if self.holds == INCONCLUSIVE and self.effect is None:
            raise ValueError(f"claim {self.id!r}: only a statistical claim (with an effect) can be inconclusive")
        if self.holds not in (NOT_COMPARABLE, INCONCLUSIVE):
            if type(self.holds).__name__ not in ("bool", "bool_"):  # numpy comparisons give numpy bools
                raise ValueError(f"claim {self.id!r}: holds must be True, False or {NOT_COMPARABLE!r}, "
                                 f"got {self.holds!r}")
            self.holds = bool(self.holds)
        if self.must_hold and self.holds in (NOT_COMPARABLE, INCONCLUSIVE):
            raise ValueError(f"claim {self.id!r}: a must-hold check cannot be {self.holds!r}")
        self.our_value = _plain(self.our_value)
        self.paper_value = _plain(self.paper_value)

    @property
    def label(self) -> str:
        return label(self.holds)

    def verdict(self) -> str:
        """One sentence: the verdict, the statement, ours against the paper's (or why it is not comparable)."""
        head = f"{self.label.capitalize()}: {self.statement}"
        numbers = f"ours {_short(self.our_value)}, paper {_short(self.paper_value)} (rule: {self.rule})"
        if self.holds == NOT_COMPARABLE and self.why_not_comparable:
            return f"{head} -- {self.why_not_comparable}; {numbers}."
        if self.caveat:
            return f"{head} -- {numbers}; {self.caveat}."
        return f"{head} -- {numbers}."

    def as_dict(self) -> dict:
        return dataclasses.asdict(self)


def label(holds) -> str:
    """The printed verdict of a ``holds`` value."""
    return {True: "holds", False: "does not hold"}.get(holds, holds if holds == INCONCLUSIVE else NOT_COMPARABLE)


def _plain(value):
    """numpy scalars to Python numbers, so claims serialise and compare cleanly."""
    if hasattr(value, "item") and getattr(value, "ndim", 1) == 0:
        return value.item()
    return value


def _not_finite(value) -> bool:
    value = _plain(value)
    return isinstance(value, (int, float)) and not isinstance(value, bool) and not math.isfinite(value)


def signed(value: float, spec: str = ".3g") -> str:
    """``value`` with its sign, never "-0": a difference that rounds to zero is printed "+0" (or "+0.0")."""
    text = f"{value:+{spec}}"
    return "+" + text[1:] if text.startswith("-") and float(text) == 0 else text


def _short(value) -> str:
    if isinstance(value, float):
        return f"{value:.4g}" if math.isfinite(value) else str(value)
    if isinstance(value, (list, tuple)):
        return "[" + ", ".join(_short(v) for v in value) + "]"
    return str(value)


def claim(id: str, kind: str, source: str, statement: str, paper_value, our_value, rule: Rule, value=None, *,
          precondition: tuple[bool, str] | None = None, must_hold: bool = False, origin: str = "paper") -> Claim:
    """Build a claim whose verdict is ``rule(value)`` (``value`` defaults to ``our_value``).

    ``precondition=(ok, why)``: when ``ok`` is false the claim is "not comparable" and ``why`` says what is
    missing (the rule is still stated, and our value still shown)."""
    tested = our_value if value is None else value
    if precondition is not None and not precondition[0]:
        return Claim(id, kind, source, statement, paper_value, our_value, rule.text, NOT_COMPARABLE,
                     must_hold=False, origin=origin, why_not_comparable=precondition[1])
    # A rule that raises is a bug in the chapter (a value of the wrong type, a missing gate): it propagates, so
    # the build stops instead of printing "does not hold" for a claim that was never tested.
    if _not_finite(tested):
        # No number was measured (a division by zero, an empty selection): a check of our code fails, a claim
        # about the paper is not comparable, since "does not hold" would read as evidence against it.
        if must_hold:
            return Claim(id, kind, source, statement, paper_value, our_value, rule.text, False, must_hold=True,
                         origin=origin)
        return Claim(id, kind, source, statement, paper_value, our_value, rule.text, NOT_COMPARABLE,
                     origin=origin, why_not_comparable=f"the measured value is {_short(_plain(tested))}, not a number")
    holds = rule(tested)
    return Claim(id, kind, source, statement, paper_value, our_value, rule.text, holds, must_hold=must_hold,
                 origin=origin)


def close_claim(id: str, kind: str, source: str, statement: str, paper_value: float, our_value: float,
                tolerance: float, why: str, origin: str = "paper") -> Claim:
    """A claim that ``our_value`` lies within ``tolerance`` of ``paper_value``; the tolerance is ours and ``why``
    says where it comes from (the predictor and VL-margins chapters recompute the paper's numbers this way)."""
    return claim(id, kind, source, statement, paper_value, float(our_value),
                 Rule.close_to(paper_value, tolerance, "ours", why), origin=origin)


def check(id: str, statement: str, measured, rule: Rule, expected="", source: str = "ours", value=None) -> Claim:
    """A must-hold check of our own code (kind "math"): an exact identity, a count that must be zero.
    ``value``: what the rule tests, when it is not the number shown (``measured``)."""
    return claim(id, "math", source, statement, expected, measured, rule, value, must_hold=True, origin="ours")


@dataclasses.dataclass(frozen=True)
class Interest:
    """The smallest effect that would count as the paper's effect at our scale, in the claim's units, positive in
    the paper's direction. Fixed in the chapter module beside the rule, before any result is read.

    ``source`` says where it comes from: the paper's number where it transfers to our task ("paper: Table 3,
    +1.47 pt"), otherwise ours with one line of reasoning ("ours: ..."). ``non_inferiority=True`` is for claims
    that something is *preserved*: ``value`` is then the largest loss that still counts as preserved."""
    value: float
    source: str
    units: str = ""
    non_inferiority: bool = False

    def __post_init__(self):
        if not (isinstance(self.value, (int, float)) and math.isfinite(self.value) and self.value > 0):
            raise ValueError(f"an effect of interest must be a positive finite number, got {self.value!r}")
        if not (self.source.startswith("paper") or self.source.startswith("ours")):
            raise ValueError(f"an effect of interest's source must start with 'paper' or 'ours', got {self.source!r}")

    def rule_text(self, level: float = 0.95) -> str:
        u = f" {self.units}" if self.units else ""
        if self.non_inferiority:
            return (f"holds if the {level:.0%} interval lies above -{_fmt(self.value)}{u} (a loss within the "
                    f"margin); does not hold if it lies below -{_fmt(self.value)}{u}; else inconclusive")
        return (f"holds if the {level:.0%} interval lies above 0; does not hold if it lies below "
                f"{_fmt(self.value)}{u} (the effect of interest); else inconclusive")

    def as_dict(self) -> dict:
        return dataclasses.asdict(self)


def _normal_quantile(p: float) -> float:
    # scipy would do, but core imports nothing numerical; statistics.NormalDist is exact to double precision
    from statistics import NormalDist
    return NormalDist().inv_cdf(p)


@dataclasses.dataclass(frozen=True)
class Effect:
    """A measured effect, oriented so that positive is the paper's direction, with its interval."""
    estimate: float
    low: float
    high: float
    level: float           # of the interval, e.g. 0.95
    test: str              # "paired bootstrap over items", "exact McNemar (Newcombe interval)", ...
    items: int
    seeds: int
    units: str = ""

    def __post_init__(self):
        if not all(math.isfinite(v) for v in (self.estimate, self.low, self.high)):
            raise ValueError(f"an effect needs finite numbers, got {self.estimate}, [{self.low}, {self.high}]")
        if not self.low <= self.high:
            raise ValueError(f"an effect's interval must have low <= high, got [{self.low}, {self.high}]")
        if not 0 < self.level < 1:
            raise ValueError(f"an interval's level must lie in (0, 1), got {self.level!r}")

    @property
    def detectable(self) -> float:
        """The smallest effect this sample could detect at ``POWER`` (two-sided, normal approximation from the
        interval's width): (z_{1-a/2} + z_power) * SE, with SE = width / (2 z_{1-a/2})."""
        z = _normal_quantile(0.5 + self.level / 2)
        return (z + _normal_quantile(POWER)) * (self.high - self.low) / (2 * z)

    def text(self) -> str:
        u = f" {self.units}" if self.units else ""
        return (f"{signed(self.estimate)}{u} [{signed(self.low)}, {signed(self.high)}] ({self.level:.0%}, {self.test}, "
                f"{self.items} items, {self.seeds} seed{'s' if self.seeds != 1 else ''})")

    def as_dict(self) -> dict:
        return {**dataclasses.asdict(self), "detectable": self.detectable, "power": POWER}


def items_for_power(items: int, detectable: float, interest: float) -> int:
    """The items (at the same seeds) at which this test would detect ``interest`` at ``POWER``: the interval's width
    shrinks as one over the root of the items, so ``items * (detectable / interest)^2``, rounded up. A planning
    figure: it assumes the per-item spread stays what this sample showed, and seeds add variance items cannot remove."""
    if items < 1 or not (detectable > 0 and interest > 0):
        raise ValueError(f"need items >= 1 and positive effects, got {items}, {detectable}, {interest}")
    return max(1, math.ceil(items * (detectable / interest) ** 2))


def decide(effect: Effect, interest: Interest) -> tuple[bool | str, str]:
    """The verdict of a statistical claim and its caveat (empty when none).

    holds: the interval lies on the paper's side of zero (non-inferiority: above -margin);
    does not hold: the interval excludes the effect of interest (non-inferiority: lies below -margin);
    inconclusive: neither, and the caveat says what this sample could have detected."""
    u = f" {interest.units}" if interest.units else ""
    could = f"this sample could detect about {effect.detectable:.3g}{u} at {POWER:.0%} power"
    if interest.non_inferiority:
        if effect.low > -interest.value:
            return True, ""
        if effect.high < -interest.value:
            return False, ""
        return INCONCLUSIVE, f"the interval spans the margin -{_fmt(interest.value)}{u}; {could}"
    if effect.low > 0:
        smaller = effect.high < interest.value
        return True, (f"in the paper's direction, but smaller than the effect of interest "
                      f"{_fmt(interest.value)}{u}" if smaller else "")
    if effect.high < interest.value:
        return False, ""
    return INCONCLUSIVE, (f"the interval spans 0 and the effect of interest {_fmt(interest.value)}{u}; {could}")


def statistical(id: str, source: str, statement: str, paper_value, effect: Effect, interest: Interest, *,
                precondition: tuple[bool, str] | None = None, origin: str = "paper",
                kind: str = "measured") -> Claim:
    """A statistical claim: its verdict is ``decide(effect, interest)``; its rule is the interest's rule text."""
    rule = interest.rule_text(effect.level)
    if precondition is not None and not precondition[0]:
        return Claim(id, kind, source, statement, paper_value, effect.text(), rule, NOT_COMPARABLE, origin=origin,
                     why_not_comparable=precondition[1], effect=effect.as_dict(), interest=interest.as_dict())
    holds, caveat = decide(effect, interest)
    return Claim(id, kind, source, statement, paper_value, effect.text(), rule, holds, origin=origin,
                 effect=effect.as_dict(), interest=interest.as_dict(), caveat=caveat)


@dataclasses.dataclass
class Finding:
    """What one analysis of a chapter returns. ``data`` carries numbers later findings reuse."""
    title: str
    claims: list = dataclasses.field(default_factory=list)
    table: Any = None                 # pandas DataFrame (kept narrow; shown with its index)
    figures: list = dataclasses.field(default_factory=list)   # plotly or matplotlib figures
    notes: list = dataclasses.field(default_factory=list)     # measured sentences that are not claims
    data: dict = dataclasses.field(default_factory=dict)

    @property
    def verdicts(self) -> list[str]:
        return [c.verdict() for c in self.claims]

    def text(self) -> str:
        """Plain-text rendering for a terminal: notes then verdicts."""
        return "\n".join([*self.notes, *self.verdicts])


_PAIRED = re.compile(r"mcnemar|bootstrap|paired test|\bp ?= ?\d", re.IGNORECASE)


def missing_effects(claims) -> list[Claim]:
    """Claims decided by a paired comparison that carry no effect or no effect of interest: a measured claim whose
    rule or shown value names a paired test (McNemar, bootstrap, a p-value) without the ``effect`` and
    ``interest`` a statistical claim must carry. Chapter tests assert this is empty on inputs that open every
    gate."""
    out = []
    for c in claims:
        shows_test = c.kind == "measured" and bool(_PAIRED.search(f"{c.rule} {c.our_value}"))
        if (shows_test or c.effect is not None) and (c.effect is None or c.interest is None) \
                and c.holds != NOT_COMPARABLE:
            out.append(c)
        elif c.holds == NOT_COMPARABLE and shows_test and c.interest is None:
            out.append(c)
    return out


def failed_must_hold(claims) -> list[Claim]:
    return [c for c in claims if c.must_hold and c.holds is not True]

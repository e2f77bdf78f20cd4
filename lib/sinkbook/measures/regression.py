"""Statistics of the Sink Strength predictor (VL paper, Sections 3.2-3.3 and 4.2), on small arrays of numbers.

The paper's 1-D linear fit of a task change on Sink Strength S, its leave-one-pair-out errors and Spearman's
rho, and the statistics we add: bootstrap intervals, exact permutation p-values, leave-one-group-out, the
S >= 2 rule as a classifier, prediction intervals, the Lemma 1 bound, and the range a statistic takes over
every input consistent with rounded printed values (``rounding_envelope``). Functions that fit take a
trailing "pairs" axis so that a whole batch of perturbed inputs is fitted in one call. Formulas: the book's
methods page (``book/methods.md``), sections on Sink Strength and Lemma 1.

Nothing here reads files or builds claims: the published tables come from ``sinkbook.core.published`` and
the chapter ``sinkbook.chapters.predictor`` turns these numbers into claims.
"""
from __future__ import annotations

import itertools
import math
from dataclasses import dataclass
from typing import Callable

import numpy as np
import pandas as pd
from scipy import stats

from ..core.published import DELTA_HALF_WIDTH, S_HALF_WIDTH, DataError


# ------------------------------------------------------------------------------------------ statistics
def midranks(values) -> np.ndarray:
    """Ranks 1..n along the last axis, ties sharing the mean of the ranks they span."""
    return stats.rankdata(np.asarray(values, dtype=float), axis=-1)


def pearson(x, y) -> float:
    x, y = np.asarray(x, dtype=np.float64).ravel(), np.asarray(y, dtype=np.float64).ravel()
    x, y = x - x.mean(), y - y.mean()
    denominator = np.linalg.norm(x) * np.linalg.norm(y)
    return float("nan") if denominator == 0 else float(x @ y / denominator)


def spearman_rho(x, y) -> np.ndarray:
    """Spearman's rho as Pearson's r of midranks, along the last axis (batched). NaN when a side is constant."""
    rx, ry = midranks(x), midranks(y)
    rx = rx - rx.mean(axis=-1, keepdims=True)
    ry = ry - ry.mean(axis=-1, keepdims=True)
    denom = np.sqrt((rx * rx).sum(-1) * (ry * ry).sum(-1))
    with np.errstate(invalid="ignore", divide="ignore"):
        return np.where(denom > 0, (rx * ry).sum(-1) / np.where(denom > 0, denom, 1.0), np.nan)


def fit_line(x, y) -> tuple[np.ndarray, np.ndarray]:
    """Least-squares intercept and slope of y on x along the last axis (batched)."""
    x, y = np.asarray(x, float), np.asarray(y, float)
    xc = x - x.mean(-1, keepdims=True)
    sxx = (xc * xc).sum(-1)
    if np.any(sxx == 0):
        raise ValueError("cannot fit a line: all x values are equal")
    slope = (xc * (y - y.mean(-1, keepdims=True))).sum(-1) / sxx
    return y.mean(-1) - slope * x.mean(-1), slope


def _leave_out_masks(groups) -> tuple[np.ndarray, list]:
    labels = list(dict.fromkeys(groups))
    groups = np.asarray(groups, dtype=object)
    return np.array([groups != g for g in labels]), labels


def leave_one_group_out(x, y, groups=None) -> tuple[np.ndarray, np.ndarray]:
    """Held-out predictions of the 1-D linear fit and of the constant-mean baseline.

    Each group (default: each pair on its own) is predicted from a fit on all other groups. Works on a
    trailing pairs axis with any leading batch shape.
    """
    x, y = np.asarray(x, float), np.asarray(y, float)
    n = x.shape[-1]
    groups = list(range(n)) if groups is None else list(groups)
    if len(groups) != n:
        raise ValueError(f"groups has {len(groups)} labels for {n} pairs")
    keep_masks, labels = _leave_out_masks(groups)
    linear = np.empty(np.broadcast_shapes(x.shape, y.shape))
    constant = np.empty_like(linear)
    for keep in keep_masks:
        if keep.sum() < 2:
            raise ValueError("leaving this group out leaves fewer than two pairs to fit")
        xk, yk = x[..., keep], y[..., keep]
        if np.ptp(xk, axis=-1).min() == 0:
            raise ValueError("leaving this group out leaves only one distinct S value; no line can be fitted")
        a, b = fit_line(xk, yk)
        held = ~keep
        linear[..., held] = (a[..., None] + b[..., None] * x[..., held])
        constant[..., held] = yk.mean(-1)[..., None]
    return linear, constant


def mean_abs_error(pred, actual) -> np.ndarray:
    return np.abs(np.asarray(pred) - np.asarray(actual)).mean(-1)


def heldout_errors(x, y, groups=None) -> dict:
    """Mean absolute held-out error of the linear fit and of the constant-mean baseline."""
    linear, constant = leave_one_group_out(x, y, groups)
    return {"linear": mean_abs_error(linear, y), "constant": mean_abs_error(constant, y),
            "predictions": linear, "baseline_predictions": constant}


def bootstrap_rho(x, y, n_bootstrap: int = 10_000, seed: int = 0, level: float = 0.95) -> dict:
    """Percentile bootstrap interval of Spearman's rho, resampling pairs with replacement.

    Resamples in which S (or the outcome) is constant have no rho and are dropped; how many is reported,
    because with six pairs that is not rare.
    """
    x, y = np.asarray(x, float), np.asarray(y, float)
    rng = np.random.default_rng(seed)
    idx = rng.integers(0, len(x), size=(n_bootstrap, len(x)))
    rhos = spearman_rho(x[idx], y[idx])
    ok = np.isfinite(rhos)
    lo, hi = np.quantile(rhos[ok], [(1 - level) / 2, (1 + level) / 2])
    return {"low": float(lo), "high": float(hi), "n_used": int(ok.sum()), "n_dropped": int((~ok).sum()),
            "level": level, "samples": rhos[ok]}


def _rank_product_counts(rx2: np.ndarray, ry2: np.ndarray) -> dict[int, int]:
    """Exact number of permutations sigma giving each value of sum_i rx2[i] * ry2[sigma(i)].

    rx2, ry2 are doubled midranks (integers). Positions with equal x-rank are interchangeable, so the state
    of the dynamic programme is how many slots of each x-rank are already filled; the y items are placed one
    after another and each placement into a group with k free slots counts k distinct permutations.
    """
    x_values, x_sizes = np.unique(rx2, return_counts=True)
    max_total = int(np.sort(rx2)[::-1] @ np.sort(ry2)[::-1])
    layer = {tuple([0] * len(x_values)): np.zeros(max_total + 1, dtype=np.int64)}
    layer[tuple([0] * len(x_values))][0] = 1
    for y_value in ry2:
        nxt: dict[tuple, np.ndarray] = {}
        for used, hist in layer.items():
            for g, (xv, size) in enumerate(zip(x_values, x_sizes)):
                free = size - used[g]
                if free == 0:
                    continue
                key = used[:g] + (used[g] + 1,) + used[g + 1:]
                shift = int(xv * y_value)
                add = nxt.setdefault(key, np.zeros(max_total + 1, dtype=np.int64))
                add[shift:] += free * hist[:max_total + 1 - shift]
        layer = nxt
    (hist,) = layer.values()
    return {int(v): int(c) for v, c in enumerate(hist) if c}


def permutation_pvalue(x, y, alternative: str = "greater") -> dict:
    """Exact permutation p-value of Spearman's rho over all n! reorderings of y (ties kept as midranks).

    Under a permutation the rank means and variances are unchanged, so rho is an increasing function of
    sum_i rank(x_i) rank(y_sigma(i)); its exact distribution comes from ``_rank_product_counts``.
    alternative: "greater" (the paper's direction, high S with small loss), "less" or "two-sided".
    """
    x, y = np.asarray(x, float), np.asarray(y, float)
    rx2 = np.rint(2 * midranks(x)).astype(np.int64)
    ry2 = np.rint(2 * midranks(y)).astype(np.int64)
    counts = _rank_product_counts(rx2, ry2)
    total = math.factorial(len(x))
    observed = int(rx2 @ ry2)
    n = len(x)
    centre = n * (n + 1) ** 2  # sum of doubled midranks products at zero correlation: 4 * n * ((n+1)/2)^2
    if alternative == "greater":
        hits = sum(c for v, c in counts.items() if v >= observed)
    elif alternative == "less":
        hits = sum(c for v, c in counts.items() if v <= observed)
    elif alternative == "two-sided":
        hits = sum(c for v, c in counts.items() if abs(v - centre) >= abs(observed - centre))
    else:
        raise ValueError(f"alternative must be 'greater', 'less' or 'two-sided', got {alternative!r}")
    # "counted" must equal n!: the chapter checks it, as the dynamic programme's own proof of completeness
    return {"p": hits / total, "hits": hits, "permutations": total, "counted": sum(counts.values()),
            "rho": float(spearman_rho(x, y))}


# -------------------------------------------------------------------------------- rounding envelopes
@dataclass
class Envelope:
    """Range of a statistic over every input consistent with the printed (rounded) values."""
    point: float     # from the printed values themselves
    low: float
    high: float
    corners: int     # how many input vectors were evaluated

    def contains(self, value: float, printed_half_width: float = 0.0) -> bool:
        """Whether a published value, itself rounded to +-printed_half_width, is consistent with the range."""
        return bool(self.low - printed_half_width - 1e-12 <= value <= self.high + printed_half_width + 1e-12)


def rounding_envelope(statistic: Callable[[np.ndarray], np.ndarray], printed: np.ndarray,
                      half_widths: np.ndarray, free: np.ndarray | None = None) -> Envelope:
    """Min and max of ``statistic`` when each free input moves anywhere within its rounding interval.

    ``printed``: the input parameters as printed (1-D); ``statistic`` maps a batch (k, len(printed)) to k
    values. Every free parameter takes -h, 0, +h, all combinations: the statistics used here are close to
    linear over intervals this small (the box is tiny against the spread of S and of the deltas), so their
    extremes lie at the corners. For a rank statistic only parameters whose printed value ties another
    matter, and three levels realise every weak ordering of a tie group of up to three.
    """
    printed = np.asarray(printed, float)
    half_widths = np.broadcast_to(np.asarray(half_widths, float), printed.shape)
    free = np.arange(len(printed)) if free is None else np.flatnonzero(free) if np.asarray(free).dtype == bool else np.asarray(free)
    if len(free) > 12:
        raise ValueError(f"{len(free)} free inputs would mean {3 ** len(free)} corners; restrict `free`")
    steps = np.array(list(itertools.product((-1.0, 0.0, 1.0), repeat=len(free))))
    batch = np.repeat(printed[None, :], len(steps), axis=0)
    batch[:, free] += steps * half_widths[free]
    values = np.asarray(statistic(batch), float)
    point = float(np.asarray(statistic(printed[None, :]), float)[0])
    return Envelope(point, float(np.nanmin(values)), float(np.nanmax(values)), len(steps))


def tied_parameters(printed) -> np.ndarray:
    """Mask of parameters whose printed value equals another parameter's printed value."""
    printed = np.asarray(printed, float)
    _, inverse, counts = np.unique(printed, return_inverse=True, return_counts=True)
    if counts.max() > 3:
        raise ValueError("a printed tie group of more than three independent values needs more grid levels")
    return counts[inverse] > 1


@dataclass
class PanelParameters:
    """A panel's inputs as independent parameters: one S per reference LLM, one delta per pair.

    ``s_index[i]`` is the S parameter of pair i; pairs sharing a reference LLM share it exactly.
    """
    s_values: np.ndarray
    s_index: np.ndarray
    deltas: np.ndarray

    @classmethod
    def from_frame(cls, df: pd.DataFrame, s_col: str, delta_col: str, reference_col: str = "reference_llm"):
        refs = list(dict.fromkeys(df[reference_col]))
        s_by_ref = df.groupby(reference_col)[s_col].agg(lambda v: v.unique())
        if any(len(v) != 1 for v in s_by_ref):
            raise DataError(f"pairs with the same {reference_col} carry different S values")
        return cls(np.array([s_by_ref[r][0] for r in refs], float),
                   np.array([refs.index(r) for r in df[reference_col]]), df[delta_col].to_numpy(float))

    @property
    def vector(self) -> np.ndarray:
        return np.concatenate([self.s_values, self.deltas])

    def split(self, batch: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        k = len(self.s_values)
        return batch[:, :k][:, self.s_index], batch[:, k:]

    def half_widths(self, delta_half_width: float = DELTA_HALF_WIDTH) -> np.ndarray:
        return np.concatenate([np.full(len(self.s_values), S_HALF_WIDTH), np.full(len(self.deltas), delta_half_width)])


def rho_envelope(params: PanelParameters) -> Envelope:
    """Range of rho(S, delta) over all tie resolutions the rounding allows."""
    free = np.concatenate([tied_parameters(params.s_values), tied_parameters(params.deltas)])
    return rounding_envelope(lambda b: spearman_rho(*params.split(b)), params.vector, params.half_widths(), free)


def lopo_error_envelope(params: PanelParameters, delta_half_width: float = DELTA_HALF_WIDTH,
                        which: str = "linear") -> Envelope:
    """Range of the leave-one-pair-out mean absolute error over the rounding box (S and, if >0, deltas)."""
    free = np.ones(len(params.vector), bool)
    if delta_half_width == 0:
        free[len(params.s_values):] = False

    def stat(batch):
        return heldout_errors(*params.split(batch))[which]
    return rounding_envelope(stat, params.vector, params.half_widths(delta_half_width), free)


def lopo_prediction_envelopes(params: PanelParameters, delta_half_width: float = DELTA_HALF_WIDTH) -> list[Envelope]:
    """Per-pair range of the held-out prediction over the rounding box."""
    free = np.ones(len(params.vector), bool)
    if delta_half_width == 0:
        free[len(params.s_values):] = False
    return [rounding_envelope(lambda b, i=i: leave_one_group_out(*params.split(b))[0][:, i],
                              params.vector, params.half_widths(delta_half_width), free)
            for i in range(len(params.deltas))]


def search_consistent_s(params: PanelParameters, published_predictions, levels: int = 21) -> dict:
    """Search the S rounding box (deltas held as given) for the S vector whose leave-one-pair-out
    predictions come closest, in the worst pair, to the published ones.

    If the best worst-pair deviation is below the published rounding (0.005), a single set of unrounded
    S values within the printed ones reproduces the whole published column at once.
    """
    k = len(params.s_values)
    if levels ** k > 500_000:
        raise ValueError(f"{levels}^{k} grid points is too many; lower `levels`")
    grid = np.array(list(itertools.product(np.linspace(-S_HALF_WIDTH, S_HALF_WIDTH, levels), repeat=k)))
    batch = np.repeat(params.vector[None, :], len(grid), axis=0)
    batch[:, :k] += grid
    x, y = params.split(batch)
    linear, _ = leave_one_group_out(x, y)
    worst = np.abs(linear - np.asarray(published_predictions, float)).max(-1)
    best = int(worst.argmin())
    return {"s_values": batch[best, :k], "max_deviation": float(worst[best]), "predictions": linear[best],
            "mean_abs_error": float(mean_abs_error(linear[best], y[best]))}


# ------------------------------------------------------------------------------- rule and prediction
def threshold_rule_confusion(s, delta, s_threshold: float = 2.0, within_pt: float = 5.4, labels=None) -> pd.DataFrame:
    """The paper's rule "S >= threshold stays within `within_pt` of the reference" as a classifier.

    Predicted safe: S >= s_threshold. Actually safe: delta >= -within_pt (a gain counts as safe).
    Returns one row per pair with the verdict; ``confusion_table`` tabulates it.
    """
    s, delta = np.asarray(s, float), np.asarray(delta, float)
    predicted = s >= s_threshold
    actual = delta >= -within_pt
    outcome = np.where(predicted & actual, "true safe", np.where(predicted & ~actual, "false safe",
                       np.where(~predicted & actual, "false risky", "true risky")))
    return pd.DataFrame({"pair": labels if labels is not None else np.arange(len(s)), "S": s, "delta": delta,
                         "predicted_safe": predicted, "actually_safe": actual, "outcome": outcome})


def confusion_table(rule: pd.DataFrame) -> pd.DataFrame:
    table = pd.crosstab(rule["predicted_safe"].map({True: "S >= threshold", False: "S < threshold"}),
                        rule["actually_safe"].map({True: "within", False: "beyond"}))
    return table.reindex(index=["S >= threshold", "S < threshold"], columns=["within", "beyond"], fill_value=0)


def predict_with_interval(x, y, x_new, level: float = 0.95) -> pd.DataFrame:
    """OLS prediction of y at x_new with the classical prediction interval (t with n-2 dof).

    The interval assumes the paper's panel is a sample from one linear relation with normal, equal-variance
    residuals; it says nothing about whether a new backbone belongs to that relation.
    """
    x, y, x_new = np.asarray(x, float), np.asarray(y, float), np.atleast_1d(np.asarray(x_new, float))
    n = len(x)
    if n < 3:
        raise ValueError("a prediction interval needs at least three pairs")
    a, b = fit_line(x, y)
    resid = y - (a + b * x)
    s2 = (resid @ resid) / (n - 2)
    sxx = ((x - x.mean()) ** 2).sum()
    se = np.sqrt(s2 * (1 + 1 / n + (x_new - x.mean()) ** 2 / sxx))
    t = stats.t.ppf((1 + level) / 2, n - 2)
    pred = a + b * x_new
    return pd.DataFrame({"S": x_new, "predicted_delta": pred, "pi_low": pred - t * se, "pi_high": pred + t * se,
                         "inside_fitted_S_range": (x_new >= x.min()) & (x_new <= x.max())})


# ------------------------------------------------------------------------------------------- Lemma 1
def sigmoid(z):
    return 1.0 / (1.0 + np.exp(-np.asarray(z, float)))


def lemma1_bound(g_base, b_gap) -> np.ndarray:
    """Lemma 1: after a perturbation of sink-anchored gap at most b_gap, the non-sink mass is at most
    sigma(b_gap - g_base)."""
    return sigmoid(np.asarray(b_gap, float) - np.asarray(g_base, float))


def margin_needed(sink_level: float) -> float:
    """Margin G - B that Lemma 1 needs to guarantee sink mass >= sink_level: log(level / (1 - level))."""
    return math.log(sink_level / (1 - sink_level))


def lemma1_worst_case(g: float = 3.0, b_gap: float = 0.4, n_keys: int = 64, sink_logit: float = 5.0) -> dict:
    """The paper's App. A.6 check: equal non-sink logits giving aggregate gap g, every non-sink logit raised
    by b_gap/2 and the sink lowered by b_gap/2; returns the realised non-sink mass and the bound."""
    other = sink_logit - g - math.log(n_keys - 1)  # so that l_sink - logsumexp(others) = g
    logits = np.full(n_keys, other)
    logits[0] = sink_logit
    realised_g = logits[0] - np.log(np.exp(logits[1:]).sum())
    delta = np.full(n_keys, b_gap / 2)
    delta[0] = -b_gap / 2
    perturbed = logits + delta
    probs = np.exp(perturbed - perturbed.max())
    probs /= probs.sum()
    return {"non_sink_mass": float(1 - probs[0]), "bound": float(lemma1_bound(g, b_gap)), "G": float(realised_g)}

"""The gradient-sinks paper's mathematics, checked numerically on synthetic instances (Chen and Yao, Sec. 4 and
App. D): Prop. 1 and the key / query path identities against autograd, Theorem 1 by exact expectation and Monte
Carlo, Theorem 2 (the RMSNorm Jacobian) and the V-scale Jacobian (Props. 7-8, Cor. 2).

No model is loaded: every instance is drawn here, seeded, in float64 on the CPU (``device`` is accepted so that
every chapter takes the same parameters). The measurements are ``sinkbook.measures.theory``; the formulas are on
the book's methods page. Identities and bounds that are theorems are must-hold checks: their failure means our
code is wrong.
"""
from __future__ import annotations

import numpy as np
import pandas as pd

from ..core.claims import Finding, Rule, check
from ..core.profiles import NON_NEGATIVE, POSITIVE, Profiles, at_least
from ..figures.gradient_theorems import gradient_norms_figure, tightness_figure, vscale_eigen_figure
from ..measures import theory as th
from .base import Chapter, finding

NAME = "gradient_theorems"
GS = "Gradient-sinks paper"
_BOOK = dict(seed=0, n_mc_samples=50000, identity_seeds=10, jacobian_points=60)
PROFILES = Profiles({"quick": dict(seed=0, n_mc_samples=20000, identity_seeds=3, jacobian_points=20),
                     "default": _BOOK, "gpu": _BOOK},
                    limits=dict(seed=NON_NEGATIVE, n_mc_samples=at_least(100), identity_seeds=POSITIVE,
                                jacobian_points=at_least(2)))
TIGHTNESS_STRENGTHS = np.linspace(0.0, 0.95, 12)
IDENTITY_1E9 = Rule.below(1e-9, "largest error")
ATTAINED = Rule.close_to(1.0, 1e-9, "ratio")
AUTOGRAD_IDENTITY = Rule.at_most(1e-10, "largest |autograd - closed form|")
EXACTLY_ZERO = Rule("== 0 exactly", lambda v: v == 0)
ALL_INSIDE = Rule.true("every noise model inside the bounds (exact expectation)")
MONTE_CARLO_AGREES = Rule.below(5.0, "largest |z|")
JACOBIAN_BOUND = Rule("largest ||J|| / bound <= 1 + 1e-12", lambda ratio: ratio <= 1 + 1e-12)
RMS_EIGEN = Rule("ones within 1e-9; eps/r^2 within 1e-6 relative where rms <= 1",
                 lambda pair: pair[0] < 1e-9 and pair[1] < 1e-6)
VSCALE_PEAK = Rule("|max - 9/8| < 1e-9 and no ||J|| above 9/8",
                   lambda pair: abs(pair[0] - 9 / 8) < 1e-9 and pair[1] <= 9 / 8 + 1e-12)
VSCALE_ARGMAX = Rule.close_to(3.0, 1e-4, "argmax r / C")
# Cor. 2: for r << C the operator norm is the radial eigenvalue, 3r/C + O((r/C)^2): attenuation as strong as
# 3r/C. "radial <= 3r/C" alone holds for every r > 0, so the check tests the expansion itself: the relative
# departure from 3r/C is first order in r/C, with the coefficient 5/3 of the exact formula
# (lambda / (3r/C) = (1 + r/3C) / (1 + r/C)^2 = 1 - 5/3 r/C + ...); 2 leaves room for the next term.
ATTENUATION_SLOPE = 2.0
ATTENUATION = Rule.at_most(ATTENUATION_SLOPE, "largest |radial / (3r/C) - 1| / (r/C) at r/C <= 1e-3")


def prop1_finding(runs: list[dict], example_head: dict | None = None) -> Finding:
    """Prop. 1 and the key / query identities against autograd (``theory.prop1_identity_runs``); the per-token
    gradient norms of ``example_head`` are plotted."""
    keys = ("value_max_abs_err", "key_max_abs_err", "query_max_abs_err", "grad_q0_abs_max")
    worst = {k: float(max(r[k] for r in runs)) for k in keys}
    statement = "largest |autograd - closed form| over {} random heads: {}"
    claims = [
        check("gs_p1_value", statement.format(len(runs), "grad_V L = A^T G"), worst["value_max_abs_err"],
              AUTOGRAD_IDENTITY, expected=0.0, source=f"{GS}, Prop. 1"),
        check("gs_p1_key", statement.format(len(runs), "key-path identity"), worst["key_max_abs_err"],
              AUTOGRAD_IDENTITY, expected=0.0, source=f"{GS}, App. D.1"),
        check("gs_p1_query", statement.format(len(runs), "query-path identity"), worst["query_max_abs_err"],
              AUTOGRAD_IDENTITY, expected=0.0, source=f"{GS}, App. D.1"),
        check("gs_p1_q0", "grad_{q_0} = 0 exactly under the causal mask (largest |grad_{q_0}| from autograd)",
              worst["grad_q0_abs_max"], EXACTLY_ZERO, expected=0.0, source=f"{GS}, Prop. 4"),
    ]
    table = pd.Series({"grad V": worst["value_max_abs_err"], "grad K": worst["key_max_abs_err"],
                       "grad Q": worst["query_max_abs_err"], "|grad q_0|": worst["grad_q0_abs_max"]},
                      name="largest deviation").to_frame()
    figures = [gradient_norms_figure(example_head)] if example_head is not None else []
    return Finding("Prop. 1 and the key / query identities", claims=claims, table=table, figures=figures)


def gradient_theorem1_finding(noise: pd.DataFrame, tightness: pd.DataFrame | None = None) -> Finding:
    """Theorem 1 of the gradient-sinks paper: one row per noise model (``theory.theorem1_noise_models``), the
    second row being the equal-pairwise-covariance model on which the upper bound is an equality; optionally the
    AR(1) tightness curve (``theory.theorem1_tightness_curve``)."""
    inside = (noise["lower"] <= noise["exact"]) & (noise["exact"] <= noise["upper"] * (1 + 1e-12))
    equal = noise.loc[noise["noise"].str.startswith("equal")]
    equal_ratio = float(equal["exact_over_upper"].iloc[0]) if len(equal) else float("nan")
    source = f"{GS}, Thm. 1"
    claims = [
        check("gs_t1_bounds", "M^2 ||mu||^2 <= E||grad_v||^2 <= the upper bound, for every noise model (number "
               "inside)", int(inside.sum()), ALL_INSIDE, expected=len(noise), source=source, value=bool(inside.all())),
        check("gs_t1_monte_carlo", "the Monte-Carlo estimate agrees with the exact expectation (largest |z| over "
              "noise models)", float(np.abs(noise["z"]).max()), MONTE_CARLO_AGREES, expected=0.0, source=source),
        check("gs_t1_tight", "the upper bound is attained under equal pairwise covariance (exact / upper)",
              equal_ratio, ATTAINED, expected=1.0, source=source),
    ]
    notes = ["Exact / upper bound: " + ", ".join(f"{r.exact_over_upper:.3f} under {r.noise} noise"
                                                  for r in noise.itertuples()) + "."]
    table = noise.set_index("noise")[["M", "S", "lower", "mc_mean", "mc_se", "exact", "upper", "z"]].T
    figures = [tightness_figure(tightness)] if tightness is not None else []
    return Finding("How much gradient the sink collects", claims=claims, table=table, figures=figures, notes=notes)


def rmsnorm_jacobian_finding(jacobians: pd.DataFrame) -> Finding:
    """Theorem 2: the RMSNorm Jacobian over inputs of many scales (``theory.rmsnorm_jacobian_table``).

    The small eigenvalue eps / r^2 is one minus a number close to one, which float64 resolves only where
    rms(x) <= 1; it is checked there."""
    resolved = jacobians.loc[jacobians["rms"] <= 1, "eig_min_rel_err"]
    small_err = float(resolved.max()) if len(resolved) else 0.0
    rest_err = float(jacobians["eig_rest_err"].max())
    source = f"{GS}, Thm. 2"
    claims = [
        check("gs_t2_bound", "||J_rms(x)||_op <= ||gamma||_inf / rms(x) (largest ||J|| / bound)",
              float(jacobians["op_over_bound"].max()), JACOBIAN_BOUND, expected=1.0, source=source),
        check("gs_t2_jacobian", "the closed-form RMSNorm Jacobian equals autograd (largest error / bound)",
              float(jacobians["closed_err"].max()), IDENTITY_1E9, expected=0.0, source=f"{GS}, Prop. 5"),
        check("gs_t2_eigen", "the eigenvalues of I - x x^T / (d r^2) are eps / r^2 and 1 (largest error)",
               max(rest_err, small_err), RMS_EIGEN, expected=0.0, source=f"{GS}, Thm. 2 proof",
               value=(rest_err, small_err)),
    ]
    notes = [] if len(resolved) else ["No input had rms(x) <= 1, so the small eigenvalue was not checked."]
    table = jacobians.drop(columns="d").agg(["min", "max"]).T.rename(index={
        "op_over_bound": "||J|| / bound", "closed_err": "closed-form error / bound",
        "eig_min_rel_err": "eps/r^2 relative error", "eig_rest_err": "error of the unit eigenvalues"})
    table.index.name = f"over {len(jacobians)} inputs"
    return Finding("The RMSNorm Jacobian", claims=claims, table=table, notes=notes)


def vscale_jacobian_finding(jacobians: pd.DataFrame, peak: dict) -> Finding:
    """Prop. 7-8 and Cor. 2: the V-scale Jacobian at random v (``theory.vscale_jacobian_table``) and the numerical
    maximum of its radial eigenvalue (``theory.vscale_radial_maximum``)."""
    small = jacobians.loc[jacobians["r_over_C"] <= 1e-3]
    largest_op = float(jacobians["op_norm"].max())
    radial_small = float(small["radial"].max())
    predicted_small = float(3 * small["r_over_C"].max())
    x = small["r_over_C"].to_numpy()
    departure = float(np.max(np.abs(small["radial"].to_numpy() / (3 * x) - 1) / x)) if len(x) else float("nan")
    claims = [
        check("gs_vs_jacobian", "the V-scale Jacobian's closed form equals autograd (largest error)",
              float(jacobians["closed_err"].max()), IDENTITY_1E9, expected=0.0, source=f"{GS}, Prop. 7"),
        check("gs_vs_eigen", "its eigenvalues are r/(r+C) and (r^2+3Cr)/(r+C)^2 (largest error)",
              float(jacobians["eig_err"].max()), IDENTITY_1E9, expected=0.0, source=f"{GS}, Prop. 8"),
        check("gs_vs_peak", "the radial eigenvalue peaks at 9/8 and no ||J|| exceeds it (numerical maximum)",
               peak["max"], VSCALE_PEAK, expected=9 / 8, source=f"{GS}, Prop. 8", value=(peak["max"], largest_op)),
        check("gs_vs_argmax", "the peak sits at r = 3C (argmax r / C)", peak["argmax_r_over_C"], VSCALE_ARGMAX,
              expected=3.0, source=f"{GS}, Prop. 8"),
        check("gs_vs_attenuation", "strong attenuation for r << C: the radial eigenvalue (the operator norm) is "
               "3r/C to first order in r/C (largest relative departure over r/C, at r/C <= 1e-3)", departure,
               ATTENUATION, expected=5 / 3, source=f"{GS}, Cor. 2"),
    ]
    notes = [f"Numerical maximum of the radial eigenvalue: {peak['max']:.12f} at r/C = {peak['argmax_r_over_C']:.6f}; "
             f"the largest operator norm over the random v is {largest_op:.6f}. At r/C <= 1e-3 the radial "
             f"eigenvalue is at most {radial_small:.2e}, where 3r/C predicts {predicted_small:.2e}."]
    return Finding("The V-scale Jacobian", claims=claims, figures=[vscale_eigen_figure(jacobians)], notes=notes)


class GradientTheoremsChapter(Chapter):
    """Every finding draws its instances (seeded) and returns its claims, in notebook order."""
    NAME = NAME
    PROFILES = PROFILES

    @property
    def seed(self) -> int:
        return int(self.settings.seed)

    def computing(self):
        return th.one_blas_thread()

    @finding
    def prop1(self) -> Finding:
        runs = th.prop1_identity_runs(self.seed, self.settings.identity_seeds)
        return prop1_finding(runs, th.prop1_identities(64, 16, self.seed))

    @finding
    def gradient_theorem1(self) -> Finding:
        noise = th.theorem1_noise_models(self.seed + 6, self.settings.n_mc_samples)
        return gradient_theorem1_finding(noise, th.theorem1_tightness_curve(self.seed + 6, TIGHTNESS_STRENGTHS))

    @finding
    def rmsnorm_jacobian(self) -> Finding:
        return rmsnorm_jacobian_finding(th.rmsnorm_jacobian_table(self.seed + 7, self.settings.jacobian_points))

    @finding
    def vscale_jacobian(self) -> Finding:
        table = th.vscale_jacobian_table(self.seed + 8, self.settings.jacobian_points)
        return vscale_jacobian_finding(table, th.vscale_radial_maximum(c=1.0))

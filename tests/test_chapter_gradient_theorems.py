"""The gradient-theorems chapter: each finding function on hand-made tables (a bound holds or is violated), and the
quick profile in-process."""
import numpy as np
import pandas as pd

from sinkbook.chapters import gradient_theorems as ch
from sinkbook.core.claims import failed_must_hold


def by_id(finding):
    return {c.id: c for c in finding.claims}


def prop1_run(err=1e-15, q0=0.0):
    return {"value_max_abs_err": err, "key_max_abs_err": err, "query_max_abs_err": err, "grad_q0_abs_max": q0}


def test_prop1_identities_hold_to_1e_10():
    head = {k: np.ones(4) for k in ("grad_v_norms", "grad_k_norms", "grad_q_norms")}
    finding = ch.prop1_finding([prop1_run(), prop1_run(2e-15)], head)
    assert all(c.holds is True for c in finding.claims) and len(finding.figures) == 1
    claims = by_id(ch.prop1_finding([prop1_run(1e-8, q0=1e-300)]))
    assert [claims[i].holds for i in ("gs_p1_value", "gs_p1_key", "gs_p1_query", "gs_p1_q0")] == [False] * 4


def noise_models(exact=(1200.0, 5950.0, 781.0), upper=(5950.0, 5950.0, 781.0), z=(0.5, 0.3, 0.7)):
    return pd.DataFrame({"noise": ["ar1 (0.6)", "equal (0.6)", "independent (0.0)"], "M": 24.0, "S": 13.0,
                         "lower": 580.0, "mc_mean": exact, "mc_se": 3.0, "exact": exact, "upper": upper, "z": z,
                         "exact_over_upper": np.array(exact) / np.array(upper)})


def test_gradient_theorem1():
    claims = by_id(ch.gradient_theorem1_finding(noise_models()))
    assert all(c.holds is True for c in claims.values()) and claims["gs_t1_bounds"].our_value == 3
    claims = by_id(ch.gradient_theorem1_finding(noise_models(exact=(1200.0, 5000.0, 900.0), z=(0.5, 6.0, 0.1))))
    assert claims["gs_t1_bounds"].holds is False and claims["gs_t1_bounds"].our_value == 2
    assert claims["gs_t1_monte_carlo"].holds is False
    assert claims["gs_t1_tight"].holds is False


def rms_table(op=1.0, closed=1e-16, eig_min=1e-8, eig_rest=1e-15, rms=(0.01, 100.0)):
    return pd.DataFrame({"d": 4, "rms": rms, "op_over_bound": op, "closed_err": closed, "eig_min_rel_err": eig_min,
                         "eig_rest_err": eig_rest})


def test_rmsnorm_jacobian():
    assert all(c.holds is True for c in ch.rmsnorm_jacobian_finding(rms_table()).claims)
    claims = by_id(ch.rmsnorm_jacobian_finding(rms_table(op=1.001, closed=1e-6, eig_min=1e-3)))
    assert [claims[i].holds for i in ("gs_t2_bound", "gs_t2_jacobian", "gs_t2_eigen")] == [False] * 3


def test_rmsnorm_small_eigenvalue_is_only_checked_where_float64_resolves_it():
    finding = ch.rmsnorm_jacobian_finding(rms_table(eig_min=0.5, rms=(10.0, 100.0)))
    assert by_id(finding)["gs_t2_eigen"].holds is True
    assert any("not checked" in note for note in finding.notes)


def vscale_table(closed=1e-16, radial_small=3e-4, op=1.08):
    return pd.DataFrame({"C": 1.0, "r_over_C": [1e-4, 3.0], "closed_err": closed, "eig_err": closed,
                         "op_norm": [3e-4, op], "radial": [radial_small, 1.125]})


def test_vscale_jacobian():
    peak = {"max": 9 / 8, "argmax_r_over_C": 3.0}
    assert all(c.holds is True for c in ch.vscale_jacobian_finding(vscale_table(), peak).claims)
    claims = by_id(ch.vscale_jacobian_finding(vscale_table(closed=1e-6, radial_small=4e-4, op=1.2),
                                              {"max": 1.2, "argmax_r_over_C": 2.9}))
    assert [claims[i].holds for i in ("gs_vs_jacobian", "gs_vs_eigen", "gs_vs_peak", "gs_vs_argmax",
                                      "gs_vs_attenuation")] == [False] * 5
    # a radial eigenvalue far below 3r/C satisfied the old "<= 3r/C" but is not Cor. 2's expansion
    assert by_id(ch.vscale_jacobian_finding(vscale_table(radial_small=1e-5), peak))["gs_vs_attenuation"].holds is False
    exact = 3e-4 * (1 + 1e-4 / 3) / (1 + 1e-4) ** 2                       # the formula itself: departure 5/3 r/C
    assert by_id(ch.vscale_jacobian_finding(vscale_table(radial_small=exact), peak))["gs_vs_attenuation"].holds is True
    over = by_id(ch.vscale_jacobian_finding(vscale_table(op=1.2), peak))["gs_vs_peak"]
    assert over.holds is False and over.our_value == 9 / 8            # an ||J|| above the peak fails the check


def test_quick_profile_runs_every_finding_and_every_check_holds():
    chapter = ch.GradientTheoremsChapter(ch.PROFILES.resolve("quick"))
    claims = chapter.results()["claims"]
    ids = [c.id for c in claims]
    assert len(ids) == len(set(ids)) and ids[0] == "gs_p1_value" and ids[-1] == "gs_vs_attenuation"
    assert not failed_must_hold(claims) and {c.kind for c in claims} == {"math"}

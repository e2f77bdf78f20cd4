"""Property-based and exact checks of sinkbook.measures.theory (the theorems chapter).

Each bound is tried over random shapes and scales with hypothesis; each identity is compared with autograd.
Several tests also assert that a bound is *attained* somewhere, so a bound made looser by mistake fails too.
"""
import math

import numpy as np
import pytest
import torch
from hypothesis import given, settings, strategies as st

from sinkbook.measures import theory as th

FAST = settings(max_examples=30, deadline=None)

seeds = st.integers(0, 2**31 - 1)
even_heads = st.sampled_from([2, 4, 6, 8, 16])


# --------------------------------------------------------------------------------------------------
# VL paper, Theorem 1
# --------------------------------------------------------------------------------------------------


@FAST
@given(seed=seeds, d=st.integers(4, 48), d_head=even_heads, n_keys=st.integers(2, 20),
       eps=st.floats(1e-3, 0.5), weight_std=st.floats(0.01, 3.0), sink_value=st.floats(0.0, 100.0))
def test_theorem1_no_qknorm_bounds_hold(seed, d, d_head, n_keys, eps, weight_std, sink_value):
    inst = th.draw_sink_instances(8, seed, d=d, d_head=d_head, n_keys=n_keys, sink_channel=d - 1,
                                  sink_value=sink_value, eps=eps, weight_std=weight_std)
    tol = 1e-9
    for rope in (False, True):
        r = th.theorem1_no_qknorm(inst, rope=rope)
        # first order: c = 1 is what the proof delivers
        assert np.all(r["B_gap_first_order"] <= r["bound_eq4"] * (1 + tol) + 1e-15)
        # exact shifts: bound plus the exact second-order cross term, no Taylor caveat
        assert np.all(r["B_gap"] <= r["rigorous_bound_eq4"] * (1 + tol) + 1e-15)
        if not rope:
            assert np.all(r["B_gap_first_order"] <= r["bound_vector_norms"] * (1 + tol) + 1e-15)
            assert np.all(r["bound_vector_norms"] <= r["bound_specialised"] * (1 + tol) + 1e-15)
            assert np.all(r["bound_specialised"] <= r["bound_eq4"] * (1 + tol) + 1e-15)
            assert np.all(r["B_gap"] <= r["rigorous_bound_specialised"] * (1 + tol) + 1e-15)


@FAST
@given(seed=seeds, eps=st.floats(1e-4, 0.3))
def test_theorem1_constant_one_is_attained(seed, eps):
    r = th.theorem1_no_qknorm(th.tight_theorem1_instance(seed, eps=eps))
    assert r["B_gap_first_order"][0] == pytest.approx(r["bound_specialised"][0], rel=1e-9)
    # zero-norm background keys make the RoPE-free Eq. 4 coincide with the specialised form
    assert r["bound_eq4"][0] == pytest.approx(r["bound_specialised"][0], rel=1e-12)


def test_first_order_shift_is_the_derivative():
    inst = th.draw_sink_instances(5, 3)
    for qk_norm in (False, True):
        for rope in (False, True):
            kw = dict(qk_norm=qk_norm, rope=rope)
            first = th.first_order_logit_shift(inst, **kw)
            h = 1e-6
            small = th.HeadInstances(inst.w_q, inst.w_k, inst.dw_q * h, inst.dw_k * h, inst.xi_q, inst.xi_keys, h)
            numeric = (th.head_logits(small, True, **kw) - th.head_logits(small, False, **kw)) / h
            np.testing.assert_allclose(numeric, first, rtol=1e-4, atol=1e-6)


@FAST
@given(seed=seeds, d=st.integers(4, 40), d_head=even_heads, n_keys=st.integers(2, 16),
       eps=st.floats(1e-4, 0.05), gamma_scale=st.floats(0.1, 5.0), rope=st.booleans())
def test_theorem1_qknorm_first_order_bound(seed, d, d_head, n_keys, eps, gamma_scale, rope):
    inst = th.draw_sink_instances(6, seed, d=d, d_head=d_head, n_keys=n_keys, eps=eps)
    rng = np.random.default_rng(seed)
    gq = gamma_scale * rng.lognormal(0, 0.5, d_head)
    gk = gamma_scale * rng.lognormal(0, 0.5, d_head)
    r = th.theorem1_qknorm(inst, gamma_q=gq, gamma_k=gk, rope=rope)
    assert np.all(r["B_gap_first_order"] <= r["bound_eq5"] * (1 + 1e-9))


@FAST
@given(seed=seeds, scale=st.floats(1e-3, 1e4))
def test_qknorm_removes_input_magnitude(seed, scale):
    inst = th.draw_sink_instances(6, seed)
    base = th.theorem1_qknorm(inst)["B_gap"]
    scaled = th.theorem1_qknorm(inst.scaled(scale))["B_gap"]
    np.testing.assert_allclose(scaled, base, rtol=1e-7, atol=1e-12)
    plain_base = th.theorem1_no_qknorm(inst)["B_gap"]
    plain_scaled = th.theorem1_no_qknorm(inst.scaled(scale))["B_gap"]
    np.testing.assert_allclose(plain_scaled, plain_base * scale**2, rtol=1e-7)


def test_magnitude_sweep_shape_and_trend():
    sweep = th.magnitude_sweep(th.draw_sink_instances(50, 0), [1, 10, 100])
    assert np.all(np.diff(sweep["B_gap_plain"]) > 0)
    assert np.ptp(sweep["B_gap_qknorm"]) / sweep["B_gap_qknorm"][0] < 1e-3
    assert np.all(sweep["max_first_order_ratio_qknorm"] <= 1)      # Eq. 5 is a first-order bound
    assert np.all(sweep["max_ratio_qknorm"] >= 0)


def test_rope_is_orthogonal_and_relative():
    rot = th.rope_matrices(np.arange(6), 8)
    for r in rot:
        np.testing.assert_allclose(r @ r.T, np.eye(8), atol=1e-12)
    # <R_m a, R_n b> depends on n - m only
    a, b = np.random.default_rng(0).normal(size=(2, 8))
    assert (rot[1] @ a) @ (rot[3] @ b) == pytest.approx((rot[2] @ a) @ (rot[4] @ b), rel=1e-12)


# --------------------------------------------------------------------------------------------------
# VL paper, App. A.3 and A.5
# --------------------------------------------------------------------------------------------------


@FAST
@given(seed=seeds, rows=st.integers(1, 12), cols=st.integers(1, 40), rank=st.integers(0, 12))
def test_frobenius_restatement_is_an_identity(seed, rows, cols, rank):
    rng = np.random.default_rng(seed)
    rank = min(rank, rows, cols)
    dq = rng.normal(size=(3, rows, cols))
    dk = np.einsum("nhr,nrd->nhd", rng.normal(size=(3, rows, rank)), rng.normal(size=(3, rank, cols)))
    m_q, m_k = rng.uniform(0.01, 2, 3), rng.uniform(0.01, 2, 3)
    forms = th.frobenius_restatement(dq, dk, m_q, m_k, gamma_q_inf=1.3, gamma_k_inf=0.7)
    np.testing.assert_allclose(forms["frobenius_form"], forms["operator_form"], rtol=1e-10)


def test_stable_rank_of_known_matrices():
    assert th.stable_rank(np.eye(5)) == pytest.approx(5.0)
    assert th.stable_rank(np.outer(np.arange(1, 4), np.ones(6))) == pytest.approx(1.0)
    assert th.stable_rank(np.zeros((3, 3))) == 0.0


@FAST
@given(seed=seeds, n_heads=st.integers(1, 12), d_head=st.integers(1, 32), spread=st.floats(0, 3))
def test_layerwise_and_per_head_envelopes(seed, n_heads, d_head, spread):
    rng = np.random.default_rng(seed)
    q_cat = rng.normal(size=(20, n_heads * d_head)) * rng.lognormal(0, spread, size=(20, n_heads * d_head))
    gamma = rng.lognormal(0, 0.5, size=n_heads * d_head)
    env = th.layerwise_envelope(q_cat, gamma, n_heads, rms_eps=1e-6)
    assert np.all(env["norm_layerwise"] <= env["envelope_layerwise"] * (1 + 1e-12))
    assert np.all(env["norm_per_head"] <= env["envelope_per_head"] * (1 + 1e-12))
    np.testing.assert_allclose(np.sum(env["rho"] ** 2, axis=1), 1.0, rtol=1e-12)


def test_envelopes_agree_at_equal_share_and_are_attained():
    q_cat = np.ones((1, 12))                                   # 3 heads of 4, equal energy
    env = th.layerwise_envelope(q_cat, np.full(12, 2.0), 3)
    np.testing.assert_allclose(env["rho"], 1 / math.sqrt(3))
    np.testing.assert_allclose(env["envelope_layerwise"], env["envelope_per_head"])
    np.testing.assert_allclose(env["norm_layerwise"], env["envelope_layerwise"])


def test_compression_shrinks_the_sink_lead():
    comp = th.compression_experiment(60, 1, [1.0, 0.1])
    assert comp["compression_identity_err"].max() < 1e-9
    weak = (comp["energy_scale"] == 0.1) & comp["sink_top1_per_head"]
    assert weak.sum() > 20
    assert np.mean(comp["G_layerwise"][weak] < comp["G_per_head"][weak]) > 0.9
    # per-head normalisation does not see the head's energy share at all
    full = comp["energy_scale"] == 1.0
    np.testing.assert_allclose(comp["G_per_head"][full], comp["G_per_head"][~full], rtol=1e-9)


# --------------------------------------------------------------------------------------------------
# VL paper, Lemma 1
# --------------------------------------------------------------------------------------------------


def test_lemma1_paper_case():
    case = th.lemma1_paper_case(G=3.0, B_gap=0.4, n_keys=64)
    assert case["G_measured"] == pytest.approx(3.0, abs=1e-12)
    assert case["B_gap_measured"] == pytest.approx(0.4, abs=1e-12)
    assert round(case["non_sink_mass"], 3) == 0.069
    assert case["non_sink_mass"] == pytest.approx(case["bound"], rel=1e-12)


@FAST
@given(seed=seeds, n_keys=st.integers(2, 200), scale=st.floats(0.01, 20), delta_scale=st.floats(0, 10))
def test_lemma1_holds_on_random_logits(seed, n_keys, scale, delta_scale):
    rng = np.random.default_rng(seed)
    logits = rng.normal(0, scale, size=(10, n_keys))
    delta = rng.normal(0, delta_scale, size=(10, n_keys))
    mass = th.softmax(logits + delta)[:, 1:].sum(axis=1)
    bound = th.sigmoid(th.sink_gap(delta) - th.aggregate_gap(logits))
    assert np.all(mass <= bound * (1 + 1e-9) + 1e-15)


@FAST
@given(n_keys=st.integers(2, 500), G=st.floats(-5, 10), B=st.floats(0, 5))
def test_lemma1_worst_case_is_tight(n_keys, G, B):
    case = th.lemma1_paper_case(G=G, B_gap=B, n_keys=n_keys)
    assert case["non_sink_mass"] == pytest.approx(case["bound"], rel=1e-9)


def test_top2_form_is_vacuous_where_aggregate_is_not():
    ex = th.lemma1_top2_example(n_keys=64, B_gap=0.4, runner_up_gap=4.0)
    assert ex["T"] < ex["log_N"] + 0.4
    assert ex["top2_bound_raw"] > 1
    assert ex["non_sink_mass"] <= ex["aggregate_bound"] * (1 + 1e-12) < 0.05


def test_lemma1_random_summary_never_violates():
    r = th.lemma1_random(300, 7)
    assert np.all(r["non_sink_mass"] <= r["bound"] * (1 + 1e-9))
    assert np.all(r["G"] <= r["T"] + 1e-12)                      # the aggregate gap never exceeds the top-2 gap


# --------------------------------------------------------------------------------------------------
# Gradient-sinks paper
# --------------------------------------------------------------------------------------------------


@FAST
@given(seed=seeds, seq_len=st.integers(2, 48), d_head=st.integers(1, 24), sink_bias=st.floats(0, 8))
def test_prop1_identities_match_autograd(seed, seq_len, d_head, sink_bias):
    r = th.prop1_identities(seq_len, d_head, seed, sink_bias=sink_bias)
    scale = max(1.0, r["grad_v_scale"])
    assert r["value_max_abs_err"] <= 1e-6 * scale
    assert r["key_max_abs_err"] <= 1e-6 * scale
    assert r["query_max_abs_err"] <= 1e-6 * scale
    assert r["grad_q0_abs_max"] == 0.0


def test_first_query_gradient_is_not_trivially_zero_elsewhere():
    r = th.prop1_identities(16, 8, 0)
    assert r["grad_q0_abs_max"] == 0.0
    assert np.all(r["grad_q_norms"][1:] > 0)


@settings(max_examples=15, deadline=None)
@given(seed=seeds, seq_len=st.integers(2, 40), d=st.integers(1, 16),
       kind=st.sampled_from(["ar1", "equal", "independent"]), strength=st.floats(0, 0.95))
def test_theorem1_gradient_bounds(seed, seq_len, d, kind, strength):
    r = th.theorem1_monte_carlo(seq_len, d, 4000, seed, kind=kind, strength=strength)
    assert r["lower"] <= r["exact"] * (1 + 1e-12)
    assert r["exact"] <= r["upper"] * (1 + 1e-12)
    assert abs(r["mc_mean"] - r["exact"]) <= 6 * r["mc_se"] + 1e-9 * r["exact"]
    if kind in ("equal", "independent"):
        assert r["exact"] == pytest.approx(r["upper"], rel=1e-9)


def test_theorem1_gradient_bad_correlation_kind():
    with pytest.raises(ValueError, match="unknown correlation kind"):
        th.theorem1_monte_carlo(8, 4, 10, 0, kind="banded")


@FAST
@given(seed=seeds, d=st.integers(1, 128), log_scale=st.floats(-4, 4), eps=st.floats(1e-8, 1e-2))
def test_rmsnorm_jacobian_bound_and_eigenvalues(seed, d, log_scale, eps):
    rng = np.random.default_rng(seed)
    x = rng.normal(size=d) * 10.0**log_scale
    gamma = rng.lognormal(0, 0.7, size=d)
    r = th.rmsnorm_jacobian_check(x, gamma, eps)
    assert r["op_norm"] <= r["bound"] * (1 + 1e-12)
    assert r["closed_form_max_abs_err"] <= 1e-9 * r["bound"]
    assert r["eig_rest_max_dev_from_1"] < 1e-9
    # eps/r^2 is a difference of two numbers near 1; check it where float64 resolves it
    assert abs(r["eig_min"] - r["eig_min_expected"]) < 1e-12 + 1e-6 * r["eig_min_expected"] or r["eig_min_expected"] < 1e-6


def test_rmsnorm_bound_attained_with_constant_gamma():
    x = np.array([1e-3, 0.0, 0.0, 0.0])                      # the perpendicular directions have gain exactly 1/r
    r = th.rmsnorm_jacobian_check(x, np.full(4, 3.0), 1e-6)
    assert r["op_norm"] == pytest.approx(r["bound"], rel=1e-12)


@FAST
@given(seed=seeds, d=st.integers(2, 64), log_ratio=st.floats(-6, 4), c=st.floats(1e-3, 1e3))
def test_vscale_jacobian(seed, d, log_ratio, c):
    v = np.random.default_rng(seed).normal(size=d)
    v *= math.sqrt(c * 10.0**log_ratio) / np.linalg.norm(v)
    r = th.vscale_jacobian_check(v, c)
    assert r["closed_form_max_abs_err"] < 1e-9
    assert r["eig_max_abs_err"] < 1e-9
    assert r["op_norm"] <= 9 / 8 + 1e-12
    assert r["perpendicular"] < 1


def test_vscale_radial_peak():
    for c in (0.01, 1.0, 250.0):
        peak = th.vscale_radial_maximum(c)
        assert peak["max"] == pytest.approx(9 / 8, abs=1e-12)
        assert peak["argmax_r_over_C"] == pytest.approx(3.0, rel=1e-5)
    perp, radial = th.vscale_eigen_formulas(np.array([1e-4, 3.0, 1e6]), 1.0)
    assert radial[0] == pytest.approx(3e-4, rel=1e-3)          # strong attenuation, ~3r/C
    assert radial[1] == pytest.approx(9 / 8)
    assert radial[2] == pytest.approx(1.0, abs=1e-5) and perp[2] == pytest.approx(1.0, abs=1e-5)


# --------------------------------------------------------------------------------------------------
# The chapter's batches of cases
# --------------------------------------------------------------------------------------------------


def test_envelope_table_has_one_row_per_shape_and_stays_under_the_envelopes():
    table = th.layerwise_envelope_table(0, n_layers=50)
    assert list(zip(table["H"], table["d_head"])) == list(th.ENVELOPE_SHAPES)
    assert (table[["max_layerwise_ratio", "max_per_head_ratio"]] <= 1 + 1e-12).all().all()
    assert (table["min_rho_sqrtH"] <= 1).all()                    # some head always carries at most its share


def test_frobenius_cases_include_zero_and_rank_one_updates():
    forms = th.frobenius_cases(1, n_cases=40, rank_one=10, zero=5)
    assert forms["relative_difference"].shape == (40,)
    assert forms["relative_difference"].max() < 1e-12
    with pytest.raises(ValueError, match="must not exceed"):
        th.frobenius_cases(1, n_cases=10, rank_one=8, zero=5)


def test_prop1_runs_cover_every_shape():
    runs = th.prop1_identity_runs(0, 3)
    assert len(runs) == len(th.PROP1_SHAPES)
    assert len(th.prop1_identity_runs(0, 10)) == 3 * len(th.PROP1_SHAPES)
    assert all(r["grad_q0_abs_max"] == 0.0 for r in runs)


def test_noise_models_and_tightness_curve():
    table = th.theorem1_noise_models(0, 500, seq_len=16, d=4)
    assert list(table["noise"]) == ["ar1 (0.6)", "equal (0.6)", "independent (0.0)"]
    assert (table["lower"] <= table["exact"]).all() and (table["exact"] <= table["upper"] * (1 + 1e-12)).all()
    curve = th.theorem1_tightness_curve(0, [0.0, 0.5], n_samples=10, seq_len=16, d=4)
    assert (curve["lower_over_upper"] <= curve["exact_over_upper"] + 1e-12).all()


def test_jacobian_tables():
    rms = th.rmsnorm_jacobian_table(0, 8)
    assert len(rms) == 4 * 2 and (rms["op_over_bound"] <= 1 + 1e-12).all()
    vs = th.vscale_jacobian_table(0, 6)
    assert len(vs) == 3 * 2 and vs["closed_err"].max() < 1e-9
    with pytest.raises(ValueError, match="points"):
        th.rmsnorm_jacobian_table(0, 3)


# --------------------------------------------------------------------------------------------------
# Bad input
# --------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("kwargs, message", [
    (dict(n_draws=0), "n_draws"),
    (dict(d_head=0), "d_head"),
    (dict(n_keys=1), "n_keys"),
    (dict(sink_channel=99), "sink_channel"),
    (dict(eps=0.0), "eps"),
])
def test_bad_instance_arguments(kwargs, message):
    args = dict(n_draws=2, seed=0) | kwargs
    with pytest.raises(ValueError, match=message):
        th.draw_sink_instances(**args)


def test_other_bad_inputs():
    with pytest.raises(ValueError, match="even head dimension"):
        th.rope_matrices([0, 1], 3)
    with pytest.raises(ValueError, match="C must be > 0"):
        th.vscale_jacobian_check(np.ones(3), 0.0)
    with pytest.raises(ValueError, match="multiple of n_heads"):
        th.layerwise_envelope(np.ones((1, 10)), np.ones(10), 3)
    with pytest.raises(ValueError, match="input scales"):
        th.magnitude_sweep(th.draw_sink_instances(2, 0), [1, -1])

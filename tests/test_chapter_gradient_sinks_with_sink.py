"""The chapter on models with a sink: pretrained probes and synthetic-setting claims gated on what each needs, the
retrofit's start, quantised evaluation leaving the model untouched, the per-group learning-rate scale of the
training loop, and the quick profile on tiny models of every family."""
import copy

import numpy as np
import pandas as pd
import pytest
import torch

from sinkbook.chapters import gradient_sinks_with_sink as ws
from sinkbook.core.claims import NOT_COMPARABLE
from sinkbook.core.models import TINY_FAMILIES
from sinkbook.runs import vscale_setting as runs
from sinkbook.interventions.vscale import apply_vscale, calibrated_theta, learned_theta, vscale_values
from sinkbook.training.loop import fit

NUMBERS = {"median R_GS": 30.0, "Sink^eps middle": 1.0, "token-0 ratio": 1.5, "token-0 norm": 2.0,
           "token-0 value norm / early": 0.4, "Bloat token 0": 3.0, "Bloat others": 1.0,
           "median |log10 Change|": 0.02, "rho(norm, Compress)": -0.8, "val loss": 3.1}


def _rows(seeds=(0, 1, 2), base=None, vscale=None, per_seed=None):
    pairs = {}
    for s in seeds:
        b = {**NUMBERS, **(base or {})}
        v = {**NUMBERS, "median R_GS": 5.0, "val loss": 3.105, **(vscale or {})}
        if per_seed and s in per_seed:
            v.update(per_seed[s])
        pairs[s] = {"baseline": b, "V-scale": v}
    return ws.seed_rows(pairs)


def _by_id(claims):
    return {c.id: c for c in claims}


def test_a_sink_without_massive_activation_tests_the_sink_claims_only():
    c = _by_id(ws.setting_claims(_rows(), theta={s: np.zeros((1, 1)) for s in (0, 1, 2)}))
    assert c["bb_baseline_sink"].holds is True and c["bb_baseline_massive"].holds is False
    assert c["bb_baseline_gradient_sink"].holds is True
    assert c["bb_vscale_lowers_rgs"].holds is True and c["bb_vscale_keeps_sink"].holds is True
    assert c["bb_vscale_loss_parity"].holds is True and c["bb_token0_value_small"].holds is True
    for gated in ("bb_vscale_lowers_token0_norm", "bb_bloat_at_token0"):
        assert c[gated].holds == "not comparable" and "massive" in c[gated].why_not_comparable
    assert c["bb_theta_layer_pattern"].holds == "not comparable"      # one layer has no layer pattern


def test_the_theta_layer_pattern_must_appear_in_every_seed_not_only_in_their_mean():
    falling = np.array([[1.0], [-1.0]])                                 # early above late
    c = _by_id(ws.setting_claims(_rows(), theta={0: falling, 1: falling, 2: falling}))
    assert c["bb_theta_layer_pattern"].holds is True
    c = _by_id(ws.setting_claims(_rows(), theta={0: 3 * falling, 1: falling, 2: -falling}))   # mean early > late
    assert c["bb_theta_layer_pattern"].holds is False and "seed 2: -1.00 early" in c["bb_theta_layer_pattern"].our_value


def test_massive_activation_statements_need_one_and_much_smaller_means_at_most_half():
    c = _by_id(ws.setting_claims(_rows()))                              # token-0 ratio 1.5: no massive activation
    for gated in ("bb_change_near_one", "bb_compress_falls_with_norm"):
        assert c[gated].holds == NOT_COMPARABLE and "token-0 ratio 1.50" in c[gated].why_not_comparable
    massive = {"token-0 ratio": 8.0}
    c = _by_id(ws.setting_claims(_rows(base=massive)))
    assert c["bb_change_near_one"].holds is True and c["bb_compress_falls_with_norm"].holds is True
    c = _by_id(ws.setting_claims(_rows(base={"token-0 value norm / early": 0.6})))
    assert c["bb_token0_value_small"].holds is False                    # smaller, but not "much smaller"


def test_loss_parity_is_a_statistical_claim_over_seeds():
    c = _by_id(ws.setting_claims(_rows(per_seed={0: {"val loss": 3.09}, 1: {"val loss": 3.2}})))
    parity = c["bb_vscale_loss_parity"]
    assert parity.effect["seeds"] == 3 and parity.interest["non_inferiority"] and parity.interest["units"] == "nats"
    assert parity.holds == "inconclusive"                                # an interval spanning the margin
    one = _by_id(ws.setting_claims(_rows(seeds=(0,))))["bb_vscale_loss_parity"]
    assert one.holds == NOT_COMPARABLE and "1 seed" in one.why_not_comparable


def test_value_spike_needs_pronounced_key_and_value_spikes_and_a_flat_query_path():
    def spikes(key, value, query_peak):
        probe = fake_probe(r_gs=24, key_spike=key, value_spike=value)
        probe.grad_q[:, 5] = query_peak                                   # one early query position
        return _by_id(ws.pretrained_claims("m", probe))["m_value_spike"].holds
    assert spikes(2.0, 3.0, 1.0) is True
    assert spikes(1.5, 3.0, 1.0) is False                                # no pronounced key spike
    assert spikes(3.0, 2.5, 1.0) is False                                # value not above key
    assert spikes(2.0, 3.0, 10.0) is False                               # the query path spikes too


def test_one_seed_against_the_paper_breaks_an_every_seed_rule():
    c = _by_id(ws.setting_claims(_rows(per_seed={1: {"median R_GS": 40.0, "Sink^eps middle": 0.5}})))
    assert c["bb_vscale_lowers_rgs"].holds is False
    assert c["bb_vscale_keeps_sink"].holds is False
    c = _by_id(ws.setting_claims(_rows(vscale={"val loss": 3.2})))
    assert c["bb_vscale_loss_parity"].holds is False


def test_without_a_sink_nothing_about_v_scale_is_compared():
    c = _by_id(ws.setting_claims(_rows(base={"Sink^eps middle": 0.2})))
    assert c["bb_baseline_sink"].holds is False
    for id_ in ("bb_baseline_gradient_sink", "bb_vscale_lowers_rgs", "bb_vscale_keeps_sink", "bb_vscale_loss_parity"):
        assert c[id_].holds == "not comparable"


def test_with_massive_activation_the_norm_claims_are_compared():
    c = _by_id(ws.setting_claims(_rows(base={"token-0 ratio": 8.0, "token-0 norm": 50.0},
                                       vscale={"token-0 norm": 10.0})))
    assert c["bb_baseline_massive"].holds is True and c["bb_vscale_lowers_token0_norm"].holds is True
    assert ws.removed_massive_activation(_rows(base={"token-0 ratio": 8.0, "token-0 norm": 50.0},
                                               vscale={"token-0 norm": 10.0}))[0] is True
    assert ws.removed_massive_activation(_rows())[0] is False


def test_seed_interval_is_the_t_interval():
    text = ws.seed_interval([1.0, 2.0, 3.0])
    half = 4.303 * 1.0 / np.sqrt(3)
    assert text == f"{2.0:.3g} [{2 - half:.3g}, {2 + half:.3g}]"


def test_calibrated_start_is_nearly_the_identity_and_not_inert(loaded_model):
    loaded = loaded_model("tiny-llama")
    model = copy.deepcopy(loaded.model).eval()
    torch.manual_seed(0)
    ids = torch.randint(0, 200, (2, 24))
    with torch.no_grad():
        before = model(input_ids=ids).logits
    theta = calibrated_theta(model, ids, share=1e-4)
    apply_vscale(model, theta=theta)
    torch.testing.assert_close(learned_theta(model), theta)
    with torch.no_grad():
        after = model(input_ids=ids).logits
    assert (after - before).abs().max() < 1e-2 * before.abs().max()
    # at the median value norm the valve keeps 1 / (1 + share) of the value; its theta gradient is not zero
    d_model, d_head = model.config.hidden_size, model.config.hidden_size // model.config.num_attention_heads
    c = d_model * d_head * 0.02 ** 2 * torch.exp(theta[0, 0])
    v = torch.randn(d_head)
    v = v / v.norm() * torch.sqrt(c / 1e-4)
    kept = vscale_values(v[None, None, :], theta[0, :1], d_model)[0, 0].norm() / v.norm()
    assert abs(float(kept) - 1 / (1 + 1e-4)) < 1e-6
    model.train()
    model(input_ids=ids, labels=ids).loss.backward()
    assert all(m.theta.grad.abs().max() > 0 for m in model.modules() if hasattr(m, "theta"))
    with pytest.raises(ValueError, match="already has V-scale"):
        calibrated_theta(model, ids, 1e-4)
    with pytest.raises(ValueError, match="layers, value heads"):
        apply_vscale(copy.deepcopy(loaded.model), theta=np.zeros((1, 1)))


def test_quantised_weights_leave_the_model_untouched_and_residual_hooks_go(loaded_model):
    loaded = loaded_model("tiny-llama")
    model = loaded.model.eval()
    state = {k: v.clone() for k, v in model.state_dict().items()}
    batches = [torch.randint(0, 200, (2, 16))]
    table = runs.quantisation_rows({"tiny": model}, batches)
    assert all(torch.equal(v, model.state_dict()[k]) for k, v in state.items())
    assert np.isfinite(table.drop(columns="model").to_numpy(dtype=float)).all()
    assert table.loc[0, "int4 weights: loss increase"] != 0.0
    assert not any(block._forward_pre_hooks for block in model.model.layers)


def test_a_parameter_group_runs_at_its_lr_scale():
    model = torch.nn.Linear(3, 1)
    optimizer = torch.optim.SGD([{"params": [model.weight]}, {"params": [model.bias], "lr_scale": 10.0}], lr=0.1)
    fit(model, optimizer, lambda step: torch.ones(2, 3), 1, lambda step: 0.1,
        loss_fn=lambda m, b: m(b).sum(), clip=None, progress=False)
    assert [g["lr"] for g in optimizer.param_groups] == [pytest.approx(0.1), pytest.approx(1.0)]


def _retrofit_result(pre=None, plain=None, vs=None):
    base = {"median R_GS": 30.0, "Sink^eps middle": 0.9, "token-0 ratio": 20.0, "token-0 norm": 100.0,
            "val loss": 3.0}
    quant = {f"{q}: loss increase": 0.01 for q in runs.QUANTISERS}
    arms = {"pretrained": {**base, **(pre or {})}, "plain fine-tune": {**base, **(plain or {})},
            "V-scale fine-tune": {**base, "token-0 norm": 40.0, "median R_GS": 10.0, **(vs or {})}}
    return {"config": {"model": "m"}, "arms": {k: {"numbers": v, "quantisation": {**quant, "largest |h|": 1.0}}
                                               for k, v in arms.items()}}


def test_retrofit_claims_compare_with_the_plain_fine_tune_and_need_the_phenomena():
    c = _by_id(ws.retrofit_claims(_retrofit_result()))
    assert c["retrofit_lowers_token0_norm"].holds is True and c["retrofit_lowers_rgs"].holds is True
    assert c["retrofit_keeps_sink"].holds is True and c["retrofit_loss_parity"].holds is True
    c = _by_id(ws.retrofit_claims(_retrofit_result(vs={"val loss": 3.1, "Sink^eps middle": 0.3})))
    assert c["retrofit_loss_parity"].holds is False and c["retrofit_keeps_sink"].holds is False
    c = _by_id(ws.retrofit_claims(_retrofit_result(vs={"median R_GS": 29.0, "token-0 norm": 99.0})))
    assert c["retrofit_lowers_rgs"].holds is False and c["retrofit_lowers_token0_norm"].holds is False  # noise, not halved
    c = _by_id(ws.retrofit_claims(_retrofit_result(pre={"token-0 ratio": 2.0})))
    assert all(x.holds == "not comparable" for x in c.values())


def test_quantisation_claim_needs_a_removed_massive_activation():
    setting = pd.DataFrame([{"model": "baseline (seed 0)", "largest |h|": 1.0,
                             **{f"{q}: loss increase": 0.01 for q in runs.QUANTISERS}},
                            {"model": "V-scale (seed 0)", "largest |h|": 1.0,
                             **{f"{q}: loss increase": 0.001 for q in runs.QUANTISERS}}])
    f = ws.quantisation_finding(setting, (False, "no massive activation"), _retrofit_result())
    c = _by_id(f.claims)
    assert c["bb_vscale_easier_to_quantise"].holds == "not comparable"
    assert c["retrofit_easier_to_quantise"].holds is False          # equal increases: not easier
    f = ws.quantisation_finding(setting, (True, ""), None)
    assert _by_id(f.claims)["bb_vscale_easier_to_quantise"].holds is True


from test_chapter_gradient_sinks import fake_probe  # noqa: E402  (the synthetic probe of the sibling tests)


def test_pretrained_claims_are_gated_on_the_models_sink():
    real = {"tiny-llama": fake_probe(r_gs=1.5, sink=0.0, ratio=1.0), "smollm2-135m-instruct": fake_probe(r_gs=24)}
    finding = ws.pretrained_finding(real, skipped={"gone": "no file"})
    c = {x.id: x for x in finding.claims}
    assert set(c) == {"tiny_llama_rgs_range", "tiny_llama_value_spike", "smollm2_135m_instruct_rgs_range",
                      "smollm2_135m_instruct_value_spike"}
    assert c["tiny_llama_rgs_range"].holds == NOT_COMPARABLE and c["tiny_llama_value_spike"].holds == NOT_COMPARABLE
    assert c["smollm2_135m_instruct_rgs_range"].holds is True
    assert c["smollm2_135m_instruct_value_spike"].holds is True          # value 3x, key 2x
    assert any("gone: not available" in n for n in finding.notes)
    assert any("tiny-llama shows no attention sink" in n for n in finding.notes)
    assert list(finding.table.columns) == list(real)
    nothing = ws.pretrained_finding({}, skipped={"gone": "no file"})
    assert not nothing.claims and nothing.notes


def test_quick_profile_runs_on_tiny_models_of_every_family(tmp_path, monkeypatch):
    """The chapter end to end on the quick profile, with a tiny random model of every family as the 'pretrained'
    models: they have no sink, so their claims are not comparable, and nothing raises."""
    from sinkbook.book.results import write_results
    from sinkbook.core.paths import cache_root
    real = cache_root()
    (tmp_path / "cache").mkdir()
    for name in ("shakespeare", "synthetic"):
        if (real / name).exists():
            (tmp_path / "cache" / name).symlink_to(real / name)
    monkeypatch.setenv("SINKBOOK_CACHE", str(tmp_path / "cache"))
    specs = [f"tiny-{family}" for family in TINY_FAMILIES]
    chapter = ws.GradientSinksWithSinkChapter(ws.PROFILES.resolve("quick", device="cpu", real_models=specs))
    doc = __import__("json").loads(write_results(**chapter.results(), directory=tmp_path / "results").read_text())
    ids = [c["id"] for c in doc["claims"]]
    assert len(ids) == len(set(ids))
    for spec in specs:
        for suffix in ("rgs_range", "value_spike"):
            c = next(c for c in doc["claims"] if c["id"] == f"{ws.slug(spec)}_{suffix}")
            assert c["holds"] == NOT_COMPARABLE and "no attention sink" in c["why_not_comparable"]
    checks = [c for c in doc["claims"] if c["must_hold"]]
    assert {c["id"] for c in checks} == {"pretrained_grad_q0_zero", "pretrained_probes_finite"}
    assert all(c["holds"] is True for c in checks)
    assert {m["spec"] for m in doc["models"]} == set(specs)

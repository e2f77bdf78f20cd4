"""The sink-criteria chapter: its finding functions on synthetic tables (holds, does not hold, not comparable),
and its quick profile, run in-process on a tiny model of every family."""
from __future__ import annotations

import json
import math

import numpy as np
import pandas as pd
import pytest

from sinkbook.chapters import sink_criteria as ch
from sinkbook.core.claims import NOT_COMPARABLE
from sinkbook.core.models import TINY_FAMILIES

TAUS = (20.0, 25.0, 30.0)


def _by_id(finding):
    return {c.id: c for c in finding.claims}


# ---- synthetic measurements ---------------------------------------------------------------------------------------

def _census(n_layers=6, n_tokens=100, llm=(1, 1, 1, 1, 1, 1), llm_other=(0,) * 6, vlm=None, massive=True,
            sink_dims=(3, 7), outlier_dims=(3, 7), sink_eps=None, mass=None):
    """What ``criteria.sink_census`` returns, with chosen counts per layer."""
    vlm = vlm or {t: [0] * n_layers for t in TAUS}
    sink_eps = sink_eps if sink_eps is not None else [1.0] * n_layers
    mass = mass if mass is not None else [10.0] * n_layers
    rows = []
    for layer in range(n_layers):
        row = {"layer": layer, "phi_llm_sinks": llm[layer], "phi_llm_other_tokens": llm_other[layer],
               "sink_eps": sink_eps[layer], "M_s": mass[layer], "S_s": 0.5 * mass[layer],
               "attn_to_first": 0.1 + 0.8 * sink_eps[layer] + 0.01 * layer}
        for t in TAUS:
            row[f"phi_vlm_{t:g}"] = vlm[t][layer]
        rows.append(row)
    return {"layers": pd.DataFrame(rows), "sink_dims": list(sink_dims), "sink_dims_are_massive": massive,
            "outlier_dims": list(outlier_dims), "n_tokens": n_tokens, "n_prompts": 5}


def test_phi_llm_sparse_and_phi_vlm_overidentifying():
    # deep third = layers 4, 5: Phi_VLM flags 90% of tokens there, Phi_LLM 1%
    vlm = {20.0: [0, 0, 10, 50, 90, 90], 25.0: [0] * 6, 30.0: [0] * 6}
    f = ch.census_finding({"m": _census(vlm=vlm)}, {"m": 1024}, tau=20.0)
    claims = _by_id(f)
    # one flagged token per layer over 5 prompts: 0.2 per prompt, well within "typically one per layer"
    assert claims["phi_llm_sparse_m"].holds is True and claims["phi_llm_sparse_m"].our_value == 0.2
    assert claims["phi_vlm_overidentifies_m"].holds is True and claims["phi_vlm_overidentifies_m"].our_value == 0.9
    assert not f.table.empty and f.figures


def test_phi_llm_dense_and_phi_vlm_not_overidentifying():
    vlm = {20.0: [0, 0, 0, 0, 2, 2], 25.0: [0] * 6, 30.0: [0] * 6}
    f = ch.census_finding({"m": _census(llm=(20,) * 6, vlm=vlm)}, {"m": 1024}, tau=20.0)
    claims = _by_id(f)
    assert claims["phi_llm_sparse_m"].holds is False                  # 4 tokens per prompt and layer
    assert claims["phi_vlm_overidentifies_m"].holds is False


@pytest.mark.parametrize("deep_share, holds", [(0.3, False), (0.5, False), (0.51, True)])
def test_phi_vlm_overidentifies_means_the_majority_of_tokens(deep_share, holds):
    """The paper: "the majority of tokens are classified as sinks" in deep layers; 30 % (which passed the old
    "> 0.2 and 3x Phi_LLM" rule) is not a majority."""
    vlm = {20.0: [0, 0, 0, 0, deep_share * 100, deep_share * 100], 25.0: [0] * 6, 30.0: [0] * 6}
    claims = _by_id(ch.census_finding({"m": _census(vlm=vlm)}, {"m": 1024}, tau=20.0))
    assert claims["phi_vlm_overidentifies_m"].holds is holds


def test_phi_llm_sparse_reads_the_typical_layer_not_the_worst():
    claims = _by_id(ch.census_finding({"m": _census(llm=(0, 5, 5, 5, 5, 40))}, {"m": 1024}, tau=20.0))
    assert claims["phi_llm_sparse_m"].our_value == 1.0 and claims["phi_llm_sparse_m"].holds is True
    claims = _by_id(ch.census_finding({"m": _census(llm=(0, 10, 10, 10, 10, 10))}, {"m": 1024}, tau=20.0))
    assert claims["phi_llm_sparse_m"].holds is False                  # two tokens per prompt in every layer


def test_census_claims_are_not_comparable_without_massive_activations_or_when_tau_cannot_fire():
    none = ch.census_finding({"m": _census(llm=(0,) * 6, massive=False)}, {"m": 64}, tau=20.0)
    for c in none.claims:
        assert c.holds == NOT_COMPARABLE and "massive" in c.why_not_comparable
    assert any("flags no token" in n for n in none.notes)
    # massive activations, but tau = 20 > sqrt(256) = 16: Phi_VLM cannot fire
    capped = _by_id(ch.census_finding({"m": _census()}, {"m": 256}, tau=20.0))
    assert capped["phi_llm_sparse_m"].holds is True
    assert capped["phi_vlm_overidentifies_m"].holds == NOT_COMPARABLE
    assert "sqrt(D)" in capped["phi_vlm_overidentifies_m"].why_not_comparable


def test_sink_dimensions_against_outlier_dimensions():
    f = ch.dimensions_finding({"a": _census(outlier_dims=(3, 7, 9)), "b": _census(outlier_dims=(3,)),
                               "c": _census(massive=False)})
    claims = _by_id(f)
    assert claims["sink_dims_are_outliers_a"].holds is True and claims["sink_dims_are_outliers_a"].our_value == "2/2"
    assert claims["sink_dims_are_outliers_b"].holds is False and claims["sink_dims_are_outliers_b"].our_value == "1/2"
    assert claims["sink_dims_are_outliers_c"].holds == NOT_COMPARABLE


def _zero_k(before, after):
    return pd.DataFrame({"layer": range(len(before)), "before": before, "after": after})


def test_zero_k_collapse_partial_and_no_sink():
    f = ch.zero_k_finding({"a": _zero_k([0.1, 0.8, 0.8], [0.1, 0.2, 0.3]),
                           "b": _zero_k([0.1, 0.8, 0.8], [0.1, 0.7, 0.8]),
                           "c": _zero_k([0.1, 0.05, 0.2], [0.0, 0.0, 0.0])})
    claims = _by_id(f)
    assert claims["zero_k_a"].holds is True and claims["zero_k_a"].our_value == pytest.approx(0.312, abs=1e-3)
    assert claims["zero_k_b"].holds is False               # a drop in only 1 of 2 sink layers, 94% kept
    assert claims["zero_k_c"].holds == NOT_COMPARABLE and "no sink" in claims["zero_k_c"].why_not_comparable


def _strength(qk_norm, strong, s=1.0, n_gaps=90, expected=90, finite=True, window=3):
    summary = {"S": s, "mean_G": s + 0.2, "strong_fraction": strong, "window": window, "n_gaps": n_gaps,
               "seconds": 0.1, "chat": False, "quantiles": {"q05": -1.0, "q25": 0.0, "q50": s, "q75": 2.0, "q95": 3.0}}
    heads = pd.DataFrame([{"layer": l, "head": h, "median_G": s + l - h} for l in range(window) for h in range(2)])
    boxes = pd.DataFrame([{"layer": l, "q1": 0.0, "median": s, "q3": 2.0, "lowerfence": -1.0, "upperfence": 3.0}
                          for l in range(window)])
    return {"summary": summary, "qk_norm": qk_norm, "heads": heads, "boxes": boxes, "n_gaps": n_gaps,
            "expected_gaps": expected, "g_finite": finite}


def test_strong_sink_share_per_head_against_layerwise_is_the_papers_comparison():
    f = ch.strength_finding({"q": _strength("per-head", 0.5), "o": _strength("layerwise", 0.1),
                             "l": _strength("none", 0.6)})
    claims = _by_id(f)
    paper, ours = claims["strong_sinks_per_head_vs_layerwise"], claims["strong_sinks_per_head_vs_none"]
    assert paper.holds is True and paper.origin == "paper"
    assert paper.our_value == "50.0% (per-head) vs 10.0% (layerwise)"
    assert ours.holds is False and ours.origin == "ours" and ours.kind == "measured"
    assert all(c.holds is True for c in f.claims if c.must_hold)
    assert len(f.figures) == 2 and "S" in f.table.index


def test_strong_sink_comparisons_are_not_comparable_without_the_kinds_they_compare():
    claims = _by_id(ch.strength_finding({"q": _strength("per-head", 0.1), "l": _strength("none", 0.4)}))
    assert claims["strong_sinks_per_head_vs_layerwise"].holds == NOT_COMPARABLE
    assert "no layerwise QK-norm model" in claims["strong_sinks_per_head_vs_layerwise"].why_not_comparable
    assert claims["strong_sinks_per_head_vs_none"].holds is False
    assert claims["strong_sinks_per_head_vs_none"].our_value == "10.0% (per-head) vs 40.0% (none)"
    alone = _by_id(ch.strength_finding({"l": _strength("none", 0.4)}))
    assert alone["strong_sinks_per_head_vs_none"].holds == NOT_COMPARABLE
    assert "no per-head QK-norm model" in alone["strong_sinks_per_head_vs_none"].why_not_comparable


def _with_chat(measured, chat):
    measured["summary"] = dict(measured["summary"], chat=chat)
    return measured


def test_architecture_correlate_needs_the_ordering_with_and_without_the_template():
    gemma, smol = _strength("per-head", 0.1, s=0.3), _with_chat(_strength("none", 0.4, s=1.6), True)
    c = _by_id(ch.architecture_finding({"g": gemma, "s": smol}, {"g": 0.3, "s": 1.5}))["s_architecture_correlate"]
    assert c.holds is False and c.origin == "paper" and "chat template" in c.caveat and "1 per-head" in c.caveat
    c = _by_id(ch.architecture_finding({"g": _strength("per-head", 0.1, s=2.0), "s": smol},
                                       {"g": 2.0, "s": 1.5}))["s_architecture_correlate"]
    assert c.holds is True
    # the template decides the order: not the paper's architectural ordering
    c = _by_id(ch.architecture_finding({"g": _strength("per-head", 0.1, s=2.0), "s": smol},
                                       {"g": 2.0, "s": 2.5}))["s_architecture_correlate"]
    assert c.holds is False
    alone = _by_id(ch.architecture_finding({"s": smol}, {"s": 1.5}))["s_architecture_correlate"]
    assert alone.holds == NOT_COMPARABLE and "per-head" in alone.why_not_comparable


def test_strength_checks_fail_when_queries_are_missed_or_g_is_infinite():
    claims = _by_id(ch.strength_finding({"m": _strength("none", 0.4, n_gaps=80, finite=False)}))
    assert claims["check_every_query_counted_m"].holds is False and claims["check_every_query_counted_m"].must_hold
    assert claims["check_s_finite_m"].holds is False


def test_cost_is_reported_without_a_verdict():
    f = ch.cost_finding({"m": {"forward_s": 2.0, "strength_s": 3.0}})
    assert f.claims == [] and f.table.loc["m", "ratio"] == 1.5 and "1.50x" in f.notes[0]


def _sweep(s_by_n, seeds=3):
    return pd.DataFrame([{"N": n, "seed": k, "S": s + 0.01 * k, "mean_G": s, "strong_fraction": 0.1}
                         for n, s in s_by_n.items() for k in range(seeds)])


def test_sample_size_shift_holds_fails_and_needs_both_sizes():
    f = ch.sample_size_finding({"a": _sweep({5: 1.05, 10: 1.0, 15: 1.0, 25: 1.0}), "b": _sweep({5: 1.5, 15: 1.0}),
                                "c": _sweep({1: 1.0, 2: 1.0}), "d": pd.DataFrame()})
    claims = _by_id(f)
    assert claims["s_sample_size_a"].holds is True and claims["s_sample_size_a"].our_value == 0.05
    assert claims["s_sample_size_b"].holds is False
    assert claims["s_sample_size_c"].holds == NOT_COMPARABLE and claims["s_sample_size_d"].holds == NOT_COMPARABLE
    assert any("N=10 and N=25" in n for n in f.notes)


def _windows(values):
    return pd.DataFrame([{"window": str(k), "layers": "0-1", "S": v, "mean_G": v, "strong_fraction": 0.1}
                         for k, v in zip(ch.WINDOWS_E4, values)])


def test_window_ordering_and_median_against_mean():
    same = ch.window_finding({"a": _windows([2, 2, 2, 2, 2]), "b": _windows([1, 1.5, 1, 0.5, 1])},
                             {"a": (2.0, 2.5, 10), "b": (1.0, 1.2, 10)})
    claims = _by_id(same)
    assert claims["s_window_ordering"].holds is True and claims["s_window_ordering"].our_value == "same"
    assert claims["s_median_vs_mean"].holds is True
    reversed_ = _by_id(ch.window_finding({"a": _windows([2, 2, 2, 2, 2]), "b": _windows([1, 1, 1, 3, 1])},
                                         {"a": (2.0, 2.5, 10), "b": (1.0, 3.0, 10)}))
    assert reversed_["s_window_ordering"].holds is False and reversed_["s_window_ordering"].our_value == "reversed"
    assert reversed_["s_median_vs_mean"].our_value == "ordering changed, sign kept"
    flipped = _by_id(ch.window_finding({"a": _windows([2] * 5), "b": _windows([1] * 5)},
                                       {"a": (2.0, 2.5, 10), "b": (-0.1, 0.3, 10)}))
    assert flipped["s_median_vs_mean"].holds is False and flipped["s_median_vs_mean"].our_value.endswith("sign changed")


def test_window_claims_compare_models_so_one_model_is_not_comparable():
    f = ch.window_finding({"a": _windows([2] * 5)}, {"a": (2.0, 2.5, 3)})
    assert {c.holds for c in f.claims} == {NOT_COMPARABLE}
    assert all("one model" in c.why_not_comparable for c in f.claims)
    assert "last 3 layers" in f.notes[0]


def _thirds(early, middle, late):
    return pd.DataFrame({"window": list(ch.THIRDS), "layers": ["0-0", "1-1", "2-2"], "S": [early, middle, late]})


def test_s_rising_with_depth():
    """Table 13 is a mean over pairs: one claim on the mean over the models that have thirds."""
    f = ch.thirds_finding({"a": _thirds(0.2, 0.9, 1.6), "b": _thirds(0.4, -0.1, 0.5), "c": None})
    claims = _by_id(f)
    assert list(claims) == ["s_rises_with_depth"]
    assert claims["s_rises_with_depth"].holds is True and claims["s_rises_with_depth"].our_value == [0.3, 0.4, 1.05]
    assert _by_id(ch.thirds_finding({"b": _thirds(0.4, -0.1, 0.5)}))["s_rises_with_depth"].holds is False
    assert _by_id(ch.thirds_finding({"c": None}))["s_rises_with_depth"].holds == NOT_COMPARABLE
    assert list(f.table.columns) == ["a", "b", "c"]


def test_head_fraction():
    f = ch.head_fraction_finding({"a": _census(sink_eps=[0.0, 1.0, 1.0, 0.75, 0.5, 1.0]),
                                  "b": _census(sink_eps=[0.0, 0.25, 0.25, 0.0, 0.75, 0.0])})
    claims = _by_id(f)
    assert claims["head_fraction_a"].holds is True and claims["head_fraction_a"].origin == "ours"
    assert claims["head_fraction_a"].our_value == pytest.approx(0.833, abs=1e-3)
    assert claims["head_fraction_b"].holds is False
    constant = ch.head_fraction_finding({"c": _census(sink_eps=[0.0] * 6)})
    assert math.isnan(constant.table.loc["corr(Sink^eps, attention to token 0)", "c"])


def test_explorer_checks():
    def data(layers, heads, prompts, shape=None):
        pattern = np.zeros((*(shape or (layers, heads)), 4, 4), dtype=np.uint8)
        return {"model": "m", "layers": layers, "heads": heads, "prompts": [{"pattern": pattern}] * prompts}
    assert ch.explorer_finding([data(3, 4, 2)], 2).claims[0].holds is True
    assert ch.explorer_finding([data(3, 4, 1)], 2).claims[0].holds is False
    assert ch.explorer_finding([data(3, 4, 2, shape=(2, 4))], 2).claims[0].holds is False


def test_profiles_share_their_keys_and_resolve_overrides():
    quick = ch.PROFILES.resolve("quick", models=["tiny-qwen2"])
    assert quick.models == ["tiny-qwen2"] and quick.window == 10
    assert set(ch.PROFILES.table["quick"]) == set(ch.PROFILES.table["gpu"])


# ---- the chapter on tiny models ------------------------------------------------------------------------------------

TINY = dict(n_prompts=2, census_prompts=1, zero_k_prompts=1, sweep_sizes=[1, 2], sweep_seeds=1, explorer_prompts=1,
            explorer_tokens=8)


def _run(models, tmp_path):
    from sinkbook.book.results import write_results
    chapter = ch.SinkCriteriaChapter(ch.PROFILES.resolve("quick", device="cpu", models=models, **TINY))
    for step in chapter.FINDINGS:
        getattr(chapter, step)()
    chapter.criteria()                                        # a second call claims nothing twice
    path = write_results(**chapter.results(), directory=tmp_path)
    return chapter, json.loads(path.read_text())


@pytest.mark.parametrize("family", TINY_FAMILIES)
def test_quick_profile_runs_on_a_tiny_model_of_every_family(family, tmp_path):
    spec = f"tiny-{family}"
    chapter, doc = _run([spec], tmp_path)
    claims = {c["id"]: c for c in doc["claims"]}
    assert len(claims) == len(doc["claims"])
    assert all(c["holds"] is True for c in doc["claims"] if c["must_hold"])
    # one model: the comparisons across models are not comparable, and random weights have no massive activation
    for cid in ("s_window_ordering", "s_median_vs_mean", "strong_sinks_per_head_vs_layerwise",
                f"phi_llm_sparse_tiny_{family}", f"sink_dims_are_outliers_tiny_{family}"):
        assert claims[cid]["holds"] == NOT_COMPARABLE, cid
    assert f"check_explorer_covers_tiny_{family}" in claims
    entry = doc["extra"]["sink_strength"][spec]
    assert set(entry) == {"S", "strong_fraction", "mean_G", "window", "n_prompts", "chat"}
    assert entry["window"] == 3 and entry["n_prompts"] == 2 and math.isfinite(entry["S"])   # K = 10 clipped to 3


def test_the_papers_qk_norm_comparison_is_made_when_the_run_has_a_layerwise_model(tmp_path):
    _, doc = _run(["tiny-llama", "tiny-qwen3", "tiny-olmo2"], tmp_path)
    claims = {c["id"]: c for c in doc["claims"]}
    for cid in ("strong_sinks_per_head_vs_layerwise", "strong_sinks_per_head_vs_none", "s_window_ordering",
                "s_median_vs_mean"):
        assert claims[cid]["holds"] in (True, False), cid
    assert claims["strong_sinks_per_head_vs_none"]["origin"] == "ours"
    assert [m["spec"] for m in doc["models"]] == ["tiny-llama", "tiny-qwen3", "tiny-olmo2"]

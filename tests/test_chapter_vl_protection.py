"""The protection chapter: its finding functions on synthetic evaluations (each verdict both ways, and the gating
when a precondition is missing), its job list, and its argument checks."""
from __future__ import annotations

import numpy as np
import pytest

from sinkbook.chapters import vl_protection as vp
from sinkbook.core.claims import INCONCLUSIVE, NOT_COMPARABLE

M = "model-a"
TASK = vp.FORMAT_TASK


def _task(name, items, chance=0.0):
    items = [float(x) for x in items]
    return {"task": name, "kind": "format", "metric": "acc", "score": float(np.mean(items)), "per_item": items,
            "chance": chance, "n": len(items), "seconds": 0.0, "details": {}}


def _doc(correct, image_correct=50, s_path=(1.5, 1.4, 1.3, 1.2), margin=1.0, n=60, intervention=None):
    probes = [{"step": 20 * i, "S": s, "arithmetic_flexible": correct / n + 0.01 * (3 - i),
               "arithmetic_strict": 0.0} for i, s in enumerate(s_path)]
    doc = {"tasks": {TASK: _task(TASK, [1] * correct + [0] * (n - correct)),
                     "knowledge_mc": _task("knowledge_mc", [1] * 40 + [0] * 20, 0.25)},
           "vision": {"per_item": [1] * image_correct + [0] * (60 - image_correct),
                      "accuracy": image_correct / 60, "chance": 0.3, "by_task": {}},
           "sink": {"S": s_path[-1], "margin_G_minus_B": margin, "pos0_mass": 0.5}, "probes": probes,
           "intervention": intervention or {}}
    return doc


def _base(correct=45, qk_norm="none", s=1.0):
    return {M: {"tasks": {TASK: _task(TASK, [1] * correct + [0] * (60 - correct)),
                          "arithmetic_strict": _task("arithmetic_strict", [0] * 60),
                          "knowledge_mc": _task("knowledge_mc", [1] * 40 + [0] * 20, 0.25)},
                "sink": {"S": s}, "model": {"qk_norm": qk_norm, "record": {"spec": M}}}}


PROTECTED = {"protection": "layers below 2 frozen; 3 sink heads projected", "first_sink_layer": 2,
             "sink_heads": {"2": [0, 1]}}


def _by_id(finding):
    return {c.id.removesuffix("_model_a"): c for c in finding.claims}


def _world(arm, arm_correct, plain_correct=20, **arm_doc):
    runs = {}
    for seed in (0, 1):
        runs[(M, vp.PLAIN, seed)] = _doc(plain_correct, margin=0.5)
        runs[(M, arm, seed)] = _doc(arm_correct, **arm_doc)
    return runs


def test_protection_that_keeps_text_at_equal_image_accuracy_holds():
    runs = _world("protection", 40, margin=1.5, intervention=PROTECTED)
    claims = _by_id(vp.protection_finding(_base(), runs, [M]))
    assert claims["protection_keeps_text"].holds is True and claims["protection_keeps_text"].origin == "ours"
    assert claims["protection_keeps_images"].holds is True
    assert claims["protection_keeps_margin"].holds is True


def test_protection_that_keeps_text_by_not_learning_images_does_not_hold():
    runs = _world("protection", 40, image_correct=35, margin=0.2, intervention=PROTECTED)
    claims = _by_id(vp.protection_finding(_base(), runs, [M]))
    assert claims["protection_keeps_text"].holds is True
    assert claims["protection_keeps_images"].holds is False        # 25 pt fewer images: not at equal accuracy
    assert claims["protection_keeps_margin"].holds is False


def test_protection_keeps_margin_waits_for_both_arms_to_learn_the_images():
    runs = _world("protection", 40, image_correct=5, margin=1.5, intervention=PROTECTED)
    margin = _by_id(vp.protection_finding(_base(), runs, [M]))["protection_keeps_margin"]
    assert margin.holds == NOT_COMPARABLE and "did not learn" in margin.why_not_comparable


def test_protection_is_not_comparable_without_a_loss_or_without_a_sink():
    runs = _world("protection", 40, intervention=PROTECTED)
    no_loss = _by_id(vp.protection_finding(_base(correct=20), runs, [M]))["protection_keeps_text"]
    assert no_loss.holds == NOT_COMPARABLE and "no loss" in no_loss.why_not_comparable
    floor = _base()
    floor[M]["tasks"][TASK] = _task(TASK, [0] * 60)
    assert _by_id(vp.protection_finding(floor, runs, [M]))["protection_keeps_text"].holds == NOT_COMPARABLE
    inactive = _world("protection", 40, intervention={"protection": "no sink layer", "first_sink_layer": None,
                                                       "sink_heads": {}})
    claims = _by_id(vp.protection_finding(_base(), inactive, [M]))
    assert all(c.holds == NOT_COMPARABLE for c in claims.values())


def test_fixed_norm_counts_its_loss_from_its_own_start():
    runs = _world("fix_qk_norm", 10, s_path=(1.5, 1.2, 0.9, 0.6))
    base = _base(qk_norm="per-head")
    # native: 45 -> 20 (-25 items); fixed: 44 -> 10 (-34 items) from its own start, one item below the native start
    start = {"tasks": {TASK: _task(TASK, [1] * 44 + [0] * 16)}}
    claims = _by_id(vp.fixed_norm_finding(base, runs, {(M, "fix_qk_norm", None): start}, [M]))
    assert claims["fixed_norm_loses_more"].holds is True and claims["fixed_norm_erodes_more"].holds is True
    # the same end from a start one item above the native one: still measured from that start
    high = {"tasks": {TASK: _task(TASK, [1] * 46 + [0] * 14)}}
    effect = _by_id(vp.fixed_norm_finding(base, runs, {(M, "fix_qk_norm", None): high}, [M]))["fixed_norm_loses_more"]
    assert effect.effect["estimate"] == pytest.approx(100 * (36 - 25) / 60)
    floor_start = {"tasks": {TASK: _task(TASK, [0] * 60)}}
    claims = _by_id(vp.fixed_norm_finding(base, runs, {(M, "fix_qk_norm", None): floor_start}, [M]))
    assert claims["fixed_norm_loses_more"].holds == NOT_COMPARABLE


def test_fixed_norm_needs_level_starts():
    """A start further than LEVEL_START_PT from the native model leaves both claims not comparable, saying by how
    much; recovered starts are read per seed, their mean against the native model."""
    runs = _world("fix_qk_norm", 2, s_path=(1.5, 1.2, 0.9, 0.6))
    base = _base(qk_norm="per-head")
    low = {"tasks": {TASK: _task(TASK, [1] * 12 + [0] * 48)}}
    claims = _by_id(vp.fixed_norm_finding(base, runs, {(M, "fix_qk_norm", None): low}, [M]))
    for c in claims.values():
        assert c.holds == NOT_COMPARABLE and "starts -55.0 pt from the native model" in c.why_not_comparable
    # seed 0 recovered to 43 of 60, seed 1 to 46: mean 44.5, within 2.5 pt of 45
    recovered = {(M, "fix_qk_norm", s): {"tasks": {TASK: _task(TASK, [1] * k + [0] * (60 - k))},
                                         "recovery": {"curve": [], "history": []}} for s, k in ((0, 43), (1, 46))}
    f = vp.fixed_norm_finding(base, runs, recovered, [M])
    assert _by_id(f)["fixed_norm_loses_more"].holds is True and "after the recovery phase" in f.notes[0]
    assert _by_id(f)["fixed_norm_loses_more"].effect["estimate"] == pytest.approx(100 * (42.5 - 25) / 60)   # fixed: 2 - 44.5
    recovered[(M, "fix_qk_norm", 1)]["tasks"][TASK] = _task(TASK, [1] * 40 + [0] * 20)     # mean 41.5: 5.8 pt
    claims = _by_id(vp.fixed_norm_finding(base, runs, recovered, [M]))
    assert claims["fixed_norm_loses_more"].holds == NOT_COMPARABLE
    assert "the recovered fixed-scale model starts -5.8 pt" in claims["fixed_norm_loses_more"].why_not_comparable


def test_recovery_finding_reports_the_curves_and_whether_the_starts_are_level():
    base = _base(qk_norm="per-head")
    curve = [{"step": 0, "relative_logit_error": 0.9, "top1_agreement": 0.2},
             {"step": 50, "loss": 0.01, "relative_logit_error": 0.1, "top1_agreement": 0.9}]
    starts = {(M, "fix_qk_norm", s): {"tasks": {t: _task(t, [1] * 44 + [0] * 16) for t in vp.TEXT_TASKS},
                                      "recovery": {"curve": curve, "history": [{}] * 50}} for s in (0, 1)}
    f = vp.recovery_finding(base, starts, [M])
    assert len(f.table) == 2 and f.table["recovery steps"].tolist() == [50, 50]
    assert f.figures and "level: the causal test is comparable" in f.notes[-1]
    assert "No fixed-scale arm" in vp.recovery_finding(base, {}, [M]).notes[0]


def test_fixed_norm_needs_a_per_head_norm_to_fix():
    runs = _world("fix_qk_norm", 2)
    start = {"tasks": {TASK: _task(TASK, [1] * 44 + [0] * 16)}}
    for qk in ("none", "layerwise"):
        claims = _by_id(vp.fixed_norm_finding(_base(qk_norm=qk), runs, {(M, "fix_qk_norm", None): start}, [M]))
        assert all(c.holds == NOT_COMPARABLE and "per-head" in c.why_not_comparable for c in claims.values())


def test_fixed_norm_that_collapses_holds():
    runs = _world("fix_qk_norm", 2)
    start = {"tasks": {TASK: _task(TASK, [1] * 44 + [0] * 16)}}
    claims = _by_id(vp.fixed_norm_finding(_base(qk_norm="per-head"), runs, {(M, "fix_qk_norm", None): start}, [M]))
    assert claims["fixed_norm_loses_more"].holds is True


def test_injection_lags_only_when_below_at_every_probe_and_at_the_end():
    base = _base()
    lagging = _world("inject_qk_norm", 5)
    claims = _by_id(vp.injection_finding(base, lagging, [M]))
    assert claims["injection_lags_vanilla"].holds is True and claims["injection_below_throughout"].holds is True
    ahead = _world("inject_qk_norm", 35)
    claims = _by_id(vp.injection_finding(base, ahead, [M]))
    assert claims["injection_lags_vanilla"].holds is False and claims["injection_below_throughout"].holds is False
    with_norm = _base(qk_norm="per-head")
    assert _by_id(vp.injection_finding(with_norm, lagging, [M]))["injection_lags_vanilla"].holds == NOT_COMPARABLE
    blind = {k: {**v, "vision": {**v["vision"], "per_item": [0] * 60, "accuracy": 0.0}} for k, v in lagging.items()}
    claim = _by_id(vp.injection_finding(base, blind, [M]))["injection_lags_vanilla"]
    assert claim.holds == NOT_COMPARABLE and "did not learn" in claim.why_not_comparable


def test_injection_claims_need_room_below_vanilla():
    floored = _world("inject_qk_norm", 0, plain_correct=0)          # plain VL ends at 0: nothing can lag it
    for runs in (floored, {k: {**v, "probes": [{**p, "arithmetic_flexible": 0.0} for p in v["probes"]]}
                           for k, v in floored.items()}):
        claims = _by_id(vp.injection_finding(_base(), runs, [M]))
        assert claims["injection_lags_vanilla"].holds == NOT_COMPARABLE
        assert "floor" in claims["injection_lags_vanilla"].why_not_comparable
        assert claims["injection_below_throughout"].holds == NOT_COMPARABLE
        assert "floor" in claims["injection_below_throughout"].why_not_comparable
    just_above = _world("inject_qk_norm", 0, plain_correct=4)       # 0.067 > 0.05: room, and the injected is lower
    assert _by_id(vp.injection_finding(_base(), just_above, [M]))["injection_below_throughout"].holds is True


def _merges(scores: dict, seeds=(0,)):
    runs = {(M, vp.PLAIN, seed): _doc(20) for seed in seeds}
    for name, correct in scores.items():
        runs.update({(M, f"merge:{name}", seed): _doc(correct) for seed in seeds})
    return runs


def test_the_papers_merge_pattern_holds_where_it_is_reproduced():
    scores = {"mix_95_5": 20, "uniform": 24, "task_arithmetic": 20, "ties": 8, "dare": 5}
    # one seed of 60 items: a merge that changes no answer cannot exclude the 2.3 pt margin (the exact interval of
    # 60 pairs is about +-3 pt), so "no extra damage" is inconclusive, and says what the sample could detect
    claim = _by_id(vp.merging_finding(_base(), _merges(scores), [M]))["mild_merge_no_extra_damage_mix_95_5"]
    assert claim.holds == INCONCLUSIVE and "could detect" in claim.caveat
    runs = _merges(scores, seeds=range(8))
    claims = _by_id(vp.merging_finding(_base(), runs, [M]))
    assert claims["mild_merge_no_extra_damage_mix_95_5"].holds is True
    assert claims["mild_merge_no_extra_damage_uniform"].holds is True
    assert claims["sparsified_merges_worst"].holds is True
    assert all(claims[f"merge_does_not_recover_{m}"].holds is True for m in ("mix_95_5", "uniform", "ties", "dare"))
    assert claims["full_strength_drops"].holds == NOT_COMPARABLE          # task arithmetic returns the adapted model
    without = _by_id(vp.merging_finding(_base(), _merges({"uniform": 24, "ties": 8}), [M]))["full_strength_drops"]
    assert without.holds == NOT_COMPARABLE and "not run" in without.our_value


def test_a_merge_that_recovers_breaks_the_papers_pattern():
    runs = _merges({"mix_95_5": 8, "uniform": 45, "ties": 30, "dare": 30}, seeds=range(8))
    claims = _by_id(vp.merging_finding(_base(), runs, [M]))
    assert claims["merge_does_not_recover_uniform"].holds is False        # back at the unadapted score
    assert claims["merge_does_not_recover_ties"].holds is True
    assert claims["mild_merge_no_extra_damage_mix_95_5"].holds is False   # 20 pt below the adapted model
    assert claims["sparsified_merges_worst"].holds is False


def test_merge_claims_are_about_the_low_s_side():
    runs = _merges({"mix_95_5": 20, "uniform": 24, "ties": 8, "dare": 5})
    claims = _by_id(vp.merging_finding(_base(s=2.0), runs, [M]))
    gated = [c for i, c in claims.items() if i.startswith(("mild_merge", "merge_does_not"))]
    assert gated and all(c.holds == NOT_COMPARABLE and "low-S" in c.why_not_comparable for c in gated)
    assert claims["sparsified_merges_worst"].holds is True      # "across both pairs": no S gate


def test_every_statistical_claim_carries_its_effect_and_interest():
    runs = {**_world("protection", 40, margin=1.5, intervention=PROTECTED), **_world("inject_qk_norm", 5),
            **_world("fix_qk_norm", 2)}
    for key, doc in _merges({"mix_95_5": 20, "uniform": 24, "ties": 8, "dare": 5}).items():
        if key[1].startswith("merge:"):
            runs[key] = doc
            runs[(M, key[1], 1)] = doc
    starts = {(M, "fix_qk_norm", None): {"tasks": {TASK: _task(TASK, [1] * 44 + [0] * 16)}}}
    claims = [*vp.protection_finding(_base(), runs, [M]).claims, *vp.injection_finding(_base(), runs, [M]).claims,
              *vp.fixed_norm_finding(_base(qk_norm="per-head"), runs, starts, [M]).claims,
              *vp.merging_finding(_base(), runs, [M]).claims]
    stat = [c for c in claims if c.id.startswith(("protection_keeps_text", "protection_keeps_images",
                                                  "fixed_norm_loses_more", "injection_lags", "mild_merge_",
                                                  "merge_does_not_recover"))]
    assert len(stat) == 10
    for c in stat:
        assert c.effect and c.interest and c.effect["seeds"] == 2, c.id
        assert c.interest["source"].startswith(("paper:", "ours:")), c.id
        assert c.holds in (True, False, INCONCLUSIVE), c.id


def test_task_choice_reports_each_verdict_on_every_scored_task():
    runs = _world("protection", 40, margin=1.5, intervention=PROTECTED)
    base = _base()
    # strict: the protection keeps nothing more than plain VL, on items enough to exclude the effect of interest
    base[M]["tasks"]["arithmetic_strict"] = _task("arithmetic_strict", [1] * 150 + [0] * 150)
    for key, doc in runs.items():
        doc["tasks"]["arithmetic_strict"] = _task("arithmetic_strict", [1] * 50 + [0] * 250)
    f = vp.task_choice_finding(base, runs, {}, [M])
    assert list(f.table.columns) == [TASK, "arithmetic_strict"]
    row = f.table.loc["protection_keeps_text_model_a"]
    assert row[TASK].startswith("holds") and row["arithmetic_strict"].startswith("does not hold")
    assert "protection_keeps_text_model_a" in f.notes[-1]


def test_capability_and_tradeoff_tables_cover_every_arm():
    runs = {**_world("protection", 40, intervention=PROTECTED), **_merges({"uniform": 30})}
    cap = vp.capability_finding(_base(), runs, [M])
    arms = set(cap.table.index.get_level_values("arm"))
    assert arms == {"plain VL", "head-selective protection", "merge uniform"}
    assert cap.figures and "arithmetic_flexible vs plain (pt)" in cap.table
    trade = vp.tradeoff_finding(_base(), runs, [M])
    assert len(trade.table) == 5 and trade.table["text kept"].max() == pytest.approx(40 / 45)
    assert vp.sink_finding(_base(), runs, [M]).table is not None


def test_a_frozen_language_model_must_score_every_text_item_as_the_unadapted_one():
    base = _base()
    same = {(M, vp.PLAIN, 0): _doc(20), (M, "frozen_llm", 0): _doc(45)}
    same[(M, "frozen_llm", 0)]["tasks"]["knowledge_mc"] = base[M]["tasks"]["knowledge_mc"]
    check = _by_id(vp.capability_finding(base, same, [M]))["frozen_llm_text_unchanged"]
    assert check.holds is True and check.must_hold
    moved = {**same, (M, "frozen_llm", 0): _doc(44)}
    assert _by_id(vp.capability_finding(base, moved, [M]))["frozen_llm_text_unchanged"].holds is False


def test_jobs_share_the_adaptation_chapters_plain_runs():
    from sinkbook.chapters import vl_adaptation as vl
    from sinkbook.runs.adaptation import adaptation_jobs, protection_jobs
    s = vp.PROFILES.resolve("default")
    chapter = vp.VLProtectionChapter(s)
    jobs = protection_jobs(chapter.recipe, s.interventions, s.seeds, s.merges, s.merge_models, s.merge_seeds)
    adaptation = adaptation_jobs(vl.PROFILES.resolve("default"))
    plain = [j for j in jobs if j.get("arm") == vp.PLAIN]
    assert plain and all(any(j["config"] == a.get("config") and j["eval"] == a["eval"] and j["probe"] == a["probe"]
                             for a in adaptation) for j in plain)
    assert all(j["eval"]["ifeval"] == 0 for j in jobs if j["kind"] in ("merge", "start") or j.get("arm") not in
               (None, vp.PLAIN))
    arms = {(j["config"]["model"], j["arm"]) for j in jobs if j["kind"] == "run"}
    assert ("gemma3-270m", "fix_qk_norm") in arms and ("gemma3-270m", "protection") in arms
    assert ("smollm2-135m-instruct", "inject_qk_norm") in arms
    for model in ("gemma3-270m", "smollm2-135m-instruct"):      # the known remedies on the plain runs' seeds
        plain_seeds = {j["config"]["seed"] for j in plain if j["config"]["model"] == model}
        for remedy in vp.REMEDIES:
            assert plain_seeds == {0, 1, 2} == {j["config"]["seed"] for j in jobs if j["kind"] == "run" and
                                                j["arm"] == remedy and j["config"]["model"] == model}, remedy


@pytest.mark.parametrize("override, why", [(dict(interventions={"x": ["dropout"]}), "unknown interventions"),
                                           (dict(merges=["average"]), "'merges' must be a list drawn from"),
                                           (dict(seeds=[]), "'seeds' must be a non-empty list")])
def test_bad_arguments_are_refused_in_one_line(override, why):
    from sinkbook.core.profiles import SettingsError
    with pytest.raises(SettingsError, match=why):
        vp.VLProtectionChapter.from_parameters("quick", **override)

"""The predictor chapter: finding functions on synthetic tables (including the not-comparable gating) and the
quick profile run in-process on a tiny model and on a model that cannot be loaded."""
import json

import numpy as np
import pandas as pd
import pytest

from sinkbook.chapters import predictor as C
from sinkbook.core.claims import NOT_COMPARABLE, MustHoldFailed
from sinkbook.core.published import (SIX_TASK_COLUMNS, TABLE4_COLUMNS, load_published_statistics, load_table,
                                     six_pairs)
from sinkbook.measures import regression as R
from sinkbook.runs.strength import sink_strengths_from_results


def _by_id(finding):
    return {c.id: c for c in finding.claims}


# ------------------------------------------------------------------------------------------ synthetic data
def synthetic_six(seed: int = 0) -> pd.DataFrame:
    """Six pairs with distinct S, no printed ties, and IFEval changes that follow S up to noise."""
    rng = np.random.default_rng(seed)
    s = np.array([2.31, 1.92, 1.40, 1.05, 0.62, 0.18])
    frame = pd.DataFrame({"pair": [f"P{i}" for i in range(6)], "s": s,
                          "reference_llm": [f"L{i}" for i in range(6)],
                          "qk": ["per-head", "per-head", "none", "none", "none", "layerwise"],
                          "headline": [True] * 5 + [False]})
    counts = np.round((6 * s - 18 + rng.normal(0, 1.5, 6)) * 541 / 100)          # gained - lost
    frame["lost"], frame["gained"] = 60 - np.minimum(counts, 0), 60 + np.maximum(counts, 0)
    frame["delta_ifeval_counts"] = 100.0 * (frame.gained - frame.lost) / 541
    frame["ifeval"] = frame.delta_ifeval_counts.round(1)
    for col in ("eq_bench", "gsm8k", "gpqa"):
        frame[col] = (3 * s - 10 + rng.normal(0, 0.7, 6)).round(1)
    frame["heldout_pred_delta"] = R.leave_one_group_out(frame.s, frame.delta_ifeval_counts)[0].round(2)
    return frame


def synthetic_table4(six: pd.DataFrame, shift: float = 0.0) -> pd.DataFrame:
    rows = {"Spearman rho n=6": {TABLE4_COLUMNS[t]: round(float(R.spearman_rho(six.s, six[c])), 3) + shift
                                 for t, c in SIX_TASK_COLUMNS.items()}}
    return pd.DataFrame.from_dict(rows, orient="index")


# ----------------------------------------------------------------------------------- six-pair statistics
def test_published_data_checks_catch_a_broken_table2_row():
    six = synthetic_six()
    t2 = six[["pair", "lost", "gained"]].assign(both_pass=300, both_fail=lambda d: 541 - 300 - d.lost - d.gained,
                                                net_pct=lambda d: (100 * (d.lost - d.gained) / 541).round(1))
    assert all(c.holds is True and c.must_hold for c in C.published_data_finding(six, t2).claims)
    broken = t2.assign(both_fail=t2.both_fail + np.r_[1, 0, 0, 0, 0, 0])
    claims = _by_id(C.published_data_finding(six, broken))
    assert claims["table2_rows_sum_to_541"].holds is False and claims["table2_rows_sum_to_541"].our_value == 1


def test_rank_correlation_holds_on_matching_values_and_fails_on_others():
    six = synthetic_six()
    good = C.rank_correlation_finding(six, synthetic_table4(six))
    assert all(c.holds is True and c.kind == "recomputed" for c in good.claims)
    assert [c.id for c in good.claims] == ["rho_six_ifeval", "rho_six_eq_bench", "rho_six_gsm8k", "rho_six_gpqa"]
    bad = C.rank_correlation_finding(six, synthetic_table4(six, shift=-0.05))
    assert not any(c.holds is True for c in bad.claims)


def test_lopo_error_is_reproduced_only_within_the_rounding_range():
    six = synthetic_six()
    linear = float(R.heldout_errors(six.s, six.delta_ifeval_counts)["linear"])
    constant = float(R.heldout_errors(six.s, six.delta_ifeval_counts)["constant"])
    published = {"lopo_error_six_ifeval_text": round(linear, 2), "constant_mean_error_six_ifeval_text": round(constant, 2)}
    assert all(c.holds for c in C.lopo_error_finding(six, published).claims)
    published["lopo_error_six_ifeval_text"] += 0.5
    assert _by_id(C.lopo_error_finding(six, published))["lopo_error_six_ifeval"].holds is False


def test_table10_finding_on_synthetic_predictions():
    six = synthetic_six()
    published = {"qwen3_vl_heldout_residual_text": round(abs(six.delta_ifeval_counts[0] - six.heldout_pred_delta[0]), 1)}
    claims = _by_id(C.table10_finding(six, published, levels=5))
    assert claims["table10_jointly_consistent"].holds is True
    assert all(claims[f"table10_pred_p{i}"].holds is True for i in range(6))


def test_s_rule_finds_a_false_safe_pair():
    t11 = pd.DataFrame({"pair": list("abcdef"), "s": [2.4, 2.1, 1.5, 1.18, 1.18, 0.3],
                        "delta_ifeval": [-2.0, -7.0, -4.0, -8.9, -17.9, -20.0]})
    six = synthetic_six()
    published = {"rule_s_threshold_text": 2.0, "rule_within_pt_text": 5.4, "rule_near_s_text": 1.2,
                 "rule_near_s_span_low_text": -8.9, "rule_near_s_span_high_text": -17.9}
    claims = _by_id(C.s_rule_finding(t11, six, published))
    assert claims["rule_s_ge_2_within_5_4"].holds is False
    assert claims["rule_near_1_2_span"].holds is True


def test_uncertainty_checks_pass_on_small_series():
    x = np.array([0.1, 0.5, 0.9, 1.3, 1.7, 2.0])
    series = {("a", "IFEval"): (x, x ** 2), ("b", "IFEval"): (x, -x)}
    finding = C.uncertainty_finding(series, n_bootstrap=200, seed=0, level=0.9)
    assert all(c.must_hold and c.holds is True for c in finding.claims)
    assert finding.table.loc[("a", "IFEval"), "rho"] == pytest.approx(1.0)


# ----------------------------------------------------------------------------------------- our models
def test_placement_without_s_is_not_comparable_with_the_reason():
    six, t11 = six_pairs(), load_table(11)
    strengths = pd.DataFrame({"model": ["tiny-llama", "no-such-model"], "S": [0.4, np.nan],
                              "source": ["measured here", ""], "note": ["", "the model could not be loaded"]})
    finding = C.placement_finding(strengths, six, t11, 0.95)
    claims = _by_id(finding)
    gone = claims["placement_no_such_model"]
    assert gone.holds == NOT_COMPARABLE and "could not be loaded" in gone.why_not_comparable
    placed = claims["placement_tiny_llama"]
    assert placed.holds == NOT_COMPARABLE and "no VLM is built" in placed.why_not_comparable
    assert (placed.kind, placed.origin) == ("measured", "ours") and "extrapolation" in placed.statement
    assert placed.our_value.startswith("S = 0.40")
    assert list(finding.table.index.get_level_values("model").unique()) == ["tiny-llama"]


def test_placement_with_no_s_at_all_still_gives_a_finding():
    strengths = pd.DataFrame({"model": ["x"], "S": [np.nan], "source": [""], "note": ["no file"]})
    finding = C.placement_finding(strengths, six_pairs(), load_table(11), 0.95)
    assert finding.table is None and not finding.figures and "none is placed" in finding.notes[0]
    empty = C.placement_finding(strengths.iloc[:0], six_pairs(), load_table(11), 0.95)
    assert empty.claims == [] and empty.notes == ["No models were given to place on the fit."]


def test_sink_strengths_are_read_from_the_sink_criteria_results(tmp_path):
    path = tmp_path / "sink_criteria.json"
    path.write_text(json.dumps({"extra": {"sink_strength": {"smollm2-135m-instruct": {"S": 1.5}}}}))
    out = sink_strengths_from_results(["smollm2-135m-instruct", "gemma3-270m"], path).set_index("model")
    assert out.S["smollm2-135m-instruct"] == 1.5
    assert np.isnan(out.S["gemma3-270m"]) and "no Sink Strength" in out.note["gemma3-270m"]
    assert "does not exist" in sink_strengths_from_results(["x"], tmp_path / "absent.json").note[0]
    path.write_text("{not json")
    assert "could not be read" in sink_strengths_from_results(["x"], path).note[0]


# ---------------------------------------------------------------------------------------- the chapter
def test_quick_profile_in_process_on_a_tiny_and_a_missing_model(tmp_path, monkeypatch):
    from sinkbook.book.results import write_results
    monkeypatch.setenv("SINKBOOK_RESULTS_DIR", str(tmp_path))
    settings = C.PROFILES.resolve("quick", device="cpu", models=["tiny-qwen2", "no-such-model"],
                                  extra_s_values={"reader-model": 1.0})
    chapter = C.PredictorChapter(settings)
    for name in chapter.FINDINGS:
        getattr(chapter, name)()
    chapter.lopo_error()                            # asking twice claims nothing twice
    ids = [c.id for c in chapter.claims]
    assert len(ids) == len(set(ids))
    by_id = {c.id: c for c in chapter.claims}
    for c in chapter.claims:
        if c.id.startswith("placement_"):
            assert (c.kind, c.origin, c.holds) == ("measured", "ours", NOT_COMPARABLE)
        else:
            # whether a printed number reproduces is the chapter's result: here, that each is decided by its rule
            # (a must-hold check of the transcription must hold, or write_results below raises)
            assert c.holds in (True, False), c.verdict()
            assert c.kind in ("recomputed", "math")
    assert "ModelNotAvailable" in by_id["placement_no_such_model"].why_not_comparable
    assert by_id["placement_tiny_qwen2"].our_value.startswith("S = ")
    assert by_id["placement_reader_model"].our_value.startswith("S = 1.00")
    path = write_results(**chapter.results())
    doc = json.loads(path.read_text())
    assert doc["chapter"] == "predictor" and doc["parameters"]["profile"] == "quick"
    assert [m["spec"] for m in doc["models"]] == ["tiny-qwen2"]
    assert {r["model"] for r in doc["extra"]["sink_strength_used"]} == {"tiny-qwen2", "no-such-model", "reader-model"}


def test_a_failing_check_stops_the_results_file_after_writing_it(tmp_path):
    from sinkbook.book.results import write_results
    six = synthetic_six()
    t2 = six[["pair", "lost", "gained"]].assign(both_pass=0, both_fail=0, net_pct=0.0)
    finding = C.published_data_finding(six, t2)
    with pytest.raises(MustHoldFailed):
        write_results("predictor", {}, finding.claims, directory=tmp_path)
    assert (tmp_path / "predictor.json").exists()


def test_profiles_share_their_keys_and_resolve_overrides():
    settings = C.PROFILES.resolve("default", models=["tiny-llama"], n_bootstrap=100)
    assert settings.models == ["tiny-llama"] and settings.n_bootstrap == 100
    assert C.PROFILES.resolve("quick").n_bootstrap < C.PROFILES.resolve("default").n_bootstrap
    assert load_published_statistics()["rule_within_pt_text"] == 5.4

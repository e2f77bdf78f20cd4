"""The OutRo chapter: finding functions on synthetic measurements (verdicts and precondition gating), the
measurements it moved out of the intervention, and its quick profile on a tiny model of every family."""
import numpy as np
import pandas as pd
import pytest
import torch

from sinkbook.chapters import outro as C
from sinkbook.interventions.outro import persistent_sinks
from sinkbook.measures.regression import pearson
from sinkbook.measures.stats import min_pairs_to_decide
from sinkbook.runs import outro_text as R
from sinkbook.core.claims import INCONCLUSIVE, NOT_COMPARABLE, missing_effects
from sinkbook.core.hooks import hook_count
from sinkbook.core.models import TINY_FAMILIES, load_model


def _by_id(finding):
    return {c.id: c for c in finding.claims}


# ---- constants and small helpers -----------------------------------------------------------------------------

def test_the_fewest_prompts_mcnemar_can_decide_on():
    assert min_pairs_to_decide(0.05) == 6          # 2 / 2^6 = 0.031 < 0.05 <= 2 / 2^5
    assert min_pairs_to_decide(0.01) == 8


def test_ifeval_setting_names():
    assert R.ifeval_options("baseline", 1.0) is None
    assert R.ifeval_options("outro", 2.0) == {"gamma": 2.0}
    assert R.ifeval_options("rotate", 1.0) == {"gamma": 1.0, "relax": False}
    assert R.ifeval_options("rotate_head_mean", 1.0)["direction"] == "head_mean"
    assert R.ifeval_options("outro_gamma_3.0", 1.0) == {"gamma": 3.0}
    with pytest.raises(ValueError, match="unknown IFEval setting"):
        R.ifeval_options("sideways", 1.0)


def test_persistent_sinks_and_pearson():
    found = {l: torch.tensor([[l < 2, True, l == 1, False]]) for l in range(6)}
    assert persistent_sinks(found).tolist() == [[False, True, False, False]]
    assert pearson([1.0, 2, 3], [2.0, 4, 6.5]) > 0.99
    assert pearson([1.0, 2, 3], [3.0, 2, 1]) == pytest.approx(-1.0)
    assert np.isnan(pearson([1.0, 1, 1], [1.0, 2, 3]))


def test_select_gamma_takes_the_lowest_mean_loss_and_the_smaller_on_ties():
    assert C.select_gamma({0.5: [4.0, 4.2], 1.0: [3.9, 4.0], 4.0: [4.5, 4.5]}) == 1.0
    assert C.select_gamma({2.0: [1.0], 0.5: [1.0]}) == 0.5


# ---- finding functions on synthetic measurements ----------------------------------------------------------------

def _sink_facts(first_sink, worst=0.02, identical=True):
    flagged = [0.0] * 5 if first_sink is None else [0.0] * first_sink + [worst] * (5 - first_sink)
    return {"layers": 5, "heads": 4, "kv_heads": 2, "share_flagged": flagged, "share_cumulative": flagged,
            "first_sink": first_sink, "persistent_is_first_real": True, "relax_layers": [0, 1, 2, 3, 4],
            "identical": identical, "rotation_ran": True,
            "check_sinks": "Phi_LLM" if first_sink is not None else "fixed position"}


def test_sinks_finding_gates_on_a_sink_and_keeps_the_checks():
    f = C.sinks_finding({"m-sparse": _sink_facts(1), "m-dense": _sink_facts(0, worst=0.8), "m-none": _sink_facts(None)})
    claims = _by_id(f)
    # Phi_LLM's sparsity is claimed once, in the sink-criteria chapter; this finding shows the set and refers to it
    assert not any(k.startswith("phi_llm_sparse") for k in claims)
    assert any("phi_llm_sparse_*" in n for n in f.notes) and f.table.loc["max share flagged at one layer", "m-dense"] == 0.8
    assert all(claims[f"gamma_zero_identical_{m}"].must_hold for m in ("m_sparse", "m_dense", "m_none"))
    assert "fixed at the last position" in claims["gamma_zero_identical_m_none"].statement
    assert any("no token at any layer" in n for n in f.notes)
    broken = C.sinks_finding({"m": _sink_facts(1, identical=False)})
    assert _by_id(broken)["gamma_zero_identical_m"].holds is False


def _redistribution(sink_change, less="delimiter"):
    L, B = 6, 2
    base = np.zeros((L, B, 3))
    base[..., R.SINK], base[..., R.DELIMITER], base[..., R.CONTENT] = 0.5, 0.2, 0.3
    rotated = base.copy()
    rotated[2:, :, R.SINK] += sink_change
    rotated[2:, :, R.DELIMITER if less == "delimiter" else R.CONTENT] -= sink_change
    counts = np.array([[1, 10, 5], [1, 10, 5]])       # per token, delimiters get 0.02, content 0.06
    return {"base": base, "rotated": rotated, "counts": counts, "first_sink": 1}


def test_redistribution_finding():
    f = C.redistribution_finding({"down": _redistribution(-0.02), "up": _redistribution(+0.01), "none": None},
                                 gamma=1.0)
    claims = _by_id(f)
    assert claims["rotation_lowers_sink_attention_down"].holds is True
    assert claims["rotation_lowers_sink_attention_down"].our_value == pytest.approx(-0.02)
    assert claims["rotation_lowers_sink_attention_up"].holds is False
    assert claims["rotation_lowers_sink_attention_none"].holds == NOT_COMPARABLE
    # the text analog of Table B.4 is shown, never scored
    assert all(claims[f"freed_attention_to_less_attended_{m}"].holds == NOT_COMPARABLE for m in ("down", "up", "none"))
    assert list(f.table.columns) == ["down", "up"]
    last = {"base": np.zeros((3, 1, 3)), "rotated": np.zeros((3, 1, 3)), "counts": np.ones((1, 3)), "first_sink": 2}
    only_last = _by_id(C.redistribution_finding({"m": last}, 1.0))
    assert only_last["rotation_lowers_sink_attention_m"].holds == NOT_COMPARABLE


def test_alignment_finding():
    heads = pd.DataFrame({"layer": [1, 1, 2], "head": [0, 1, 0], "sink_score": [0.1, 0.5, 0.9],
                          "cosine": [0.0, 0.4, 0.8]})
    f = C.alignment_finding({"hi": {"r_per_layer": [0.9, 0.7], "heads": heads},
                             "lo": {"r_per_layer": [0.2, float("nan")], "heads": heads}, "none": None})
    claims = _by_id(f)
    assert claims["alignment_pearson_hi"].holds is True and claims["alignment_pearson_hi"].our_value == 0.8
    assert claims["alignment_pearson_lo"].holds is False and claims["alignment_pearson_lo"].our_value == 0.2
    assert claims["alignment_pearson_none"].holds == NOT_COMPARABLE
    # "approximately 0.7": 0.6 is not it, though it passed the old ">= 0.5"
    near = _by_id(C.alignment_finding({"m": {"r_per_layer": [0.6, 0.6], "heads": heads}}))
    assert near["alignment_pearson_m"].holds is False


def _ablation(*shifts, n=8, noise=0.0):
    """Per-window losses: the baseline, and one ablated head per shift (its mean loss change, nats)."""
    rng = np.random.default_rng(0)
    base = 4 + rng.normal(0, 0.1, n)
    rows = [{"head": f"L1H{i}", "sink_score": 0.9, "delta": d, "windows": list(base + d + rng.normal(0, noise, n))}
            for i, d in enumerate(shifts)]
    return {"baseline_loss": float(base.mean()), "baseline_windows": list(base), "rows": rows}


def test_ablation_finding():
    f = C.ablation_finding({"mixed": _ablation(-0.03, 0.02, 0.0005),
                            "one_way": _ablation(0.01, 0.02, 0.003),
                            "noisy": _ablation(-0.1, 0.0, noise=0.05),
                            "few": _ablation(-0.03, 0.02, n=4),
                            "none": {"baseline_loss": 4.0, "baseline_windows": [4.0] * 8, "rows": []}})
    claims = _by_id(f)
    assert claims["head_ablation_mixed_mixed"].holds is True
    assert claims["head_ablation_mixed_mixed"].our_value.startswith("1 help, 2 hurt of 3")   # noiseless: 0.0005 too
    # every head raises the loss, and every interval excludes lowering it by 0.01 nats
    assert claims["head_ablation_mixed_one_way"].holds is False
    # a help is seen; whether any head hurts, 8 noisy windows cannot say
    assert claims["head_ablation_mixed_noisy"].holds == INCONCLUSIVE
    assert "could detect" in claims["head_ablation_mixed_noisy"].caveat
    assert claims["head_ablation_mixed_few"].holds == NOT_COMPARABLE
    assert "at least 8" in claims["head_ablation_mixed_few"].why_not_comparable
    assert claims["head_ablation_mixed_none"].holds == NOT_COMPARABLE
    assert missing_effects(f.claims) == []


def _loss_run(shift, n=8, rotated=True, noise=0.0, seed=0):
    rng = np.random.default_rng(seed)
    base = 4 + rng.normal(0, 0.1, n)
    sweep = {0.5: base + 0.01, 1.0: base - 0.02, 4.0: base + 0.1}
    test_base = 4 + rng.normal(0, 0.1, n)
    return {"baseline": base, "sweep": sweep, "rotated": rotated, "test_baseline": test_base,
            "test_rotated": test_base + shift + rng.normal(0, noise, n)}


def test_rotation_strength_finding_maps_the_test_onto_the_claim():
    f = C.rotation_strength_finding({"better": _loss_run(-0.03), "worse": _loss_run(+0.03),
                                     "same": _loss_run(0.0, noise=0.05), "few": _loss_run(-0.03, n=4),
                                     "nosink": _loss_run(0.0, rotated=False)})
    claims = _by_id(f)
    assert claims["rotation_loss_better"].holds is True
    assert "(here 1)" in claims["rotation_loss_better"].statement          # chosen on the sweep windows
    assert claims["rotation_loss_better"].effect["estimate"] == pytest.approx(0.03)   # positive: the loss falls
    assert claims["rotation_loss_worse"].holds is False
    assert claims["rotation_loss_same"].holds == INCONCLUSIVE               # 8 noisy windows: neither way
    assert claims["rotation_loss_same"].interest["value"] == C.LOSS_INTEREST.value
    assert claims["rotation_loss_few"].holds == NOT_COMPARABLE
    assert "at least 8" in claims["rotation_loss_few"].why_not_comparable
    assert claims["rotation_loss_nosink"].holds == NOT_COMPARABLE
    assert f.table.loc[1.0, "better"] == pytest.approx(-0.02)


def _grades(passes):
    graded = [p for p in passes if p is not None]
    return {"passes": list(passes), "summary": {"prompts_graded": len(graded), "prompts_total": len(passes),
                                                "prompt_level_strict": sum(graded) / len(graded) if graded else
                                                float("nan")}}


def _compliance(base, outro=None, chat=True, has_sinks=True, controls=None):
    settings = {"baseline": _grades(base)}
    if outro is not None:
        settings["outro"] = _grades(outro)
    for name, passes in (controls or {}).items():
        settings[name] = _grades(passes)
    return {"chat": chat, "has_sinks": has_sinks, "settings": settings}


def _pair(both, lost, gained, neither, ungraded=0):
    base = [True] * both + [True] * lost + [False] * gained + [False] * neither + [None] * ungraded
    treated = [True] * both + [False] * lost + [True] * gained + [False] * neither + [None] * ungraded
    return base, treated


def test_compliance_finding_decides_on_the_interval():
    f = C.compliance_finding({
        "gains": _compliance(*_pair(10, 0, 9, 30, ungraded=2)),
        "noise": _compliance(*_pair(10, 3, 5, 30)),
        "loses": _compliance(*_pair(10, 9, 0, 30)),
    }, gamma=1.0, max_new_tokens=48)
    claims = _by_id(f)
    assert claims["ifeval_gains"].holds is True and claims["ifeval_gains"].effect["items"] == 49
    assert claims["ifeval_noise"].holds == INCONCLUSIVE             # 3 lost, 5 gained: spans 0 and +0.53 pt
    assert claims["ifeval_loses"].holds is False
    assert claims["ifeval_gains"].interest["source"].startswith("paper: Table B.8")
    assert missing_effects(f.claims) == []
    assert f.table.loc["outro", "gains"] == "0.388 on 49 prompts"


def test_compliance_finding_is_not_comparable_without_headroom_or_subject():
    floor = [False] * 114 + [True]
    f = C.compliance_finding({
        "floor": _compliance(floor),
        "base-model": _compliance([True, False, False], chat=False),
        "nosink": _compliance([True, False] * 10, has_sinks=False),
        "tiny-set": _compliance([True, False, True], [True, True, True]),
    }, gamma=1.0, max_new_tokens=48)
    claims = _by_id(f)
    for name in ("floor", "base_model", "nosink", "tiny_set"):
        assert claims[f"ifeval_{name}"].holds == NOT_COMPARABLE, name
    assert "at the floor" in claims["ifeval_floor"].why_not_comparable
    assert claims["ifeval_floor"].our_value == "baseline 0.009 on 115 prompts"       # the measured rate is shown
    assert "base model" in claims["ifeval_base_model"].why_not_comparable
    assert "0.333 on 3 prompts" in claims["ifeval_base_model"].why_not_comparable
    assert "at least 6" in claims["ifeval_tiny_set"].why_not_comparable


def test_direction_controls_claim_each_control():
    rng = np.random.default_rng(1)
    windows = 4 + rng.normal(0, 0.1, 8)
    losses = {"beats": {"rotated": True, "sink": windows, "random_token": windows + 0.05, "head_mean": windows + 0.2},
              "ties": {"rotated": True, "sink": windows, "random_token": windows + rng.normal(0, 0.05, 8),
                       "head_mean": windows + 0.2},
              "nosink": {"rotated": False, "sink": windows, "random_token": windows, "head_mean": windows}}
    low, high = _pair(10, 0, 9, 31)              # the same 50 prompts: 10 pass under one setting, 19 under the other
    near = list(high)
    near[10] = False                               # one discordant prompt: no test can decide
    compliance = {
        "beats": _compliance(low, low, controls={"rotate": high, "rotate_random_token": low,
                                                 "rotate_head_mean": low}),
        "half": _compliance(low, low, controls={"rotate": high, "rotate_random_token": near,
                                                "rotate_head_mean": low}),
        "worse": _compliance(low, low, controls={"rotate": low, "rotate_random_token": high,
                                                 "rotate_head_mean": high}),
        "not-run": _compliance(low, low),
        "base-model": _compliance(low[:5], chat=False),
    }
    f = C.direction_controls_finding(losses, compliance, gamma=1.0)
    claims = _by_id(f)
    for kind in ("random_token", "head_mean"):
        assert claims[f"direction_controls_loss_{kind}_beats"].holds is True
        assert claims[f"direction_controls_loss_{kind}_nosink"].holds == NOT_COMPARABLE
        assert claims[f"direction_controls_ifeval_{kind}_beats"].holds is True    # 9 discordant, all one way
        assert claims[f"direction_controls_ifeval_{kind}_worse"].holds is False
        assert claims[f"direction_controls_ifeval_{kind}_not_run"].holds == NOT_COMPARABLE
        assert claims[f"direction_controls_ifeval_{kind}_base_model"].holds == NOT_COMPARABLE
    assert claims["direction_controls_loss_random_token_ties"].holds == INCONCLUSIVE
    assert claims["direction_controls_loss_head_mean_ties"].holds is True
    assert claims["direction_controls_ifeval_random_token_half"].holds == INCONCLUSIVE   # one prompt apart
    assert claims["direction_controls_ifeval_head_mean_half"].holds is True
    assert claims["direction_controls_ifeval_head_mean_beats"].interest["value"] == 9.56
    assert missing_effects(f.claims) == []


def test_overhead_finding_compares_with_the_papers_ratio():
    def ratios(r, rows=5):
        return {"ratios": {"sdpa": {"decode_s_per_token": 0.1, "latency_ratio": 1.0, "prefill_s": 1.0,
                                    "peak_memory_mib": 0.0, "rotated_decode_rows": 0},
                           "outro": {"decode_s_per_token": 0.1 * r, "latency_ratio": r, "prefill_s": 1.0,
                                     "peak_memory_mib": 0.0, "rotated_decode_rows": rows},
                           "eager": {"decode_s_per_token": 0.2, "latency_ratio": 2.0, "prefill_s": 1.0,
                                     "peak_memory_mib": 0.0, "rotated_decode_rows": 0}}, "state_kib": 36.0}
    f = C.overhead_finding({"fast": ratios(1.05), "between": ratios(1.105), "slow": ratios(1.2),
                            "hooks-only": ratios(1.0, rows=0)})
    claims = _by_id(f)
    assert claims["overhead_fast"].holds is True and claims["overhead_fast"].paper_value == 1.11
    assert claims["overhead_slow"].holds is False
    assert claims["overhead_hooks_only"].holds == NOT_COMPARABLE
    # our own <= 1.10 target is reported apart from the claim: 1.105 meets the paper's 1.11 but misses it
    assert claims["overhead_between"].holds is True
    assert "met in this run" in f.notes[0] and "missed in this run" in f.notes[1]


# ---- measurements moved out of the intervention -----------------------------------------------------------------

@pytest.fixture(scope="module")
def tiny_llama():
    return load_model("tiny-llama", device="cpu")


def test_window_losses_are_per_window_means_and_refuse_relaxation(tiny_llama):
    model = tiny_llama.model
    ids = torch.randint(0, 256, (5, 12), generator=torch.Generator().manual_seed(0))
    losses, rotated = R.window_losses(model, ids, chunk=2)
    with torch.no_grad():
        logits = model(input_ids=ids).logits[:, 1:-1]
    want = torch.nn.functional.cross_entropy(logits.transpose(1, 2), ids[:, 2:], reduction="none").mean(1)
    np.testing.assert_allclose(losses, want.double().numpy(), rtol=1e-5)
    assert not rotated
    with pytest.raises(ValueError, match="relax"):
        R.window_losses(model, ids, options={"gamma": 1.0})
    ablated, _ = R.window_losses(model, ids, ablate=(0, 1))
    assert not np.allclose(ablated, losses)


def test_test_windows_never_overlap_the_sweep_windows(tiny_llama):
    from sinkbook.training.corpus import heldout_text_windows
    sweep, _ = heldout_text_windows(tiny_llama.tokenizer, 4, 32)
    test = R.later_heldout_windows(tiny_llama.tokenizer, 4, 32)
    assert test.shape == sweep.shape and (test[:, 0] == sweep[:, 0]).all()     # the same <bos> prefix
    assert not {tuple(r) for r in sweep[:, 1:].tolist()} & {tuple(r) for r in test[:, 1:].tolist()}


def test_benchmark_reports_three_settings_with_ratios(tiny_llama):
    from sinkbook.measures.decoding import benchmark_decoding, overhead_ratios
    rows = benchmark_decoding(tiny_llama, R.benchmark_settings(tiny_llama.model, 1.0), prompt_tokens=12,
                              new_tokens=3, repeats=1)
    ratios = overhead_ratios(rows)
    assert set(ratios) == {"sdpa", "outro", "eager"}
    assert ratios["sdpa"]["latency_ratio"] == 1.0 and all(r["prefill_s"] > 0 for r in rows)
    assert [r["setting"] for r in rows] == ["sdpa", "outro", "eager"]     # interleaved within the repeat
    assert ratios["outro"]["rotated_decode_rows"] == 0                     # no sink in a random tiny model
    assert hook_count(tiny_llama.model) == 0 and tiny_llama.model.config._attn_implementation == "sdpa"


# ---- the quick profile on every tiny family ---------------------------------------------------------------------

@pytest.mark.parametrize("family", TINY_FAMILIES)
def test_quick_profile_runs_on_a_tiny_model_without_sinks(family, tmp_path):
    from sinkbook.book.results import write_results
    spec = f"tiny-{family}"
    chapter = C.OutRoChapter(C.PROFILES.resolve("quick", device="cpu", models=[spec]))
    results = chapter.results()
    claims = {c.id: c for c in results["claims"]}
    checks = [c for c in claims.values() if c.must_hold]
    assert checks and all(c.holds is True for c in checks)
    measured = [c for c in claims.values() if not c.must_hold]
    assert len(measured) == 11 and all(c.holds == NOT_COMPARABLE for c in measured), \
        [(c.id, c.holds) for c in measured if c.holds != NOT_COMPARABLE]
    assert all(c.why_not_comparable for c in measured)
    write_results(**results, directory=tmp_path)                       # no must-hold failure, writes cleanly
    assert (tmp_path / "outro.json").exists()

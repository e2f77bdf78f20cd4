"""The gradient-sinks chapter: finding functions on synthetic probes, its gating, and its quick profile."""
import importlib.util
import json

import numpy as np
import pandas as pd
import pytest
import torch

from sinkbook.chapters import gradient_sinks as gs
from sinkbook.core.claims import NOT_COMPARABLE
from sinkbook.core.models import TINY_FAMILIES
from sinkbook.core.paths import REPO_ROOT
from sinkbook.core.profiles import SettingsError
from sinkbook.core.published import reported_0p3b
from sinkbook.interventions.vscale import probe_raw_values, valve_constant
from sinkbook.measures.criteria import late_query_attention, uniform_share
from sinkbook.measures.gradprobes import SINK_MIN, ProbeResult, sink_check
from sinkbook.runs.gradient_sinks import EMERGENCE_DIR, load_emergence_runs, training_trajectory


def fake_probe(r_gs=20.0, sink=0.9, ratio=8.0, key_spike=2.0, value_spike=3.0, q0=0.0, layers=4, tokens=40,
               heads=4) -> ProbeResult:
    """A ProbeResult whose summary numbers are set directly: median R_GS ``r_gs`` in every layer, Sink^eps
    ``sink``, token-0 / early-token norm ratio ``ratio``, path spikes, and |grad q_0| = ``q0`` (others 1)."""
    def spiked(value):
        a = np.ones((layers, tokens))
        a[:, 0] = value
        return a
    ones3 = np.ones((layers, 2, tokens - 1))
    return ProbeResult(
        loss=3.0, grad_h_tilde=spiked(r_gs), grad_q=spiked(q0), grad_k=spiked(key_spike), grad_v=spiked(value_spike),
        residual_norm=spiked(ratio), mlp_out_norm=np.ones((layers, tokens)),
        value_norm=np.ones((layers, heads, tokens)),
        alpha0=np.full((layers, heads), sink), sink_rate=np.full(layers, sink),
        attn_ratios={k: ones3 for k in ("bloat", "change", "compress")},
        mlp_ratios={k: ones3 for k in ("bloat", "change", "compress")}, input_norm=ones3, half_norm=ones3)


PAPER_BASE, PAPER_VS = dict(r_gs=40, sink=0.9, ratio=11.1), dict(r_gs=6, sink=0.85, ratio=3.0)


def _vscale(base=PAPER_BASE, vs=PAPER_VS, losses=(2.917, 2.907)):
    finding = gs.gradient_sink_finding({"baseline": fake_probe(**base), "V-scale": fake_probe(**vs)},
                                       {"baseline": losses[0], "V-scale": losses[1]}, "xs")
    return finding, {c.id: c for c in finding.claims}


def test_reported_numbers_are_read_from_the_data_file():
    paper = reported_0p3b()
    assert paper["median_r_gs"] == (40, 6) and paper["token0_norm_mean"] == (1916, 346)
    assert paper["token0_ratio_mean"] == (11.1, 3.0) and paper["val_loss"] == (2.917, 2.907)
    table = gs.paper_values_finding().table
    assert list(table.columns) == ["baseline", "V-scale", "source"] and not gs.paper_values_finding().claims


def test_paper_like_outcome_holds_everywhere():
    finding, c = _vscale()
    assert all(claim.holds is True for claim in c.values()), [x.verdict() for x in c.values()]
    assert all(claim.kind == "measured" for claim in c.values())
    assert c["vscale_lowers_token0_norm"].paper_value == "1916 -> 346"
    assert c["vscale_lowers_rgs"].our_value == "40.00 -> 6.00" and c["baseline_gradient_sink"].our_value == 40
    assert "has both" in finding.notes[0]
    assert finding.table.shape[1] == 2                       # quantities down, the two models across


@pytest.mark.parametrize("r_gs, holds", [(2.0, False), (9.9, False), (10.0, True), (55.0, True), (100.0, True),
                                         (150.0, False)])
def test_baseline_gradient_sink_uses_the_papers_range(r_gs, holds):
    """Causal masking alone gives R_GS > 1; the paper's gradient sinks have medians of 10-100."""
    _, c = _vscale(base=dict(PAPER_BASE, r_gs=r_gs))
    assert c["baseline_gradient_sink"].holds is holds
    assert c["baseline_gradient_sink"].rule == "10 <= median R_GS(0; 31) <= 100"


def test_opposite_outcome_fails():
    _, c = _vscale(base=dict(r_gs=5, sink=0.9, ratio=6.0), vs=dict(r_gs=7, sink=0.1, ratio=7.0), losses=(3.0, 3.5))
    assert all(claim.holds is False for claim in c.values()), [x.verdict() for x in c.values()]


@pytest.mark.parametrize("vs_r_gs, holds", [(20.0, True), (20.5, False), (39.0, False)])
def test_lowers_means_at_least_halved_in_both_chapters(vs_r_gs, holds):
    """One rule for "V-scale lowers": at most LOWER_FACTOR x the baseline (a 2.5 % drop is not a suppression)."""
    from sinkbook.chapters import gradient_sinks_with_sink as ws
    from sinkbook.measures import gradprobes
    _, c = _vscale(vs=dict(PAPER_VS, r_gs=vs_r_gs))
    assert c["vscale_lowers_rgs"].holds is holds
    assert gs.LOWERS is gradprobes.LOWERS and ws.LOWERS is gradprobes.LOWERS
    assert gradprobes.lowered([40.0, 10.0], [20.0, 6.0]) is False          # every seed must be halved
    with pytest.raises(ValueError):
        gradprobes.lowered([1.0, 2.0], [1.0])


def test_lowers_gate_is_written_once():
    from sinkbook.measures.gradprobes import lowers_precondition
    yes, sink_no, massive_no = (True, ""), (False, "no sink"), (False, "no massive")
    assert lowers_precondition("median R_GS", yes, massive_no) == (True, "")
    assert lowers_precondition("token-0 norm", yes, massive_no) == (False, "no massive")
    assert lowers_precondition("token-0 ratio", sink_no, massive_no) == (False, "no sink")
    with pytest.raises(ValueError):
        lowers_precondition("loss", yes, yes)


def test_loss_parity_tolerance():
    assert _vscale(losses=(3.0, 3.019))[1]["vscale_loss_parity"].holds is True
    assert _vscale(losses=(3.0, 3.03))[1]["vscale_loss_parity"].holds is False


@pytest.mark.parametrize("sink, ratio, missing", [(0.1, 8.0, "no attention sink"), (0.9, 2.0, "no massive activation"),
                                                  (0.0, 1.0, "no attention sink")])
def test_vscale_claims_need_the_sink_and_the_massive_activation(sink, ratio, missing):
    finding, c = _vscale(base=dict(r_gs=40, sink=sink, ratio=ratio))
    vscale_ids = [k for k in c if k.startswith("vscale_")]
    assert len(vscale_ids) == 5
    for key in vscale_ids:
        if key == "vscale_lowers_rgs" and sink >= SINK_MIN:
            assert c[key].holds is True, key            # a gradient sink needs only the attention sink (one gate)
            continue
        assert c[key].holds == NOT_COMPARABLE, key
        assert missing in c[key].why_not_comparable
    theta = gs.theta_claims(np.array([[0.5, 0.1], [0.2, 0.3], [-0.1, 0.2], [-0.4, -0.2]]),
                            sink_check(fake_probe(sink=sink, ratio=ratio)))
    assert all(t.holds == NOT_COMPARABLE for t in theta)
    # the gradient sink itself needs only the attention sink
    assert (c["baseline_gradient_sink"].holds == NOT_COMPARABLE) == (sink < SINK_MIN)
    assert "not comparable" in finding.notes[0]


def test_theta_pattern_claims_read_the_sign_and_the_order():
    both = sink_check(fake_probe())
    c = {x.id: x for x in gs.theta_claims(np.array([[0.5, 0.1], [0.2, 0.3], [-0.1, 0.2], [-0.4, -0.2]]), both)}
    assert c["vscale_theta_layer_pattern"].holds is True and c["vscale_theta_late_negative"].holds is True
    assert c["vscale_theta_late_negative"].our_value.startswith("75%")   # 3 of the 4 later-half values
    positive = {x.id: x for x in gs.theta_claims(np.array([[0.7, 0.6], [0.2, 0.1]]), both)}
    assert positive["vscale_theta_layer_pattern"].holds is True
    assert positive["vscale_theta_late_negative"].holds is False


def test_theta_finding_compares_raw_value_norms_with_the_valve_constant():
    theta = np.zeros((2, 4))
    finding = gs.theta_finding(theta, np.ones((2, 4, 40)), d_model=64, d_head=16,
                               base_check=sink_check(fake_probe()))
    assert len(finding.figures) == 1 and len(finding.claims) == 2 and "+0.000" in finding.notes[0]
    np.testing.assert_allclose(valve_constant(theta, 64, 16), 64 * 16 * 0.02**2)


@pytest.mark.parametrize("q0, holds", [(0.0, True), (5e-6, True), (1e-3, False)])
def test_grad_q0_check_allows_float32_rounding_only(q0, holds):
    finding = gs.checks_finding({"a": fake_probe(), "b": fake_probe(q0=q0)}, {"a": 3.0})
    c = {x.id: x for x in finding.claims}
    assert c["grad_q0_zero"].must_hold and c["grad_q0_zero"].holds is holds
    assert c["grad_q0_zero"].our_value == pytest.approx(q0)
    assert c["probes_finite"].holds is True


def test_non_finite_numbers_fail_the_check():
    broken = fake_probe(r_gs=float("nan"))
    assert {x.id: x for x in gs.checks_finding({"a": broken}, {}).claims}["probes_finite"].holds is False
    infinite_loss = gs.checks_finding({"a": fake_probe()}, {"b": float("inf")})
    assert {x.id: x for x in infinite_loss.claims}["probes_finite"].holds is False


def _sweep_row(size, sink, ratio):
    return {"size": size, "layers x d_model x heads": "2 x 64 x 4", "parameters (M)": 0.6, "steps": 60,
            "tokens seen (M)": 0.03, "train minutes": 0.1, "val loss": 6.0, "Sink^eps middle": sink,
            "token-0 ratio (max, middle)": ratio, "median R_GS": 2.0, "sink + massive": sink >= 0.5 and ratio >= 5}


def test_sweep_picks_the_smallest_size_with_both():
    rows = [_sweep_row("nano", 0.0, 2.0), _sweep_row("xs", 0.6, 6.0), _sweep_row("s", 0.7, 9.0)]
    finding = gs.sweep_finding(rows)
    assert finding.data["chosen"] == "xs" and finding.claims[0].holds is True
    assert finding.claims[0].origin == "ours" and finding.claims[0].id == "size_with_sink"
    assert list(finding.table.columns) == ["nano", "xs", "s"]
    assert gs.sweep_finding(rows, size="s").data["chosen"] == "s"
    none = gs.sweep_finding(rows[:1], profile="quick")
    assert none.data["chosen"] == "nano" and none.claims[0].holds is False and "gpu" in none.notes[0]


def test_trajectory_notes_read_the_trend():
    steps = np.arange(1, 9) * 100
    rising = pd.DataFrame({"step": steps, "Sink^eps middle": steps / 1000, "token-0 ratio (max, middle)": steps / 100,
                           "largest alpha_0 of a head": 0.1, "median R_GS": 2.0, "sink + massive": False})
    finding = gs.trajectory_finding({"xs": rising, "nano": rising.tail(1)})
    assert "+1.000 and +10.00 per 1000 steps" in finding.notes[0]
    assert "no intermediate snapshots" in finding.notes[1]
    assert finding.table.index.names == ["size", "step"] and len(finding.figures) == 1


def test_late_attention_finding_names_the_largest_head():
    shares = {"nano": {"token 0": np.array([[0.1, 0.2], [0.6, 0.3]]), "line breaks": np.full((2, 2), 0.1)}}
    finding = gs.late_attention_finding(shares, {"token 0": 0.02, "line breaks": 0.1})
    assert "0.600 (nano, layer 1)" in finding.notes[0]
    assert finding.table.shape == (2, 4)


@pytest.mark.parametrize("sink, massive, phrase", [(True, True, "has both"), (False, True, "no attention sink"),
                                                   (True, False, "no massive activation"), (False, False, "neither")])
def test_scale_verdict_names_what_the_baseline_has(sink, massive, phrase):
    check = {"sink": sink, "massive": massive, "sink_rate_middle": 0.6 if sink else 0.0,
             "token0_ratio_middle_max": 6.0 if massive else 2.0}
    text = gs.scale_verdict(check, "xs")
    assert phrase in text and "xs baseline" in text
    assert ("not comparable" in text) is not (sink and massive)


# ---- recorded runs and the script that records them ----------------------------------------------------------

def _load_script():
    spec = importlib.util.spec_from_file_location("sink_emergence", REPO_ROOT / "scripts" / "sink_emergence.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


ROWS = [{"step": 500, "sink_rate_middle": 0.0, "token0_ratio_middle_max": 2.0, "largest_alpha0": 0.1, "val_loss": 5.0},
        {"step": 1000, "sink_rate_middle": 0.1, "token0_ratio_middle_max": 3.0, "largest_alpha0": 0.2, "val_loss": 4.5}]


def test_emergence_runs_read_batch_and_context_fields_and_old_files(tmp_path):
    assert load_emergence_runs(tmp_path).empty
    assert gs.recorded_runs_finding(load_emergence_runs(tmp_path)).notes[0].startswith("No recorded runs")
    # new schema: batch and context are fields (the command string is not parsed)
    (tmp_path / "new.json").write_text(json.dumps({"command": "x --batch 99", "status": "complete", "batch": 8,
                                                   "context": 64, "rows": ROWS}))
    # old schema: no such fields; those runs used the script's defaults, TrainConfig's 16 x 128
    (tmp_path / "old.json").write_text(json.dumps({"command": "x", "status": "complete", "rows": ROWS}))
    runs = load_emergence_runs(tmp_path)
    assert list(runs.run) == ["new", "new", "old", "old"]
    assert list(runs["tokens (M)"]) == [500 * 8 * 64 / 1e6, 1000 * 8 * 64 / 1e6,
                                        500 * 16 * 128 / 1e6, 1000 * 16 * 128 / 1e6]
    finding = gs.recorded_runs_finding(runs)
    assert list(finding.table.index) == ["new", "old"] and "new: x --batch 99" in finding.notes


def test_recorded_runs_in_the_repository_load():
    shipped = load_emergence_runs()
    assert {"xs-8000", "nano-8000"} <= set(shipped.run)
    assert shipped.command.str.contains("scripts/sink_emergence.py").all()
    assert shipped.loc[shipped.run == "xs-8000", "tokens (M)"].max() == pytest.approx(8000 * 16 * 128 / 1e6)


def test_sink_emergence_script_writes_the_schema_the_chapter_reads(tmp_path, monkeypatch):
    script = _load_script()
    out = tmp_path / "tiny.json"
    monkeypatch.setattr("sys.argv", ["sink_emergence.py"])
    script.main(["--size", "nano", "--steps", "4", "--every", "2", "--batch", "2", "--context", "40",
                 "--out", str(out)])
    doc = json.loads(out.read_text())
    assert doc["status"] == "complete" and doc["batch"] == 2 and doc["context"] == 40
    assert doc["command"].startswith(".venv/bin/python scripts/sink_emergence.py --size nano")
    assert [r["step"] for r in doc["rows"]] == [2, 4]
    old_keys = set(json.loads((EMERGENCE_DIR / "nano-8000.json").read_text())["rows"][0])
    assert set(doc["rows"][0]) == old_keys
    assert set(json.loads((EMERGENCE_DIR / "nano-8000.json").read_text())) <= set(doc)
    runs = load_emergence_runs(tmp_path)
    assert list(runs["tokens (M)"]) == [2 * 2 * 40 / 1e6, 4 * 2 * 40 / 1e6]


def test_sink_emergence_never_changes_the_size_table():
    from sinkbook.training.scratch import SIZES
    script = _load_script()
    before = dict(SIZES)
    import argparse
    assert script.parse_shape("4,128,8,384", argparse.ArgumentParser()) == (4, 128, 8, 384)
    with pytest.raises(SystemExit):
        script.parse_shape("4,130,8,384", argparse.ArgumentParser())
    assert SIZES == before


# ---- measurements on small models ----------------------------------------------------------------------------

def _nano(seed=0):
    from sinkbook.training.scratch import TrainConfig, build_model
    cfg = TrainConfig(size="nano", steps=4, warmup_steps=1, batch_size=2, context=40, vocab_size=64, seed=seed)
    return build_model(cfg, bos_id=0)


def test_training_trajectory_probes_every_checkpoint():
    from sinkbook.measures.gradprobes import probe_batch
    models = [(step, _nano(seed=step)) for step in (2, 4)]
    ids = torch.randint(1, 64, (2, 40), generator=torch.Generator().manual_seed(0))
    ids[:, 0] = 0
    table = training_trajectory(models, ids)
    assert list(table.step) == [2, 4]
    direct = probe_batch(models[1][1], ids)
    assert table["largest alpha_0 of a head"].iloc[1] == float(direct.alpha0.max())
    assert np.isclose(table["median R_GS"].iloc[1], np.median(direct.r_gs()))


def test_late_query_attention_matches_eager_attention_weights():
    model = _nano()
    ids = torch.randint(1, 64, (3, 40), generator=torch.Generator().manual_seed(1))
    ids[:, 0] = 0
    masks = {"bos": torch.zeros_like(ids, dtype=torch.bool), "odd": ids % 2 == 1}
    masks["bos"][:, 0] = True
    got = late_query_attention(model, ids, masks, first_query=8)
    model.set_attn_implementation("eager")
    with torch.no_grad():
        attn = torch.stack(model(ids, output_attentions=True).attentions)   # (L, B, H, T, S)
    late = attn[:, :, :, 8:, :]
    for name, m in masks.items():
        expected = (late * m[None, :, None, None, :]).sum(-1).mean((1, 3))
        np.testing.assert_allclose(got[name], expected.numpy(), rtol=1e-5, atol=1e-7)
    assert got["bos"].shape == (2, 4)
    # zero queries give uniform causal attention: the share equals the uniform expectation
    with torch.no_grad():
        for layer in model.model.layers:
            layer.self_attn.q_proj.weight.zero_()
    flat = late_query_attention(model, ids, masks, first_query=8)
    np.testing.assert_allclose(flat["odd"], uniform_share(masks["odd"], 8), rtol=1e-5)
    np.testing.assert_allclose(flat["bos"], uniform_share(masks["bos"], 8), rtol=1e-5)
    with pytest.raises(ValueError, match="no query"):
        late_query_attention(model, ids[:, :8], masks, first_query=8)


def test_vscale_probe_takes_the_value_path_before_vscale():
    """On a V-scale model the value path (gradient and norms) is read at the raw v, as in the paper; the hook
    library's v_proj point is after the valve. The chain rule through the valve is checked in test_vscale."""
    from sinkbook.interventions.vscale import apply_vscale, raw_value_norms
    from sinkbook.measures.gradprobes import probe_batch
    model = apply_vscale(_nano())
    ids = torch.randint(1, 64, (2, 40), generator=torch.Generator().manual_seed(2))
    ids[:, 0] = 0
    raw, after = probe_raw_values(model, ids), probe_batch(model, ids)
    np.testing.assert_allclose(raw.grad_h_tilde, after.grad_h_tilde, rtol=1e-6)
    assert raw.grad_v.shape == after.grad_v.shape and not np.allclose(raw.grad_v, after.grad_v)
    np.testing.assert_allclose(raw.value_norm, raw_value_norms(model, ids).numpy(), rtol=1e-6)


# ---- profiles and the whole chapter --------------------------------------------------------------------------

def test_profile_parameters():
    chapter = gs.GradientSinksChapter(gs.PROFILES.resolve("quick", steps=7))
    assert chapter.runs.steps == {"nano": 7}
    assert gs.GradientSinksChapter(gs.PROFILES.resolve("default", size="xs")).runs.sweep_sizes == ["xs"]
    with pytest.raises(SettingsError, match="unknown sizes"):
        gs.GradientSinksChapter(gs.PROFILES.resolve("quick", sweep_sizes=["huge"]))
    with pytest.raises(SettingsError, match="no step count"):
        gs.GradientSinksChapter(gs.PROFILES.resolve("quick", sweep_sizes=["xs"]))
    with pytest.raises(SettingsError, match="steps"):
        gs.GradientSinksChapter(gs.PROFILES.resolve("quick", steps="many"))


@pytest.fixture
def private_cache(tmp_path, monkeypatch):
    """Trained runs go to a temporary cache; the corpus (and its tokenizer) is shared with the real one."""
    from sinkbook.core.paths import cache_root
    (tmp_path / "cache").mkdir()
    (tmp_path / "cache" / "shakespeare").symlink_to(cache_root() / "shakespeare")
    monkeypatch.setenv("SINKBOOK_CACHE", str(tmp_path / "cache"))
    return tmp_path / "cache"


def test_quick_profile_runs_end_to_end(private_cache, tmp_path):
    """The chapter end to end on the quick profile: a 60-step nano model, nothing raises."""
    from sinkbook.book.results import write_results
    chapter = gs.GradientSinksChapter(gs.PROFILES.resolve("quick", device="cpu"))
    for name in chapter.FINDINGS:
        finding = getattr(chapter, name)()
        assert finding.title
    results = chapter.results()
    path = write_results(**results, directory=tmp_path / "results")
    doc = json.loads(path.read_text())
    ids = [c["id"] for c in doc["claims"]]
    assert len(ids) == len(set(ids))
    checks = [c for c in doc["claims"] if c["must_hold"]]
    assert {c["id"] for c in checks} == {"grad_q0_zero", "probes_finite"} and all(c["holds"] is True for c in checks)
    assert doc["parameters"]["profile"] == "quick" and doc["extra"]["chosen_size"] == "nano"
    # a 60-step nano model has no sink: every V-scale claim is not comparable
    assert all(c["holds"] == NOT_COMPARABLE for c in doc["claims"] if c["id"].startswith("vscale_"))

"""Sink criteria on synthetic tensors with known answers, and on tiny models end to end."""
from __future__ import annotations

import math

import pytest
import torch

from sinkbook.core.hooks import capture, intervene
from sinkbook.core.models import encode
from sinkbook.interventions.zero_k import zero_k_edits, zero_k_effect
from sinkbook.measures import criteria


def _hidden_with_massive_token(B=2, T=6, D=32, dim=5, value=500.0):
    torch.manual_seed(0)
    h = torch.randn(B, T, D) * 0.1
    h[:, 0, dim] = value
    return h


def test_phi_vlm_flags_the_token_with_a_dominant_sink_dimension():
    h = _hidden_with_massive_token()
    assert criteria.massive_dimensions(h) == {5}
    assert criteria.sink_dimensions({0: h}) == [5]
    flagged = criteria.phi_vlm(h, [5], tau=5.0)
    assert flagged[:, 0].all() and not flagged[:, 1:].any()
    # a single coordinate is at most sqrt(D) times the vector's RMS: tau above sqrt(D) can never fire
    ratio = criteria.rms_ratio(h, [5])
    assert ratio.max() <= math.sqrt(32) + 1e-4 and ratio[0, 0] > 0.99 * math.sqrt(32)
    assert not criteria.phi_vlm(h, [5], tau=math.sqrt(32) + 0.01).any()
    with pytest.raises(ValueError, match="sink dimension"):
        criteria.phi_vlm(h, [], tau=20)


def test_phi_vlm_and_massive_stats_leave_padding_out():
    h = _hidden_with_massive_token()
    mask = torch.ones(2, 6, dtype=torch.long)
    mask[1, 0] = 0                                            # the massive token of row 1 is padding
    assert not criteria.phi_vlm(h, [5], tau=5.0, attention_mask=mask)[1].any()
    stats = criteria.massive_activation_stats(h, mask)
    assert torch.isnan(stats["token_max"][1, 0]) and stats["token_max"][0, 0] == 500.0
    assert stats["ratio"][0, 0] > 1000


def test_sink_dimensions_fall_back_to_the_largest_ratio_without_massive_entries():
    torch.manual_seed(1)
    h = torch.randn(1, 8, 16) * 0.1
    h[0, :, 9] = 3.0                                          # large but below Phi_LLM's 100
    assert criteria.massive_dimensions(h) == set()
    assert 9 in criteria.sink_dimensions({0: h}, fallback_top=1)


def test_outlier_dimensions_follow_the_three_thresholds():
    torch.manual_seed(2)
    layers, N, T, D = 8, 10, 50, 12
    exceeding = torch.zeros(N, D)
    for layer in range(layers):
        h = torch.randn(N, T, D)
        h[:, :, 3] = 7.0                                      # always above 6: an outlier dim
        if layer < 1:
            h[:, :, 4] = 7.0                                  # above 6 in only 1 of 8 layers (< 25%)
        h[:, :2, 6] = 9.0                                     # 2 of 50 tokens (4% < 6%)
        exceeding += criteria.outlier_dim_counts(h).float()
    assert criteria.outlier_dimensions(exceeding, layers) == [3]
    exceeding[:2, 3] = 0                                      # missing in 2 of 10 sequences (< 90%)
    assert criteria.outlier_dimensions(exceeding, layers) == []


def _pattern_with_padding():
    """(B=2, H=2, T=4, S=4); row 1 has one left-padding position, so its first real token is 1."""
    p = torch.zeros(2, 2, 4, 4)
    for t in range(4):
        p[0, :, t, 0] = 1.0 if t == 0 else 0.5
        p[0, :, t, t] += 0.0 if t == 0 else 0.5
    p[1, 0, 1:, 1] = 1.0
    p[1, 1, 1, 1] = 1.0
    p[1, 1, 2, 2] = 1.0
    p[1, 1, 3, 3] = 1.0
    p[1, :, 0, 0] = 0.25                                      # padded query row: must be ignored
    mask = torch.tensor([[1, 1, 1, 1], [0, 1, 1, 1]])
    return p, mask


def test_column_mass_and_head_fraction_on_a_known_pattern():
    p, mask = _pattern_with_padding()
    mass, second = criteria.column_mass(p, mask)
    torch.testing.assert_close(mass[0], torch.tensor([2.5, 2.5]))          # 1 + 0.5 * 3
    torch.testing.assert_close(second[0], torch.tensor([1.75, 1.75]))      # 1 + 0.25 * 3
    torch.testing.assert_close(mass[1], torch.tensor([3.0, 1.0]))
    fraction, alpha = criteria.head_fraction_sink(p, mask, eps=0.3, t_eps=64)
    torch.testing.assert_close(alpha[1], torch.tensor([1.0, 1 / 3]))
    torch.testing.assert_close(fraction, torch.tensor([1.0, 1.0]))
    fraction, alpha = criteria.head_fraction_sink(p, mask, eps=0.5, t_eps=2)
    torch.testing.assert_close(alpha[0], torch.tensor([0.75, 0.75]))       # queries 0 and 1 only
    torch.testing.assert_close(fraction, torch.tensor([1.0, 0.5]))
    to_first = criteria.attention_to_key(p, mask)
    torch.testing.assert_close(to_first[0], torch.tensor([0.5, 0.5]))
    torch.testing.assert_close(to_first[1], torch.tensor([1.0, 0.0]))


def test_zero_k_zeroes_only_the_top_dimension_of_the_sink_key():
    torch.manual_seed(3)
    k = torch.randn(2, 3, 5, 8)
    k[0, :, 1, 2] = 50.0
    position = torch.tensor([1, 0])
    edit = zero_k_edits([0], position)[("k", 0)]
    new = edit(k, 0)
    assert (new[0, :, 1, 2] == 0).all()
    top = k[1, :, 0].abs().argmax(-1)
    assert (new[1, torch.arange(3), 0, top] == 0).all()
    changed = (new != k)
    assert changed.sum() == 6                                 # one dim per (sequence, KV head)
    assert torch.equal(k[0, :, 1, 2], torch.full((3,), 50.0))  # the input is left as it was


def test_zero_k_changes_attention_to_the_sink_through_intervene(loaded_model):
    loaded = loaded_model("tiny-llama")
    batch = encode(loaded.tokenizer, ["a short sentence for the sink test"])
    first = torch.tensor([0])
    with torch.no_grad(), capture(loaded.model, points=("pattern",), layers=[0]) as cap:
        loaded.model(**batch)
    before = cap["pattern", 0][0, :, 1:, 0]
    with torch.no_grad(), intervene(loaded.model, zero_k_edits([0], first)), \
            capture(loaded.model, points=("pattern",), layers=[0]) as cap:
        loaded.model(**batch)
    after = cap["pattern", 0][0, :, 1:, 0]
    assert not torch.allclose(before, after)
    table = zero_k_effect(loaded, ["a short sentence", "another sentence that is longer"])
    assert list(table.columns) == ["layer", "before", "after"] and len(table) == 3
    assert (table.before - table.after).abs().max() > 1e-4


def test_sink_census_on_a_tiny_model(loaded_model):
    loaded = loaded_model("tiny-gemma3")
    prompts = ["first test prompt", "a second and somewhat longer test prompt"]
    census = criteria.sink_census(loaded, prompts, taus=(2.0, 4.0))
    per_layer = census["layers"]
    assert list(per_layer.layer) == [0, 1, 2]
    batch = encode(loaded.tokenizer, prompts)
    assert census["n_tokens"] == int(batch["attention_mask"].sum())
    assert (per_layer["phi_vlm_2"] >= per_layer["phi_vlm_4"]).all()
    assert ((per_layer.sink_eps >= 0) & (per_layer.sink_eps <= 1)).all()
    assert (per_layer.S_s <= per_layer.M_s + 1e-6).all()
    # the census's attention numbers agree with a direct capture of layer 2
    with torch.no_grad(), capture(loaded.model, points=("pattern",), layers=[2]) as cap:
        loaded.model(**batch)
    mass, _ = criteria.column_mass(cap["pattern", 2], batch["attention_mask"])
    assert per_layer.M_s[2] == pytest.approx(mass.mean().item(), rel=1e-5)


def test_phi_llm_still_matches_its_definition():
    h = _hidden_with_massive_token(value=150.0)
    assert criteria.phi_llm(h)[:, 0].all() and not criteria.phi_llm(h)[:, 1:].any()
    assert not criteria.phi_llm(_hidden_with_massive_token(value=90.0)).any()   # below the floor of 100

"""Post-training quantisers against their formulas, and the V-scale retrofit's identity start."""
from __future__ import annotations

import pytest
import torch

from sinkbook.core.arch import decoder_layers
from sinkbook.core.models import load_model
from sinkbook.interventions.quantise import (quantise_activations, quantise_weights, quantised_residual,
                                             rtn_quantise, rtn_scales)
from sinkbook.interventions.vscale import RETROFIT_THETA, apply_vscale


@pytest.mark.parametrize("bits", [8, 4])
def test_rtn_matches_its_formula_row_by_row(bits):
    torch.manual_seed(0)
    w = torch.randn(6, 10) * torch.tensor([[0.1], [1.0], [5.0], [0.01], [2.0], [0.0]])
    q = rtn_quantise(w, bits)
    q_max = 2 ** (bits - 1) - 1
    for row in range(5):
        s = w[row].abs().max() / q_max
        expected = torch.clamp(torch.round(w[row] / s), -q_max, q_max) * s
        torch.testing.assert_close(q[row], expected)
        assert float((q[row] - w[row]).abs().max()) <= float(s) / 2 + 1e-7
        assert len(torch.unique(torch.round(q[row] / s))) <= 2 * q_max + 1
    assert torch.equal(q[5], w[5])                                   # a zero row stays zero
    assert rtn_scales(w, bits).shape == (6, 1)


def test_values_on_the_grid_are_kept_and_bad_bits_refused():
    w = torch.tensor([[-7.0, -3.0, 0.0, 1.0, 7.0]])
    assert torch.equal(rtn_quantise(w, 4), w)
    with pytest.raises(ValueError, match="bits must be"):
        rtn_quantise(w, 5)


def test_activation_quantiser_scales_per_token_or_per_tensor():
    x = torch.tensor([[[100.0, 0.3, -0.2], [1.0, 0.5, -0.25]]])      # a massive activation on token 0
    per_token = quantise_activations(x, 8, "token")
    per_tensor = quantise_activations(x, 8, "tensor")
    torch.testing.assert_close(per_token[0, 1], torch.round(x[0, 1] / (1 / 127)) * (1 / 127))
    assert per_tensor[0, 1].abs().max() <= 100 / 127                  # token 1 is rounded on token 0's scale
    assert float((per_tensor[0, 1] - x[0, 1]).abs().max()) > float((per_token[0, 1] - x[0, 1]).abs().max())
    with pytest.raises(ValueError, match="granularity"):
        quantise_activations(x, 8, "channel")


def test_weight_quantisation_touches_only_decoder_linears():
    loaded = load_model("tiny-llama", device="cpu")
    before = {k: v.clone() for k, v in loaded.model.state_dict().items()}
    info = quantise_weights(loaded.model, 4)
    after = loaded.model.state_dict()
    changed = {k for k in before if not torch.equal(before[k], after[k])}
    assert changed and all(".layers." in k and k.endswith("proj.weight") for k in changed)
    assert info["layers"] == 7 * len(decoder_layers(loaded.model)) and 0 < info["max_relative_error"] < 0.5
    k = next(iter(changed))
    torch.testing.assert_close(after[k], rtn_quantise(before[k], 4))


def test_residual_quantisation_hooks_apply_inside_the_block_only():
    loaded = load_model("tiny-llama", device="cpu")
    ids = torch.tensor([[256, 72, 105, 33, 44]])
    with torch.no_grad():
        plain = loaded.model(ids).logits
        with quantised_residual(loaded.model, bits=8):
            quantised = loaded.model(ids).logits
        with pytest.raises(RuntimeError), quantised_residual(loaded.model, bits=4):
            raise RuntimeError("boom")
        again = loaded.model(ids).logits
    assert not torch.equal(plain, quantised)
    torch.testing.assert_close(again, plain)
    assert all(not block._forward_pre_hooks for block in decoder_layers(loaded.model))


def test_vscale_retrofit_starts_as_the_identity():
    loaded = load_model("tiny-llama", device="cpu")
    ids = torch.tensor([[256, 72, 105, 33, 44]])
    with torch.no_grad():
        before = loaded.model(ids).logits
        apply_vscale(loaded.model, theta=RETROFIT_THETA)
        retrofit = loaded.model(ids).logits
    torch.testing.assert_close(retrofit, before, rtol=1e-5, atol=1e-5)
    fresh = load_model("tiny-llama", device="cpu")
    with torch.no_grad():
        apply_vscale(fresh.model)                                     # the paper's theta = 0 is not the identity
        assert not torch.allclose(fresh.model(ids).logits, before, atol=1e-3)

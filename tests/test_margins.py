"""Theorem 1 on a weight update, against its definition: the projection-only logits are those of the reference
model with one layer's W_q / W_k replaced (a full forward pass per layer), and the realised ones those of the
adapted model."""
import copy

import pytest
import torch

from sinkbook.core.arch import arch_for, decoder_layers, get_module
from sinkbook.core.models import encode
from sinkbook.measures.margins import (_projections_from, attention_logits, sink_margins, theorem1_on_update,
                                       window_layers)


def _adapted(model, scale=0.02, seed=0):
    """A copy with every weight moved (so the realised change differs from the projection-only one)."""
    torch.manual_seed(seed)
    other = copy.deepcopy(model)
    with torch.no_grad():
        for p in other.parameters():
            p.add_(scale * p.abs().mean() * torch.randn_like(p))
    return other


def _batch(tokenizer):
    return encode(tokenizer, ["the cat sat on the mat and looked around", "a short one", "one more prompt here"])


@pytest.mark.parametrize("family", ["llama", "gemma3"])
def test_projection_only_logits_match_a_forward_pass_per_layer(family, loaded_model):
    loaded = loaded_model(f"tiny-{family}")
    reference, adapted = loaded.model, _adapted(loaded.model)
    batch = _batch(loaded.tokenizer)
    layers = window_layers(reference)
    result = theorem1_on_update(reference, adapted, batch, layers)
    rows = result["rows"]
    base = attention_logits(reference, batch, layers)
    realised = sink_margins(base, attention_logits(adapted, batch, layers), batch["attention_mask"])
    for layer in layers:
        with _projections_from(reference, adapted, layer):
            swapped = attention_logits(reference, batch, [layer])
        direct = sink_margins({layer: base[layer]}, swapped, batch["attention_mask"])[layer]
        keep = ~torch.isnan(direct["G"])
        mine = rows[rows.layer == layer]
        assert len(mine) == int(keep.sum())
        torch.testing.assert_close(torch.tensor(mine.B_projection.values), direct["B"][keep], rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(torch.tensor(mine.G.values), direct["G"][keep], rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(torch.tensor(mine.B_realised.values), realised[layer]["B"][keep],
                                   rtol=1e-5, atol=1e-5)
    # the update moved other weights too, so the two B's differ somewhere: the test can tell them apart
    assert (rows.B_realised - rows.B_projection).abs().max() > 1e-3
    # the reference model's weights are back and no hook is left behind
    arch = arch_for(reference)
    for layer in layers:
        block = decoder_layers(reference)[layer]
        assert not torch.equal(get_module(block, arch.q_proj).weight, get_module(decoder_layers(adapted)[layer],
                                                                                    arch.q_proj).weight)
        assert not get_module(block, arch.attn)._forward_pre_hooks


def test_theorem1_bound_holds_on_a_small_update(loaded_model):
    loaded = loaded_model("tiny-llama")
    result = theorem1_on_update(loaded.model, _adapted(loaded.model, scale=0.01), _batch(loaded.tokenizer))
    assert result["form"] == "eq4"
    assert ((result["rows"].B_projection / result["rows"].bound) <= 1 + 1e-4).all()


@pytest.mark.parametrize("family", ["llama", "gemma3"])
def test_first_order_regime_is_the_largest_relative_change_of_a_projection(family, loaded_model):
    from sinkbook.measures.margins import first_order_regime
    loaded = loaded_model(f"tiny-{family}")
    reference, arch = loaded.model, arch_for(loaded.model)
    batch, layers = _batch(loaded.tokenizer), window_layers(loaded.model)
    assert first_order_regime(reference, copy.deepcopy(reference), batch, layers) == 0.0
    scaled = copy.deepcopy(reference)
    with torch.no_grad():                       # dW = 0.1 W on one layer's keys: ||dW x|| / ||W x|| = 0.1 exactly
        get_module(decoder_layers(scaled)[layers[-1]], arch.k_proj).weight.mul_(1.1)
    assert first_order_regime(reference, scaled, batch, layers) == pytest.approx(0.1, rel=1e-4)
    moved = _adapted(reference, scale=0.05)     # random moves: positive, and larger for larger moves
    assert 0 < first_order_regime(reference, moved, batch, layers) < first_order_regime(
        reference, _adapted(reference, scale=0.5), batch, layers)

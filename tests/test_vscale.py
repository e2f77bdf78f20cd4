"""V-scale: the forward map, its Jacobian, and how it sits in a Llama model."""
import math

import pytest
import torch

from sinkbook.interventions.vscale import (SIGMA, VScaledProjection, apply_vscale, has_vscale, learned_theta,
                             vscale_jacobian_eigenvalues, vscale_values)



@pytest.fixture(autouse=True)
def float64_default():
    """Exact comparisons here run in float64; restore the default so other test modules keep float32."""
    previous = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    yield
    torch.set_default_dtype(previous)


def test_forward_matches_formula_per_head():
    torch.manual_seed(0)
    d_model, heads, d_head = 48, 3, 16
    v = torch.randn(2, 5, heads, d_head) * 0.3
    theta = torch.tensor([0.0, 1.0, -2.0])
    out = vscale_values(v, theta, d_model)
    for h in range(heads):
        c = d_model * d_head * SIGMA**2 * math.exp(theta[h].item())
        for b in range(2):
            for t in range(5):
                x = v[b, t, h]
                r = float(x @ x)
                torch.testing.assert_close(out[b, t, h], x * r / (r + c))


def test_small_values_shrink_and_large_values_pass():
    d_model, d_head = 64, 16
    c = d_model * d_head * SIGMA**2
    small = torch.full((1, d_head), math.sqrt(c / d_head) * 0.01)   # ||v||^2 = 1e-4 C
    large = torch.full((1, d_head), math.sqrt(c / d_head) * 100.0)  # ||v||^2 = 1e4 C
    theta = torch.zeros(1)
    assert vscale_values(small, theta, d_model).norm() < 1e-3 * small.norm()
    assert vscale_values(large, theta, d_model).norm() > 0.999 * large.norm()


@pytest.mark.parametrize("scale", [0.05, 0.4, 1.0, 3.0])
def test_jacobian_eigenvalues_match_autograd(scale):
    torch.manual_seed(1)
    d_model, d_head = 32, 8
    theta = torch.tensor([0.3])
    v = torch.randn(1, d_head) * scale
    jac = torch.autograd.functional.jacobian(lambda x: vscale_values(x, theta, d_model), v).reshape(d_head, d_head)
    eig = torch.linalg.eigvalsh((jac + jac.T) / 2)
    torch.testing.assert_close(jac, jac.T)  # the Jacobian is symmetric
    c = torch.tensor(d_model * d_head * SIGMA**2 * math.exp(0.3))
    perp, radial = vscale_jacobian_eigenvalues(v.pow(2).sum(), c)
    expected = torch.sort(torch.cat([perp.repeat(d_head - 1), radial.reshape(1)])).values
    torch.testing.assert_close(eig, expected, rtol=1e-9, atol=1e-12)


def test_radial_eigenvalue_peaks_at_nine_eighths():
    c = torch.tensor(2.0)
    r = torch.linspace(0.01, 40, 20001)
    _, radial = vscale_jacobian_eigenvalues(r, c)
    assert radial.max().item() == pytest.approx(9 / 8, abs=1e-6)
    assert r[radial.argmax()].item() == pytest.approx(3 * c.item(), rel=1e-2)


def _tiny_llama(**kw):
    from transformers import LlamaConfig, LlamaForCausalLM
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=kw.get("kv", 4), max_position_embeddings=64)
    return LlamaForCausalLM(cfg).to(torch.float32)


def test_apply_vscale_wraps_every_layer_and_changes_output():
    model = _tiny_llama()
    ids = torch.randint(0, 64, (2, 12))
    before = model(ids).logits
    apply_vscale(model)
    assert has_vscale(model)
    assert learned_theta(model).shape == (2, 4)
    after = model(ids).logits
    assert not torch.allclose(before, after)
    with pytest.raises(ValueError, match="twice"):
        apply_vscale(model)


def test_wrapped_v_proj_equals_formula_on_raw_values():
    model = apply_vscale(_tiny_llama(kv=2))            # GQA: one theta per KV head
    wrapped = model.model.layers[1].self_attn.v_proj
    assert isinstance(wrapped, VScaledProjection) and wrapped.theta.shape == (2,)
    with torch.no_grad():
        wrapped.theta.copy_(torch.tensor([0.5, -1.0]))
    x = torch.randn(3, 7, 32, dtype=torch.float32)
    raw = wrapped.proj(x).view(3, 7, 2, 8)
    expected = vscale_values(raw, wrapped.theta, 32).reshape(3, 7, 16)
    torch.testing.assert_close(wrapped(x), expected)


def test_theta_receives_gradient():
    model = apply_vscale(_tiny_llama())
    ids = torch.randint(0, 64, (2, 12))
    model(ids, labels=ids).loss.backward()
    grads = [layer.self_attn.v_proj.theta.grad for layer in model.model.layers]
    assert all(g is not None and g.abs().sum() > 0 for g in grads)


def test_sdpa_and_eager_agree_with_vscale():
    model = apply_vscale(_tiny_llama())
    ids = torch.randint(0, 64, (2, 12))
    model.set_attn_implementation("sdpa")
    a = model(ids).logits
    model.set_attn_implementation("eager")
    b = model(ids).logits
    torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)


def test_raw_value_norms_match_a_direct_computation():
    """||W_V h~_t|| per value head, from the layer input through input_layernorm, before V-scale."""
    from sinkbook.interventions.vscale import raw_value_norms
    model = apply_vscale(_tiny_llama(kv=2))
    with torch.no_grad():
        for layer in model.model.layers:                       # a valve that visibly changes the values
            layer.self_attn.v_proj.theta.fill_(2.0)
    ids = torch.randint(0, 64, (3, 12), generator=torch.Generator().manual_seed(3))
    got = raw_value_norms(model, ids)
    with torch.no_grad():
        hidden = model(ids, output_hidden_states=True).hidden_states
        expected = []
        for i, layer in enumerate(model.model.layers):
            raw = layer.self_attn.v_proj.proj(layer.input_layernorm(hidden[i]))      # (B, T, Hkv * d)
            expected.append(raw.view(3, 12, 2, 8).norm(dim=-1).mean(0).T)           # (Hkv, T)
    assert got.shape == (2, 2, 12)
    torch.testing.assert_close(got, torch.stack(expected).float(), rtol=1e-5, atol=1e-6)
    after = torch.stack([layer.self_attn.v_proj(layer.input_layernorm(hidden[i])).view(3, 12, 2, 8)
                         .norm(dim=-1).mean(0).T for i, layer in enumerate(model.model.layers)]).detach()
    assert (got.double() > after.double()).all()              # V-scale shrinks every value state


def test_raw_value_norms_refuse_a_model_without_vscale():
    from sinkbook.interventions.vscale import raw_value_norms
    with pytest.raises(ValueError, match="no V-scale"):
        raw_value_norms(_tiny_llama(), torch.randint(0, 64, (1, 5)))


def test_raw_value_gradients_follow_the_chain_rule_through_the_valve():
    """grad wrt raw v = J^T grad wrt v_hat, J = phi I + 2C/(r+C)^2 v v^T (paper Prop. 8), summed over the batch."""
    from sinkbook.core.hooks import capture, frozen
    from sinkbook.interventions.vscale import raw_values
    model = apply_vscale(_tiny_llama(kv=2))
    with torch.no_grad():
        model.model.layers[0].self_attn.v_proj.theta.copy_(torch.tensor([1.5, -0.5]))
    ids = torch.randint(0, 64, (2, 12), generator=torch.Generator().manual_seed(4))
    with frozen(model), capture(model, points=("v_proj",), grads=("v_proj",)) as cap, raw_values(model) as raw:
        embeddings = model.get_input_embeddings()(ids).detach().requires_grad_(True)
        model(inputs_embeds=embeddings, labels=ids).loss.backward()
    theta = model.model.layers[0].self_attn.v_proj.theta.detach()
    g = cap.grad("v_proj", 0).double()                          # (B, T, Hkv, d), wrt v_hat
    v = raw[0].detach().double().view(2, 12, 2, 8)
    r = v.pow(2).sum(-1, keepdim=True)
    c = (32 * 8 * SIGMA**2 * torch.exp(theta.double()))[:, None]
    jg = r / (r + c) * g + 2 * c / (r + c) ** 2 * v * (v * g).sum(-1, keepdim=True)
    expected = jg.sum(0).flatten(-2).norm(dim=-1)
    got = raw.grad_norms()
    assert got.shape == (2, 12)
    torch.testing.assert_close(got[0].double(), expected, rtol=1e-4, atol=1e-9)
    with raw_values(model) as no_backward:
        with torch.no_grad():
            model(ids)
    with pytest.raises(ValueError, match="no gradient"):
        no_backward.grad_norms()

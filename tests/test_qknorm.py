"""The two QK-norm interventions against their definitions: the fixed scale is the calibrated mean of 1/RMS, is
linear in its input and keeps the step-0 function close; the injected norm is per-head RMS normalisation with
unit, trainable gains applied before RoPE."""
import copy

import pytest
import torch

from sinkbook.core.arch import arch_for, decoder_layers, get_module, head_dim
from sinkbook.core.hooks import capture, hook_count
from sinkbook.core.models import encode, load_model
from sinkbook.interventions.qknorm import FixedQKScale, HeadRMSNorm, fix_qk_norm, inject_qk_norm

TEXTS = ["The cat sat on the mat and looked out of the window.", "Attention sinks anchor the first token.",
         "Hello world, again and again"]
NATIVE = ("qwen3", "gemma3")           # per-head QK-norm
WITHOUT = ("llama", "mistral", "qwen2")


def _model(family):
    loaded = load_model(f"tiny-{family}", device="cpu")     # a fresh copy: both interventions change the model
    return loaded.model, encode(loaded.tokenizer, TEXTS, chat=False), loaded.tokenizer


def _logits(model, batch):
    with torch.no_grad():
        return model(**batch).logits


# ---- fix_qk_norm ----------------------------------------------------------------------------------------

@pytest.mark.parametrize("family", NATIVE)
def test_the_fixed_scale_is_the_mean_inverse_rms_over_real_tokens(family):
    model, batch, _ = _model(family)
    arch = arch_for(model)
    with torch.no_grad(), capture(model, points=("q_proj", "k_proj")) as cap:     # pre-norm, (B, T, H, d)
        model(**batch)
    real = batch["attention_mask"].bool()
    native = {(i, kind): get_module(block, getattr(arch, kind + "_norm"))
              for i, block in enumerate(decoder_layers(model)) for kind in "qk"}
    fixed = fix_qk_norm(model, batch)
    for (i, kind), norm in native.items():
        eps = getattr(norm, "variance_epsilon", getattr(norm, "eps", None))
        x = cap[kind + "_proj", i].double()
        expected = torch.rsqrt(x.pow(2).mean(-1) + eps)[real].mean(0)                # (H,)
        module = fixed[i][kind]
        assert get_module(decoder_layers(model)[i], getattr(arch, kind + "_norm")) is module
        assert isinstance(module, FixedQKScale)
        torch.testing.assert_close(module.scale.double(), expected, rtol=1e-5, atol=0)
        # per token: F(x) = N(x) * c_h * RMS(x_h), the native norm's output rescaled, nothing else
        layout = (lambda t: t.transpose(1, 2)) if arch.family == "gemma3_text" else (lambda t: t)
        xf = cap[kind + "_proj", i]                                                   # (B, T, H, d)
        rms = torch.sqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
        with torch.no_grad():
            got = layout(module(layout(xf)))
            want = layout(norm(layout(xf))) * module.scale[:, None] * rms
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
        assert module.weight is norm.weight and module.weight.requires_grad
        assert "scale" not in dict(module.named_parameters())


@pytest.mark.parametrize("family", NATIVE)
def test_step0_logits_stay_close_to_the_native_model(family):
    model, batch, tok = _model(family)
    native = copy.deepcopy(model)
    # exact where every token's head RMS is the calibrated one: a batch of one token, calibrated on itself
    one = encode(tok, [""], chat=False)
    assert one["input_ids"].shape == (1, 1)
    exact = copy.deepcopy(model)
    fix_qk_norm(exact, one)
    torch.testing.assert_close(_logits(exact, one), _logits(native, one), rtol=1e-5, atol=1e-5)

    fix_qk_norm(model, batch)
    ref, new = _logits(native, batch), _logits(model, batch)
    real = batch["attention_mask"].bool()
    err = float((new - ref)[real].norm() / ref[real].norm())
    # Measured: 0.45 (tiny-qwen3), 0.17 (tiny-gemma3). Random heads of d_h = 16 give each token a head RMS
    # within about +-25% of the mean (5-95%), and three layers compound it. The same model without the division
    # by RMS at all (scale 1) is much further off, so the calibration is doing the work.
    assert err < 0.5, err
    arch = arch_for(model)
    for layer in decoder_layers(model):
        for path in (arch.q_norm, arch.k_norm):
            get_module(layer, path).scale.fill_(1.0)
    unscaled = float((_logits(model, batch) - ref)[real].norm() / ref[real].norm())
    assert unscaled > 1.5 * err, (unscaled, err)


@pytest.mark.parametrize("family", NATIVE)
def test_the_replacement_no_longer_normalises(family):
    model, batch, _ = _model(family)
    arch = arch_for(model)
    native_norm = get_module(decoder_layers(model)[1], arch.q_norm)
    module = fix_qk_norm(model, batch)[1]["q"]
    torch.manual_seed(0)
    x = torch.randn(2, 4, 5, head_dim(model)) if module.head_axis == -3 else torch.randn(2, 5, 4, head_dim(model))
    y = torch.randn_like(x)
    with torch.no_grad():
        for a in (0.5, 10.0):
            torch.testing.assert_close(module(a * x), a * module(x))
            torch.testing.assert_close(native_norm(a * x), native_norm(x), rtol=1e-3, atol=1e-3)   # the norm did
        torch.testing.assert_close(module(x + y), module(x) + module(y))
    # in the model: scaling W_q by 10 scales the queries the kernel gets by 10 (the native norm absorbed it)
    q_proj = get_module(decoder_layers(model)[1], arch.q_proj)

    def queries():
        with torch.no_grad(), capture(model, points=("q",), layers=[1]) as cap:
            model(**batch)
        return cap["q", 1]
    before = queries()
    with torch.no_grad():
        q_proj.weight.mul_(10.0)
    torch.testing.assert_close(queries(), 10.0 * before, rtol=1e-4, atol=1e-4)


def test_fix_refuses_models_without_a_per_head_norm():
    for family, match in (("llama", "has no per-head QK-norm"), ("olmo2", "has no per-head QK-norm.*layerwise")):
        model, batch, _ = _model(family)
        with pytest.raises(ValueError, match=match):
            fix_qk_norm(model, batch)
    model, batch, _ = _model("qwen3")
    fix_qk_norm(model, batch)
    with pytest.raises(ValueError, match="already fixed"):
        fix_qk_norm(model, batch)


# ---- inject_qk_norm -------------------------------------------------------------------------------------

@pytest.mark.parametrize("family", WITHOUT)
def test_the_injected_norm_is_per_head_rms_with_unit_gains(family):
    model, batch, _ = _model(family)
    arch = arch_for(model)
    d, eps = head_dim(model), model.config.rms_norm_eps
    native = _logits(model, batch)
    injected = inject_qk_norm(model)
    with torch.no_grad(), capture(model, points=("attn_in", "q_proj", "k_proj", "q", "k")) as cap:
        model(**batch)
    for i, block in enumerate(decoder_layers(model)):
        attn = get_module(block, arch.attn)
        for kind in "qk":
            proj = get_module(block, getattr(arch, kind + "_proj"))
            raw = torch.nn.functional.linear(cap["attn_in", i], proj.weight, proj.bias).unflatten(-1, (-1, d))
            direct = raw / torch.sqrt(raw.pow(2).mean(-1, keepdim=True) + eps)
            torch.testing.assert_close(cap[kind + "_proj", i], direct, rtol=1e-5, atol=1e-5)
            # RoPE comes after the norm: it rotates, so every head vector the kernel gets has norm ~ sqrt(d)
            norms = cap[kind, i].norm(dim=-1)
            torch.testing.assert_close(norms, torch.full_like(norms, d ** 0.5), rtol=1e-3, atol=0)
            norm = getattr(attn, kind + "_norm")
            assert isinstance(norm, HeadRMSNorm) and norm is injected.norms[i][kind]
            assert torch.equal(norm.weight, torch.ones(d)) and norm.weight.requires_grad
    assert {id(p) for p in injected.parameters()} <= {id(p) for p in model.parameters()}
    assert not torch.allclose(_logits(model, batch), native)     # unit gains do not preserve the function


def test_the_injected_gains_train_and_remove_restores_the_model():
    model, batch, _ = _model("llama")
    native, hooks = _logits(model, batch), hook_count(model)
    injected = inject_qk_norm(model)
    optimizer = torch.optim.SGD(injected.parameters(), lr=0.1)
    loss = model(**batch, labels=batch["input_ids"]).loss
    loss.backward()
    assert all(p.grad is not None and p.grad.abs().max() > 0 for p in injected.parameters())
    optimizer.step()
    assert not torch.equal(injected.norms[1]["q"].weight, torch.ones(head_dim(model)))
    # a deep copy applies its own norms (the hook is a bound method, not a closure over the original)
    twin = copy.deepcopy(model)
    with torch.no_grad():
        for layer in injected.norms.values():
            layer["k"].weight.mul_(3.0)
    assert not torch.allclose(_logits(twin, batch), _logits(model, batch))
    injected.remove()
    torch.testing.assert_close(_logits(model, batch), native, rtol=0, atol=0)
    assert hook_count(model) == hooks
    assert not any(hasattr(get_module(b, "self_attn"), "q_norm") for b in decoder_layers(model))


def test_inject_refuses_a_model_that_has_a_norm():
    for family in ("qwen3", "gemma3", "olmo2"):
        model, _, _ = _model(family)
        with pytest.raises(ValueError, match="already has a (per-head|layerwise) QK-norm"):
            inject_qk_norm(model)
    model, _, _ = _model("llama")
    inject_qk_norm(model)
    with pytest.raises(ValueError, match="already has an injected QK-norm"):
        inject_qk_norm(model)

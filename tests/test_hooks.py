"""The capture and intervene contexts against transformers' own eager attention and plain forwards."""
import numpy as np
import pytest
import torch

from sinkbook.core.hooks import CAPTURE_POINTS, capture, hook_count, intervene
from sinkbook.core.models import encode


def eager_attentions(model, **inputs):
    model.set_attn_implementation("eager")
    try:
        with torch.no_grad():
            return model(**inputs, output_attentions=True).attentions
    finally:
        model.set_attn_implementation("sdpa")


def check_capture_matches_eager(model, inputs, layers=None):
    reference = eager_attentions(model, **inputs)
    with torch.no_grad(), capture(model, points=("pattern",), layers=layers) as cap:
        model(**inputs)
    assert model.config._attn_implementation == "sdpa"
    errors = []
    for layer in cap.layers:
        got, want = cap["pattern", layer], reference[layer]
        assert got.shape == want.shape
        keep = inputs["attention_mask"].bool()[:, None, :, None] if "attention_mask" in inputs else slice(None)
        # rows of padded queries are meaningless in both implementations
        diff = torch.where(keep, (got - want).abs(), 0.0) if "attention_mask" in inputs else (got - want).abs()
        errors.append(diff.max().item())
    return max(errors)


def test_pattern_matches_eager_tiny(tiny, ids):
    assert check_capture_matches_eager(tiny.model, {"input_ids": ids}) <= 1e-5


def test_pattern_matches_eager_with_left_padding(tiny):
    batch = encode(tiny.tokenizer, ["a short one", "a considerably longer prompt than the first"], chat=False)
    assert batch["attention_mask"][0, 0] == 0  # really padded
    assert check_capture_matches_eager(tiny.model, batch) <= 1e-5


@pytest.mark.real_model
def test_pattern_matches_eager_real(real):
    batch = encode(real.tokenizer, ["List three facts about the Moon, in lowercase letters only."])
    layers = [0, real.model.config.num_hidden_layers // 2, -1]
    assert check_capture_matches_eager(real.model, batch, layers=layers) <= 1e-5


def test_logits_unchanged_inside_and_after(tiny, ids):
    model = tiny.model
    with torch.no_grad():
        before = model(ids).logits
        hooks_before = hook_count(model)
        with capture(model, points=tuple(CAPTURE_POINTS)):
            inside = model(ids).logits
        after = model(ids).logits
    assert torch.equal(before, inside)
    assert torch.equal(before, after)
    assert hook_count(model) == hooks_before


@pytest.mark.real_model
def test_logits_unchanged_after_real(real):
    batch = encode(real.tokenizer, ["Say hello."])
    with torch.no_grad():
        before = real.model(**batch).logits
        with capture(real.model, points=("pattern", "z", "resid_mid")):
            real.model(**batch)
        after = real.model(**batch).logits
    assert torch.equal(before, after)


def test_shapes_follow_gqa(tiny, ids):
    cfg = tiny.model.config
    H, Hkv, d, D = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim, cfg.hidden_size
    assert Hkv < H  # the tiny configs use grouped-query attention
    with torch.no_grad(), capture(tiny.model, points=tuple(CAPTURE_POINTS), layers=[1]) as cap:
        tiny.model(ids)
    B, T = ids.shape
    expected = {"resid_pre": (B, T, D), "q": (B, H, T, d), "k": (B, Hkv, T, d), "v": (B, Hkv, T, d),
                "pattern": (B, H, T, T), "z": (B, T, H, d), "resid_mid": (B, T, D), "resid_post": (B, T, D)}
    assert {p: tuple(cap[p, 1].shape) for p in expected} == expected


def test_residual_points_are_consistent(loaded_model, ids):
    model = loaded_model("tiny-llama").model
    with torch.no_grad(), capture(model, points=("resid_pre", "resid_post"), layers=[0, 1]) as cap:
        model(ids)
    assert torch.equal(cap["resid_post", 0], cap["resid_pre", 1])


def test_z_is_attention_output(loaded_model, ids):
    """z @ o_proj^T + residual == resid_mid (Llama: the attention branch has no post-norm)."""
    model = loaded_model("tiny-llama").model
    with torch.no_grad(), capture(model, points=("z", "resid_pre", "resid_mid"), layers=[1]) as cap:
        model(ids)
    o_proj = model.model.layers[1].self_attn.o_proj
    rebuilt = cap["resid_pre", 1] + o_proj(cap["z", 1].flatten(-2))
    assert torch.allclose(rebuilt, cap["resid_mid", 1], atol=1e-5)


def test_no_hook_left_after_exception(tiny, ids):
    model = tiny.model
    hooks_before = hook_count(model)
    with pytest.raises(RuntimeError, match="boom"):
        with capture(model, points=tuple(CAPTURE_POINTS)):
            model(ids)
            raise RuntimeError("boom")
    assert hook_count(model) == hooks_before
    assert model.config._attn_implementation == "sdpa"
    with pytest.raises(RuntimeError, match="boom"):
        with intervene(model, {("z", 0): lambda z, layer: z, ("k", 1): lambda k, layer: k}):
            raise RuntimeError("boom")
    assert hook_count(model) == hooks_before
    assert not any(hasattr(m, "_sinkbook_listeners") for m in model.modules())


def test_identity_intervention_keeps_logits(tiny, ids):
    model = tiny.model
    identity = lambda x, layer: x  # noqa: E731
    edits = {("resid_pre", 0): identity, ("k", 1): identity, ("v", 1): identity, ("z", 2): identity,
             ("attn", 2): lambda call: None}
    with torch.no_grad():
        before = model(ids).logits
        with intervene(model, edits):
            inside = model(ids).logits
    assert torch.equal(before, inside)


def test_intervention_changes_logits_and_is_undone(loaded_model, ids):
    model = loaded_model("tiny-qwen3").model
    with torch.no_grad():
        before = model(ids).logits
        with intervene(model, {("z", 1): lambda z, layer: torch.zeros_like(z)}):
            edited = model(ids).logits
        after = model(ids).logits
    assert not torch.allclose(before, edited)
    assert torch.equal(before, after)


def test_zeroing_values_zeroes_z(loaded_model, ids):
    model = loaded_model("tiny-llama").model
    with torch.no_grad(), intervene(model, {("v", 0): lambda v, layer: torch.zeros_like(v)}), \
            capture(model, points=("z",), layers=[0]) as cap:
        model(ids)
    assert torch.count_nonzero(cap["z", 0]) == 0


def test_reducer_replaces_tensor(loaded_model, ids):
    model = loaded_model("tiny-gemma3").model
    with torch.no_grad(), capture(model, points=("pattern",), reducers={"pattern": lambda p, layer: p[..., 0].mean()}) as cap:
        model(ids)
    assert all(cap["pattern", layer].ndim == 0 for layer in cap.layers)


def test_stop_early_skips_later_layers(loaded_model, ids):
    model = loaded_model("tiny-llama").model
    seen = []
    handle = model.model.layers[2].register_forward_pre_hook(lambda m, a: seen.append(2))
    try:
        with torch.no_grad(), capture(model, points=("resid_pre",), layers=[1], stop_early=True) as cap:
            model(ids)
            pytest.fail("the forward pass should have been abandoned")
    finally:
        handle.remove()
    assert seen == [] and cap["resid_pre", 1].shape[0] == 2


def test_capture_during_generate_with_cache(loaded_model):
    lm = loaded_model("tiny-llama")
    batch = encode(lm.tokenizer, ["hello"], chat=False)
    T = batch["input_ids"].shape[1]
    with torch.no_grad(), capture(lm.model, points=("pattern", "k"), layers=[0]) as cap:
        out = lm.model.generate(**batch, max_new_tokens=3, do_sample=False)
    # the last decode step sees all earlier keys from the cache
    assert cap["pattern", 0].shape[-2:] == (1, T + 2)
    assert torch.allclose(cap["pattern", 0].sum(-1), torch.ones(1))
    assert out.shape[1] == T + 3


def test_bad_arguments_give_clear_errors(loaded_model):
    model = loaded_model("tiny-llama").model
    with pytest.raises(ValueError, match="unknown capture point"):
        with capture(model, points=("attn_scores",)):
            pass
    with pytest.raises(ValueError, match="out of range"):
        with capture(model, layers=[7]):
            pass
    with pytest.raises(ValueError, match="cannot intervene"):
        with intervene(model, {("pattern", 0): lambda x, layer: x}):
            pass


# ---- residual-stream points, projections and gradients, on every family -------------------------------------

def test_branch_points_add_up_to_the_residual_stream(tiny, ids):
    from sinkbook.core.arch import arch_for, decoder_layers, get_module
    model = tiny.model
    points = ("resid_pre", "attn_in", "q_proj", "k_proj", "v_proj", "attn_out", "resid_mid", "mlp_in", "mlp_out",
              "resid_post")
    with torch.no_grad(), capture(model, points=points) as cap:
        model(input_ids=ids)
    arch = arch_for(model)
    cfg = model.config
    for layer in cap.layers:
        block = decoder_layers(model)[layer]
        torch.testing.assert_close(cap["resid_mid", layer], cap["resid_pre", layer] + cap["attn_out", layer])
        torch.testing.assert_close(cap["resid_post", layer], cap["resid_mid", layer] + cap["mlp_out", layer])
        expected_in = cap["resid_pre", layer] if arch.input_norm is None else \
            get_module(block, arch.input_norm)(cap["resid_pre", layer])
        torch.testing.assert_close(cap["attn_in", layer], expected_in)
        q = get_module(block, arch.q_proj)(cap["attn_in", layer])
        torch.testing.assert_close(cap["q_proj", layer], q.unflatten(-1, (cfg.num_attention_heads, -1)))
        assert cap["k_proj", layer].shape[-2] == cfg.num_key_value_heads
        assert cap["v_proj", layer].shape == cap["k_proj", layer].shape
        if layer + 1 < len(cap.layers):
            torch.testing.assert_close(cap["resid_post", layer], cap["resid_pre", layer + 1])


def test_gradients_of_captured_points_match_autograd(tiny, ids):
    from sinkbook.core.hooks import frozen
    model = tiny.model
    embeds = model.get_input_embeddings()(ids).detach().requires_grad_(True)
    grads = ("resid_pre", "attn_in", "q_proj", "resid_mid", "mlp_in", "resid_post")
    hooks_before = hook_count(model)     # transformers keeps its own output-recording hooks once asked for attentions
    with frozen(model), capture(model, points=("pattern",), grads=grads) as cap:
        out = model(inputs_embeds=embeds, labels=ids)
        out.loss.backward()
    assert all(p.grad is None for p in model.parameters())
    # the first layer's input is the embedding (Gemma scales inside the embedding module, before this point)
    torch.testing.assert_close(cap.grad("resid_pre", 0), embeds.grad)
    last = cap.layers[-1]
    # an independent route: keep the same activations in the graph and ask autograd directly
    with frozen(model), capture(model, points=("attn_in", "resid_mid", "mlp_in"), detach=False) as plain:
        loss = model(inputs_embeds=embeds.detach().requires_grad_(True), labels=ids).loss
    for point in ("attn_in", "resid_mid", "mlp_in"):
        for layer in cap.layers:
            (direct,) = torch.autograd.grad(loss, plain[point, layer], retain_graph=True)
            torch.testing.assert_close(cap.grad(point, layer), direct)
    assert cap.grad("q_proj", 0).shape == cap["q_proj", 0].shape
    assert cap.grad("resid_post", last).abs().sum() > 0
    with pytest.raises(ValueError, match="not captured with gradients"):
        cap.grad("pattern", 0)
    assert hook_count(model) == hooks_before


def test_pattern_cannot_carry_a_gradient(tiny):
    with pytest.raises(ValueError, match="no gradient"):
        with capture(tiny.model, grads=("pattern",)):
            pass


def test_gradient_probe_runs_on_every_family(tiny, ids):
    from sinkbook.measures.gradprobes import probe_batch
    model = tiny.model
    batch = torch.cat([torch.full((2, 1), tiny.tokenizer.bos_token_id), ids, ids], dim=1)   # 41 tokens, BOS first
    hooks_before = hook_count(model)
    r = probe_batch(model, batch)
    L = model.config.num_hidden_layers
    assert r.grad_h_tilde.shape == (L, batch.shape[1]) and np.isfinite(r.r_gs()).all()
    assert (r.grad_q[:, 0] <= 1e-5 * r.grad_q[:, 1:].max()).all()
    assert all(p.grad is None and p.requires_grad for p in model.parameters())
    assert hook_count(model) == hooks_before
    for ratios in (r.attn_ratios, r.mlp_ratios):
        assert all(np.isfinite(v).all() and (v > 0).all() for v in ratios.values())

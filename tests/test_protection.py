"""Head-selective sink protection against its definitions: frozen layers stay bitwise, the protected component of
every W_q / W_k update is zero and the rest passes unchanged, the sink key is pinned (and moves without the
projection), a model without a sink is left alone, bad arguments fail early.

Random tiny models have no sink of their own, so most tests choose the first layer and the heads by hand."""
import copy

import pytest
import torch

from sinkbook.core.arch import arch_for, decoder_layers, get_module, head_dim
from sinkbook.core.hooks import capture, hook_count
from sinkbook.core.models import encode, load_model
from sinkbook.interventions.protection import (LayerDirections, SinkProtection, calibrate_protection,
                                               first_sink_layer, sink_heads)

PROMPTS = ["The cat sat on the mat.", "Hello world, again"]


def _fresh(loaded, dtype=torch.float32):
    """A private copy of a cached tiny model (training must not leak into other tests) and the calibration batch."""
    return copy.deepcopy(loaded.model).to(dtype), encode(loaded.tokenizer, PROMPTS, chat=False)


def _train(model, optimizer, steps=3, seed=0):
    torch.manual_seed(seed)
    for _ in range(steps):
        ids = torch.randint(0, 256, (2, 12))
        ids[:, 0] = 256                               # BOS first, as in the calibration prompts
        loss = model(input_ids=ids, labels=ids).loss
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()


def _state(model):
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def _first(batch):
    return batch["attention_mask"].argmax(-1)         # left padding: the first real token of each row


def _at_sink(model, batch, layer, points):
    """The captured points at the sink position of every row, e.g. 'k' -> (B, Hkv, d), 'attn_in' -> (B, D)."""
    with torch.no_grad(), capture(model, points=points, layers=[layer]) as cap:
        model(**batch)
    rows = torch.arange(batch["input_ids"].shape[0])
    out = {}
    for point in points:
        x = cap[point, layer]
        out[point] = x[rows, :, _first(batch)] if point in ("k", "v") else x[rows, _first(batch)]
    return out


def _proj(model, layer, which):
    arch = arch_for(model)
    return get_module(decoder_layers(model)[layer], getattr(arch, which))


def _stack(module, before_w, before_b):
    """[dW | db] since the snapshot (the bias column only when the projection has one)."""
    dw = module.weight.detach() - before_w
    if module.bias is None:
        return dw
    return torch.cat([dw, (module.bias.detach() - before_b)[:, None]], dim=1)


def _freeze_like_protection(model, first_layer, layer):
    """What attach freezes for one protected layer, plus the embeddings (the adaptation recipe freezes them)."""
    arch = arch_for(model)
    blocks = decoder_layers(model)
    params = [p for block in blocks[:first_layer] for p in block.parameters()]
    params += [p for path in (arch.input_norm, arch.q_norm, arch.k_norm) if path
               for p in get_module(blocks[layer], path).parameters()]
    for p in params + [model.get_input_embeddings().weight]:
        p.requires_grad_(False)


# ---- freezing and detaching ---------------------------------------------------------------------------------

def test_frozen_layers_stay_bitwise_and_detach_undoes_everything(tiny):
    model, batch = _fresh(tiny)
    # heads at layer 1 too: its norms are listed twice (frozen layer and protected layer), detach must still restore
    prot = calibrate_protection(model, batch, first_layer=2, heads={1: [0], 2: [1, 2]})
    assert prot.active and "layers below 2 frozen" in prot.reason
    flags = {n: p.requires_grad for n, p in model.named_parameters()}
    before, hooks = _state(model), hook_count(model)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    prot.attach(model, optimizer)
    with pytest.raises(RuntimeError, match="already attached"):
        prot.attach(model, optimizer)
    _train(model, optimizer)
    names = dict((id(p), n) for n, p in model.named_parameters())
    blocks = decoder_layers(model)
    arch = arch_for(model)
    frozen = [names[id(p)] for block in blocks[:2] for p in block.parameters()]
    frozen += [names[id(p)] for path in (arch.input_norm, arch.q_norm, arch.k_norm) if path
               for p in get_module(blocks[2], path).parameters()]
    after = _state(model)
    for n in frozen:
        assert torch.equal(after[n], before[n]), n
    moved = [n for n in after if not torch.equal(after[n], before[n])]
    assert set(moved) == set(after) - set(frozen)      # everything else trained (AdamW decays even zero grads)

    prot.detach()
    assert {n: p.requires_grad for n, p in model.named_parameters()} == flags
    assert not optimizer._optimizer_step_pre_hooks and not optimizer._optimizer_step_post_hooks
    assert hook_count(model) == hooks
    _train(model, optimizer, steps=1)                  # the layers below move again once detached
    assert not torch.equal(_state(model)[frozen[0]], before[frozen[0]])


# ---- the protected component is zero ------------------------------------------------------------------------

def test_every_update_loses_its_protected_component_and_the_sink_key_is_pinned(tiny):
    model, batch = _fresh(tiny)
    d = head_dim(model)
    prot = calibrate_protection(model, batch, first_layer=1, heads={1: [0]})     # head 0 -> kv head 0
    model.get_input_embeddings().weight.requires_grad_(False)
    at_sink = _at_sink(model, batch, 1, ("attn_in", "k_proj", "k"))
    q, k = _proj(model, 1, "q_proj"), _proj(model, 1, "k_proj")
    snap = {m: (m.weight.detach().clone(), None if m.bias is None else m.bias.detach().clone()) for m in (q, k)}
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    prot.attach(model, optimizer)
    _train(model, optimizer)
    prot.detach()

    # key side, against the definition: [dW_k | db_k] [xi_s; 1] = 0 on the protected kv head's rows
    xi = at_sink["attn_in"].double()                                           # (B, D), the k_proj input
    if k.bias is not None:
        xi = torch.cat([xi, xi.new_ones(xi.shape[0], 1)], dim=1)
    dk = _stack(k, *snap[k]).double()
    moved = dk @ xi.T                                                          # (Hkv * d, B)
    assert dk[:d].abs().max() > 1e-3                                           # the protected rows did train
    assert moved[:d].abs().max() <= 1e-5 * dk[:d].abs().max() * xi.norm(dim=1).max()
    layerwise = arch_for(model).qk_norm == "layerwise"      # OLMo 2's shared RMS: every row of k_proj pinned
    if not layerwise:                                                          # kv head 1 is not protected
        assert moved[d:].abs().max() > 1e-2 * dk[d:].abs().max() * xi.norm(dim=1).max()

    # the sink key itself, before and after QK-norm and RoPE: kv head 0 pinned, kv head 1 free
    now = _at_sink(model, batch, 1, ("k_proj", "k"))
    for point in ("k_proj", "k"):
        scale = at_sink[point].abs().max()
        torch.testing.assert_close(now[point][:, 0], at_sink[point][:, 0], rtol=0, atol=1e-5 * scale)
        if not layerwise:
            assert (now[point][:, 1] - at_sink[point][:, 1]).abs().max() > 1e-3 * scale

    # query side: U^T [dW_q | db_q] = 0 on the protected rows, for the stored directions U
    dirs = prot.directions[1]
    dq = _stack(q, *snap[q]).double()[dirs.q_rows]
    assert dirs.q_basis.shape[1] >= 1 and dq.abs().max() > 1e-3
    assert (dirs.q_basis.T @ dq).abs().max() <= 1e-5 * dq.abs().max()

    # and the module's own report agrees
    report = prot.protected_components(model, _named(model, snap))[1]
    assert report["q"] <= 1e-5 * report["q_update"] and report["k"] <= 1e-5 * report["k_update"]


def _named(model, snap):
    names = {id(p): n for n, p in model.named_parameters()}
    out = {}
    for m, (w, b) in snap.items():
        out[names[id(m.weight)]] = w
        if b is not None:
            out[names[id(m.bias)]] = b
    return out


def test_without_the_projection_the_sink_key_moves(tiny):
    """The negative control of the test above: the same freezing, no projection."""
    model, batch = _fresh(tiny)
    _freeze_like_protection(model, first_layer=1, layer=1)
    before = _at_sink(model, batch, 1, ("k",))["k"]
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    _train(model, optimizer)
    after = _at_sink(model, batch, 1, ("k",))["k"]
    assert (after[:, 0] - before[:, 0]).abs().max() > 1e-3 * before.abs().max()


def test_the_query_directions_hold_the_sink_logit(tiny):
    """With every w(t) captured (energy 1 on a short prompt: 6 queries, fewer than d), a projected W_q update leaves
    the logits of the calibration queries to the sink unchanged: exactly without QK-norm (the logit is linear in
    q_t), to first order with it; the unprojected update moves them. Logits from the captured q, k (post-RoPE)."""
    model, _ = _fresh(tiny, torch.float64)
    batch = encode(tiny.tokenizer, ["abcdef"], chat=False)
    prot = calibrate_protection(model, batch, first_layer=1, heads={1: [0]}, energy=1.0)
    q = _proj(model, 1, "q_proj")
    w0 = q.weight.detach().clone()
    torch.manual_seed(0)
    dw = 1e-4 * w0.abs().max() * torch.randn_like(w0)
    projected, _ = prot.project_q(1, dw)
    kept = projected - dw
    assert projected.norm() > 0.5 * dw.norm()                  # most of the update passes

    def sink_logits(delta):
        with torch.no_grad():
            q.weight.copy_(w0 + delta)
            with capture(model, points=("q", "k"), layers=[1]) as cap:
                model(**batch)
            q.weight.copy_(w0)
        return cap["q", 1][0, 0, 1:] @ cap["k", 1][0, 0, 0]           # head 0 (kv head 0), queries t > 0

    base = sink_logits(torch.zeros_like(dw))
    raw = (sink_logits(dw) - base).abs().max()
    left = (sink_logits(projected) - base).abs().max()
    assert raw > 1e-7
    # Measured: ~1e-8 without QK-norm (w(t) comes through the float32 logits of hooks.AttentionCall), ~3e-4 with
    # it (the second-order leak at this update size; it shrinks with the update).
    tol = 1e-6 if arch_for(model).qk_norm == "none" else 1e-2
    assert left <= tol * raw, (float(left), float(raw))
    assert kept.abs().max() > 0                                     # something was removed


# ---- the rest passes unchanged (projection algebra on synthetic directions) ----------------------------------

def _synthetic(with_bias, seed=0):
    g = torch.Generator().manual_seed(seed)
    q_rows, k_rows = torch.arange(4, 12), torch.arange(0, 8)
    q_basis = torch.linalg.qr(torch.randn(8, 3, generator=g, dtype=torch.float64))[0]
    k_basis = torch.linalg.qr(torch.randn(6 + with_bias, 2, generator=g, dtype=torch.float64))[0]
    dirs = LayerDirections(q_rows, q_basis, k_rows, k_basis, {0: 1.0})
    return SinkProtection(first_layer=1, heads={1: (1,)}, directions={1: dirs}), g


@pytest.mark.parametrize("with_bias", [False, True])
def test_projection_removes_exactly_the_protected_part(with_bias):
    prot, g = _synthetic(with_bias)
    dirs = prot.directions[1]
    rnd = lambda *s: torch.randn(*s, generator=g, dtype=torch.float64)   # noqa: E731
    dw, db = rnd(16, 6), (rnd(16) if with_bias else None)

    # query side: (I - U U^T) on the protected rows; other rows untouched
    pw, pb = prot.project_q(1, dw, db)
    stacked = dw[dirs.q_rows] if db is None else torch.cat([dw[dirs.q_rows], db[dirs.q_rows, None]], 1)
    p_stacked = pw[dirs.q_rows] if db is None else torch.cat([pw[dirs.q_rows], pb[dirs.q_rows, None]], 1)
    torch.testing.assert_close(dirs.q_basis.T @ p_stacked, torch.zeros(3, stacked.shape[1], dtype=torch.float64),
                               rtol=0, atol=1e-12)
    torch.testing.assert_close(stacked - p_stacked, dirs.q_basis @ (dirs.q_basis.T @ stacked), rtol=0, atol=1e-12)
    others = torch.ones(16, dtype=torch.bool)
    others[dirs.q_rows] = False
    assert torch.equal(pw[others], dw[others]) and (db is None or torch.equal(pb[others], db[others]))
    again = prot.project_q(1, pw, pb)
    torch.testing.assert_close(again[0], pw, rtol=0, atol=1e-12)
    if with_bias:
        torch.testing.assert_close(again[1], pb, rtol=0, atol=1e-12)
    orth = (torch.eye(8, dtype=torch.float64) - dirs.q_basis @ dirs.q_basis.T) @ stacked
    ow = dw.clone()
    ow[dirs.q_rows] = orth[:, :6]
    ob = None
    if with_bias:
        ob = db.clone()
        ob[dirs.q_rows] = orth[:, 6]
    out = prot.project_q(1, ow, ob)
    torch.testing.assert_close(out[0], ow, rtol=0, atol=1e-12)

    # key side: [dW | db] (I - u u^T) on the protected rows
    kw, kb = prot.project_k(1, dw, db)
    k_stacked = kw[dirs.k_rows] if db is None else torch.cat([kw[dirs.k_rows], kb[dirs.k_rows, None]], 1)
    torch.testing.assert_close(k_stacked @ dirs.k_basis, torch.zeros(8, 2, dtype=torch.float64), rtol=0, atol=1e-12)
    assert torch.equal(kw[8:], dw[8:])
    torch.testing.assert_close(prot.project_k(1, kw, kb)[0], kw, rtol=0, atol=1e-12)
    orth_k = rnd(16, 6 + with_bias)
    orth_k = orth_k - (orth_k @ dirs.k_basis) @ dirs.k_basis.T                 # rows orthogonal to every u
    out = prot.project_k(1, orth_k[:, :6].contiguous(), orth_k[:, 6].contiguous() if with_bias else None)
    torch.testing.assert_close(out[0], orth_k[:, :6], rtol=0, atol=1e-12)
    if with_bias:
        torch.testing.assert_close(out[1], orth_k[:, 6], rtol=0, atol=1e-12)


def test_projected_gradients_when_asked():
    loaded = load_model("tiny-qwen2", device="cpu")                 # k_proj with a bias
    model, batch = _fresh(loaded)
    prot = calibrate_protection(model, batch, first_layer=1, heads={1: [0]})
    k = _proj(model, 1, "k_proj")
    optimizer = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    prot.attach(model, optimizer, project_grads=True)
    _train(model, optimizer, steps=1)
    grad = torch.cat([k.weight.grad, k.bias.grad[:, None]], dim=1).double()
    u = prot.directions[1].k_basis
    d = head_dim(model)
    assert (grad[:d] @ u).abs().max() <= 1e-6 * grad[:d].abs().max()
    assert (grad[d:] @ u).abs().max() > 1e-3 * grad[d:].abs().max()
    prot.detach()


# ---- no sink, and the rules ---------------------------------------------------------------------------------

def test_a_model_without_a_sink_is_left_alone(tiny):
    model, batch = _fresh(tiny)
    control = copy.deepcopy(model)
    prot = calibrate_protection(model, batch)
    assert prot.first_layer is None and not prot.heads and not prot.directions
    assert not prot.active and "no sink layer" in prot.reason
    flags = {n: p.requires_grad for n, p in model.named_parameters()}
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    prot.attach(model, optimizer)
    assert not optimizer._optimizer_step_pre_hooks and not optimizer._optimizer_step_post_hooks
    assert {n: p.requires_grad for n, p in model.named_parameters()} == flags
    _train(model, optimizer)
    _train(control, torch.optim.AdamW(control.parameters(), lr=1e-2))
    trained, plain = _state(model), _state(control)
    assert all(torch.equal(trained[n], plain[n]) for n in trained)
    prot.detach()


def test_first_sink_layer_rules():
    phi = torch.tensor([0.0, 0.25, 0.5, 1.0])
    frac = torch.tensor([0.0, 0.75, 0.25, 1.0])
    assert first_sink_layer(phi, frac) == (2, "phi_llm")
    assert first_sink_layer(phi, frac, rule="head_fraction") == (1, "head_fraction")
    assert first_sink_layer(phi, frac, min_fraction=0.2) == (1, "phi_llm")
    assert first_sink_layer(torch.zeros(4), frac) == (1, "head_fraction")        # auto falls back
    assert first_sink_layer(torch.zeros(4), frac, rule="phi_llm") == (None, "phi_llm")
    assert first_sink_layer(torch.zeros(4), torch.zeros(4))[0] is None
    alpha = torch.tensor([[0.9, 0.1], [0.31, 0.3], [0.0, 0.5]])
    assert sink_heads(alpha, 1) == {1: (0,), 2: (1,)}
    assert sink_heads(alpha, 0, eps=0.05) == {0: (0, 1), 1: (0, 1), 2: (1,)}
    assert sink_heads(alpha, None) == {}


def test_the_rule_finds_a_planted_massive_activation():
    """Layer 0 writes a massive value into the first token's residual stream: Phi_LLM flags the input of layer 1."""
    loaded = load_model("tiny-llama", device="cpu")
    model, batch = _fresh(loaded)
    first = _first(batch)

    def plant(module, args, output):
        output = output.clone()
        output[torch.arange(output.shape[0]), first, 3] += 1e4
        return output

    handle = decoder_layers(model)[0].register_forward_hook(plant)
    try:
        prot = calibrate_protection(model, batch)
    finally:
        handle.remove()
    assert prot.census.phi_first.tolist() == [0.0, 1.0, 1.0]
    assert (prot.first_layer, prot.rule) == (1, "phi_llm") and prot.active
    assert prot.heads == sink_heads(prot.census.alpha, 1)


@pytest.mark.parametrize("kwargs, match", [
    (dict(rule="median"), "unknown rule"),
    (dict(first_layer=3), "first_layer"),
    (dict(first_layer="first"), "first_layer"),
    (dict(heads={5: [0]}), "layer"),
    (dict(heads={1: [4]}), r"query-head indices 0\.\.3"),
    (dict(heads=[1, 2]), "mapping"),
    (dict(rank=0), "rank"),
    (dict(rank=None), "rank"),
    (dict(energy=1.5), "energy"),
    (dict(eps=1.2), "eps"),
    (dict(min_fraction=0), "min_fraction"),
    (dict(k_rtol=0), "k_rtol"),
])
def test_bad_arguments_fail_early(kwargs, match):
    loaded = load_model("tiny-llama", device="cpu")
    batch = encode(loaded.tokenizer, PROMPTS, chat=False)
    with pytest.raises(ValueError, match=match):
        calibrate_protection(loaded.model, batch, **kwargs)

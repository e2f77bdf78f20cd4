"""The trainer (determinism, recipe) and the gradient probes, on tiny models and a synthetic corpus."""
import dataclasses

import numpy as np
import pytest
import torch

from sinkbook.training.corpus import Corpus, sample_batch, validation_batches
from sinkbook.measures.gradprobes import middle_layers, probe_batch, shows_sink_and_massive_activation
from sinkbook.core.hooks import attention_implementation
from sinkbook.training.loop import decay_groups as param_groups
from sinkbook.training.scratch import TrainConfig, build_model, load_checkpoints, load_run, lr_at, train


def _corpus(vocab=300):
    rng = np.random.default_rng(0)
    # a learnable stream: a short repeated motif with noise, so the loss can drop in a few steps
    motif = rng.integers(1, vocab, 37)
    ids = np.tile(motif, 400)
    noise = rng.random(len(ids)) < 0.1
    ids[noise] = rng.integers(1, vocab, noise.sum())
    ids = ids.astype(np.uint16)
    return Corpus(ids[:12000], ids[12000:], tokenizer=None, bos_id=0, vocab_size=vocab,
                  train_works=["a"], val_works=["b"], sdist=None)


CFG = TrainConfig(size="nano", steps=4, batch_size=4, context=40, warmup_steps=1, vocab_size=300,
                  eval_every=2, eval_batches=1, lr=3e-3)


def _run(cfg, corpus, tmp_path):
    return train(cfg, corpus, device="cpu", use_cache=False, save=False, progress=False)


@pytest.mark.parametrize("vscale", [False, True])
def test_training_is_deterministic_per_seed(vscale, tmp_path):
    corpus = _corpus()
    cfg = CFG.with_(vscale=vscale)
    a, b = _run(cfg, corpus, tmp_path), _run(cfg, corpus, tmp_path)
    assert [h["loss"] for h in a.history] == [h["loss"] for h in b.history]
    for (name, pa), (_, pb) in zip(a.model.state_dict().items(), b.model.state_dict().items()):
        assert torch.equal(pa, pb), name
    c = _run(cfg.with_(seed=1), corpus, tmp_path)
    assert [h["loss"] for h in c.history] != [h["loss"] for h in a.history]


def test_training_lowers_the_loss():
    corpus = _corpus()
    run = train(CFG.with_(steps=30, warmup_steps=3, eval_every=30), corpus, device="cpu", use_cache=False,
                save=False, progress=False)
    assert run.history[-1]["loss"] < run.history[0]["loss"] - 1.0


def test_same_data_for_baseline_and_vscale():
    corpus = _corpus()
    g1, g2 = torch.Generator().manual_seed(5), torch.Generator().manual_seed(5)
    assert torch.equal(sample_batch(corpus.train_ids, 3, 20, 0, g1), sample_batch(corpus.train_ids, 3, 20, 0, g2))
    batch = sample_batch(corpus.train_ids, 3, 20, corpus.bos_id, torch.Generator().manual_seed(0))
    assert batch.shape == (3, 20) and (batch[:, 0] == corpus.bos_id).all()
    no_bos = sample_batch(corpus.train_ids, 3, 20, None, torch.Generator().manual_seed(0))
    assert no_bos.shape == (3, 20)


def test_weight_decay_only_on_matrices():
    model = build_model(CFG.with_(vscale=True), bos_id=0)
    decay, rest = param_groups(model, 0.1)
    assert decay["weight_decay"] == 0.1 and rest["weight_decay"] == 0.0
    assert all(p.ndim == 2 for p in decay["params"]) and all(p.ndim == 1 for p in rest["params"])
    thetas = {id(l.self_attn.v_proj.theta) for l in model.model.layers}
    assert thetas <= {id(p) for p in rest["params"]}


def test_schedule_warms_up_then_decays():
    cfg = TrainConfig(size="nano", steps=100, warmup_steps=10, lr=1.0, min_lr_ratio=0.1)
    lrs = [lr_at(s, cfg) for s in range(100)]
    assert lrs[0] == pytest.approx(0.1) and lrs[9] == pytest.approx(1.0)
    assert all(x >= y for x, y in zip(lrs[10:], lrs[11:]))
    assert lrs[-1] == pytest.approx(0.1, abs=0.01)


def test_bad_config_is_refused_clearly():
    with pytest.raises(ValueError, match="unknown model size"):
        TrainConfig(size="huge")
    with pytest.raises(ValueError, match="warmup_steps"):
        TrainConfig(steps=10, warmup_steps=20)


def test_checkpoint_round_trip(tmp_path):
    corpus = _corpus()
    run = train(CFG, corpus, device="cpu", use_cache=True, save=True, progress=False, root=tmp_path)
    assert not run.from_cache
    again = load_run(CFG, corpus, "cpu", root=tmp_path)
    assert again is not None and again.from_cache
    ids = validation_batches(corpus.val_ids, 2, 40, 0, 1)[0]
    torch.testing.assert_close(run.model(ids).logits, again.model(ids).logits)
    assert load_run(CFG.with_(seed=9), corpus, "cpu", root=tmp_path / "other") is None


@pytest.mark.parametrize("vscale", [False, True])
def test_probes_basic_correctness(vscale):
    corpus = _corpus()
    model = build_model(CFG.with_(vscale=vscale), bos_id=0)
    ids = validation_batches(corpus.val_ids, 3, 40, 0, 1)[0]
    r = probe_batch(model, ids)
    L = model.config.num_hidden_layers
    assert r.grad_q.shape == (L, 40) and r.residual_norm.shape == (L, 40)
    # causal masking: grad wrt q_0 is zero; the fused SDPA backward leaves float32 rounding, eager gives exact 0
    assert (r.grad_q[:, 0] <= 1e-6 * r.grad_q[:, 1:].max()).all()
    assert (r.grad_q[:, 1:10] > 0).all() and (r.grad_k[:, 0] > 0).all() and (r.grad_v[:, 0] > 0).all()
    with attention_implementation(model, "eager"):
        assert (probe_batch(model, ids).grad_q[:, 0] == 0).all()
    assert model.config._attn_implementation == "sdpa"               # restored after the eager probe
    assert all(p.requires_grad for p in model.parameters()) and all(p.grad is None for p in model.parameters())
    # the reported loss is the model's own loss on that batch
    assert r.loss == pytest.approx(model(ids, labels=ids).loss.item(), rel=1e-5)
    # R_GS by hand from the stored token-wise norms
    g = r.grad_h_tilde
    assert r.r_gs()[0] == pytest.approx(g[0, 0] / g[0, 1:32].mean(), rel=1e-6)
    assert r.sink_rate.shape == (L,) and ((0 <= r.sink_rate) & (r.sink_rate <= 1)).all()
    assert np.isfinite(r.attn_ratios["bloat"]).all()


def test_probe_gradients_match_autograd_on_h_tilde():
    corpus = _corpus()
    model = build_model(CFG, bos_id=0)
    ids = validation_batches(corpus.val_ids, 2, 40, 0, 1)[0]
    r = probe_batch(model, ids)
    captured = {}
    h = model.model.layers[1].input_layernorm.register_forward_hook(lambda m, a, o: captured.setdefault("x", o))
    try:
        loss = model(ids, labels=ids).loss
    finally:
        h.remove()
    (g,) = torch.autograd.grad(loss, captured["x"])
    np.testing.assert_allclose(r.grad_h_tilde[1], g.sum(0).norm(dim=-1).numpy(), rtol=1e-4, atol=1e-9)


def test_sink_rate_and_massive_activation_are_detected_when_planted():
    """Plant a sink: make every head of every layer attend to token 0 and make token 0's residual huge."""
    corpus = _corpus()
    model = build_model(CFG.with_(size="xs"), bos_id=0)
    ids = validation_batches(corpus.val_ids, 2, 64, 0, 1)[0]
    with torch.no_grad():
        model.model.embed_tokens.weight[0] *= 400.0      # BOS embedding: massive residual at token 0
    r = probe_batch(model, ids)
    verdict = shows_sink_and_massive_activation(r)
    assert verdict["token0_ratio_middle_max"] > 5 and verdict["massive"]
    mid = middle_layers(r.n_layers)
    assert mid == slice(1, 3)


def test_sink_rate_formula_on_uniform_attention():
    """Zero query weights give uniform causal attention, a_t0 = 1/(t+1): alpha_0 is a harmonic mean."""
    corpus = _corpus()
    model = build_model(CFG, bos_id=0)
    with torch.no_grad():
        for layer in model.model.layers:
            layer.self_attn.q_proj.weight.zero_()
    ids = validation_batches(corpus.val_ids, 2, 40, 0, 1)[0]
    for t_eps, expected_rate in ((40, 0.0), (2, 1.0)):
        r = probe_batch(model, ids, sink_t_eps=t_eps)
        harmonic = sum(1 / (t + 1) for t in range(t_eps)) / t_eps
        np.testing.assert_allclose(r.alpha0, harmonic, rtol=1e-5)
        assert (r.sink_rate == expected_rate).all()


def test_intermediate_checkpoints_are_written(tmp_path):
    corpus = _corpus()
    train(CFG, corpus, device="cpu", use_cache=False, save=True, progress=False, root=tmp_path, checkpoint_every=2)
    saved = sorted(p.name for p in tmp_path.glob("*.pt"))
    assert saved == ["final.pt", "step-2.pt"]
    assert torch.load(tmp_path / "step-2.pt", weights_only=False)["step"] == 2


def test_load_checkpoints_returns_the_saved_weights_in_step_order(tmp_path):
    corpus = _corpus()
    cfg = CFG.with_(steps=6, warmup_steps=1)
    run = train(cfg, corpus, device="cpu", use_cache=False, save=True, progress=False, root=tmp_path, checkpoint_every=2)
    found = load_checkpoints(cfg, corpus, "cpu", root=tmp_path)
    assert [step for step, _ in found] == [2, 4, 6]
    ids = validation_batches(corpus.val_ids, 2, 40, 0, 1)[0]
    torch.testing.assert_close(found[-1][1](ids).logits, run.model(ids).logits)
    # an intermediate checkpoint is a different model from the final one
    assert not torch.equal(found[0][1](ids).logits, run.model(ids).logits)
    assert load_checkpoints(cfg.with_(seed=5), corpus, "cpu", root=tmp_path / "none") == []

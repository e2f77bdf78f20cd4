"""core.precision: float32 leaves a forward pass alone; bfloat16 autocasts its products and keeps the weights."""
import pytest
import torch

from sinkbook.core.precision import autocast, check_precision, fast_bfloat16


def test_float32_is_untouched_and_bfloat16_autocasts_the_products():
    layer = torch.nn.Linear(8, 4)
    x = torch.randn(3, 8)
    with autocast("float32"):
        exact = layer(x)
    with autocast("bfloat16"):
        fast = layer(x)
    assert exact.dtype == torch.float32 and fast.dtype == torch.bfloat16
    assert layer.weight.dtype == torch.float32
    torch.testing.assert_close(fast.float(), exact, rtol=2e-2, atol=2e-2)
    assert not torch.equal(fast.float(), exact)          # the products really ran in bfloat16


def test_a_training_step_under_bfloat16_keeps_float32_weights_and_gradients():
    layer = torch.nn.Linear(8, 4)
    with autocast("bfloat16"):
        out = layer(torch.randn(2, 8))
    out.float().sum().backward()
    assert out.dtype == torch.bfloat16 and layer.weight.grad.dtype == torch.float32


def test_unknown_precision_is_refused_in_one_line():
    with pytest.raises(ValueError, match="precision must be one of float32, bfloat16, got 'fp16'"):
        check_precision("fp16")
    assert isinstance(fast_bfloat16("cpu"), bool)


def test_fit_in_bfloat16_tracks_float32_and_keeps_float32_weights():
    from sinkbook.core.models import load_model
    from sinkbook.training.loop import fit
    batch = torch.randint(0, 200, (4, 24), generator=torch.Generator().manual_seed(0))
    histories, weights = {}, {}
    for precision in ("float32", "bfloat16"):
        torch.manual_seed(0)
        model = load_model("tiny-llama", device="cpu").model
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
        result = fit(model, optimizer, lambda step: batch, 3, lambda step: 1e-3, progress=False, precision=precision)
        histories[precision] = [row["loss"] for row in result.history]
        weights[precision] = {n: p.dtype for n, p in model.named_parameters()}
    assert set(weights["bfloat16"].values()) == {torch.float32}
    assert histories["bfloat16"] != histories["float32"]                 # the products did run in bfloat16
    assert histories["bfloat16"] == pytest.approx(histories["float32"], rel=1e-2)
    with pytest.raises(ValueError, match="precision must be one of"):
        fit(model, optimizer, lambda step: batch, 1, lambda step: 1e-3, progress=False, precision="half")


def test_evaluation_casts_frozen_weights_once_and_changes_no_number():
    """With a model given and gradients off, frozen weights are cast once per context (autocast's cache), the
    outputs equal plain autocast's bit for bit, and every weight's requires_grad is restored, after an exception
    too; with gradients on, nothing is marked."""
    from sinkbook.core.models import load_model
    model = load_model("tiny-llama", device="cpu").model
    model.get_input_embeddings().requires_grad_(False)
    flags = {n: p.requires_grad for n, p in model.named_parameters()}
    ids = torch.randint(0, 200, (2, 12), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        with autocast("bfloat16"):
            plain = model(ids).logits
        with autocast("bfloat16", model=model):
            assert all(p.requires_grad for p in model.parameters())
            once = model(ids).logits
            again = model(ids).logits
        with pytest.raises(RuntimeError, match="stop"):
            with autocast("bfloat16", model=model):
                raise RuntimeError("stop")
    assert torch.equal(plain, once) and torch.equal(once, again)
    assert {n: p.requires_grad for n, p in model.named_parameters()} == flags
    with autocast("bfloat16", model=model):
        assert not model.get_input_embeddings().weight.requires_grad      # gradients on: left alone
    with torch.no_grad(), autocast("float32", model=model):
        assert not model.get_input_embeddings().weight.requires_grad


def _frozen_tiny_llama():
    from sinkbook.core.models import load_model
    torch.manual_seed(0)
    model = load_model("tiny-llama", device="cpu").model
    model.get_input_embeddings().requires_grad_(False)
    model.get_output_embeddings().requires_grad_(False)
    model.model.layers[0].requires_grad_(False)
    return model


def test_training_casts_frozen_linears_once_and_changes_no_number(monkeypatch):
    """fit's frozen-weight copies (``frozen_linears_cast_once``) give the same losses and weights, bit for bit, as
    autocast's cast at every step; the frozen layers are patched during the run only, and unpatched after an
    exception too."""
    import contextlib
    import sinkbook.training.loop as loop
    batch = torch.randint(0, 200, (4, 24), generator=torch.Generator().manual_seed(0))
    frozen_layers = lambda m: [l for l in m.modules() if isinstance(l, torch.nn.Linear) and not l.weight.requires_grad]
    runs = {}
    for mode in ("every step", "once"):
        if mode == "every step":
            monkeypatch.setattr(loop, "frozen_linears_cast_once", lambda model, precision: contextlib.nullcontext())
        else:
            monkeypatch.undo()
        model = _frozen_tiny_llama()
        seen = []
        check = type("Check", (), {"start": lambda self, m: None,
                                   "__call__": lambda self, step, m, record, last:
                                   seen.append(all("forward" in vars(l) for l in frozen_layers(m)))})()
        optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-3)
        result = loop.fit(model, optimizer, lambda step: batch, 3, lambda step: 1e-3, progress=False,
                          precision="bfloat16", callbacks=[check])
        runs[mode] = ([r["loss"] for r in result.history], {n: p.detach().clone() for n, p in model.named_parameters()})
        assert seen == [mode == "once"] * 3
        assert not any("forward" in vars(l) for l in frozen_layers(model))
    assert runs["once"][0] == runs["every step"][0]
    assert all(torch.equal(runs["once"][1][n], w) for n, w in runs["every step"][1].items())
    assert len(frozen_layers(model)) >= 8                               # the output matrix and layer 0's linears

    def broken(step):
        raise RuntimeError("stop")
    with pytest.raises(RuntimeError, match="stop"):
        loop.fit(model, optimizer, broken, 2, lambda step: 1e-3, progress=False, precision="bfloat16")
    assert not any("forward" in vars(l) for l in frozen_layers(model))


def test_a_frozen_weight_changed_in_place_is_cast_again():
    from sinkbook.core.precision import frozen_linears_cast_once
    layer = torch.nn.Linear(8, 4).requires_grad_(False)
    x = torch.randn(3, 8)
    with frozen_linears_cast_once(layer, "bfloat16"), autocast("bfloat16"):
        first = layer(x)
        with torch.no_grad():
            layer.weight.mul_(2)
        second = layer(x)
    with autocast("bfloat16"):
        expected = layer(x)
    assert torch.equal(second, expected) and not torch.equal(first, second)
    with frozen_linears_cast_once(layer, "float32"):
        assert "forward" not in vars(layer)

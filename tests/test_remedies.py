"""Each intervention placed in the adaptation recipe (training.remedies): what it trains, freezes, mixes and saves,
checked on tiny models against the plain run with the same seed."""
from __future__ import annotations

import pytest
import torch

from sinkbook.core.models import load_model
from sinkbook.interventions.qknorm import FixedQKScale, HeadRMSNorm
from sinkbook.training.adapt import AdaptConfig, adapt, load_run
from sinkbook.training.remedies import RecipeChange

TINY = dict(steps=3, stage1_steps=1, align_steps=5, batch_size=4, lr=1e-3, stage1_lr=1e-2, probe_every=3)


def _run(tmp_path, model, intervention, **extra):
    cfg = AdaptConfig(model, intervention=intervention, **{**TINY, **extra})
    return adapt(cfg, device="cpu", use_cache=False, progress=False, out=tmp_path / intervention), cfg


def _llm_state(model_name):
    return {k: v.clone() for k, v in load_model(model_name, device="cpu").model.state_dict().items()}


def test_plain_keys_do_not_change_and_interventions_get_their_own():
    plain = AdaptConfig("tiny-llama")
    assert "intervention" not in plain.record() and "text_share" not in plain.record()
    keys = {AdaptConfig("tiny-llama", intervention=i).key() for i in ("none", "protection", "lora", "frozen_llm")}
    assert len(keys) == 4
    assert AdaptConfig("tiny-llama", intervention="text_blend", text_share=0.5).key() != \
        AdaptConfig("tiny-llama", intervention="text_blend").key()


@pytest.mark.parametrize("bad, why", [(dict(intervention="dropout"), "intervention must be one of"),
                                      (dict(intervention="lora", modality="text"), "use modality 'vision'"),
                                      (dict(intervention="text_blend", text_share=1.0), "text_share"),
                                      (dict(intervention="lora", lora_rank=0), "lora_rank")])
def test_bad_interventions_are_refused(bad, why):
    with pytest.raises(ValueError, match=why):
        AdaptConfig("tiny-llama", **bad)


def test_text_blend_spaces_its_text_steps_evenly():
    cfg = AdaptConfig("tiny-llama", intervention="text_blend", text_share=0.25)
    change = RecipeChange(cfg, None, None)
    assert [s for s in range(12) if change.text_step(s)] == [3, 7, 11]
    assert not any(RecipeChange(AdaptConfig("tiny-llama"), None, None).text_step(s) for s in range(12))


def test_text_blend_trains_text_batches_on_its_steps(tmp_path, monkeypatch):
    import sinkbook.training.adapt as adapt_module
    seen = []
    real = adapt_module._vlm_loss

    def spy(model, batch):
        seen.append("images" in batch and batch["images"] is not None and len(batch["images"]) > 0)
        return real(model, batch)
    monkeypatch.setattr(adapt_module, "_vlm_loss", spy)
    _run(tmp_path, "tiny-llama", "text_blend", steps=4, stage1_steps=0, text_share=0.5)
    assert seen == [True, False, True, False]          # steps 1 and 3 are text-only at a share of 1/2


def test_frozen_llm_trains_only_the_projector(tmp_path):
    before = _llm_state("tiny-llama")
    run, _ = _run(tmp_path, "tiny-llama", "frozen_llm")
    after = run.vlm.llm.state_dict()
    assert all(torch.equal(after[k], v) for k, v in before.items())
    assert run.intervention["intervention"] == "frozen_llm"


def test_lora_is_merged_into_plain_weights_and_touches_only_attention(tmp_path):
    before = _llm_state("tiny-llama")
    run, _ = _run(tmp_path, "tiny-llama", "lora", lora_rank=4, lr=1e-2)
    after = run.vlm.llm.state_dict()
    assert set(after) == set(before) and not any("lora_" in k for k in after)
    changed = {k for k, v in before.items() if not torch.equal(after[k], v)}
    assert changed and all(any(p in k for p in ("q_proj", "k_proj", "v_proj", "o_proj")) for k in changed)
    reloaded = load_model(str(tmp_path / "lora" / "model"), device="cpu")
    ids = torch.tensor([[256, 72, 105, 33]])
    torch.testing.assert_close(reloaded.model(ids).logits, run.vlm.llm(ids).logits)


def test_protection_freezes_below_the_first_sink_layer(tmp_path, monkeypatch):
    import sinkbook.interventions.protection as protection
    real = protection.calibrate_protection
    monkeypatch.setattr(protection, "calibrate_protection",
                        lambda model, batch: real(model, batch, first_layer=1, heads={1: [0]}))
    before = _llm_state("tiny-llama")
    run, _ = _run(tmp_path, "tiny-llama", "protection")
    after = run.vlm.llm.state_dict()
    layer0 = [k for k in before if ".layers.0." in k]
    assert layer0 and all(torch.equal(after[k], before[k]) for k in layer0)
    assert any(not torch.equal(after[k], before[k]) for k in before if ".layers.1.mlp" in k)
    assert run.intervention["first_sink_layer"] == 1 and run.intervention["sink_heads"] == {"1": [0]}


@pytest.mark.parametrize("model, intervention, module", [("tiny-gemma3", "fix_qk_norm", FixedQKScale),
                                                          ("tiny-llama", "inject_qk_norm", HeadRMSNorm)])
def test_a_changed_qk_norm_survives_saving_and_loading(tmp_path, model, intervention, module):
    run, _ = _run(tmp_path, model, intervention)
    assert any(isinstance(m, module) for m in run.vlm.llm.modules())
    again = load_run(tmp_path / intervention, device="cpu")
    assert any(isinstance(m, module) for m in again.vlm.llm.modules())
    ids = torch.tensor([[2, 72, 105, 33]])
    torch.testing.assert_close(again.vlm.llm(ids).logits, run.vlm.llm(ids).logits)
    # without restoring, the saved weights load as a different function: the restore is what keeps it
    plain = load_model(str(tmp_path / intervention / "model"), device="cpu")
    assert not torch.allclose(plain.model(ids).logits, run.vlm.llm(ids).logits, atol=1e-4)

"""LoRA through peft on the language model of a DigitVLM: trains, merges back into plain weights, saves and reloads.

Skipped where peft is not installed (it is not one of the pinned dependencies yet: ``peft==0.21.2``)."""
import pytest
import torch

pytest.importorskip("peft")

from sinkbook.core.models import load_model
from sinkbook.interventions.lora import apply_lora, merge_lora


class TinyVLM(torch.nn.Module):
    """Stands in for training.vlm.DigitVLM (interventions may not import training): an llm and a projector."""

    def __init__(self, llm):
        super().__init__()
        self.llm, self.projector = llm, torch.nn.Linear(8, llm.config.hidden_size)

    def forward(self, ids, feats):
        embeds = self.llm.get_input_embeddings()(ids)
        embeds = torch.cat([self.projector(feats)[:, None], embeds[:, 1:]], dim=1)
        return self.llm(inputs_embeds=embeds, labels=ids).loss


def test_lora_trains_merges_and_reloads(tmp_path):
    loaded = load_model("tiny-llama", device="cpu")
    llm = loaded.model
    base = {k: v.clone() for k, v in llm.state_dict().items()}
    vlm = TinyVLM(llm)
    handle = apply_lora(vlm, r=4, alpha=8)
    assert vlm.llm is llm
    trainable = {n for n, p in vlm.named_parameters() if p.requires_grad}
    assert trainable and all("lora_" in n or n.startswith("projector.") for n in trainable)
    assert any(n.startswith("projector.") for n in trainable)
    # B starts at zero: the adapted model is the base model at step 0
    torch.manual_seed(0)
    ids, feats = torch.randint(0, 256, (2, 12)), torch.randn(2, 8)
    with torch.no_grad():
        before = llm(input_ids=ids).logits
    optimizer = torch.optim.AdamW([p for p in vlm.parameters() if p.requires_grad], lr=1e-2)
    losses = []
    for _ in range(5):
        loss = vlm(ids, feats)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        losses.append(float(loss.detach()))
    assert losses[-1] < losses[0]
    llm.eval()
    with torch.no_grad():
        adapted = llm(input_ids=ids).logits
    assert not torch.allclose(adapted, before)
    merged = merge_lora(handle)
    assert merged is llm and type(merged).__name__ == "LlamaForCausalLM"
    assert not any("lora_" in n for n, _ in merged.named_parameters())
    with torch.no_grad():
        after_merge = merged(input_ids=ids).logits
    torch.testing.assert_close(after_merge, adapted, rtol=1e-4, atol=1e-4)
    changed = {k for k, v in merged.state_dict().items() if not torch.equal(v, base[k])}
    assert changed and all(k.split(".")[-2] in ("q_proj", "k_proj", "v_proj", "o_proj") for k in changed)
    merged.save_pretrained(tmp_path)
    loaded.tokenizer.save_pretrained(tmp_path)
    again = load_model(str(tmp_path), device="cpu").model
    with torch.no_grad():
        torch.testing.assert_close(again(input_ids=ids).logits, after_merge)


def test_targets_can_be_restricted():
    llm = load_model("tiny-qwen3", device="cpu").model
    handle = apply_lora(llm, r=2, targets=("q_proj", "k_proj"))
    names = {n.split(".lora_")[0].rsplit(".", 1)[-1] for n, _ in llm.named_parameters() if "lora_" in n}
    assert names == {"q_proj", "k_proj"}
    assert len(handle.parameters()) == 2 * 2 * 3      # A and B, two projections, three layers

"""Zero-K (OutRo paper, Sec. 4 / Figs. 4-5): zero the largest-magnitude dimension(s) of the sink token's key.

The edit acts on the keys the attention kernel receives (after QK-norm and RoPE, through the ``k``
intervention point), at every chosen layer and KV head, for one token per sequence; other keys are untouched.
Definition: the book's methods page (book/methods.md).
"""
from __future__ import annotations

import torch

from ..core.arch import n_layers
from ..core.hooks import capture, intervene
from ..core.models import encode
from ..measures.criteria import attention_to_key, first_real_position


def zero_k_edits(layers, position: torch.Tensor, top: int = 1) -> dict:
    """``intervene`` edits that zero, at each layer and KV head, the ``top`` largest-|k| dims of the key of
    token ``position`` (B,) (OutRo's Zero-K). Other tokens' keys are untouched."""
    def zero(k, layer):
        k = k.clone()
        rows = torch.arange(k.shape[0], device=k.device)
        sink_key = k[rows, :, position.to(k.device)]                                # (B, Hkv, d)
        dims = sink_key.abs().topk(top, dim=-1).indices
        sink_key = sink_key.scatter(-1, dims, 0.0)
        k[rows, :, position.to(k.device)] = sink_key
        return k
    return {("k", layer): zero for layer in layers}


def zero_k_effect(loaded, prompts: list[str], chat: bool | None = None, top: int = 1):
    """OutRo's Zero-K on the first token: mean attention to it per layer with and without zeroing the top-1
    dim of its key at every layer. Returns a DataFrame (layer, before, after)."""
    import pandas as pd

    model = loaded.model
    batch = encode(loaded.tokenizer, prompts, chat=chat, device=loaded.device)
    mask = batch["attention_mask"]
    first = first_real_position(mask, mask.shape[0], mask.device)
    layers = list(range(n_layers(model)))

    def run(edits):
        out = {}

        def reduce_pattern(pattern, layer):
            out[layer] = attention_to_key(pattern, mask, first).mean().item()
        with torch.no_grad(), intervene(model, edits), capture(model, points=("pattern",),
                                                               reducers={"pattern": reduce_pattern}):
            model(**batch, use_cache=False)
        return out

    before, after = run({}), run(zero_k_edits(layers, first, top))
    return pd.DataFrame({"layer": layers, "before": [before[x] for x in layers], "after": [after[x] for x in layers]})

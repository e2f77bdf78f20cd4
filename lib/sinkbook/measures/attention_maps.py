"""Per-head attention maps for the explorer: every layer's and head's pattern, median G and sink key, per prompt.

The book's explorer (``book.explorer``) draws these arrays; computing them is a measurement like any other, so it
lives here and chapters can check what the explorer will show.
"""
from __future__ import annotations

import numpy as np
import torch

from ..core.hooks import intervene
from ..core.models import encode
from .strength import gap_from_logits


def explorer_data(loaded, prompts: list[str], chat: bool | None = None, max_tokens: int = 64) -> dict:
    """Attention patterns, per-head G and sink key of every layer and head, one prompt at a time (no padding).

    Returns {"model", "layers", "heads", "prompts": [{"text", "tokens", "pattern" (L, H, T, T) uint8,
    "gap" (L, H) median G over queries 1.., "sink" (L, H) most frequent argmax key}]}. Prompts longer than
    ``max_tokens`` are cut (the page grows with T^2).
    """
    model = loaded.model
    cfg = getattr(model.config, "text_config", None) or model.config
    n_layers, n_heads = cfg.num_hidden_layers, cfg.num_attention_heads
    out = {"model": loaded.spec, "layers": n_layers, "heads": n_heads, "prompts": []}
    for text in prompts:
        batch = encode(loaded.tokenizer, [text], chat=chat, device=loaded.device)
        batch = {k: v[:, :max_tokens] for k, v in batch.items()}
        T = batch["input_ids"].shape[1]
        pattern = np.zeros((n_layers, n_heads, T, T), dtype=np.uint8)
        gap = np.zeros((n_layers, n_heads), dtype=np.float32)
        sink = np.zeros((n_layers, n_heads), dtype=np.int64)

        def keep(call):
            logits = call.logits()[0]                                       # (H, T, T)
            probs = torch.softmax(logits, dim=-1)
            pattern[call.layer] = (probs * 255).round().clamp(0, 255).to(torch.uint8).cpu().numpy()
            g, argmax = gap_from_logits(logits[:, 1:])                      # query 0 sees only itself
            gap[call.layer] = torch.nanmedian(g, dim=-1).values.cpu().numpy()
            sink[call.layer] = argmax.mode(dim=-1).values.cpu().numpy()
            return None

        with torch.no_grad(), intervene(model, {("attn", layer): keep for layer in range(n_layers)}):
            model(**batch, use_cache=False)
        tokens = loaded.tokenizer.convert_ids_to_tokens(batch["input_ids"][0].tolist())
        out["prompts"].append({"text": text, "tokens": [_readable(t) for t in tokens], "pattern": pattern,
                               "gap": gap, "sink": sink})
    return out


def explorer_datasets(models, prompts: list[str], chat: bool | None = None, max_tokens: int = 64) -> list[dict]:
    """``explorer_data`` for each loaded model, in order: what ``static_explorer_html`` takes."""
    return [explorer_data(loaded, prompts, chat=chat, max_tokens=max_tokens) for loaded in models]


def _readable(token: str) -> str:
    """Byte-level BPE markers to what they stand for, so axis labels read as text."""
    return token.replace("Ġ", "␣").replace("▁", "␣").replace("Ċ", "⏎").replace("\n", "⏎")


# ---- static HTML for the built book ------------------------------------------------------------------------

"""Which tokens are attention sinks: the criteria of the OutRo and gradient-sinks papers.

Formulas: shared notes (methods.md) restating OutRo Sec. 3 / App. A and the gradient-sinks paper Sec. 3.
"""
from __future__ import annotations

import torch


def phi_llm(hidden: torch.Tensor, attention_mask: torch.Tensor | None = None) -> torch.Tensor:
    """Phi_LLM massive-activation sinks on a decoder layer's input ``hidden`` (B, T, D) -> bool (B, T).

    Token i is a sink when max_d |h_i[d]| >= max(100, 1000 * median |h|), the median over all tokens and
    dims of that layer's input (per sequence; padded positions, if a mask is given, are left out).
    """
    magnitude = hidden.detach().abs().float()
    peak = magnitude.amax(dim=-1)                                  # (B, T)
    out = torch.zeros_like(peak, dtype=torch.bool)
    for b in range(hidden.shape[0]):
        keep = attention_mask[b].bool() if attention_mask is not None else slice(None)
        threshold = max(100.0, 1000.0 * magnitude[b][keep].median().item())
        out[b] = peak[b] >= threshold
        if attention_mask is not None:
            out[b] &= attention_mask[b].bool()
    return out

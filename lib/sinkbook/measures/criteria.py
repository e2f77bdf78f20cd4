"""Which tokens are attention sinks: the criteria of the OutRo and gradient-sinks papers.

Formulas: the book's methods page (book/methods.md), after OutRo Sec. 3 / App. A and the gradient-sinks
paper Sec. 3.
"""
from __future__ import annotations

import math

import numpy as np
import torch

from ..core.hooks import capture
from ..core.models import encode


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


# ---- Phi_VLM: ratio of the sink dimensions to the token's RMS ----------------------------------------------

def massive_threshold(hidden: torch.Tensor, keep: torch.Tensor | None = None) -> float:
    """Phi_LLM's threshold max(100, 1000 * median |h|) for one sequence's layer input (T, D)."""
    magnitude = hidden.detach().abs().float()
    if keep is not None:
        magnitude = magnitude[keep.bool()]
    return max(100.0, 1000.0 * magnitude.median().item())


def massive_dimensions(hidden: torch.Tensor, attention_mask: torch.Tensor | None = None) -> set[int]:
    """Dims holding a massive entry (|h| >= the Phi_LLM threshold) anywhere in a (B, T, D) layer input."""
    dims = set()
    for b in range(hidden.shape[0]):
        keep = attention_mask[b].bool() if attention_mask is not None else torch.ones(hidden.shape[1], dtype=torch.bool)
        entries = hidden[b][keep].detach().abs().float()
        hit = (entries >= massive_threshold(hidden[b], keep)).any(dim=0)
        dims.update(int(d) for d in torch.nonzero(hit).flatten())
    return dims


def rms_ratio(hidden: torch.Tensor, dims) -> torch.Tensor:
    """max_{d in dims} |h_i[d]| / RMS(h_i) for each token: (B, T, D) -> (B, T)."""
    dims = sorted(dims)
    if not dims:
        return torch.zeros(hidden.shape[:-1])
    h = hidden.detach().float()
    rms = h.pow(2).mean(dim=-1).sqrt().clamp_min(1e-12)
    return h[..., dims].abs().amax(dim=-1) / rms


def phi_vlm(hidden: torch.Tensor, sink_dims, tau: float = 20.0,
            attention_mask: torch.Tensor | None = None) -> torch.Tensor:
    """Phi_VLM sinks: max over the sink dimensions of |h_i[d]| / RMS(h_i) >= tau. (B, T, D) -> bool (B, T)."""
    if not sink_dims:
        raise ValueError("Phi_VLM needs at least one sink dimension; find them with sink_dimensions() first")
    out = rms_ratio(hidden, sink_dims) >= tau
    if attention_mask is not None:
        out &= attention_mask.bool()
    return out


def sink_dimensions(layer_inputs: dict, attention_mask: torch.Tensor | None = None, fallback_top: int = 2) -> list[int]:
    """The model's fixed set D_sink, found on calibration data.

    ``layer_inputs`` maps layer -> (B, T, D) decoder-layer input. D_sink is every dim that holds a massive
    entry (Phi_LLM threshold) at some layer. A model with no massive entry at all (it happens in small
    models) gets the ``fallback_top`` dims with the largest |h| / median|h| over all layers instead, and
    the caller can tell from ``massive_dimensions`` that the set is a fallback.
    """
    dims = set()
    for hidden in layer_inputs.values():
        dims |= massive_dimensions(hidden, attention_mask)
    if dims:
        return sorted(dims)
    score = None
    for hidden in layer_inputs.values():
        h = hidden.detach().abs().float()
        if attention_mask is not None:
            h = h * attention_mask[..., None].to(h.dtype)
        per_dim = h.amax(dim=(0, 1)) / h.median().clamp_min(1e-12)
        score = per_dim if score is None else torch.maximum(score, per_dim)
    return sorted(int(d) for d in score.topk(fallback_top).indices)


# ---- massive activations and outlier dimensions ------------------------------------------------------------

def massive_activation_stats(hidden: torch.Tensor, attention_mask: torch.Tensor | None = None) -> dict:
    """Per-sequence statistics of one layer input (B, T, D): the largest |h| of each token, its dim, the
    layer median |h| and their ratio (how far above the crowd the biggest token sits)."""
    magnitude = hidden.detach().abs().float()
    peak, peak_dim = magnitude.amax(dim=-1), magnitude.argmax(dim=-1)
    medians = []
    for b in range(hidden.shape[0]):
        keep = attention_mask[b].bool() if attention_mask is not None else slice(None)
        medians.append(magnitude[b][keep].median())
    median = torch.stack(medians)
    if attention_mask is not None:
        peak = peak.masked_fill(~attention_mask.bool(), float("nan"))
    return {"token_max": peak, "token_max_dim": peak_dim, "median": median, "ratio": peak / median[:, None]}


def outlier_dim_counts(hidden: torch.Tensor, attention_mask: torch.Tensor | None = None, magnitude: float = 6.0,
                       token_fraction: float = 0.06) -> torch.Tensor:
    """For one layer input (B, T, D): bool (B, D), dim exceeds ``magnitude`` at more than ``token_fraction``
    of a sequence's tokens. Summed over layers this feeds ``outlier_dimensions``."""
    big = hidden.detach().abs().float() > magnitude
    if attention_mask is None:
        share = big.float().mean(dim=1)
    else:
        m = attention_mask.to(torch.float32)[..., None]
        share = (big.float() * m).sum(dim=1) / m.sum(dim=1)
    return share > token_fraction


def outlier_dimensions(layers_exceeding: torch.Tensor, n_layers: int, layer_fraction: float = 0.25,
                       sequence_fraction: float = 0.9) -> list[int]:
    """Outlier dims (OutRo Table 1 / A.1, after LLM.int8): |h| > 6 at > 6% of tokens in > 25% of layers,
    in at least 90% of sequences. ``layers_exceeding`` (N, D) counts, per sequence, the layers where
    ``outlier_dim_counts`` was True."""
    per_sequence = layers_exceeding.float() / n_layers > layer_fraction           # (N, D)
    share = per_sequence.float().mean(dim=0)
    return [int(d) for d in torch.nonzero(share >= sequence_fraction).flatten()]


# ---- criteria on attention patterns ------------------------------------------------------------------------

def first_real_position(attention_mask: torch.Tensor | None, batch: int, device=None) -> torch.Tensor:
    """(B,) index of each sequence's first real token (left padding)."""
    if attention_mask is None:
        return torch.zeros(batch, dtype=torch.long, device=device)
    return (attention_mask.cumsum(-1) == 0).sum(-1)


def column_mass(pattern: torch.Tensor, attention_mask: torch.Tensor | None = None,
                position: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """M_s = sum_{t>=s} a_ts and S_s = sum_{t>=s} a_ts^2 for key s per head: (B, H, T, S) -> two (B, H).

    ``position`` (B,) is the key s of each sequence (default: its first real token). Padded query rows
    are left out.
    """
    B, S = pattern.shape[0], pattern.shape[-1]
    position = first_real_position(attention_mask, B, pattern.device) if position is None else position
    column = pattern.float()[torch.arange(B), :, :, position]                     # (B, H, T)
    if attention_mask is not None:
        column = column * attention_mask[:, None, -pattern.shape[2]:].to(column.dtype)
    return column.sum(dim=-1), column.pow(2).sum(dim=-1)


def head_fraction_sink(pattern: torch.Tensor, attention_mask: torch.Tensor | None = None, eps: float = 0.3,
                       t_eps: int = 64) -> tuple[torch.Tensor, torch.Tensor]:
    """Gradient-sinks paper's thresholded criterion at s = first token: returns (Sink^eps (B,), alpha (B, H)).

    alpha^h = mean of a_ts over the queries t = s .. s + T_eps - 1; a head votes for the sink when
    alpha^h > eps, and Sink^eps is the fraction of heads that vote. A prompt shorter than T_eps tokens
    averages over the queries it has (the paper's 1/T_eps would dilute short prompts).
    """
    B, H, T, S = pattern.shape
    start = first_real_position(attention_mask, B, pattern.device)
    column = pattern.float()[torch.arange(B), :, :, start]                        # (B, H, T)
    t = torch.arange(T, device=pattern.device)[None, :]
    window = (t >= start[:, None]) & (t < start[:, None] + t_eps)                   # (B, T)
    alpha = (column * window[:, None]).sum(-1) / window.sum(-1, keepdim=True).clamp_min(1)
    return (alpha > eps).float().mean(dim=-1), alpha


def attention_to_key(pattern: torch.Tensor, attention_mask: torch.Tensor | None = None,
                     position: torch.Tensor | None = None) -> torch.Tensor:
    """Mean attention that the real queries after s pay to key s, per sequence and head: (B, H)."""
    B, H, T, S = pattern.shape
    position = first_real_position(attention_mask, B, pattern.device) if position is None else position
    column = pattern.float()[torch.arange(B), :, :, position]
    t = torch.arange(T, device=pattern.device)[None, :]
    after = t > position[:, None]
    if attention_mask is not None:
        after = after & attention_mask[:, -T:].bool()
    return (column * after[:, None]).sum(-1) / after.sum(-1, keepdim=True).clamp_min(1)


# ---- per-layer census on a model ----------------------------------------------------------------------------

def sink_census(loaded, prompts: list[str], chat: bool | None = None, taus=(20.0, 25.0, 30.0), eps: float = 0.3,
                t_eps: int = 64, sink_dims=None) -> dict:
    """Every criterion of this module on every layer of ``loaded`` over ``prompts`` (one batched forward).

    Returns {"layers": pandas DataFrame (one row per layer), "sink_dims", "sink_dims_are_massive",
    "outlier_dims", "n_tokens"}. Attention patterns are reduced inside the forward pass (column mass,
    head fraction, attention to the first token), so only the layer inputs (B, T, D) are kept.
    """
    import pandas as pd

    model = loaded.model
    batch = encode(loaded.tokenizer, prompts, chat=chat, device=loaded.device)
    mask = batch["attention_mask"]
    attn_stats = {}

    def reduce_pattern(pattern, layer):
        mass, second = column_mass(pattern, mask)
        fraction, alpha = head_fraction_sink(pattern, mask, eps=eps, t_eps=t_eps)
        attn_stats[layer] = {"M_s": mass.mean().item(), "S_s": second.mean().item(),
                             "sink_eps": fraction.mean().item(),
                             "attn_to_first": attention_to_key(pattern, mask).mean().item()}
        return None

    # The outlier-dimension magnitude 6.0 comes from LLM.int8, where it applies to the inputs of linear layers
    # (the raw residual stream of these models exceeds 6 almost everywhere): it is tested on ``attn_in``.
    with torch.no_grad(), capture(model, points=("resid_pre", "attn_in", "pattern"),
                                  reducers={"pattern": reduce_pattern}) as cap:
        model(**batch, use_cache=False)
    inputs = {layer: cap["resid_pre", layer].float().cpu() for layer in cap.layers}
    attention_inputs = {layer: cap["attn_in", layer].float().cpu() for layer in cap.layers}
    mask = mask.cpu()
    massive = set()
    for hidden in inputs.values():
        massive |= massive_dimensions(hidden, mask)
    if sink_dims is not None:
        dims = sorted(sink_dims)
    else:   # same rule as sink_dimensions(), without scanning the layers twice
        dims = sorted(massive) if massive else sink_dimensions(inputs, mask)
    first = first_real_position(mask, mask.shape[0])
    rows, exceeding = [], torch.zeros(mask.shape[0], next(iter(inputs.values())).shape[-1])
    for layer, hidden in inputs.items():
        sinks = phi_llm(hidden, mask)
        stats = massive_activation_stats(hidden, mask)
        ratio = rms_ratio(hidden, dims).masked_fill(~mask.bool(), 0.0)
        rows_b = torch.arange(mask.shape[0])
        row = {"layer": layer,
               "phi_llm_sinks": int(sinks.sum()), "phi_llm_first_token": float(sinks[rows_b, first].float().mean()),
               "phi_llm_other_tokens": int(sinks.sum() - sinks[rows_b, first].sum()),
               "max_abs_h": float(torch.nan_to_num(stats["token_max"], nan=0.0).amax()),
               "first_token_max_abs_h": float(stats["token_max"][rows_b, first].median()),
               "median_abs_h": float(stats["median"].median()),
               "massive_ratio": float(torch.nan_to_num(stats["ratio"], nan=0.0).amax(dim=1).median()),
               "vlm_ratio_first_token": float(ratio[rows_b, first].median())}
        for tau in taus:
            vlm = ratio >= tau
            row[f"phi_vlm_{tau:g}"] = int(vlm.sum())
            row[f"phi_vlm_{tau:g}_first_token"] = float(vlm[rows_b, first].float().mean())
        row.update(attn_stats.get(layer, {}))
        rows.append(row)
        exceeding += outlier_dim_counts(attention_inputs[layer], mask).float()
    return {"layers": pd.DataFrame(rows), "sink_dims": dims, "sink_dims_are_massive": bool(massive),
            "outlier_dims": outlier_dimensions(exceeding, len(inputs)), "n_tokens": int(mask.sum()),
            "n_prompts": len(prompts)}


def late_query_attention(model, input_ids, key_masks: dict, first_query: int = 32) -> dict:
    """{name: (layers, heads) array}: the mean attention mass that queries at positions >= ``first_query`` put on
    the keys selected by each (batch, tokens) boolean mask, e.g. token 0 or every line break. Reduced per head
    inside the capture hook, so no (layers x heads x T x T) tensor is kept."""
    if input_ids.shape[1] <= first_query:
        raise ValueError(f"sequences of {input_ids.shape[1]} tokens have no query at position >= {first_query}")
    device = next(model.parameters()).device
    masks = {name: m.to(device=device, dtype=torch.float32) for name, m in key_masks.items()}
    shares: dict = {name: {} for name in masks}

    def reduce(pattern, layer):                       # (B, H, T, S)
        late = pattern[:, :, first_query:, :].float()
        for name, m in masks.items():
            shares[name][layer] = (late * m[:, None, None, :]).sum(-1).mean((0, 2)).cpu().numpy()
        return None

    with torch.no_grad(), capture(model, points=("pattern",), reducers={"pattern": reduce}):
        model(input_ids=input_ids.to(device))
    return {name: np.stack([per_layer[l] for l in sorted(per_layer)]) for name, per_layer in shares.items()}


def uniform_share(key_mask, first_query: int = 32) -> float:
    """What ``late_query_attention`` would give for a head that spreads attention evenly over the causal past."""
    m = key_mask.float()
    seen = m.cumsum(1) / torch.arange(1, m.shape[1] + 1)  # share of masked keys among 0..t
    return float(seen[:, first_query:].mean())


def census_summary(census: dict, hidden_size: int, taus) -> dict:
    """One model's census (``criteria.sink_census``) reduced to the shares the claims read."""
    per_layer, n_tokens = census["layers"], census["n_tokens"]
    n_layers = len(per_layer)
    deep = per_layer[per_layer.layer >= 2 * n_layers // 3]
    flagged = int(per_layer.phi_llm_sinks.sum())
    row = {"sqrt(D)": math.sqrt(hidden_size), "sink dims": list(census["sink_dims"]),
           "massive dims found": bool(census["sink_dims_are_massive"]),
           "Phi_LLM share (all layers)": flagged / (n_tokens * n_layers),
           "Phi_LLM flags that are token 0": 1 - per_layer.phi_llm_other_tokens.sum() / max(flagged, 1),
           "layers with a Phi_LLM sink": int((per_layer.phi_llm_sinks > 0).sum())}
    for t in taus:
        row[f"Phi_VLM tau={t:g} share, last third"] = deep[f"phi_vlm_{t:g}"].sum() / (n_tokens * len(deep))
    row["Phi_LLM share, last third"] = deep.phi_llm_sinks.sum() / (n_tokens * len(deep))
    row["Phi_LLM flags"] = flagged
    return row

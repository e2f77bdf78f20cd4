"""Sink Strength (VL paper, Sec. 3.2 and App. D.1): how hard each head leans on its favourite key.

Formulas: the book's methods page (book/methods.md), after the VL paper Sec. 3.2, App. D.1 and E.4.

For layer l, head h and query q, let p* be the key with the largest attention logit. The gap

    G = l_{p*} - logsumexp_{p != p*} l_p  ( = log(a_{p*} / (1 - a_{p*})) )

is computed from the logits, so it stays finite and exact when a_{p*} rounds to 1 in float32.
S is the median of G over (l, h, q) in the last K layers (K = 10) on the calibration prompts.

Which queries count:
- padded positions (left padding of a batch) are never queries and never keys;
- a query that sees a single key (the first real token of every prompt) has no competitor, so
  a_{p*} = 1 and G = +inf; such rows carry no information about sinks and are left out (NaN).
  With causal attention this removes exactly the first token of each prompt. Every other real token
  counts, chat-template tokens included (they are what the model reads).

G is computed inside the attention call of each hooked layer (``intervene`` on ``"attn"``), so each
layer's (B, H, T, T) logits are freed before the next layer runs; only (B, H, T) gaps are kept.
The forward pass stops after the last hooked layer (no final norm, no LM head).
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch

from ..core.arch import n_layers as layer_count
from ..core.arch import require
from ..core.hooks import capture, intervene

DEFAULT_WINDOW = 10
QUERY_BLOCK = 256        # query rows whose logits are formed at once (a memory bound, not a result)
STRONG_SINK_G = 2.0      # G > 2 means the favourite key takes > 88% of the head's attention
WINDOWS_E4 = (3, 5, 10, 15, 20)            # the last-K windows of VL App. E.4
THIRDS = ("early", "middle", "late")       # equal thirds of the decoder (VL Table 13)


def gap_from_logits(logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(..., S) logits with masked keys at -inf -> (G, argmax key), G NaN where fewer than 2 keys are visible."""
    logits = logits.float()
    top, argmax = logits.max(dim=-1)
    rest = logits.scatter(-1, argmax.unsqueeze(-1), float("-inf"))
    others = torch.logsumexp(rest, dim=-1)
    gap = top - others
    gap = torch.where(torch.isfinite(gap), gap, torch.full_like(gap, float("nan")))
    return gap, argmax


@dataclass
class StrengthResult:
    """Per-layer gaps of one batch of prompts; S for any window is a reduction of these."""
    gaps: dict                       # layer -> (B, H, T) float32, NaN where excluded
    sink_keys: dict                  # layer -> (B, H, T) int64 argmax key (position in the padded batch)
    n_layers: int
    attention_mask: torch.Tensor     # (B, T)
    seconds: float = 0.0
    info: dict = field(default_factory=dict)

    def layers_for(self, window: int | str | None = DEFAULT_WINDOW) -> list[int]:
        """Layer indices of the last ``window`` layers, or "early"/"middle"/"late" thirds, or all (None)."""
        if window is None:
            chosen = list(range(self.n_layers))
        elif isinstance(window, str):
            thirds = {"early": 0, "middle": 1, "late": 2}
            if window not in thirds:
                raise ValueError(f"window must be a number of last layers or one of {list(thirds)}, got {window!r}")
            bounds = [round(i * self.n_layers / 3) for i in range(4)]
            chosen = list(range(bounds[thirds[window]], bounds[thirds[window] + 1]))
        else:
            if not 1 <= int(window) <= self.n_layers:
                raise ValueError(f"window K={window} is out of range: the model has {self.n_layers} layers")
            chosen = list(range(self.n_layers - int(window), self.n_layers))
        missing = [layer for layer in chosen if layer not in self.gaps]
        if missing:
            raise ValueError(f"layers {missing} were not measured; compute with layers=None (all) for this window")
        return chosen

    def subset(self, prompts) -> "StrengthResult":
        """The same gaps restricted to some prompts (indices into the batch); used for sample-size sweeps
        without recomputing (each prompt's gaps do not depend on the others in its batch)."""
        idx = torch.as_tensor(list(prompts), dtype=torch.long)
        return StrengthResult({k: v[idx] for k, v in self.gaps.items()}, {k: v[idx] for k, v in self.sink_keys.items()},
                              self.n_layers, self.attention_mask[idx], self.seconds,
                              {**self.info, "n_prompts": len(idx)})

    def values(self, window: int | str | None = DEFAULT_WINDOW) -> torch.Tensor:
        """All finite G in the window, flattened."""
        g = torch.cat([self.gaps[layer].flatten() for layer in self.layers_for(window)])
        return g[~torch.isnan(g)]

    def strength(self, window: int | str | None = DEFAULT_WINDOW, reduce: str = "median") -> float:
        g = self.values(window)
        if g.numel() == 0:
            raise ValueError("no query has two or more visible keys; use longer prompts")
        if reduce == "median":
            return float(g.median()) if g.numel() % 2 else float(g.quantile(0.5))
        if reduce == "mean":
            return float(g.mean())
        raise ValueError(f"reduce must be 'median' or 'mean', got {reduce!r}")

    def strong_fraction(self, window: int | str | None = DEFAULT_WINDOW, threshold: float = STRONG_SINK_G) -> float:
        """Fraction of (layer, head, query) in the window with G > threshold."""
        g = self.values(window)
        return float((g > threshold).float().mean())

    def head_table(self, window: int | str | None = None):
        """pandas DataFrame: one row per (layer, head) with median G, strong fraction and the sink position
        (most frequent argmax key, counted from each prompt's first real token)."""
        import pandas as pd
        first_real = (self.attention_mask.cumsum(-1) == 0).sum(-1)   # (B,) index of first real token
        rows = []
        for layer in self.layers_for(window):
            g, keys = self.gaps[layer], self.sink_keys[layer]
            for head in range(g.shape[1]):
                gh = g[:, head]
                valid = ~torch.isnan(gh)
                vals = gh[valid]
                rel = (keys[:, head] - first_real[:, None])[valid]
                rows.append({"layer": layer, "head": head, "median_G": float(vals.median()),
                             "mean_G": float(vals.mean()), "strong_fraction": float((vals > STRONG_SINK_G).float().mean()),
                             "sink_key": int(rel.mode().values), "sink_key_share": float((rel == rel.mode().values).float().mean())})
        return pd.DataFrame(rows)

    def layer_quantiles(self, window: int | str | None = DEFAULT_WINDOW):
        """pandas DataFrame, one row per layer of the window: the five numbers of a box plot of G (quartiles,
        and the furthest G within 1.5 IQR of them), so a figure need not carry every gap."""
        import pandas as pd
        rows = []
        for layer in self.layers_for(window):
            g = self.gaps[layer].flatten()
            g = g[~torch.isnan(g)]
            if g.numel() == 0:
                continue
            q1, median, q3 = (float(g.quantile(q)) for q in (0.25, 0.5, 0.75))
            reach = 1.5 * (q3 - q1)
            rows.append({"layer": layer, "q1": q1, "median": median, "q3": q3,
                         "lowerfence": float(g[g >= q1 - reach].min()), "upperfence": float(g[g <= q3 + reach].max())})
        return pd.DataFrame(rows, columns=["layer", "q1", "median", "q3", "lowerfence", "upperfence"])

    def quantiles(self, window: int | str | None = DEFAULT_WINDOW, qs=(0.05, 0.25, 0.5, 0.75, 0.95)) -> dict:
        g = self.values(window)
        return {f"q{round(q * 100):02d}": float(g.quantile(q)) for q in qs}

    def summary(self, window: int | str | None = DEFAULT_WINDOW) -> dict:
        return {"S": self.strength(window), "mean_G": self.strength(window, "mean"),
                "strong_fraction": self.strong_fraction(window), "quantiles": self.quantiles(window),
                "window": window, "layers": self.layers_for(window), "n_gaps": int(self.values(window).numel()),
                "seconds": self.seconds, **self.info}


def gaps_for_batch(model, batch: dict, layers=None, learned_sink: dict | None = None) -> tuple[dict, dict]:
    """Run one forward pass and return ({layer: G (B,H,T)}, {layer: argmax key (B,H,T)}) for ``layers``.

    A model with learned sink logits (gpt-oss) puts part of each row's attention on a column that is no key. G keeps
    its definition over the keys (the sink's share scales every key alike, so the keys' ratios are untouched);
    given a dict, ``learned_sink`` receives {layer: (share of the learned sink (B,H,T), G with the learned sink
    counted as one more key (B,H,T))}, NaN at padded queries."""
    require(model, "sink strength")
    n_layers = layer_count(model)
    layers = list(range(n_layers)) if layers is None else sorted({(x + n_layers) % n_layers for x in layers})
    mask = batch.get("attention_mask")
    real = mask.bool() if mask is not None else torch.ones_like(batch["input_ids"], dtype=torch.bool)
    gaps, keys = {}, {}

    def reduce_block(call, rows: slice):
        logits = call.logits(rows)                                 # (B, H, rows, S), masked at -inf
        S = logits.shape[-1]
        logits = logits.masked_fill(~real[:, None, None, -S:], float("-inf"))
        queries = real[:, None, -call.query.shape[2]:][..., rows]  # (B, 1, rows): real query positions
        gap, argmax = gap_from_logits(logits)
        out = [gap.masked_fill(~queries, float("nan")), argmax]
        if learned_sink is not None and call.sinks is not None:
            column = call.sinks.float().view(1, -1, 1, 1).expand(*logits.shape[:-1], 1)
            both = torch.cat([logits, column], dim=-1)
            out += [torch.softmax(both, dim=-1)[..., -1].masked_fill(~queries, float("nan")),
                    gap_from_logits(both)[0].masked_fill(~queries, float("nan"))]
        return out

    def reduce_layer(call):
        # Query blocks: the layer's (B, H, T, S) logits are never whole, so memory grows with T, not T^2.
        T = call.query.shape[2]
        blocks = [reduce_block(call, slice(i, i + QUERY_BLOCK)) for i in range(0, T, QUERY_BLOCK)]
        parts = [torch.cat(p, dim=-1) for p in zip(*blocks)]
        gaps[call.layer], keys[call.layer] = parts[0], parts[1]
        if len(parts) > 2:
            learned_sink[call.layer] = (parts[2], parts[3])
        return None                                                # the attention output is left as it is

    edits = {("attn", layer): reduce_layer for layer in layers}
    with torch.no_grad(), intervene(model, edits), capture(model, points=(), layers=[layers[-1]], stop_early=True):
        model(**batch, use_cache=False)
    return gaps, keys


def sink_strength(loaded, prompts: list[str], chat: bool | None = None, layers=None, batch_size: int = 16,
                  window: int | None = DEFAULT_WINDOW) -> StrengthResult:
    """Gaps G on ``prompts`` for ``layers`` (default: the last ``window`` layers; ``layers="all"`` for all)."""
    from ..core.models import check_input_fits, encode
    if not prompts:
        raise ValueError("no prompts given")
    n_layers = layer_count(loaded.model)
    if layers is None:
        if not 1 <= int(window) <= n_layers:
            raise ValueError(f"window K={window} is out of range: {loaded.spec} has {n_layers} layers")
        layers = list(range(n_layers - int(window), n_layers))
    elif layers == "all":
        layers = list(range(n_layers))
    start = time.perf_counter()
    gaps, keys, masks = {}, {}, []
    width = 0
    chunks = [prompts[i:i + batch_size] for i in range(0, len(prompts), batch_size)]
    encoded = [encode(loaded.tokenizer, chunk, chat=chat, device=loaded.device) for chunk in chunks]
    width = max(b["input_ids"].shape[1] for b in encoded)
    for batch in encoded:                        # every batch, before the first forward pass
        check_input_fits(loaded, batch["attention_mask"])
    shares, with_sink = [], []
    for batch in encoded:
        learned = {}
        g, k = gaps_for_batch(loaded.model, batch, layers, learned)
        shares += [v[0][torch.isfinite(v[0])].flatten() for v in learned.values()]
        with_sink += [v[1][torch.isfinite(v[1])].flatten() for v in learned.values()]
        pad = width - batch["input_ids"].shape[1]                  # re-pad on the left so chunks stack
        for layer in g:
            gaps.setdefault(layer, []).append(torch.nn.functional.pad(g[layer].cpu(), (pad, 0), value=float("nan")))
            keys.setdefault(layer, []).append(torch.nn.functional.pad(k[layer].cpu() + pad, (pad, 0), value=0))
        masks.append(torch.nn.functional.pad(batch["attention_mask"].cpu(), (pad, 0), value=0))
    seconds = time.perf_counter() - start
    used_chat = bool(getattr(loaded.tokenizer, "chat_template", None)) if chat is None else bool(chat)
    info = {"model": loaded.spec, "n_prompts": len(prompts), "chat": used_chat}
    if shares:                 # learned sink logits: how much attention they take, and S if they counted as a key
        info["learned_sink_share"] = float(torch.cat(shares).mean())
        info["S_with_learned_sink"] = float(torch.cat(with_sink).median())
    return StrengthResult({layer: torch.cat(v) for layer, v in gaps.items()},
                          {layer: torch.cat(v) for layer, v in keys.items()}, n_layers, torch.cat(masks),
                          seconds, info)


# ---- robustness sweeps (VL paper App. D.1, E.4) -------------------------------------------------------------

def sample_size_sweep(result: StrengthResult, sizes=(5, 10, 15, 25, 50, 100), seeds=(0, 1, 2),
                      window: int | str | None = DEFAULT_WINDOW):
    """S and strong-sink fraction on random subsets of the measured prompts: one row per (N, seed).
    Sizes larger than the number of prompts measured are skipped."""
    import numpy as np
    import pandas as pd
    n_total = result.attention_mask.shape[0]
    rows = []
    for n in sizes:
        if n > n_total:
            continue
        for seed in seeds:
            pick = np.random.default_rng(seed).choice(n_total, size=n, replace=False)
            sub = result.subset(sorted(pick.tolist()))
            rows.append({"N": n, "seed": seed, "S": sub.strength(window), "mean_G": sub.strength(window, "mean"),
                         "strong_fraction": sub.strong_fraction(window)})
    return pd.DataFrame(rows)


def window_sweep(result: StrengthResult, windows=WINDOWS_E4):
    """S (median and mean) and strong fraction for each window: last K layers or a third of the decoder
    (``windows=THIRDS``). K larger than the model's depth is clipped to all layers (and says so in the
    'layers' column)."""
    import pandas as pd
    rows = []
    for window in windows:
        w = min(window, result.n_layers) if isinstance(window, int) else window
        layers = result.layers_for(w)
        rows.append({"window": str(window), "layers": f"{layers[0]}-{layers[-1]}", "S": result.strength(w),
                     "mean_G": result.strength(w, "mean"), "strong_fraction": result.strong_fraction(w)})
    return pd.DataFrame(rows)

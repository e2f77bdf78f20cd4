"""The sink margin of the VL paper (Sec. 4; see the book's methods page): G_base, B_gap and their difference,
measured between a reference model and an adapted one on the same prompts, and Theorem 1's bound evaluated on
the actual per-head weight updates.

For a layer l, head h and query q of the reference model, s = p_sink is the key with the largest logit and

    G_base = l_s - logsumexp_{p != s} l_p,        B_gap = max_{p != s} |delta_p - delta_s|,

where delta_p = l'_p - l_p is the change of the logit of key p (l' from the adapted model; the softmax
normaliser cancels in the difference, so this equals the change of log(a_p / a_s)). Queries that see a single
key, and padding, are left out (NaN). Lemma 1 then bounds the attention that leaves the sink by
sigma(B_gap - G_base).

Theorem 1 holds the hidden states at their reference values and perturbs only W_q and W_k. ``theorem1_on_update``
measures exactly that change (the adapted q/k projection weights copied into one layer of the reference model
at a time) and compares it with the bound:
- no QK-norm (Eq. 4, written here with the exact second-order term so that it is a true inequality):
  B_gap <= s * eps * ||xi_q|| (||W_q^h|| + ||W_k^h|| + eps) * (||xi_s|| + max_{p != s} ||xi_p||),
  with s the layer's logit scaling (1/sqrt(d_h)), eps = max(||dW_q^h||, ||dW_k^h||) (operator norms of the
  head's rows of the update), xi the input of the projections (``attn_in``);
- per-head QK-norm (Eq. 5, first order): B_gap <= c * eps * ||gamma_q||_inf ||gamma_k||_inf (1/m_q + 1/m_k)
  * s * sqrt(d_h), with c = 2 (our sharpening of the paper's unspecified constant, see the theorems chapter) and
  m_q, m_k the smallest RMS(W xi) / ||xi|| over the prompts' query and key inputs of that head;
- layerwise QK-norm is outside Theorem 1 (the paper's Remark 1): no bound is computed.
"""
from __future__ import annotations

import contextlib
import math

import numpy as np
import torch

from ..core.arch import arch_for, decoder_layers, get_module, head_dim, n_layers, norm_gain, text_config
from ..core.hooks import capture, intervene
from .strength import STRONG_SINK_G, gap_from_logits

QKNORM_BOUND_CONSTANT = 2.0


def _logit_keeper(out: dict, attention_mask: torch.Tensor):
    """An ``("attn", layer)`` edit that stores the call's float32 logits in ``out[layer]`` (padding at -inf)."""
    real = attention_mask.bool()

    def keep(call):
        logits = call.logits()
        out[call.layer] = logits.masked_fill(~real[:, None, None, -logits.shape[-1]:], float("-inf")).cpu()
        return None
    return keep


def attention_logits(model, batch: dict, layers) -> dict:
    """{layer: (B, H, T, S) float32 pre-softmax logits}, masked keys (causal, window, padding) at -inf."""
    out = {}
    keep = _logit_keeper(out, batch["attention_mask"])
    layers = sorted(layers)
    with torch.no_grad(), intervene(model, {("attn", l): keep for l in layers}), \
            capture(model, points=(), layers=[layers[-1]], stop_early=True):
        model(**batch, use_cache=False)
    return out


def sink_margins(base: dict, new: dict, attention_mask: torch.Tensor) -> dict:
    """{layer: {"G": (B,H,T), "B": (B,H,T), "sink": (B,H,T) key index}} from reference and adapted logits."""
    real = attention_mask.bool().cpu()
    out = {}
    for layer, l0 in base.items():
        l1 = new[layer]
        g, sink = gap_from_logits(l0)
        visible = torch.isfinite(l0)
        delta = torch.where(visible, l1 - l0, torch.zeros_like(l0))
        anchored = delta - delta.gather(-1, sink[..., None])
        anchored = anchored.masked_fill(~visible, 0.0).scatter(-1, sink[..., None], 0.0)
        b = anchored.abs().amax(-1)
        excluded = torch.isnan(g) | ~real[:, None, -g.shape[-1]:]
        out[layer] = {"G": g.masked_fill(excluded, float("nan")), "B": b.masked_fill(excluded, float("nan")),
                      "sink": sink}
    return out


def margin_summary(margins: dict) -> dict:
    """The paper's Table 5 quantities over every (layer, head, query): median G, median B, their difference,
    plus the share of queries whose own margin G - B is positive and the strong-sink share (G > 2)."""
    g = torch.cat([m["G"].flatten() for m in margins.values()])
    b = torch.cat([m["B"].flatten() for m in margins.values()])
    keep = ~torch.isnan(g) & ~torch.isnan(b)
    g, b = g[keep].double(), b[keep].double()
    median_g, median_b = float(np.median(g.numpy())), float(np.median(b.numpy()))
    return {"median_G": median_g, "median_B": median_b, "G_minus_B": median_g - median_b,
            "share_positive_margin": float(((g - b) > 0).double().mean()),
            "strong_fraction": float((g > STRONG_SINK_G).double().mean()), "n": int(keep.sum())}


def window_layers(model, window: int = 10) -> list[int]:
    L = n_layers(model)
    return list(range(L - min(window, L), L))


@contextlib.contextmanager
def _projections_from(model, adapted, layer: int):
    """Inside the block, layer ``layer`` of ``model`` uses ``adapted``'s W_q and W_k (biases and norms kept)."""
    arch = arch_for(model)
    mine, theirs = decoder_layers(model)[layer], decoder_layers(adapted)[layer]
    saved = []
    try:
        for path in (arch.q_proj, arch.k_proj):
            weight = get_module(mine, path).weight
            saved.append((weight, weight.detach().clone()))
            with torch.no_grad():
                weight.copy_(get_module(theirs, path).weight)
        yield
    finally:
        with torch.no_grad():
            for weight, value in saved:
                weight.copy_(value)


@contextlib.contextmanager
def _recorded_calls(model, layers, calls: dict):
    """Inside the block, ``calls[layer] = (args, kwargs)`` of each listed layer's attention module call."""
    arch = arch_for(model)
    handles = []
    try:
        for layer in layers:
            module = get_module(decoder_layers(model)[layer], arch.attn)
            handles.append(module.register_forward_pre_hook(
                lambda mod, args, kwargs, layer=layer: calls.__setitem__(layer, (args, dict(kwargs))),
                with_kwargs=True))
        yield calls
    finally:
        for handle in handles:
            handle.remove()


def _head_rows(weight: torch.Tensor, heads: int) -> torch.Tensor:
    """(heads * d, D) -> (heads, d, D)."""
    return weight.detach().float().unflatten(0, (heads, -1))


def theorem1_on_update(reference, adapted, batch: dict, layers=None) -> dict:
    """Per (layer, head, query): G_base, the projection-only B_gap, the realised B_gap and Theorem 1's bound.

    ``reference`` and ``adapted`` are two models of the same architecture (e.g. a base LLM and its adapted
    language backbone). Returns {"rows": DataFrame (layer, head, G, B_projection, B_realised, bound), "form":
    "eq4" | "eq5" | None, "why": text when no bound applies}."""
    import pandas as pd
    arch = arch_for(reference)
    cfg = text_config(reference)
    layers = window_layers(reference) if layers is None else list(layers)
    H, Hkv, d = cfg.num_attention_heads, cfg.num_key_value_heads, head_dim(reference)
    groups = H // Hkv
    base, calls = {}, {}
    keep = _logit_keeper(base, batch["attention_mask"])
    # One reference pass records the base logits, the projections' input and each window layer's attention call;
    # re-running only that attention module with the adapted W_q, W_k then gives the projection-only logits (the
    # hidden states stay the reference's, as Theorem 1 assumes) without a forward pass per layer.
    with torch.no_grad(), intervene(reference, {("attn", l): keep for l in layers}), \
            _recorded_calls(reference, layers, calls), \
            capture(reference, points=("attn_in",), layers=layers, stop_early=True) as cap:
        reference(**batch, use_cache=False)
    realised = sink_margins(base, attention_logits(adapted, batch, layers), batch["attention_mask"])
    form = {"none": "eq4", "per-head": "eq5"}.get(arch.qk_norm)
    real = batch["attention_mask"].bool().cpu()
    rows = []
    for layer in layers:
        swapped, (args, kwargs) = {}, calls[layer]
        with torch.no_grad(), _projections_from(reference, adapted, layer), \
                intervene(reference, {("attn", layer): _logit_keeper(swapped, batch["attention_mask"])}):
            get_module(decoder_layers(reference)[layer], arch.attn)(*args, **kwargs)
        only = sink_margins({layer: base[layer]}, swapped, batch["attention_mask"])[layer]
        block_ref, block_new = decoder_layers(reference)[layer], decoder_layers(adapted)[layer]
        wq = _head_rows(get_module(block_ref, arch.q_proj).weight, H)
        wk = _head_rows(get_module(block_ref, arch.k_proj).weight, Hkv)
        dq = _head_rows(get_module(block_new, arch.q_proj).weight, H) - wq
        dk = _head_rows(get_module(block_new, arch.k_proj).weight, Hkv) - wk
        op = lambda m: torch.linalg.matrix_norm(m, ord=2)
        eps = torch.maximum(op(dq), op(dk).repeat_interleave(groups))                      # (H,)
        xi = cap["attn_in", layer].float().cpu()                                           # (B, T, D)
        scaling = getattr(get_module(block_ref, arch.attn), "scaling", d ** -0.5)
        g, sink = only["G"], only["sink"]                                                 # (B, H, T)
        bound = _bound(form, reference, block_ref, arch, xi, real, wq, wk, eps, sink, base[layer], groups, scaling, d)
        keep = ~torch.isnan(g)
        heads = torch.arange(H)[None, :, None].expand_as(g)[keep]
        rows.append(pd.DataFrame({
            "layer": layer, "head": heads.numpy(), "G": g[keep].numpy(), "B_projection": only["B"][keep].numpy(),
            "B_realised": realised[layer]["B"][keep].numpy(),
            "bound": bound[keep].numpy() if bound is not None else np.nan, "eps": eps[heads].numpy()}))
    table = pd.concat(rows, ignore_index=True)
    why = None if form else (f"Theorem 1 has no bound for {arch.qk_norm} QK-norm (the paper's Remark 1 covers it "
                             f"only semi-formally)")
    return {"rows": table, "form": form, "why": why}


def _bound(form, model, block, arch, xi, real, wq, wk, eps, sink, logits, groups, scaling, d):
    if form is None:
        return None
    B, T, _ = xi.shape
    if form == "eq4":
        norms = xi.norm(dim=-1).masked_fill(~real[:, -T:], 0.0)                        # (B, T)
        visible = torch.isfinite(logits)                                                # (B, H, T, S)
        others = norms[:, None, None, :].expand_as(logits).masked_fill(~visible, 0.0)
        others = others.scatter(-1, sink[..., None], 0.0).amax(-1)                        # max_{p != s} ||xi_p||
        sink_norm = norms.gather(1, sink.flatten(1)).view_as(sink)                        # ||xi_s||
        w = torch.linalg.matrix_norm(wq, ord=2) + torch.linalg.matrix_norm(wk, ord=2).repeat_interleave(groups)
        return (scaling * eps[None, :, None] * norms[:, None, :] * (w + eps)[None, :, None]
                * (sink_norm + others))
    # eq5: per-head QK-norm, first order, c = QKNORM_BOUND_CONSTANT
    gq = norm_gain(model, get_module(block, arch.q_norm)).abs().max()
    gk = norm_gain(model, get_module(block, arch.k_norm)).abs().max()
    x = xi[real[:, -T:]]                                                                  # (N, D) real tokens
    xnorm = x.norm(dim=-1).clamp_min(1e-12)

    def floor(w):                                                                       # min RMS(W xi) / ||xi||
        proj = torch.einsum("hdD,nD->hnd", w, x)
        return (proj.pow(2).mean(-1).sqrt() / xnorm).amin(-1)                             # (heads,)
    m_q = floor(wq)
    m_k = floor(wk).repeat_interleave(groups)
    per_head = QKNORM_BOUND_CONSTANT * eps * gq * gk * (1 / m_q + 1 / m_k) * scaling * math.sqrt(d)
    return per_head[None, :, None].expand(sink.shape)


def first_order_regime(reference, adapted, batch: dict, layers) -> float:
    """How far an update is from the first-order regime Theorem 1 assumes: the largest ||dW x|| / ||W x|| over the
    window ``layers``, the query and key projections of every head and every real calibration token x (the input
    of the reference's attention), with dW the adapted minus the reference weight. Under 0.1 the expansion's
    second-order term is about a tenth of the first-order one or less."""
    arch = arch_for(reference)
    cfg = text_config(reference)
    heads = {arch.q_proj: cfg.num_attention_heads, arch.k_proj: cfg.num_key_value_heads}
    real = batch["attention_mask"].bool().cpu()
    with torch.no_grad(), capture(reference, points=("attn_in",), layers=layers, stop_early=True) as cap:
        reference(**batch, use_cache=False)
    worst = 0.0
    for layer in layers:
        x = cap["attn_in", layer].float().cpu()
        x = x[real[:, -x.shape[1]:]]                                                    # (N, D) real tokens
        block_ref, block_new = decoder_layers(reference)[layer], decoder_layers(adapted)[layer]
        for name, h in heads.items():
            w = _head_rows(get_module(block_ref, name).weight, h)                        # (h, d, D)
            dw = _head_rows(get_module(block_new, name).weight, h).to(w.device) - w
            ratio = torch.einsum("hdD,nD->hnd", dw, x).norm(dim=-1) / \
                torch.einsum("hdD,nD->hnd", w, x).norm(dim=-1).clamp_min(1e-12)
            worst = max(worst, float(ratio.max()))
    return worst


def theorem1_summary(result: dict) -> dict:
    """Share of (layer, head, query) whose projection-only change stays within the bound, and how tight it is."""
    rows = result["rows"]
    if result["form"] is None or rows.empty:
        return {"form": result["form"], "n": len(rows), "share_within": float("nan"), "median_ratio": float("nan"),
                "max_ratio": float("nan"), "share_realised_within": float("nan")}
    ratio = rows.B_projection / rows.bound
    return {"form": result["form"], "n": len(rows), "share_within": float((ratio <= 1 + 1e-4).mean()),
            "median_ratio": float(np.median(ratio)), "max_ratio": float(ratio.max()),
            "share_realised_within": float((rows.B_realised <= rows.bound).mean()),
            "median_eps": float(rows.eps.median())}


def sink_state(model, batch: dict, layers, reference_logits: dict | None = None) -> dict:
    """The sink of one model on one batch of prompts, from a single forward pass over the window ``layers``:

    S (median G), strong-sink share (G > 2), the attention mass on the first real token (mean over layers,
    heads and every later query), the share of (prompt, layer) where Phi_LLM flags the first token, the
    largest token-0 / other-token residual-norm ratio over the window; and, given ``reference_logits`` of a
    reference model on the same batch, the Table 5 margin quantities against it. Returns (dict, logits)."""
    from .criteria import first_real_position, phi_llm
    layers = sorted(layers)
    mask = batch["attention_mask"]
    real = mask.bool()
    first = first_real_position(mask, mask.shape[0])
    logits, flags, ratios, mass = {}, [], [], []

    def keep(call):
        l = call.logits()
        l = l.masked_fill(~real[:, None, None, -l.shape[-1]:], float("-inf"))
        logits[call.layer] = l.cpu()
        probs = torch.softmax(l, -1).nan_to_num(0.0)
        col = probs[torch.arange(l.shape[0]), :, :, first]                          # (B, H, T)
        later = (torch.arange(l.shape[2])[None, :] > first[:, None]) & real[:, -l.shape[2]:].cpu()
        mass.append(float((col * later[:, None]).sum() / (later.sum() * l.shape[1]).clamp_min(1)))
        return None

    def resid(hidden, layer):
        h = hidden.float()
        flags.append(phi_llm(h, mask)[torch.arange(h.shape[0]), first].float().mean().item())
        norms = h.norm(dim=-1).masked_fill(~real, float("nan"))
        token0 = norms[torch.arange(h.shape[0]), first]
        others = norms.clone()
        others[torch.arange(h.shape[0]), first] = float("nan")
        ratios.append(float((token0 / others.nanmean(-1)).mean()))
        return None

    with torch.no_grad(), intervene(model, {("attn", l): keep for l in layers}), \
            capture(model, points=("resid_pre",), layers=layers, reducers={"resid_pre": resid}, stop_early=True):
        model(**batch, use_cache=False)
    g = torch.cat([gap_from_logits(logits[l])[0].masked_fill(~real[:, None, :].cpu(), float("nan")).flatten()
                   for l in layers])
    g = g[~torch.isnan(g)].double()
    out = {"S": float(np.median(g.numpy())), "strong_fraction": float((g > STRONG_SINK_G).double().mean()),
           "pos0_mass": float(np.mean(mass)), "phi_llm_first": float(np.mean(flags)),
           "token0_ratio": float(np.max(ratios))}
    if reference_logits is not None:
        out.update({f"margin_{k}": v for k, v in
                    margin_summary(sink_margins({l: reference_logits[l] for l in layers}, logits, mask)).items()})
    return out, logits

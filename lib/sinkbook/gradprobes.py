"""Forward and backward probes of the gradient-sinks paper (Secs. 2-3, App. C; formulas in
shared/notes/methods.md), for any decoder whose layers expose ``input_layernorm``, ``self_attn.{q,k,v,o}_proj``,
``post_attention_layernorm`` and ``mlp`` (Llama; Gemma3 too, whose extra norms sit inside those branches).

One batch is run forward with eager attention (so the attention probabilities are returned), the loss is
back-propagated, and gradients are read from tensors marked with ``retain_grad`` by forward hooks. Parameters
are frozen during the probe (the embedding output is made the leaf that requires grad), so no parameter
gradient is stored and the model is left as it was.

Notation (per layer l): h^l the layer input (residual stream), h~ = input_layernorm(h^l), h^{l+1/2} the
residual after the attention branch, r_attn / r_mlp the branch outputs, h~mlp = post_attention_layernorm(h^{l+1/2}).
"""
from __future__ import annotations

import contextlib
import dataclasses

import numpy as np
import torch

from .vscale import value_projection

SINK_EPS, SINK_T_EPS, RGS_T_E = 0.3, 64, 31


@dataclasses.dataclass
class ProbeResult:
    loss: float
    grad_h_tilde: np.ndarray        # (L, T) token-wise norm of the batch-summed grad wrt h~
    grad_q: np.ndarray              # (L, T) same, on the query / key / value paths (raw projections)
    grad_k: np.ndarray
    grad_v: np.ndarray
    residual_norm: np.ndarray       # (L, T) ||h^l_t||, mean over the batch
    mlp_out_norm: np.ndarray        # (L, T) ||r_mlp_t||, mean over the batch
    value_norm: np.ndarray          # (L, Hkv, T) ||v_t|| per value head, mean over the batch
    alpha0: np.ndarray              # (L, H) mean attention paid to token 0 by queries 0..T_eps-1, mean over batch
    sink_rate: np.ndarray           # (L,) Sink^eps at s = 0: share of heads with alpha_0 > eps, mean over batch
    attn_ratios: dict               # bloat / change / compress: (L, B, T-1) each (last position has no target)
    mlp_ratios: dict                # the same for the MLP branch
    input_norm: np.ndarray          # (L, B, T-1) ||h^l_t|| (x-axis for the attention-branch ratios)
    half_norm: np.ndarray           # (L, B, T-1) ||h^{l+1/2}_t|| (x-axis for the MLP-branch ratios)

    @property
    def n_layers(self) -> int:
        return self.grad_h_tilde.shape[0]

    def r_gs(self, s: int = 0, t_e: int = RGS_T_E) -> np.ndarray:
        """R_GS^l(s; T_e) per layer: ||grad h~_s|| over the mean of ||grad h~_t||, 0 <= t <= T_e, t != s."""
        g = self.grad_h_tilde
        if g.shape[1] <= t_e:
            raise ValueError(f"R_GS(.; {t_e}) needs sequences longer than {t_e} tokens, got {g.shape[1]}")
        others = np.delete(g[:, : t_e + 1], s, axis=1)
        return g[:, s] / (others.sum(axis=1) / t_e)

    def early_ratio(self, t_e: int = RGS_T_E) -> np.ndarray:
        """Per layer: token-0 residual norm over the mean residual norm of tokens 1..T_e."""
        return self.residual_norm[:, 0] / self.residual_norm[:, 1 : t_e + 1].mean(axis=1)

    def summary(self, layers: slice | None = None) -> dict:
        sl = layers or slice(None)
        r = self.r_gs()[sl]
        return {"median_r_gs": float(np.median(r)), "token0_norm_mean": float(self.residual_norm[sl, 0].mean()),
                "early_norm_mean": float(self.residual_norm[sl, 1 : RGS_T_E + 1].mean()),
                "token0_ratio_mean": float(self.residual_norm[sl, 0].mean() / self.residual_norm[sl, 1 : RGS_T_E + 1].mean()),
                "token0_ratio_max": float(self.early_ratio()[sl].max()),
                "sink_rate_mean": float(self.sink_rate[sl].mean()),
                "mlp_out_token0_mean": float(self.mlp_out_norm[sl, 0].mean()),
                "grad_q0_max": float(self.grad_q[:, 0].max()), "loss": self.loss}


def middle_layers(n_layers: int) -> slice:
    """The layers away from both ends: [L/4, L - L/4) (all of them when L < 4)."""
    k = n_layers // 4
    return slice(k, n_layers - k)


@contextlib.contextmanager
def _eager_attention(model):
    previous = model.config._attn_implementation
    model.set_attn_implementation("eager")
    try:
        yield
    finally:
        model.set_attn_implementation(previous)


@contextlib.contextmanager
def _frozen(model):
    flags = [(p, p.requires_grad) for p in model.parameters()]
    for p, _ in flags:
        p.requires_grad_(False)
    try:
        yield
    finally:
        for p, flag in flags:
            p.requires_grad_(flag)


def _token_norms(t: torch.Tensor) -> np.ndarray:
    return t.detach().float().norm(dim=-1).cpu().numpy()


def _pre_mlp_norm(layer):
    # Gemma3 normalises the attention output with post_attention_layernorm *before* the residual add and
    # has a separate pre_feedforward_layernorm; in Llama post_attention_layernorm is the pre-MLP norm.
    return getattr(layer, "pre_feedforward_layernorm", None) or layer.post_attention_layernorm


def _mlp_branch_end(layer):
    """The module whose output is added to the residual stream by the MLP branch."""
    return getattr(layer, "post_feedforward_layernorm", None) or layer.mlp


def text_windows(tokenizer, text: str, batch_size: int, context: int, bos: bool = True) -> torch.Tensor:
    """(batch, context) windows of ``text`` tokenised by a pretrained model's tokenizer, evenly spaced,
    each starting with the model's BOS token when ``bos`` and the tokenizer has one."""
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    bos_id = getattr(tokenizer, "bos_token_id", None) if bos else None
    body = context - (bos_id is not None)
    if len(ids) < body * batch_size:
        raise ValueError(f"text has {len(ids)} tokens, too few for {batch_size} windows of {context}")
    starts = np.linspace(0, len(ids) - body, batch_size, endpoint=False).astype(int)
    rows = [([bos_id] if bos_id is not None else []) + ids[s:s + body] for s in starts]
    return torch.tensor(rows, dtype=torch.long)


def probe_batch(model, input_ids: torch.Tensor, sink_eps: float = SINK_EPS, sink_t_eps: int = SINK_T_EPS) -> ProbeResult:
    """Run every probe on one batch ``input_ids`` (B, T) with loss = next-token cross-entropy on the batch."""
    if input_ids.ndim != 2:
        raise ValueError(f"input_ids must be (batch, tokens), got shape {tuple(input_ids.shape)}")
    decoder = model.model
    layers = list(decoder.layers)
    device = next(model.parameters()).device
    input_ids = input_ids.to(device)
    grabbed: dict[tuple[str, int], torch.Tensor] = {}
    handles = []

    def keep(name, i, tensor):
        tensor.retain_grad()
        grabbed[(name, i)] = tensor

    def out_hook(name, i):
        def hook(module, args, output):
            keep(name, i, output[0] if isinstance(output, tuple) else output)
        return hook

    def in_hook(name, i):
        def hook(module, args):
            keep(name, i, args[0])
        return hook

    def leaf_embeddings(module, args, output):
        return output.detach().requires_grad_(True)

    try:
        handles.append(decoder.embed_tokens.register_forward_hook(leaf_embeddings))
        for i, layer in enumerate(layers):
            attn = layer.self_attn
            handles += [
                layer.input_layernorm.register_forward_pre_hook(in_hook("h", i)),
                layer.input_layernorm.register_forward_hook(out_hook("h_tilde", i)),
                attn.q_proj.register_forward_hook(out_hook("q", i)),
                attn.k_proj.register_forward_hook(out_hook("k", i)),
                value_projection(attn).register_forward_hook(out_hook("v", i)),
                _pre_mlp_norm(layer).register_forward_pre_hook(in_hook("h_half", i)),
                _pre_mlp_norm(layer).register_forward_hook(out_hook("h_tilde_mlp", i)),
                _mlp_branch_end(layer).register_forward_hook(out_hook("r_mlp", i)),
            ]
        handles.append(decoder.norm.register_forward_pre_hook(in_hook("h", len(layers))))
        with _eager_attention(model), _frozen(model):
            out = model(input_ids=input_ids, labels=input_ids, output_attentions=True, use_cache=False)
            out.loss.backward()
            attentions = [a.detach().float() for a in out.attentions]
    finally:
        for h in handles:
            h.remove()

    def grad(name, i):
        g = grabbed[(name, i)].grad
        if g is None:  # e.g. a module the loss does not reach; report zeros rather than crash
            return torch.zeros_like(grabbed[(name, i)])
        return g.float()

    L = len(layers)
    d_head = getattr(model.config, "head_dim", None) or model.config.hidden_size // model.config.num_attention_heads
    t_eps = min(sink_t_eps, input_ids.shape[1])
    res = {k: [] for k in ("gh", "gq", "gk", "gv", "res", "mlp", "vn", "alpha", "sink", "xin", "xhalf")}
    attn_r = {"bloat": [], "change": [], "compress": []}
    mlp_r = {"bloat": [], "change": [], "compress": []}
    for i in range(L):
        g_in, g_half, g_out = grad("h", i), grad("h_half", i), grad("h", i + 1)
        g_tilde, g_tilde_mlp = grad("h_tilde", i), grad("h_tilde_mlp", i)
        res["gh"].append(_token_norms(g_tilde.sum(0)))
        res["gq"].append(_token_norms(grad("q", i).sum(0)))
        res["gk"].append(_token_norms(grad("k", i).sum(0)))
        res["gv"].append(_token_norms(grad("v", i).sum(0)))
        res["res"].append(_token_norms(grabbed[("h", i)]).mean(0))
        res["mlp"].append(_token_norms(grabbed[("r_mlp", i)]).mean(0))
        v = grabbed[("v", i)].detach().float()
        res["vn"].append(v.view(*v.shape[:-1], v.shape[-1] // d_head, d_head).norm(dim=-1).mean(0).T.cpu().numpy())
        a = attentions[i]                                    # (B, H, T, T)
        alpha = a[:, :, :t_eps, 0].mean(-1)                  # (B, H)
        res["alpha"].append(alpha.mean(0).cpu().numpy())
        res["sink"].append(float((alpha > sink_eps).float().mean(1).mean(0)))
        # grad wrt r_attn equals grad wrt h^{l+1/2}; grad wrt r_mlp equals grad wrt h^{l+1}
        # The last position has no target, so every gradient there is 0: it is left out of the ratios.
        n = lambda t: _token_norms(t[:, :-1])
        attn_r["bloat"].append(n(g_tilde) / n(g_half))
        attn_r["change"].append(n(g_in) / n(g_half))
        attn_r["compress"].append(n(g_in - g_half) / n(g_tilde))
        mlp_r["bloat"].append(n(g_tilde_mlp) / n(g_out))
        mlp_r["change"].append(n(g_half) / n(g_out))
        mlp_r["compress"].append(n(g_half - g_out) / n(g_tilde_mlp))
        res["xin"].append(n(grabbed[("h", i)]))
        res["xhalf"].append(n(grabbed[("h_half", i)]))
    return ProbeResult(
        loss=float(out.loss.detach()), grad_h_tilde=np.stack(res["gh"]), grad_q=np.stack(res["gq"]),
        grad_k=np.stack(res["gk"]), grad_v=np.stack(res["gv"]), residual_norm=np.stack(res["res"]),
        mlp_out_norm=np.stack(res["mlp"]), value_norm=np.stack(res["vn"]), alpha0=np.stack(res["alpha"]),
        sink_rate=np.array(res["sink"]), attn_ratios={k: np.stack(v) for k, v in attn_r.items()},
        mlp_ratios={k: np.stack(v) for k, v in mlp_r.items()}, input_norm=np.stack(res["xin"]),
        half_norm=np.stack(res["xhalf"]))


def shows_sink_and_massive_activation(result: ProbeResult, sink_min: float = 0.5, ratio_min: float = 5.0) -> dict:
    """The issue's test for a model worth studying: Sink^eps(0) >= 0.5 in the middle layers and a token-0
    residual norm >= 5x the early-token mean (largest middle-layer ratio)."""
    mid = middle_layers(result.n_layers)
    sink = float(result.sink_rate[mid].mean())
    ratio = float(result.early_ratio()[mid].max())
    return {"sink_rate_middle": sink, "token0_ratio_middle_max": ratio, "sink": sink >= sink_min,
            "massive": ratio >= ratio_min, "both": sink >= sink_min and ratio >= ratio_min}

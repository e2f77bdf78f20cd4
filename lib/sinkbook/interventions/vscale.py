"""V-scale: a learnable value-path gradient valve for Llama-style attention.

Gradient-sinks paper, Sec. 5 (formula on the book's methods page): each value state ``v`` of
one head, after ``v_proj`` and before the attention-weighted sum, becomes

    v_hat = v * ||v||^2 / (||v||^2 + C),   C = d_model * d_head * sigma^2 * exp(theta),

with sigma = 0.02 and one learnable ``theta`` per (layer, value head), initialised at 0.

Because a ``v_proj`` output goes straight into aggregation in the families without a value norm (no RoPE on
values), rescaling that output is exactly "after v_proj, before aggregation". We therefore wrap each layer's
value projection (found through the architecture table) in a small module; the attention kernel itself (SDPA
or eager) is untouched. Families that normalise values after the projection are refused.
"""
from __future__ import annotations

import contextlib
import dataclasses
import math

import numpy as np
import torch
from torch import nn

from ..core.arch import arch_for, decoder_layers, get_module, head_dim, text_config
from ..measures.gradprobes import ProbeResult, probe_batch

SIGMA = 0.02


def vscale_values(v: torch.Tensor, theta: torch.Tensor, d_model: int, sigma: float = SIGMA) -> torch.Tensor:
    """Apply V-scale to value states ``v`` of shape (..., n_heads, d_head); ``theta`` has shape (n_heads,)."""
    d_head = v.shape[-1]
    c = (d_model * d_head * sigma**2) * torch.exp(theta).to(v.dtype)      # (n_heads,)
    sq_norm = v.pow(2).sum(-1, keepdim=True)                              # (..., n_heads, 1)
    return v * (sq_norm / (sq_norm + c.unsqueeze(-1)))


def vscale_jacobian_eigenvalues(sq_norm: torch.Tensor, c: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Closed-form eigenvalues of d v_hat / d v (paper Prop. 8): perpendicular r/(r+C), radial (r^2+3Cr)/(r+C)^2."""
    r = sq_norm
    return r / (r + c), (r * r + 3 * c * r) / (r + c) ** 2


class VScaledProjection(nn.Module):
    """``v_proj`` followed by V-scale, one ``theta`` per value head (KV head under GQA). ``index``: for a fused
    q/k/v projection, the output channels that hold the values (in head order); only those are scaled."""

    def __init__(self, proj: nn.Module, n_heads: int, d_head: int, d_model: int, sigma: float = SIGMA,
                 theta: float = 0.0, index: torch.Tensor | None = None):
        super().__init__()
        width = getattr(proj, "out_features", None) or getattr(proj, "nf", None)
        if index is None and width != n_heads * d_head:
            raise ValueError(f"v_proj gives {width} features, expected {n_heads} heads x {d_head}")
        self.register_buffer("index", index, persistent=False)
        self.proj = proj
        self.n_heads, self.d_head, self.d_model, self.sigma = n_heads, d_head, d_model, sigma
        self.theta = nn.Parameter(torch.full((n_heads,), float(theta), device=proj.weight.device,
                                             dtype=proj.weight.dtype))

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        out = self.proj(hidden)
        v = out if self.index is None else out[..., self.index]
        heads = v.reshape(*v.shape[:-1], self.n_heads, self.d_head)
        scaled = vscale_values(heads, self.theta, self.d_model, self.sigma).reshape(v.shape)
        return scaled if self.index is None else out.index_copy(-1, self.index, scaled)

    def extra_repr(self) -> str:
        return f"n_heads={self.n_heads}, d_head={self.d_head}, d_model={self.d_model}, sigma={self.sigma}"


def _set_module(root: nn.Module, dotted: str, module: nn.Module) -> None:
    parent, _, name = dotted.rpartition(".")
    setattr(get_module(root, parent) if parent else root, name, module)


RETROFIT_THETA = -30.0       # C ~ 1e-9 of its default: v_hat / v = r / (r + C) is 1 to float precision at start


def apply_vscale(model: nn.Module, sigma: float = SIGMA, theta=0.0) -> nn.Module:
    """Wrap every layer's value projection with V-scale (in place; returns the model). ``theta``: the initial
    value of every theta (the paper's 0 for training from scratch; ``RETROFIT_THETA`` to add V-scale to a
    pretrained model as the identity to float precision), or a (layers, value heads) array of starts, e.g.
    ``calibrated_theta``'s."""
    arch = arch_for(model)
    cfg = text_config(model)
    n_kv = arch.kv_heads
    starts = torch.as_tensor(theta, dtype=torch.float32)
    if starts.ndim and tuple(starts.shape) != (len(decoder_layers(model)), n_kv):
        raise ValueError(f"theta must be a number or a (layers, value heads) = ({len(decoder_layers(model))}, "
                         f"{n_kv}) array, got shape {tuple(starts.shape)}")
    for i, layer in enumerate(decoder_layers(model)):
        proj = get_module(layer, arch.v_proj)
        if isinstance(proj, VScaledProjection):
            raise ValueError(f"layer {i} already has V-scale; apply_vscale was called twice")
        if not isinstance(proj, nn.Linear) and type(proj).__name__ != "Conv1D":
            raise TypeError(f"layer {i}: the value projection is {type(proj).__name__}, expected nn.Linear")
        index = arch.qkv_index("v")
        wrapped = VScaledProjection(proj, n_kv, head_dim(model), cfg.hidden_size, sigma, 0.0,
                                    None if index is None else index.to(proj.weight.device))
        with torch.no_grad():
            wrapped.theta.copy_((starts[i] if starts.ndim else starts).expand(n_kv))
        _set_module(layer, arch.v_proj, wrapped)
    return model


@torch.no_grad()
def calibrated_theta(model: nn.Module, input_ids: torch.Tensor, share: float, sigma: float = SIGMA) -> torch.Tensor:
    """(layers, value heads) theta at which C is ``share`` x the head's median ||v_t||^2 on ``input_ids``.

    A retrofit start that is (nearly) the identity but not inert: every value with ||v||^2 >= the median keeps at
    least 1 / (1 + share) of itself, while C, and so the gradient that reaches theta, is not vanishingly small
    (at ``RETROFIT_THETA`` the optimiser would hardly move theta at all)."""
    if has_vscale(model):
        raise ValueError("the model already has V-scale; calibrate before apply_vscale")
    arch = arch_for(model)
    cfg = text_config(model)
    n_kv = arch.kv_heads
    d_head = head_dim(model)
    index = arch.qkv_index("v")            # the value channels of a fused q/k/v projection
    kept = {}
    handles = [get_module(layer, arch.v_proj).register_forward_hook(
        lambda m, a, out, i=i: kept.__setitem__(i, out.detach().float())) for i, layer in enumerate(decoder_layers(model))]
    try:
        model(input_ids=input_ids.to(next(model.parameters()).device))
    finally:
        for h in handles:
            h.remove()
    rows = []
    for i in sorted(kept):
        v = kept[i] if index is None else kept[i][..., index.to(kept[i].device)]
        sq = v.unflatten(-1, (n_kv, d_head)).pow(2).sum(-1).flatten(0, -2)        # (B*T, heads)
        rows.append(torch.log(share * sq.median(0).values / (cfg.hidden_size * d_head * sigma**2)))
    return torch.stack(rows).cpu()


def vscale_layers(model: nn.Module) -> list[VScaledProjection]:
    arch = arch_for(model)
    found = [get_module(layer, arch.v_proj) for layer in decoder_layers(model)]
    return [m for m in found if isinstance(m, VScaledProjection)]


def has_vscale(model: nn.Module) -> bool:
    return bool(vscale_layers(model))


def learned_theta(model: nn.Module) -> torch.Tensor:
    """theta as a (layers, value heads) tensor; raises if the model has no V-scale."""
    thetas = [m.theta.detach().cpu() for m in vscale_layers(model)]
    if not thetas:
        raise ValueError("this model has no V-scale layers (build it with vscale=True)")
    return torch.stack(thetas)


class RawValues(dict):
    """{layer: raw value states (B, T, Hkv * d)} kept by ``raw_values`` during one forward pass."""

    def __init__(self, n_heads: dict):
        super().__init__()
        self.n_heads = n_heads

    def _stacked(self, fn) -> torch.Tensor:
        if not self:
            raise ValueError("no raw value states were kept: the model has no V-scale layers, or it did not run")
        return torch.stack([fn(self[i], self.n_heads[i]) for i in sorted(self)]).cpu()

    def norms(self) -> torch.Tensor:
        """(layers, value heads, T): ||v_t|| per value head, mean over the batch."""
        return self._stacked(lambda v, n: v.detach().unflatten(-1, (n, -1)).float().norm(dim=-1).mean(0).T)

    def grad_norms(self) -> torch.Tensor:
        """(layers, T): token-wise norm of the batch-summed gradient wrt the raw value states (all heads), as
        ``measures.gradprobes`` takes it on the value path; needs a backward pass inside the block."""
        def norm(v, n):
            if v.grad is None:
                raise ValueError("the raw value states have no gradient: run the backward pass inside raw_values()")
            return v.grad.float().sum(0).norm(dim=-1)
        return self._stacked(norm)


@contextlib.contextmanager
def raw_values(model: nn.Module):
    """Keep every V-scale layer's raw value states (the ``v_proj`` output before V-scale) of the forward pass run
    inside the block; when they are part of an autograd graph their gradients are kept too (``retain_grad``).
    The hook library's ``v_proj`` point is the value after V-scale; the paper's value path is the raw ``v``."""
    kept = RawValues({})
    handles = []
    for i, m in enumerate(vscale_layers(model)):
        kept.n_heads[i] = m.n_heads

        def keep(module, args, output, i=i):
            if output.requires_grad:
                output.retain_grad()
            kept[i] = output
        handles.append(m.proj.register_forward_hook(keep))
    try:
        yield kept
    finally:
        for h in handles:
            h.remove()


@torch.no_grad()
def raw_value_norms(model: nn.Module, input_ids: torch.Tensor) -> torch.Tensor:
    """(layers, value heads, T): ||v_t|| of the raw value states (before V-scale), mean over the batch."""
    if not has_vscale(model):
        raise ValueError("this model has no V-scale layers")
    with raw_values(model) as kept:
        model(input_ids=input_ids.to(next(model.parameters()).device))
    return kept.norms()


def vscale_constant(d_model: int, d_head: int, theta: float = 0.0, sigma: float = SIGMA) -> float:
    return d_model * d_head * sigma**2 * math.exp(theta)


def valve_constant(theta, d_model: int, d_head: int, sigma: float = SIGMA) -> np.ndarray:
    """C = d_model d_head sigma^2 exp(theta), per (layer, head)."""
    return d_model * d_head * sigma**2 * np.exp(np.asarray(theta, dtype=float))


def probe_raw_values(model, input_ids) -> ProbeResult:
    """``probe_batch`` on a V-scale model, with the value path (gradient and norms) taken at the raw value states
    before V-scale, where the paper takes it (the hook library's ``v_proj`` point is after V-scale)."""
    with raw_values(model) as raw:
        probe = probe_batch(model, input_ids)
    return dataclasses.replace(probe, grad_v=raw.grad_norms().numpy(), value_norm=raw.norms().numpy())


def theta_halves(theta) -> tuple[float, float]:
    """Mean learned theta over the first and over the second half of the layers ((layers, heads) array)."""
    theta = np.asarray(theta)
    return float(theta[: max(1, len(theta) // 2)].mean()), float(theta[len(theta) // 2:].mean())

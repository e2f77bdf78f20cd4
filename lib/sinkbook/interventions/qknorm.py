r"""Per-head QK-RMSNorm switched off (frozen to a fixed scale) or switched on (injected after pretraining).

Per-head QK-RMSNorm maps each head's pre-RoPE query (and key) x_h in R^{d_h} to

    N(x)_h = gamma * x_h / RMS(x_h),      RMS(x_h) = sqrt(mean_j x_hj^2 + eps),

with the gain gamma in R^{d_h} shared by the heads of a layer (Gemma stores gamma - 1). Theorem 1 of the Sink
Strength paper (Sec. 4) credits this division with removing the raw input magnitude ||xi|| from the bound on
the sink-gap perturbation. The paper proposes two experiments on that norm and runs one:

- ``fix_qk_norm`` -- the causal test the paper proposes (Limitations: "disabling per-head QK-RMSNorm during VL
  training ... to see whether IFEval collapses"). Each q_norm / k_norm becomes

      F(x)_h = gamma * x_h * c_h,         c_h = mean over the real calibration tokens of 1 / RMS(x_h),

  one constant per layer, side (q or k) and head, measured on calibration text. F is linear in x: training can
  grow q and k, and with them the logits, without bound, which is what the native norm prevents. gamma stays
  the same trainable parameter. At step 0, F(x) / N(x) = c_h RMS(x_h): the function is kept exactly for a
  token whose head RMS equals 1 / c_h and is off by the ratio elsewhere. How near "nearly the same function"
  is depends on the spread of the per-token RMS. Measured on three short sentences (calibrated on the same
  text, relative L2 error of the logits): tiny random Qwen3 0.45, tiny Gemma 3 0.17; Gemma-3-270M 0.90,
  with top-1 agreement 17%. There the spread is wide (c_h RMS from 0.2 to 2.6, 5-95%, for the queries of
  layer 9 of 18; the first token's sit 2.5-5x below), fixing a single layer alone costs 0.10-0.41, and the
  median, 1 / mean RMS or a mean without the first token do no better (0.80-0.84). So on the real target
  this is not the same function at step 0; a run that uses it needs a text-only recovery phase, or a
  comparison against a matched control, before VL training. (One measurement, not a test: the tests check
  the definition, exactness on a one-token calibration, and the tiny-model numbers.)
- ``inject_qk_norm`` -- the paper's negative control (Sec. 5, "Post-pretraining QK-RMSNorm injection"; recipe
  in App. F.3): per-head QK-RMSNorm with unit-scale gains gamma_q = gamma_k = 1 added to a model trained
  without it (SmolLM2 / Llama, Mistral, Qwen2). It sits on the q_proj / k_proj outputs, read per head, so RoPE
  comes after the norm as in Qwen 3 and Gemma 3. Unit gains do not preserve the function: every head's q and k
  get RMS 1 (the paper's injected model scores 11 on IFEval at its first evaluated checkpoint, against 59.9
  for the base).
"""
from __future__ import annotations

import torch
from torch import nn

from ..core.arch import arch_for, decoder_layers, get_module, head_dim, require, text_config

_KINDS = ("q", "k")


# ---- disabling the native norm --------------------------------------------------------------------------

class FixedQKScale(nn.Module):
    """F(x)_h = (offset + weight) * x_h * scale[h]: a QK-RMSNorm whose 1/RMS is frozen to a per-head constant."""

    def __init__(self, weight: nn.Parameter, scale: torch.Tensor, head_axis: int, offset: float = 0.0):
        super().__init__()
        self.weight = weight                      # the native gain, same Parameter: still trained
        self.register_buffer("scale", scale)      # (heads,)
        self.head_axis, self.offset = head_axis, offset

    def forward(self, x):
        shape = [1] * x.dim()
        shape[self.head_axis] = -1
        scale = self.scale.to(torch.float32).view(shape)
        return (x.float() * scale * (self.offset + self.weight.float())).type_as(x)

    def extra_repr(self):
        return f"heads={self.scale.numel()}, head_axis={self.head_axis}, offset={self.offset}"


def _eps(norm) -> float:
    for name in ("variance_epsilon", "eps"):      # Qwen 3 and Gemma 3 name it differently
        if hasattr(norm, name):
            return float(getattr(norm, name))
    raise ValueError(f"cannot find the epsilon of {type(norm).__name__}")


def _head_axis(norm_input: torch.Tensor, proj_output: torch.Tensor) -> int:
    """Where the norm's input keeps its heads: Qwen 3 normalises (B, T, H, d), Gemma 3 (B, H, T, d)."""
    per_head = proj_output.unflatten(-1, (-1, norm_input.shape[-1]))               # (B, T, H, d)
    if norm_input.shape == per_head.shape and torch.equal(norm_input, per_head):
        return -2
    moved = per_head.transpose(1, 2)
    if norm_input.shape == moved.shape and torch.equal(norm_input, moved):
        return -3
    raise ValueError("the q/k norm does not read the projection output per head; fix_qk_norm cannot place it")


def fix_qk_norm(model, batch: dict) -> dict:
    """Replace every layer's per-head q_norm / k_norm by a ``FixedQKScale`` calibrated on ``batch`` (module
    docstring). Returns {layer: {"q": module, "k": module}}."""
    arch = arch_for(model)
    if arch.qk_norm != "per-head":
        detail = "its QK-norm is layerwise, one RMS over all heads" if arch.qk_norm == "layerwise" else "none"
        raise ValueError(f"{arch.family} has no per-head QK-norm ({detail}); fix_qk_norm replaces the native "
                         "per-head q/k RMSNorm of Gemma 3 or Qwen 3")
    blocks = decoder_layers(model)
    norms = {(i, kind): get_module(block, getattr(arch, kind + "_norm"))
             for i, block in enumerate(blocks) for kind in _KINDS}
    if any(isinstance(norm, FixedQKScale) for norm in norms.values()):
        raise ValueError("this model's QK-norm is already fixed")
    seen_in, seen_out, handles = {}, {}, []
    for (i, kind), norm in norms.items():
        proj = get_module(blocks[i], getattr(arch, kind + "_proj"))
        handles.append(norm.register_forward_pre_hook(
            lambda m, args, key=(i, kind): seen_in.__setitem__(key, args[0].detach())))
        handles.append(proj.register_forward_hook(
            lambda m, args, out, key=(i, kind): seen_out.__setitem__(key, out.detach())))
    try:
        with torch.no_grad():
            model(**batch, use_cache=False)
    finally:
        for handle in handles:
            handle.remove()
    ids = batch["input_ids"]
    real = batch.get("attention_mask", torch.ones_like(ids)).to(torch.float32)     # (B, T)
    out = {}
    for (i, kind), norm in norms.items():
        x = seen_in[i, kind]
        axis = _head_axis(x, seen_out[i, kind])
        inv_rms = torch.rsqrt(x.float().pow(2).mean(-1) + _eps(norm))              # (B, T, H) or (B, H, T)
        if axis == -3:
            inv_rms = inv_rms.transpose(1, 2)
        # padding rows carry no text: the constant is a mean over real tokens only
        scale = (inv_rms * real[..., None]).sum((0, 1)) / real.sum()
        fixed = FixedQKScale(norm.weight, scale.to(norm.weight.device), axis, arch.norm_gain_offset)
        parent, name = _parent(blocks[i], getattr(arch, kind + "_norm"))
        setattr(parent, name, fixed)
        out.setdefault(i, {})[kind] = fixed
    return out


def _parent(block, dotted: str):
    head, _, name = dotted.rpartition(".")
    return (get_module(block, head) if head else block), name


# ---- injecting a norm -----------------------------------------------------------------------------------

class HeadRMSNorm(nn.Module):
    """Per-head RMSNorm on a flat projection output (..., H * d): each head's d coordinates divided by their RMS,
    times a gain shared by the heads (initialised to ones)."""

    def __init__(self, head_dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(head_dim))
        self.eps = eps

    def forward(self, x):
        heads = x.float().unflatten(-1, (-1, self.weight.shape[0]))
        normed = heads * torch.rsqrt(heads.pow(2).mean(-1, keepdim=True) + self.eps) * self.weight.float()
        return normed.flatten(-2).type_as(x)

    def projection_hook(self, module, args, output):
        # A bound method, not a closure: a deep copy of the model then hooks the copy's own norm.
        return self(output)

    def extra_repr(self):
        return f"head_dim={self.weight.shape[0]}, eps={self.eps}"


class InjectedQKNorm:
    """What ``inject_qk_norm`` added: the norms per layer and the hooks that apply them; ``remove()`` undoes it."""

    def __init__(self, model, norms: dict, handles: list):
        self.model, self.norms, self._handles = model, norms, handles

    def parameters(self) -> list:
        return [norm.weight for layer in self.norms.values() for norm in layer.values()]

    def remove(self) -> None:
        arch = arch_for(self.model)
        for handle in self._handles:
            handle.remove()
        for i, block in enumerate(decoder_layers(self.model)):
            attn = get_module(block, arch.attn)
            for kind in _KINDS:
                if isinstance(getattr(attn, kind + "_norm", None), HeadRMSNorm):
                    delattr(attn, kind + "_norm")
        self._handles, self.norms = [], {}


def inject_qk_norm(model, eps: float | None = None) -> InjectedQKNorm:
    """Add per-head QK-RMSNorm with unit gains to a model without QK-norm (module docstring).

    The norms become trainable submodules ``<attn>.q_norm`` / ``<attn>.k_norm`` (Qwen 3's names), applied by
    forward hooks on q_proj / k_proj, so the projections keep their weights and names. Consequences: the
    ``q_proj`` / ``k_proj`` capture points of ``core.hooks`` see the normalised output; ``save_pretrained``
    writes the gains but the family's class does not load them (keep the state dict); a LoRA adapter added
    afterwards would add its update after the norm. ``eps`` defaults to the model's ``rms_norm_eps``."""
    arch = arch_for(model)
    if arch.qk_norm != "none":
        raise ValueError(f"{arch.family} already has a {arch.qk_norm} QK-norm; inject_qk_norm adds one to a model "
                         "without it (Llama / SmolLM2, Mistral, Qwen2)")
    require(model, "QK-norm tools")        # a fused q/k/v projection has no q_proj / k_proj output to normalise
    cfg = text_config(model)
    eps = eps if eps is not None else getattr(cfg, "rms_norm_eps", 1e-6)
    blocks = decoder_layers(model)
    if any(hasattr(get_module(block, arch.attn), "q_norm") for block in blocks):
        raise ValueError("this model already has an injected QK-norm; remove() it first")
    d = head_dim(model)
    norms, handles = {}, []
    for i, block in enumerate(blocks):
        attn = get_module(block, arch.attn)
        for kind in _KINDS:
            proj = get_module(block, getattr(arch, kind + "_proj"))
            norm = HeadRMSNorm(d, eps).to(device=proj.weight.device, dtype=proj.weight.dtype)
            attn.add_module(kind + "_norm", norm)
            handles.append(proj.register_forward_hook(norm.projection_hook))
            norms.setdefault(i, {})[kind] = norm
    return InjectedQKNorm(model, norms, handles)


# ---- saving and loading a changed model --------------------------------------------------------------------
# ``save_pretrained`` writes the gains but the family's class rebuilds its native norms (or none) on loading, so
# a model saved after either change would load as a different function. These two functions carry the change.

def qk_norm_state(model) -> dict | None:
    """What ``fix_qk_norm`` or ``inject_qk_norm`` changed in ``model`` (None if neither): enough to redo it."""
    arch = arch_for(model)
    fixed, injected = {}, {}
    for i, block in enumerate(decoder_layers(model)):
        attn = get_module(block, arch.attn)
        for kind in _KINDS:
            norm = getattr(attn, kind + "_norm", None)
            if isinstance(norm, FixedQKScale):
                fixed[f"{i}.{kind}"] = {"scale": norm.scale.detach().cpu(), "head_axis": norm.head_axis,
                                        "offset": norm.offset}
            elif isinstance(norm, HeadRMSNorm):
                injected[f"{i}.{kind}"] = {"weight": norm.weight.detach().cpu(), "eps": norm.eps}
    if fixed:
        return {"kind": "fixed", "norms": fixed}
    if injected:
        return {"kind": "injected", "norms": injected}
    return None


def restore_qk_norm(model, state: dict | None) -> None:
    """Redo on a freshly loaded ``model`` the change ``qk_norm_state`` recorded (the saved gains are the native
    norms' weights for a fixed scale, and are copied in for injected norms)."""
    if not state:
        return
    arch = arch_for(model)
    blocks = decoder_layers(model)
    if state["kind"] == "injected":
        injected = inject_qk_norm(model, eps=next(iter(state["norms"].values()))["eps"])
        with torch.no_grad():
            for key, saved in state["norms"].items():
                i, kind = key.split(".")
                injected.norms[int(i)][kind].weight.copy_(saved["weight"])
        return
    for key, saved in state["norms"].items():
        i, kind = key.split(".")
        block = blocks[int(i)]
        norm = get_module(block, getattr(arch, kind + "_norm"))
        fixed = FixedQKScale(norm.weight, saved["scale"].to(norm.weight.device), saved["head_axis"], saved["offset"])
        parent, name = _parent(block, getattr(arch, kind + "_norm"))
        setattr(parent, name, fixed)

"""Capture and intervene on a transformers causal LM, layer by layer, without leaving hooks behind.

Capture points (TransformerLens-style names; B batch, T query length, S key length incl. KV cache,
H query heads, Hkv key/value heads, d head dim, D hidden size):

==============  ===================  =====================================================================
name            shape                what it is
==============  ===================  =====================================================================
``resid_pre``   (B, T, D)            residual stream entering the decoder layer
``attn_in``     (B, T, D)            input of the q/k/v projections (the layer input after its
                                     pre-attention norm; the raw layer input in post-norm families)
``q_proj``      (B, T, H, d)         output of the query projection, before QK-norm and RoPE
``k_proj``      (B, T, Hkv, d)       output of the key projection, before QK-norm and RoPE
``v_proj``      (B, T, Hkv, d)       output of the value projection module (after V-scale if present)
``q``           (B, H, T, d)         queries after QK-norm and RoPE, as the attention kernel receives them
``k``           (B, Hkv, S, d)       keys after QK-norm and RoPE (cached keys included)
``v``           (B, Hkv, S, d)       values, one per KV head, as the kernel receives them
``pattern``     (B, H, T, S)         attention probabilities, recomputed from the captured q/k
``z``           (B, T, H, d)         per-head attention outputs, before ``o_proj``
``attn_out``    (B, T, D)            what the attention branch adds to the residual stream
``resid_mid``   (B, T, D)            residual stream after the attention branch has been added
``mlp_in``      (B, T, D)            input of the MLP (after its pre-MLP norm, if any)
``mlp_out``     (B, T, D)            what the MLP branch adds to the residual stream
``resid_post``  (B, T, D)            residual stream leaving the layer (after the MLP branch)
==============  ===================  =====================================================================

Gradients: ``capture(..., grads=("resid_pre", ...))`` keeps those points attached to the autograd graph
(``retain_grad``); after ``loss.backward()`` inside the block, ``cap.grad(point, layer)`` is the gradient of
the loss with respect to that activation. ``pattern`` has no gradient (it is recomputed on the side).

How: the model keeps running its own SDPA (or eager / flash) kernel. For the duration of a context its
config's attention implementation is switched to a registered wrapper that calls that same kernel and,
for hooked layers only, hands the exact q/k/v/mask it received to the capture or intervention. Residual
points and ``z`` use ordinary module hooks. Everything is undone in ``finally``.
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Callable

import torch
from transformers import AttentionInterface
from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, AttentionMaskInterface
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

from .arch import UnsupportedArchitecture, arch_for, get_module, text_config

CAPTURE_POINTS = {
    "resid_pre": "(B, T, D) residual stream entering the decoder layer",
    "attn_in": "(B, T, D) input of the q/k/v projections (after the pre-attention norm, if any)",
    "q_proj": "(B, T, H, d) query projection output, before QK-norm and RoPE",
    "k_proj": "(B, T, Hkv, d) key projection output, before QK-norm and RoPE",
    "v_proj": "(B, T, Hkv, d) value projection module output (after V-scale, if present)",
    "q": "(B, H, T, d) queries after QK-norm and RoPE",
    "k": "(B, Hkv, S, d) keys after QK-norm and RoPE, cached keys included",
    "v": "(B, Hkv, S, d) values per KV head, as the kernel receives them",
    "pattern": "(B, H, T, S) attention probabilities computed from the captured q/k",
    "z": "(B, T, H, d) per-head attention outputs before o_proj",
    "attn_out": "(B, T, D) what the attention branch adds to the residual stream",
    "resid_mid": "(B, T, D) residual stream after attention is added",
    "mlp_in": "(B, T, D) input of the MLP (after the pre-MLP norm, if any)",
    "mlp_out": "(B, T, D) what the MLP branch adds to the residual stream",
    "resid_post": "(B, T, D) residual stream leaving the layer",
}
INTERVENTION_POINTS = ("resid_pre", "k", "v", "z", "attn")
_ATTN_POINTS = {"q", "k", "v", "pattern"}
_PREFIX = "sinkbook_"


# ---- the attention call, as the kernel sees it ----------------------------------------------------------

@dataclass
class AttentionCall:
    """One call of a layer's attention kernel: what it got, and (after the call) what it returned."""
    module: torch.nn.Module
    layer: int
    query: torch.Tensor          # (B, H, T, d)
    key: torch.Tensor            # (B, Hkv, S, d)
    value: torch.Tensor          # (B, Hkv, S, d)
    attention_mask: torch.Tensor | None
    scaling: float
    sliding_window: int | None
    softcap: float | None
    output: torch.Tensor | None = None   # (B, T, H, d)
    sinks: torch.Tensor | None = None    # (H,) learned sink logits (gpt-oss): a column every query sees, no value


    @property
    def groups(self) -> int:
        return self.query.shape[1] // self.key.shape[1]

    def visible(self, queries: slice = slice(None)) -> torch.Tensor:
        """Boolean (B or 1, 1, T, S): which keys each query may attend to (causal, window, padding); ``queries``
        keeps a block of query rows."""
        T, S = self.query.shape[2], self.key.shape[2]
        if self.attention_mask is not None and self.attention_mask.dtype == torch.bool:
            mask = self.attention_mask[..., -S:]
            return mask[..., queries, :] if mask.shape[-2] == T else mask
        q_pos = torch.arange(S - T, S, device=self.query.device)[queries, None]
        k_pos = torch.arange(S, device=self.query.device)[None, :]
        visible = k_pos <= q_pos
        if self.sliding_window:
            visible = visible & (k_pos > q_pos - self.sliding_window)
        visible = visible[None, None]
        if self.attention_mask is not None:  # additive float mask
            mask = self.attention_mask[..., -S:]
            mask = mask[..., queries, :] if mask.shape[-2] == T else mask
            visible = visible & (mask > torch.finfo(self.attention_mask.dtype).min / 2)
        return visible

    def logits(self, queries: slice = slice(None)) -> torch.Tensor:
        """(B, H, T, S) pre-softmax scores with masked entries at -inf, in float32. ``queries``: only that block of
        query rows, (B, H, rows, S), so a reduction over blocks never holds a whole T x S per head."""
        key = self.key.float().repeat_interleave(self.groups, dim=1)
        scores = torch.matmul(self.query[:, :, queries].float(), key.transpose(-1, -2)) * self.scaling
        if self.softcap:
            scores = torch.tanh(scores / self.softcap) * self.softcap
        return scores.masked_fill(~self.visible(queries), float("-inf"))

    def probabilities(self) -> torch.Tensor:
        """(B, H, T, S) attention probabilities, as eager attention would return them (float32).

        With learned sink logits the softmax runs over the keys and the sink, and the sink's share is dropped, so
        a row sums to less than 1. Rows of padding queries, which may see no key at all, are all zeros."""
        logits = self.logits()
        if self.sinks is None:
            return torch.softmax(logits, dim=-1).nan_to_num_(0.0)
        sink = self.sinks.float().view(1, -1, 1, 1).expand(*logits.shape[:-1], 1)
        return torch.softmax(torch.cat([logits, sink], dim=-1), dim=-1)[..., :-1].nan_to_num_(0.0)


def _wrapped_attention(base_name: str) -> Callable:
    def attention(module, query, key, value, attention_mask, scaling=None, **kwargs):
        base = ALL_ATTENTION_FUNCTIONS[base_name] if base_name != "eager" else _eager(module)
        listeners = getattr(module, "_sinkbook_listeners", None)
        if not listeners:
            return base(module, query, key, value, attention_mask, scaling=scaling, **kwargs)
        call = AttentionCall(module, module._sinkbook_layer, query, key, value, attention_mask,
                             scaling if scaling is not None else query.shape[-1] ** -0.5,
                             kwargs.get("sliding_window"), kwargs.get("softcap"), sinks=kwargs.get("s_aux"))
        for listener in listeners:
            listener.before(call)      # may replace call.key / call.value
        out, weights = base(module, call.query, call.key, call.value, attention_mask, scaling=scaling, **kwargs)
        call.output = out
        for listener in listeners:
            listener.after(call)       # may replace call.output
        return call.output, weights
    return attention


def _eager(module):
    import importlib
    import sys
    # eager attention is defined per model file (Gemma 2 soft-caps in it, gpt-oss adds its sinks there); a file
    # without one uses llama's generic one (repeat_kv, mask add, softmax).
    own = getattr(sys.modules.get(type(module).__module__), "eager_attention_forward", None)
    return own or importlib.import_module("transformers.models.llama.modeling_llama").eager_attention_forward


def _configs(model) -> list:
    seen, out = set(), []
    for module in model.modules():
        cfg = getattr(module, "config", None)
        if cfg is not None and id(cfg) not in seen:
            seen.add(id(cfg))
            out.append(cfg)
    return out


@contextlib.contextmanager
def _wrapped_kernel(model):
    """Switch the model to the wrapper of its own kernel; nested contexts share one switch."""
    configs = _configs(model)
    originals = [cfg._attn_implementation for cfg in configs]
    try:
        for cfg, original in zip(configs, originals):
            if original and not original.startswith(_PREFIX):
                name = _PREFIX + original
                if name not in ALL_ATTENTION_FUNCTIONS:
                    AttentionInterface.register(name, _wrapped_attention(original))
                    AttentionMaskInterface.register(name, ALL_MASK_ATTENTION_FUNCTIONS[original])
                cfg._attn_implementation = name
        yield
    finally:
        for cfg, original in zip(configs, originals):
            cfg._attn_implementation = original


class _Listener:
    """Base for objects notified by the wrapped attention kernel of one layer."""
    def before(self, call: AttentionCall) -> None: ...
    def after(self, call: AttentionCall) -> None: ...


class _HookSet:
    """Module hooks and attention listeners that are all removed together; removal is idempotent."""

    def __init__(self):
        self._handles, self._listeners = [], []

    def module_hook(self, module, kind: str, fn, **kw):
        register = {"pre": module.register_forward_pre_hook, "post": module.register_forward_hook}[kind]
        self._handles.append(register(fn, **kw))

    def listen(self, attn_module, listener: _Listener, layer: int):
        if not hasattr(attn_module, "_sinkbook_listeners"):
            attn_module._sinkbook_listeners = []
        attn_module._sinkbook_layer = layer   # not every family numbers its attention modules (layer_idx)
        attn_module._sinkbook_listeners.append(listener)
        self._listeners.append((attn_module, listener))

    def remove(self):
        for handle in self._handles:
            handle.remove()
        for module, listener in self._listeners:
            listeners = getattr(module, "_sinkbook_listeners", [])
            if listener in listeners:
                listeners.remove(listener)
            if not listeners and hasattr(module, "_sinkbook_listeners"):
                del module._sinkbook_listeners
                if hasattr(module, "_sinkbook_layer"):
                    del module._sinkbook_layer
        self._handles, self._listeners = [], []


def _normalise_layers(layers, n_layers: int) -> list[int]:
    if layers is None:
        return list(range(n_layers))
    layers = [layers] if isinstance(layers, int) else list(layers)
    out = []
    for layer in layers:
        index = layer + n_layers if layer < 0 else layer
        if not 0 <= index < n_layers:
            raise ValueError(f"layer {layer} is out of range: the model has {n_layers} layers (0..{n_layers - 1})")
        out.append(index)
    return sorted(set(out))


def _first_tensor(args, kwargs, name="hidden_states"):
    return kwargs[name] if name in kwargs else args[0]


def hook_count(model) -> int:
    """Forward hooks and attention listeners currently attached anywhere in the model (tests use it; compare
    counts before and after, since transformers keeps output-recording hooks of its own once attentions are asked for)."""
    n = 0
    for module in model.modules():
        n += len(module._forward_hooks) + len(module._forward_pre_hooks)
        n += len(getattr(module, "_sinkbook_listeners", []))
    return n


# ---- capture --------------------------------------------------------------------------------------------

class StopForward(Exception):
    """Raised after the last hooked layer when ``stop_early=True``; the capture context swallows it."""


class Capture:
    """What a ``capture`` context collected: ``cap["pattern", 5]`` or ``cap.get("pattern", 5)``;
    ``cap.grad("resid_pre", 5)`` after a backward pass for points captured with ``grads``."""

    def __init__(self, points, layers):
        self.points, self.layers, self.values = tuple(points), tuple(layers), {}
        self._kept = {}          # (point, layer) -> (tensor in the graph, view giving the documented shape)

    def __getitem__(self, key):
        point, layer = key
        if key in self._kept:
            tensor, view = self._kept[key]
            return view(tensor)
        if (point, layer) not in self.values:
            raise KeyError(f"nothing captured for {point!r} at layer {layer}; captured: {sorted(self.values)}")
        return self.values[point, layer]

    def get(self, point, layer, default=None):
        try:
            return self[point, layer]
        except KeyError:
            return default

    def stacked(self, point) -> torch.Tensor:
        """All captured layers of one point stacked on a new leading axis (layers in ascending order)."""
        return torch.stack([self[point, layer] for layer in self.layers])

    def grad(self, point, layer) -> torch.Tensor:
        """d loss / d activation for a point captured with ``grads``; zeros where the loss does not reach it."""
        if (point, layer) not in self._kept:
            raise ValueError(f"{point!r} was not captured with gradients; pass grads=({point!r}, ...) to capture")
        tensor, view = self._kept[point, layer]
        return view(tensor.grad if tensor.grad is not None else torch.zeros_like(tensor))


# point -> (module path in the arch table, "pre" (module input) or "post" (module output), unflatten heads)
_MODULE_POINTS = {
    "attn_in": ("q_proj", "pre", None), "q_proj": ("q_proj", "post", "q"), "k_proj": ("k_proj", "post", "kv"),
    "v_proj": ("v_proj", "post", "kv"), "z": ("o_proj", "pre", "q"), "attn_out": ("attn_out", "post", None),
    "resid_mid": ("resid_mid_input", "pre", None), "mlp_in": ("mlp", "pre", None),
    "mlp_out": ("mlp_out", "post", None),
}


@contextlib.contextmanager
def capture(model, points=("pattern",), layers=None, reducers: dict | None = None,
            stop_early: bool = False, detach: bool = True, grads=()):
    """Capture named points at chosen layers during forward passes run inside the ``with`` block.

    ``reducers`` maps a point to ``fn(tensor, layer) -> value``; the value is stored instead of the tensor,
    so e.g. one number per head and query can be kept instead of a (B, H, T, S) pattern for every layer.
    Each forward pass overwrites what the previous one stored (reducers can accumulate in a closure).
    With ``stop_early=True`` the forward pass is abandoned after the last hooked layer (code after the
    model call inside the ``with`` block is then skipped); the model's output is not produced.
    ``grads`` names points whose captured tensors stay in the autograd graph (see ``Capture.grad``).
    """
    points, grads = tuple(points), tuple(grads)
    unknown = (set(points) | set(grads)) - set(CAPTURE_POINTS)
    if unknown:
        raise ValueError(f"unknown capture point(s) {sorted(unknown)}; known: {', '.join(CAPTURE_POINTS)}")
    if "pattern" in grads:
        raise ValueError("'pattern' is recomputed beside the kernel and has no gradient; capture 'q'/'k' instead")
    points = tuple(dict.fromkeys(points + grads))
    arch = arch_for(model)
    if arch.parallel and "resid_mid" in grads:
        raise UnsupportedArchitecture(f"a gradient at 'resid_mid' is not available for {arch.family!r}: attention "
                                      f"and MLP run in parallel, so that stream is never formed inside the model")
    decoder = list(get_module(model, arch.layers))
    layers = _normalise_layers(layers, len(decoder))
    reducers = dict(reducers or {})
    cap = Capture(points, layers)
    hooks = _HookSet()
    heads = {"q": arch.heads, "kv": arch.kv_heads}
    parts = {"q_proj": "q", "k_proj": "k", "v_proj": "v"}
    # In a parallel block resid_mid never exists in the model; it is the sum it would be, formed from the layer
    # input and the attention branch's output (both captured on the side).
    summed = arch.parallel and "resid_mid" in points
    side = {}

    def store(point, layer, tensor, view=lambda t: t):
        # A gradient is kept on the tensor the model itself uses; the documented shape is a view taken on access.
        if point in grads:
            if tensor.requires_grad:
                tensor.retain_grad()
            cap._kept[point, layer] = (tensor, view)
            return
        tensor = view(tensor.detach() if detach else tensor)
        cap.values[point, layer] = reducers[point](tensor, layer) if point in reducers else tensor

    class AttentionCapture(_Listener):
        def __init__(self, layer):
            self.layer = layer

        def before(self, call):
            for point, tensor in (("q", call.query), ("k", call.key), ("v", call.value)):
                if point in points:
                    store(point, self.layer, tensor)
            if "pattern" in points:
                with torch.no_grad():
                    store("pattern", self.layer, call.probabilities())

    def module_hook(point, layer, split):
        index = arch.qkv_index(parts[point]) if point in parts else None

        def unflatten(tensor):
            if index is not None:          # a fused q/k/v projection: this point's channels, in head order
                tensor = tensor[..., index.to(tensor.device)]
            return tensor.unflatten(-1, (heads[split], -1)) if split else tensor

        def pre(module, args, kwargs):
            store(point, layer, _first_tensor(args, kwargs, "input" if point == "z" else "hidden_states"), unflatten)

        def post(module, args, kwargs, output):
            store(point, layer, output[0] if isinstance(output, tuple) else output, unflatten)
        return pre, post

    def block_post_hook(layer, stop):
        def hook(module, args, kwargs, output):
            if summed:
                store("resid_mid", layer, side.pop(("resid_pre", layer)) + side.pop(("attn_out", layer)))
            if "resid_post" in points:
                store("resid_post", layer, output[0] if isinstance(output, tuple) else output)
            if stop:
                raise StopForward
        return hook

    try:
        with _wrapped_kernel(model):
            for layer in layers:
                block = decoder[layer]
                if _ATTN_POINTS & set(points):
                    hooks.listen(get_module(block, arch.attn), AttentionCapture(layer), layer)
                if "resid_pre" in points:
                    hooks.module_hook(block, "pre", module_hook("resid_pre", layer, None)[0], with_kwargs=True)
                if summed:
                    hooks.module_hook(block, "pre", _keep(side, ("resid_pre", layer), "pre"), with_kwargs=True)
                    hooks.module_hook(get_module(block, arch.attn_out), "post", _keep(side, ("attn_out", layer), "post"),
                                      with_kwargs=True)
                for point, (where, kind, split) in _MODULE_POINTS.items():
                    if point in points and not (point == "resid_mid" and summed):
                        pre, post = module_hook(point, layer, split)
                        hooks.module_hook(get_module(block, getattr(arch, where)), kind,
                                          pre if kind == "pre" else post, with_kwargs=True)
                stop = stop_early and layer == layers[-1]
                if "resid_post" in points or stop or summed:
                    hooks.module_hook(block, "post", block_post_hook(layer, stop), with_kwargs=True)
            try:
                yield cap
            except StopForward:
                pass
    finally:
        hooks.remove()


def _keep(side: dict, key, kind: str):
    """A hook keeping a module's input (``pre``) or output (``post``) tensor in ``side`` under ``key``."""
    def pre(module, args, kwargs):
        side[key] = _first_tensor(args, kwargs).detach()

    def post(module, args, kwargs, output):
        side[key] = (output[0] if isinstance(output, tuple) else output).detach()
    return pre if kind == "pre" else post


@contextlib.contextmanager
def attention_implementation(model, name: str):
    """Run ``model`` with another attention kernel ("sdpa", "eager", ...) inside the block."""
    original = text_config(model)._attn_implementation
    model.set_attn_implementation(name)
    try:
        yield
    finally:
        model.set_attn_implementation(original)


@contextlib.contextmanager
def frozen(model):
    """Parameters stop requiring gradients inside the block (activation gradients only); restored after."""
    flags = [(p, p.requires_grad) for p in model.parameters()]
    try:
        for p, _ in flags:
            p.requires_grad_(False)
        yield
    finally:
        for p, flag in flags:
            p.requires_grad_(flag)


# ---- intervene ------------------------------------------------------------------------------------------

@contextlib.contextmanager
def intervene(model, edits: dict):
    """Modify activations during forward passes run inside the ``with`` block.

    ``edits`` maps ``(point, layer)`` to a function; points:
    - ``"resid_pre"``: ``fn(hidden (B, T, D), layer) -> hidden``, the decoder layer's input;
    - ``"k"`` / ``"v"``: ``fn(tensor (B, Hkv, S, d), layer) -> tensor``, what the kernel attends with
      (after the KV cache was updated, so the cache keeps the unmodified keys/values);
    - ``"z"``: ``fn(z (B, T, H, d), layer) -> z``, per-head outputs before o_proj;
    - ``"attn"``: ``fn(call: AttentionCall) -> output (B, T, H, d) or None``, with the full kernel call
      (q, k, v, mask, output) for interventions that need them together, e.g. recomputing some rows.
    """
    arch = arch_for(model)
    decoder = list(get_module(model, arch.layers))
    for point, layer in edits:
        if point not in INTERVENTION_POINTS:
            raise ValueError(f"cannot intervene on {point!r}; points: {', '.join(INTERVENTION_POINTS)}")
        _normalise_layers([layer], len(decoder))
    hooks = _HookSet()

    class AttentionEdit(_Listener):
        def __init__(self, layer, kind, fn):
            self.layer, self.kind, self.fn = layer, kind, fn

        def before(self, call):
            if self.kind == "k":
                call.key = self.fn(call.key, self.layer)
            elif self.kind == "v":
                call.value = self.fn(call.value, self.layer)

        def after(self, call):
            if self.kind == "attn":
                new = self.fn(call)
                if new is not None:
                    call.output = new

    def resid_pre_edit(layer, fn):
        def hook(module, args, kwargs):
            if "hidden_states" in kwargs:
                return args, {**kwargs, "hidden_states": fn(kwargs["hidden_states"], layer)}
            return (fn(args[0], layer), *args[1:]), kwargs
        return hook

    def z_edit(layer, fn, head_dim):
        def hook(module, args, kwargs):
            z = _first_tensor(args, kwargs, "input")
            new = fn(z.unflatten(-1, (-1, head_dim)), layer).flatten(-2)
            return (new, *args[1:]), kwargs
        return hook

    try:
        with _wrapped_kernel(model):
            for (point, layer), fn in edits.items():
                layer = _normalise_layers([layer], len(decoder))[0]
                block = decoder[layer]
                attn = get_module(block, arch.attn)
                if point == "resid_pre":
                    hooks.module_hook(block, "pre", resid_pre_edit(layer, fn), with_kwargs=True)
                elif point == "z":
                    hooks.module_hook(get_module(block, arch.o_proj), "pre", z_edit(layer, fn, arch.head_dim),
                                      with_kwargs=True)
                else:
                    hooks.listen(attn, AttentionEdit(layer, point, fn), layer)
            yield
    finally:
        hooks.remove()

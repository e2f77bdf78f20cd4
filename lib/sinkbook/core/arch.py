"""Where things live inside a decoder layer, read from the model itself.

``arch_for(model)`` derives one ``ArchSpec`` per model from its modules and one probe forward pass over a few
tokens that stops after the first decoder layer: the list of decoder layers, the attention module, the query,
key, value and output projections (separate or fused), the QK-norm and its kind, the norms around each branch
and whether the two branches run in parallel. Only what cannot be read is written by hand, in
``HAND_WRITTEN``: how a fused q/k/v projection orders its output channels.

Paths are dotted, relative to one decoder layer, except ``layers``, relative to the ``*ForCausalLM``.
``resid_mid_input`` is the module whose *input* is the residual stream right after attention has been added
(None in a parallel block, where no such stream exists); ``attn_out`` / ``mlp_out`` are the modules whose
*output* each branch adds to the residual stream (a post-branch norm where the family has one).
"""
from __future__ import annotations

import copy
import sys
import weakref
from dataclasses import dataclass

import torch

QK_NORM_KINDS = ("none", "per-head", "layerwise")


@dataclass(frozen=True)
class ArchSpec:
    family: str
    layers: str                 # path from the *ForCausalLM to the list of decoder layers
    attn: str                   # attention module, relative to a layer
    q_proj: str                 # a fused q/k/v projection appears as q_proj, k_proj and v_proj alike
    k_proj: str
    v_proj: str
    o_proj: str
    q_norm: str | None          # None when the family has no QK-norm
    k_norm: str | None
    qk_norm: str                # "none" | "per-head" (over each head's d_h) | "layerwise" (over H*d_h)
    input_norm: str | None      # norm applied to the layer input before attention (None: post-norm family)
    resid_mid_input: str | None  # module whose input is the post-attention residual stream (None: parallel block)
    mlp: str
    attn_out: str               # module whose output the attention branch adds to the residual stream
    mlp_out: str                # module whose output the MLP branch adds to the residual stream
    norm_gain_offset: float = 0.0   # a norm multiplies by (offset + weight): Gemma stores gains minus 1
    qkv_layout: str | None = None   # None: separate projections; "concat": [q | k | v]; "per-head": [q_h k_h v_h]...
    parallel: bool = False          # attention and MLP both read the layer input (GPT-J, Phi, GPT-NeoX, Falcon)
    rotary: bool = True             # positions enter through rotary embeddings (False: learned or none)
    sinks: bool = False             # learned per-head sink logits in the softmax (gpt-oss)
    heads: int = 0
    kv_heads: int = 0
    head_dim: int = 0

    @property
    def fused(self) -> bool:
        return self.qkv_layout is not None

    def qkv_index(self, which: str) -> torch.Tensor | None:
        """Output channels of the (fused) projection that hold ``which`` in "q", "k", "v", in head order;
        None for a separate projection, whose whole output is that part."""
        if not self.fused:
            return None
        H, Hkv, d = self.heads, self.kv_heads, self.head_dim
        if self.qkv_layout == "concat":
            start, size = {"q": (0, H * d), "k": (H * d, Hkv * d), "v": ((H + Hkv) * d, Hkv * d)}[which]
            return torch.arange(start, start + size)
        # "per-head": GPT-NeoX views the output as (H, 3, d); Falcon's new layout as (Hkv, H/Hkv + 2, d)
        groups = H // Hkv
        block = torch.arange(Hkv * (groups + 2) * d).view(Hkv, groups + 2, d)
        part = {"q": block[:, :groups], "k": block[:, groups:groups + 1], "v": block[:, groups + 1:]}[which]
        return part.reshape(-1)


# ---- what cannot be read from the model --------------------------------------------------------------------

@dataclass(frozen=True)
class HandWritten:
    """A fact about a family that its modules do not reveal, with the reason it is needed."""
    family: str
    qkv_layout: str
    why: str


def _falcon_layout(config) -> str:
    return "per-head" if getattr(config, "new_decoder_architecture", False) or not getattr(
        config, "multi_query", True) else "concat"


HAND_WRITTEN: dict[str, HandWritten] = {
    "gpt2": HandWritten("gpt2", "concat", "c_attn's output is split in three equal thirds q | k | v"),
    "gpt_bigcode": HandWritten("gpt_bigcode", "concat", "c_attn's output is q (H*d) | k (Hkv*d) | v (Hkv*d)"),
    "phi3": HandWritten("phi3", "concat", "qkv_proj's output is q (H*d) | k (Hkv*d) | v (Hkv*d)"),
    "dbrx": HandWritten("dbrx", "concat", "Wqkv's output is q (H*d) | k (Hkv*d) | v (Hkv*d)"),
    "gpt_neox": HandWritten("gpt_neox", "per-head", "query_key_value's output is viewed as (H, 3 d): per head q, k, v"),
    "persimmon": HandWritten("persimmon", "per-head", "query_key_value's output is viewed as (H, 3 d), as in GPT-NeoX"),
    "falcon": HandWritten("falcon", "per config", "query_key_value is q | k | v with multi-query attention, "
                          "otherwise grouped per key/value head (q..q, k, v)"),
}
ARCHITECTURES = HAND_WRITTEN      # the book's architecture table lists what is written by hand

_QUERY = ("q_proj", "query", "q", "wq", "query_proj")
_KEY = ("k_proj", "key", "k", "wk", "key_proj")
_VALUE = ("v_proj", "value", "v", "wv", "value_proj")
_FUSED = ("c_attn", "query_key_value", "qkv_proj", "Wqkv", "qkv", "W_pack")
_OUT = ("o_proj", "out_proj", "dense", "c_proj", "wo", "o")
_Q_NORM = ("q_norm", "q_layernorm", "query_layernorm")
_K_NORM = ("k_norm", "k_layernorm", "key_layernorm")


class UnsupportedArchitecture(ValueError):
    """A family, or one capability on it, that the library cannot serve; the message is one line."""


_SPECS: "weakref.WeakKeyDictionary[torch.nn.Module, ArchSpec]" = weakref.WeakKeyDictionary()


def arch_for(model_or_config) -> ArchSpec:
    """The architecture of a model, derived once per model object. A config is accepted too: its model is
    built on the meta device (no memory, no weights) for the module names, without the probe pass."""
    if not isinstance(model_or_config, torch.nn.Module):
        from transformers import AutoModelForCausalLM
        config = model_or_config
        try:
            with torch.device("meta"):
                model = AutoModelForCausalLM.from_config(config)
        except Exception as err:
            raise UnsupportedArchitecture(f"architecture {config.model_type!r} is not supported: transformers builds "
                                          f"no causal LM from its config ({type(err).__name__})") from None
        return derive(model, probe=False)
    spec = _SPECS.get(model_or_config)
    if spec is None:
        spec = _SPECS[model_or_config] = derive(model_or_config)
    return spec


def derive(model, probe: bool = True) -> ArchSpec:
    """Read an ``ArchSpec`` off ``model`` (see the module docstring); raise UnsupportedArchitecture, in one line
    naming what is missing, when a decoder layer cannot be mapped."""
    config = text_config(model)
    family = config.model_type
    if not _uses_attention_interface(model):
        raise UnsupportedArchitecture(f"architecture {family!r} is not supported: its attention does not go through "
                                      f"transformers' attention interface, where the library reads q, k, v and the mask")
    layers_path = _find_layers(model, config)
    block = get_module(model, layers_path)[0]
    attn_name = _child(block, lambda name, m: "attention" in type(m).__name__.lower() and _has_params(m))
    if attn_name is None:
        raise UnsupportedArchitecture(f"architecture {family!r} is not supported: its decoder layer "
                                      f"({type(block).__name__}) has no attention module")
    attn = get_module(block, attn_name)
    names = dict(attn.named_children())
    q, k, v = (next((n for n in group if n in names), None) for group in (_QUERY, _KEY, _VALUE))
    fused = next((n for n in _FUSED if n in names), None)
    out = next((n for n in _OUT if n in names), None)
    if out is None or not ((q and k and v) or fused):
        raise UnsupportedArchitecture(f"architecture {family!r} is not supported: its attention module "
                                      f"{type(attn).__name__} has no q/k/v/output projections the library knows "
                                      f"(children: {', '.join(names)})")
    head_dim_ = int(getattr(attn, "head_dim", 0) or getattr(config, "head_dim", 0)
                    or config.hidden_size // config.num_attention_heads)
    heads = config.num_attention_heads
    layout = None
    if q and k and v:
        q, k, v = (f"{attn_name}.{n}" for n in (q, k, v))
        kv_heads = _out_features(get_module(block, k)) // head_dim_
    else:
        hand = HAND_WRITTEN.get(family)
        if hand is None:
            raise UnsupportedArchitecture(f"architecture {family!r} is not supported: its attention fuses q/k/v in "
                                          f"{fused!r}, whose channel order is not in core.arch.HAND_WRITTEN")
        layout = _falcon_layout(config) if hand.qkv_layout == "per config" else hand.qkv_layout
        q = k = v = f"{attn_name}.{fused}"
        width = _out_features(get_module(block, q)) // head_dim_
        kv_heads = (width - heads) // 2
    o_proj = f"{attn_name}.{out}"
    q_norm = next((f"{attn_name}.{n}" for n in _Q_NORM if n in names), None)
    k_norm = next((f"{attn_name}.{n}" for n in _K_NORM if n in names), None)
    qk_kind = _qk_norm_kind(get_module(block, q_norm), head_dim_, heads) if q_norm and k_norm else "none"
    rotary = any("rotary" in type(m).__name__.lower() or "rope" in type(m).__name__.lower()
                 for m in model.modules())
    mlp = _child(block, lambda name, m: name in ("mlp", "feed_forward", "block_sparse_moe", "ffn", "moe")) or \
        _child(block, lambda name, m: "attention" not in type(m).__name__.lower() and any(
            s in type(m).__name__.lower() for s in ("mlp", "moe", "feedforward", "experts")))
    if mlp is None:
        raise UnsupportedArchitecture(f"architecture {family!r} is not supported: no MLP found in its decoder "
                                      f"layer {type(block).__name__}")
    placement = _probe_norms(model, block, attn_name, mlp) if probe else _guess_norms(block)
    offset = _gain_offset(block, q_norm or placement["input_norm"] or placement.get("any_norm"))
    return ArchSpec(family=family, layers=layers_path, attn=attn_name, q_proj=q, k_proj=k, v_proj=v, o_proj=o_proj,
                    q_norm=q_norm, k_norm=k_norm, qk_norm=qk_kind, input_norm=placement["input_norm"],
                    resid_mid_input=placement["resid_mid_input"], mlp=mlp,
                    attn_out=placement["attn_out"] or o_proj, mlp_out=placement["mlp_out"] or mlp,
                    norm_gain_offset=offset, qkv_layout=layout, parallel=placement["parallel"], rotary=rotary,
                    sinks=isinstance(getattr(attn, "sinks", None), torch.nn.Parameter),
                    heads=heads, kv_heads=kv_heads, head_dim=head_dim_)


def _uses_attention_interface(model) -> bool:
    # The class flag marks the families that accept outside kernels; some that dispatch through the interface
    # (StableLM) lack it, so the model file importing the interface's registry counts too. Falcon's file does not.
    if getattr(model, "_supports_attention_backend", False):
        return True
    return any(hasattr(sys.modules.get(type(m).__module__), "ALL_ATTENTION_FUNCTIONS")
               for m in model.modules() if "attention" in type(m).__name__.lower())


def _has_params(module) -> bool:
    return any(True for _ in module.parameters())


def _child(block, test) -> str | None:
    return next((name for name, m in block.named_children() if test(name, m)), None)


def _out_features(proj) -> int:
    weight = proj.weight
    # transformers' Conv1D (GPT-2) stores (in, out); nn.Linear (out, in)
    return weight.shape[1] if type(proj).__name__ == "Conv1D" else weight.shape[0]


def _find_layers(model, config) -> str:
    n = config.num_hidden_layers
    found = [name for name, m in model.named_modules()
             if isinstance(m, torch.nn.ModuleList) and len(m) == n and len(m) > 0
             and len({type(x) for x in m}) == 1
             and any("attention" in type(c).__name__.lower() for c in m[0].children())]
    # a vision-language model also holds its vision tower's layers; the language model's are the ones wanted
    text = [name for name in found if not any(s in name for s in ("vision", "visual", "image", "audio"))]
    if not text:
        raise UnsupportedArchitecture(f"architecture {config.model_type!r} is not supported: no list of "
                                      f"{n} decoder layers with an attention module was found")
    return text[0]


def _qk_norm_kind(norm, head_dim_: int, heads: int) -> str:
    weight = getattr(norm, "weight", None)
    if weight is None:                        # StableLM keeps one norm per head in a ModuleList
        return "per-head"
    if weight.shape[-1] == head_dim_:
        return "per-head"
    if weight.numel() >= heads * head_dim_ or weight.shape[-1] != head_dim_:
        return "layerwise"
    return "per-head"


def _is_norm(module) -> bool:
    return "norm" in type(module).__name__.lower()


def _guess_norms(block) -> dict:
    """Without a forward pass: the conventional names, for configs given without a model."""
    names = dict(block.named_children())
    pre = next((n for n in ("input_layernorm", "ln_1", "attention_norm") if n in names), None)
    return {"input_norm": pre, "resid_mid_input": "post_attention_layernorm" if pre and "post_attention_layernorm"
            in names else None, "attn_out": None, "mlp_out": None, "parallel": False,
            "any_norm": next((n for n, m in names.items() if _is_norm(m) and _has_params(m)), None)}


def _probe_norms(model, block, attn_name: str, mlp_name: str) -> dict:
    """One forward pass over four tokens, stopped after the first decoder layer, recording which direct child of
    the layer reads which tensor: that tells the pre-attention norm, the post-branch norms, the module that reads
    the post-attention residual, and whether the MLP reads the layer input (a parallel block)."""
    seen_in, seen_out, order = {}, {}, []

    class _Stop(Exception):
        pass

    def pre(name):
        def hook(module, args, kwargs):
            x = kwargs.get("hidden_states", args[0] if args else None)
            if isinstance(x, torch.Tensor):
                seen_in[name] = x
                order.append(name)
        return hook

    def post(name):
        def hook(module, args, kwargs, output):
            seen_out[name] = output[0] if isinstance(output, tuple) else output
        return hook

    def stop(module, args, kwargs, output):
        raise _Stop

    handles = [block.register_forward_pre_hook(pre("<layer>"), with_kwargs=True),
               block.register_forward_hook(stop, with_kwargs=True)]
    for name, child in block.named_children():
        handles.append(child.register_forward_pre_hook(pre(name), with_kwargs=True))
        handles.append(child.register_forward_hook(post(name), with_kwargs=True))
    device = next(model.parameters()).device
    ids = torch.tensor([[1, 2, 3, 4]], device=device)
    modes = [(m, m.training) for m in model.modules()]
    model.eval()                         # dropout would make a module's input differ from what produced it
    try:
        with torch.no_grad():
            model(input_ids=ids, use_cache=False)
    except _Stop:
        pass
    finally:
        for h in handles:
            h.remove()
        for m, mode in modes:
            m.training = mode
    if "<layer>" not in seen_in or attn_name not in seen_in or mlp_name not in seen_in:
        raise UnsupportedArchitecture(f"architecture {text_config(model).model_type!r} is not supported: the probe "
                                      f"pass did not reach the attention and MLP of the first decoder layer")

    def same(a, b):
        return a is b or (a.shape == b.shape and torch.equal(a, b))

    def producer(x):
        """The norm child whose output is ``x``, or None."""
        return next((n for n, out in seen_out.items() if isinstance(out, torch.Tensor) and n not in
                     (attn_name, mlp_name) and _is_norm(get_module(block, n)) and same(out, x)), None)

    def consumer(x):
        """The norm child that reads ``x``, or None."""
        return next((n for n in order if n not in ("<layer>", attn_name, mlp_name)
                     and _is_norm(get_module(block, n)) and same(seen_in[n], x)), None)

    layer_in = seen_in["<layer>"]
    input_norm = producer(seen_in[attn_name])
    mlp_reads = seen_in[mlp_name]
    pre_mlp = producer(mlp_reads)
    mlp_source = seen_in[pre_mlp] if pre_mlp else mlp_reads
    parallel = same(mlp_source, layer_in)
    attn_out = consumer(seen_out[attn_name])
    mlp_out = consumer(seen_out[mlp_name])
    if parallel:
        resid_mid_input = None
    else:
        resid_mid_input = pre_mlp or mlp_name
    return {"input_norm": input_norm, "resid_mid_input": resid_mid_input, "attn_out": attn_out,
            "mlp_out": mlp_out, "parallel": parallel,
            "any_norm": next((n for n in order if n != "<layer>" and _is_norm(get_module(block, n))
                              and _has_params(get_module(block, n))), None)}


def _gain_offset(block, norm_path: str | None) -> float:
    """1.0 when the norm multiplies by (1 + weight), as Gemma's do, else 0.0: read by zeroing a copy's weight."""
    if norm_path is None:
        return 0.0
    norm = get_module(block, norm_path)
    weight = getattr(norm, "weight", None)
    if weight is None or weight.is_meta or weight.ndim != 1:
        return 0.0
    probe = copy.deepcopy(norm).float()
    with torch.no_grad():
        probe.weight.zero_()
        if getattr(probe, "bias", None) is not None:
            probe.bias.zero_()
        x = torch.randn(2, weight.shape[0], generator=torch.Generator().manual_seed(0)).to(weight.device)
        return 1.0 if probe(x).abs().max() > 1e-3 else 0.0


# ---- capabilities --------------------------------------------------------------------------------------------

CAPABILITIES = ("capture", "sink strength", "gradient probes", "OutRo", "V-scale", "QK-norm tools")


def capability_problem(model, capability: str) -> str | None:
    """Why ``capability`` cannot run on ``model``, in a clause, or None when it can."""
    if capability not in CAPABILITIES:
        raise ValueError(f"unknown capability {capability!r}; known: {', '.join(CAPABILITIES)}")
    spec = arch_for(model)
    if capability == "gradient probes" and spec.parallel:
        return ("attention and MLP run in parallel on the layer input, so there is no residual stream between "
                "the branches (resid_mid) for the probes' h^{l+1/2}")
    if capability == "QK-norm tools":
        if spec.qk_norm == "layerwise":
            return "its QK-norm is layerwise (one RMS over all heads); the tools fix or inject per-head norms"
        norm = get_module(decoder_layers(model)[0], spec.q_norm) if spec.q_norm else None
        if spec.qk_norm == "per-head" and not hasattr(norm, "weight"):
            return "its per-head QK-norm keeps one norm module per head; the tools replace one shared norm"
        if spec.qk_norm == "per-head" and getattr(norm, "bias", None) is not None:
            return "its QK-norm is a LayerNorm (centred, with a bias); the tools calibrate RMSNorm scales"
        if spec.qk_norm == "none" and spec.fused:
            return "its q/k projections are fused in one module; injecting a QK-norm needs separate ones"
    return None


def require(model, capability: str) -> ArchSpec:
    """The model's spec, or UnsupportedArchitecture in one line naming the missing capability and why."""
    problem = capability_problem(model, capability)
    if problem:
        raise UnsupportedArchitecture(f"{capability} is not available for {arch_for(model).family!r}: {problem}")
    return arch_for(model)


# ---- small helpers -----------------------------------------------------------------------------------------

def get_module(root, dotted: str):
    for part in dotted.split("."):
        root = root[int(part)] if part.isdigit() else getattr(root, part)
    return root


def decoder_layers(model) -> list:
    return list(get_module(model, arch_for(model).layers))


def norm_gain(model, norm_module):
    """The effective per-channel gain gamma of one of the model's RMSNorm modules."""
    return norm_module.weight.detach().float() + arch_for(model).norm_gain_offset


def text_config(model_or_config):
    """The language model's config (the ``text_config`` of a multimodal config)."""
    config = getattr(model_or_config, "config", model_or_config)
    return getattr(config, "text_config", None) or config


def head_logits(model, hidden: torch.Tensor) -> torch.Tensor:
    """The output head on rows of last hidden states, in float32, with the model's final logit soft-capping (Gemma).
    Applied only where logits are needed (labelled or scored positions): with a 262k-word head the head is most of
    a small model's cost."""
    logits = model.get_output_embeddings()(hidden).float()
    cap = getattr(text_config(model), "final_logit_softcapping", None)
    return torch.tanh(logits / cap) * cap if cap else logits


def n_layers(model) -> int:
    return text_config(model).num_hidden_layers


def head_dim(model) -> int:
    if isinstance(model, torch.nn.Module):
        return arch_for(model).head_dim
    cfg = text_config(model)
    return getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads

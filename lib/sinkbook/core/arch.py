"""One declarative table per architecture family: where things live inside a decoder layer.

Paths are dotted, relative to one decoder layer (``model.model.layers[i]``), except ``layers``, which is
relative to the ``*ForCausalLM``. Three entries name the modules that mark the residual stream, because
pre-norm Llama, Gemma 3's sandwich norms and Olmo2's post-norm layers place their norms differently:
``resid_mid_input`` is the module whose *input* is the residual stream right after attention has been
added; ``attn_out`` / ``mlp_out`` are the modules whose *output* each branch adds to the residual stream.
"""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class ArchSpec:
    family: str
    layers: str                 # path from the *ForCausalLM to the list of decoder layers
    attn: str                   # attention module, relative to a layer
    q_proj: str
    k_proj: str
    v_proj: str
    o_proj: str
    q_norm: str | None          # None when the family has no QK-norm
    k_norm: str | None
    qk_norm: str                # "none" | "per-head" (RMS over each head's d_h) | "layerwise" (over H*d_h)
    input_norm: str | None      # norm applied to the layer input before attention (None: post-norm family)
    resid_mid_input: str        # module whose input is the post-attention residual stream
    mlp: str
    attn_out: str               # module whose output the attention branch adds to the residual stream
    mlp_out: str                # module whose output the MLP branch adds to the residual stream
    norm_gain_offset: float = 0.0   # an RMSNorm multiplies by (offset + weight): Gemma stores gains minus 1


_LLAMA_LIKE = dict(layers="model.layers", attn="self_attn", q_proj="self_attn.q_proj",
                   k_proj="self_attn.k_proj", v_proj="self_attn.v_proj", o_proj="self_attn.o_proj", mlp="mlp")
_PRE_NORM = dict(attn_out="self_attn.o_proj", mlp_out="mlp")
_SANDWICH = dict(attn_out="post_attention_layernorm", mlp_out="post_feedforward_layernorm")

ARCHITECTURES: dict[str, ArchSpec] = {
    "llama": ArchSpec("llama", **_LLAMA_LIKE, q_norm=None, k_norm=None, qk_norm="none",
                      input_norm="input_layernorm", resid_mid_input="post_attention_layernorm", **_PRE_NORM),
    "mistral": ArchSpec("mistral", **_LLAMA_LIKE, q_norm=None, k_norm=None, qk_norm="none",
                        input_norm="input_layernorm", resid_mid_input="post_attention_layernorm", **_PRE_NORM),
    "qwen2": ArchSpec("qwen2", **_LLAMA_LIKE, q_norm=None, k_norm=None, qk_norm="none",
                      input_norm="input_layernorm", resid_mid_input="post_attention_layernorm", **_PRE_NORM),
    "qwen3": ArchSpec("qwen3", **_LLAMA_LIKE, q_norm="self_attn.q_norm", k_norm="self_attn.k_norm",
                      qk_norm="per-head", input_norm="input_layernorm", resid_mid_input="post_attention_layernorm", **_PRE_NORM),
    "gemma3_text": ArchSpec("gemma3_text", **_LLAMA_LIKE, q_norm="self_attn.q_norm", k_norm="self_attn.k_norm",
                            qk_norm="per-head", input_norm="input_layernorm",
                            resid_mid_input="pre_feedforward_layernorm", norm_gain_offset=1.0, **_SANDWICH),
    "olmo2": ArchSpec("olmo2", **_LLAMA_LIKE, q_norm="self_attn.q_norm", k_norm="self_attn.k_norm",
                      qk_norm="layerwise", input_norm=None, resid_mid_input="mlp", **_SANDWICH),
}
_ALIASES = {"gemma3": "gemma3_text"}


class UnsupportedArchitecture(ValueError):
    pass


def arch_for(model_or_config) -> ArchSpec:
    config = text_config(model_or_config)
    model_type = _ALIASES.get(config.model_type, config.model_type)
    if model_type not in ARCHITECTURES:
        raise UnsupportedArchitecture(
            f"architecture {config.model_type!r} is not supported; supported families: "
            f"{', '.join(sorted(ARCHITECTURES))}. Add an ArchSpec row in sinkbook/arch.py to support it.")
    return ARCHITECTURES[model_type]


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


def n_layers(model) -> int:
    return text_config(model).num_hidden_layers


def head_dim(model) -> int:
    cfg = text_config(model)
    return getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads

"""One declarative table per architecture family: where things live inside a decoder layer.

Paths are dotted, relative to one decoder layer (``model.model.layers[i]``). ``resid_mid_input`` names
the module whose *input* is the residual stream right after attention has been added (it differs
between pre-norm Llama, Gemma3's sandwich norms and Olmo2's post-norm layers).
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


_LLAMA_LIKE = dict(layers="model.layers", attn="self_attn", q_proj="self_attn.q_proj",
                   k_proj="self_attn.k_proj", v_proj="self_attn.v_proj", o_proj="self_attn.o_proj", mlp="mlp")

ARCHITECTURES: dict[str, ArchSpec] = {
    "llama": ArchSpec("llama", **_LLAMA_LIKE, q_norm=None, k_norm=None, qk_norm="none",
                      input_norm="input_layernorm", resid_mid_input="post_attention_layernorm"),
    "mistral": ArchSpec("mistral", **_LLAMA_LIKE, q_norm=None, k_norm=None, qk_norm="none",
                        input_norm="input_layernorm", resid_mid_input="post_attention_layernorm"),
    "qwen2": ArchSpec("qwen2", **_LLAMA_LIKE, q_norm=None, k_norm=None, qk_norm="none",
                      input_norm="input_layernorm", resid_mid_input="post_attention_layernorm"),
    "qwen3": ArchSpec("qwen3", **_LLAMA_LIKE, q_norm="self_attn.q_norm", k_norm="self_attn.k_norm",
                      qk_norm="per-head", input_norm="input_layernorm", resid_mid_input="post_attention_layernorm"),
    "gemma3_text": ArchSpec("gemma3_text", **_LLAMA_LIKE, q_norm="self_attn.q_norm", k_norm="self_attn.k_norm",
                            qk_norm="per-head", input_norm="input_layernorm",
                            resid_mid_input="pre_feedforward_layernorm"),
    "olmo2": ArchSpec("olmo2", **_LLAMA_LIKE, q_norm="self_attn.q_norm", k_norm="self_attn.k_norm",
                      qk_norm="layerwise", input_norm=None, resid_mid_input="mlp"),
}
_ALIASES = {"gemma3": "gemma3_text"}


class UnsupportedArchitecture(ValueError):
    pass


def arch_for(model_or_config) -> ArchSpec:
    config = getattr(model_or_config, "config", model_or_config)
    config = getattr(config, "text_config", None) or config
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

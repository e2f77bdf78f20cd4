"""LoRA on the language model of a vision-language model (Hu et al., 2022), through peft, merged back for saving.

One of the remedies the VL paper lists (Sec. 1-2: "low-rank adapters"): instead of updating W, stage 2 trains
W + (alpha / r) B A with A (r x d_in), B (d_out x r), B initialised at zero, so the model starts as the base
model. ``apply_lora`` puts adapters on the attention projections (q/k/v/o by default, found through the
architecture table) and freezes every other weight of the language model; ``merge_lora`` folds B A into W and
removes the adapters, so the result is a plain model of the original class that ``save_pretrained`` /
``load_model`` handle as before.

Needs ``peft==0.21.2`` (its requirements, numpy, packaging, psutil, pyyaml, torch, transformers, tqdm,
accelerate>=0.21, safetensors, huggingface_hub>=0.25, are all already installed with our pins; nothing else
changes). Without it, ``apply_lora`` raises ImportError with the install line.
"""
from __future__ import annotations

from dataclasses import dataclass

from torch import nn

from ..core.arch import arch_for

PEFT_PIN = "peft==0.21.2"
DEFAULT_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj")


def _peft():
    try:
        import peft
    except ImportError:
        raise ImportError(f"LoRA needs peft; install it with `pip install {PEFT_PIN}`") from None
    return peft


@dataclass
class LoraHandle:
    """What ``apply_lora`` returns: the peft wrapper (kept only to merge) and the model it changed in place."""
    peft_model: object
    llm: nn.Module
    targets: tuple

    def parameters(self):
        """The adapter parameters (what the optimiser trains besides the projector)."""
        return [p for n, p in self.llm.named_parameters() if "lora_" in n]


def _language_model(model: nn.Module) -> nn.Module:
    return getattr(model, "llm", model)         # a DigitVLM, or a causal LM itself


def apply_lora(model: nn.Module, r: int = 16, alpha: float = 32, dropout: float = 0.0,
               targets=DEFAULT_TARGETS) -> LoraHandle:
    """Add LoRA adapters to the language model of ``model`` (a DigitVLM or a causal LM), in place.

    ``targets`` are projection names of the architecture table (``q_proj``, ``k_proj``, ``v_proj``, ``o_proj``,
    or MLP leaf names such as ``gate_proj``). Afterwards only the adapters of the language model require
    gradients; nothing outside the language model (the projector) is touched."""
    peft = _peft()
    llm = _language_model(model)
    arch = arch_for(llm)
    leaves = []
    for target in targets:
        path = getattr(arch, target, None) if target in ("q_proj", "k_proj", "v_proj", "o_proj") else target
        leaves.append((path or target).rsplit(".", 1)[-1])
    config = peft.LoraConfig(r=r, lora_alpha=alpha, lora_dropout=dropout, target_modules=sorted(set(leaves)),
                             bias="none")
    wrapped = peft.get_peft_model(llm, config)
    if wrapped.base_model.model is not llm:        # peft changes the model in place; a copy would detach the VLM
        raise RuntimeError("peft returned a copy of the language model instead of changing it in place")
    return LoraHandle(wrapped, llm, tuple(targets))


def merge_lora(handle: LoraHandle) -> nn.Module:
    """Fold the adapters into the weights (W <- W + alpha/r B A) and remove them; returns the same language-model
    object, now of its original class without adapters, ready for ``save_pretrained``."""
    merged = handle.peft_model.merge_and_unload()
    if merged is not handle.llm:
        raise RuntimeError("peft's merge_and_unload returned a different object than the adapted language model")
    if "peft_config" in vars(merged):             # peft leaves its config on the model; the model is plain now
        del merged.peft_config
    return merged

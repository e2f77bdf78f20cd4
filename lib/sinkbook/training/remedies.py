"""How each intervention of the protection chapter changes the adaptation recipe of ``training.adapt``.

One class, one method per moment of the recipe, so ``adapt`` reads the same with or without an intervention:

- ``prepare()``: before stage 0 (model surgery: the QK-norm of the language model fixed or injected);
- ``stage2_parameters(params)``: what stage 2 trains (frozen LLM: the projector only; LoRA: the projector and
  the adapters);
- ``attach(optimizer)``: after stage 2's optimizer is built (head-selective protection hooks its steps);
- ``text_step(step)``: whether stage-2 step ``step`` trains on a text-only batch (re-blending text-only data);
- ``finish()``: after stage 2 (detach the protection, merge LoRA into the weights) -> what the run records.

The interventions themselves live in ``sinkbook.interventions`` and are tested there against their definitions;
this module only places them in the recipe.
"""
from __future__ import annotations

import math

INTERVENTIONS = ("none", "frozen_llm", "lora", "protection", "text_blend", "fix_qk_norm", "inject_qk_norm")
CHANGES_NORMS = ("fix_qk_norm", "inject_qk_norm")


def calibration_batch(loaded) -> dict:
    """The 15 calibration prompts (the ones S is measured on), on the model's device."""
    from ..core.models import encode
    from ..core.prompts import prompt_texts
    return encode(loaded.tokenizer, prompt_texts(), device=loaded.device)


class RecipeChange:
    def __init__(self, cfg, vlm, loaded):
        self.cfg, self.vlm, self.loaded = cfg, vlm, loaded
        self.name = cfg.intervention
        self.protection = self.lora = None
        self.record: dict = {"intervention": self.name}

    def prepare(self) -> None:
        if self.name == "fix_qk_norm":
            from ..interventions.qknorm import fix_qk_norm
            fixed = fix_qk_norm(self.vlm.llm, calibration_batch(self.loaded))
            self.record["fixed_layers"] = len(fixed)
        elif self.name == "inject_qk_norm":
            from ..interventions.qknorm import inject_qk_norm
            injected = inject_qk_norm(self.vlm.llm)
            self.record["injected_layers"] = len(injected.norms)

    def stage2_parameters(self, params: list) -> list:
        if self.name == "frozen_llm":
            self.vlm.llm.requires_grad_(False)
            return list(self.vlm.projector.parameters())
        if self.name == "lora":
            from ..interventions.lora import apply_lora
            self.lora = apply_lora(self.vlm, r=self.cfg.lora_rank, alpha=2 * self.cfg.lora_rank)
            return list(self.vlm.projector.parameters()) + self.lora.parameters()
        return params

    def attach(self, optimizer) -> None:
        if self.name != "protection":
            return
        from ..interventions.protection import calibrate_protection
        self.protection = calibrate_protection(self.vlm.llm, calibration_batch(self.loaded))
        self.protection.attach(self.vlm.llm, optimizer)
        self.record.update({"protection": self.protection.reason, "first_sink_layer": self.protection.first_layer,
                            "sink_heads": {str(k): list(v) for k, v in self.protection.heads.items()}})

    def text_step(self, step: int) -> bool:
        """Evenly spaced text-only steps: step s is text-only when floor((s + 1) p) > floor(s p)."""
        p = self.cfg.text_share if self.name == "text_blend" else 0.0
        return math.floor((step + 1) * p) > math.floor(step * p)

    def finish(self) -> dict:
        if self.protection is not None:
            self.protection.detach()
        if self.lora is not None:
            from ..interventions.lora import merge_lora
            merge_lora(self.lora)
            self.record["lora_merged"] = True
        return self.record

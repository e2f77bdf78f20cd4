"""The gpu profile of the chapters whose gpu profile reaches code the others do not, run here on tiny models with
tiny budgets: vision probes during training, IFEval-style compliance of base models, every image task, bfloat16
adaptation (vl_adaptation); the frozen-LLM, LoRA and text re-blending arms and every merge (vl_protection); the
extra compliance settings (outro); a wider sweep of rotation strengths and pruning shares (outro_multimodal).
Everything else of the gpu profile is a larger number, which the default book already runs at its own size."""
from __future__ import annotations

import pytest

from sinkbook.core.claims import INCONCLUSIVE, NOT_COMPARABLE

VERDICTS = {True, False, INCONCLUSIVE, NOT_COMPARABLE}
TINY_RECIPE = dict(steps=2, stage1_steps=1, batch_size=4, probe_every=1, probe_arithmetic=2, probe_vision=2,
                   probe_prompts=2, probe_heldout_windows=1, probe_heldout_length=32, arithmetic=2, knowledge=2,
                   ifeval=1, ifeval_tokens=4, vision=3, heldout_windows=1)


def _checked(results) -> dict:
    claims = {c.id: c for c in results["claims"]}
    assert claims and {c.holds for c in claims.values()} <= VERDICTS
    assert all(c.holds is True for c in claims.values() if c.must_hold)
    return claims


def test_vl_adaptation_gpu_profile(private_cache):
    from sinkbook.chapters import vl_adaptation as vl
    from sinkbook.training.digits import TASKS
    settings = vl.PROFILES.resolve("gpu", device="cpu", models=["tiny-llama"], seeds=[0], workers=1, **TINY_RECIPE)
    assert settings.precision == "bfloat16" and settings.ifeval_base_models and list(settings.tasks) == list(TASKS)
    chapter = vl.VLAdaptationChapter(settings)
    _checked(chapter.results())
    run = chapter.runs["tiny-llama", "vision", 0]
    assert run["config"]["precision"] == "bfloat16" and run["config"]["tasks"] == list(TASKS)
    assert all("vision_accuracy" in p for p in run["probes"])            # vision probed along training
    assert "ifeval" in chapter.base["tiny-llama"]["tasks"]               # a base model's compliance is scored


def test_vl_protection_gpu_profile(private_cache):
    from sinkbook.chapters import vl_protection as vp
    settings = vp.PROFILES.resolve("gpu", device="cpu", interventions={"tiny-qwen3": ["frozen_llm", "lora",
                                                                                     "text_blend", "fix_qk_norm"]},
                                   seeds=[0], merge_models=["tiny-qwen3"], merge_seeds=[0], workers=1,
                                   adaptation=TINY_RECIPE, recovery_steps=2)
    assert len(settings.merges) == len(vp.MERGES)
    chapter = vp.VLProtectionChapter(settings)
    _checked(chapter.results())
    arms = {arm for (_, arm, _) in chapter.runs}
    assert {"none", "frozen_llm", "lora", "text_blend", "fix_qk_norm"} <= arms
    # the fixed-scale arm trained from its seed's recovered start, which was also evaluated before VL training
    start = chapter.starts[("tiny-qwen3", "fix_qk_norm", 0)]
    assert [row["step"] for row in start["recovery"]["curve"]] == [0, 2]
    assert chapter.runs[("tiny-qwen3", "fix_qk_norm", 0)]["intervention"]["recovery"] == start["recovery"]
    assert len(chapter.recovery().table) == 1


def test_outro_gpu_profile():
    from sinkbook.chapters import outro as C
    settings = C.PROFILES.resolve("gpu", device="cpu", models=["tiny-qwen2"], analysis_prompts=2, n_windows=2,
                                  window_length=32, n_ablation_heads=1, n_prompts=3, screen_prompts=2,
                                  max_new_tokens=4, batch_size=4, bench=[16, 3, 1], threads=1)
    assert settings.ifeval_extra == ["relax", "outro_gamma_0.5", "outro_gamma_3.0"]
    chapter = C.OutRoChapter(settings)
    _checked(chapter.results())
    # A random tiny model has no sink, so the chapter never reaches the extra settings; run them directly.
    for name in settings.ifeval_extra:
        graded = chapter.runs.generations("tiny-qwen2", name, 2)
        assert len(graded["passes"]) == 2 and len(graded["responses"]) == 2


def test_outro_multimodal_gpu_profile(private_cache):
    from sinkbook.chapters import outro_multimodal as C
    settings = C.PROFILES.resolve("gpu", device="cpu", models=["tiny-qwen2"], n_test=6, n_val=2, analysis_items=2,
                                  batch_size=4, workers=1, adaptation={**TINY_RECIPE, "workers": 1})
    assert len(settings.gammas) == 6 and len(settings.prune_keep) == 3
    _checked(C.OutRoMultimodalChapter(settings).results())

"""The sink-criteria measurements on loaded text models: the census of sink criteria, Zero-K, G at every layer,
the sample-size sweep, timings and the explorer's attention maps, each computed once per run of the chapter."""
from __future__ import annotations

import time

import torch

from ..core.models import architecture_info, encode, load_model
from ..core.prompts import prompt_texts
from ..interventions.zero_k import zero_k_effect
from ..measures.attention_maps import explorer_datasets
from ..measures.criteria import sink_census
from ..measures.strength import sample_size_sweep, sink_strength

TAU_SWEEP = (20.0, 25.0, 30.0)        # the thresholds of OutRo Table A.3


class CriteriaRuns:
    """Models loaded on first use and every measurement of the sink-criteria chapter, cached by name; ``settings``
    holds models, device, the prompt counts, tau, eps, t_eps, window, seed and the sweep and explorer sizes."""

    def __init__(self, settings):
        self.settings = settings
        self._loaded: dict = {}
        self._cache: dict = {}

    @property
    def loaded(self) -> dict:
        for spec in self.settings.models:
            if spec not in self._loaded:
                self._loaded[spec] = load_model(spec, device=self.settings.device)
        return self._loaded

    def _measure(self, key, compute):
        if key not in self._cache:
            self._cache[key] = compute()
        return self._cache[key]

    def _prompts(self, n: int, source: str = "calibration") -> list[str]:
        return prompt_texts(n, source)

    def info(self) -> dict:
        return self._measure("info", lambda: {spec: architecture_info(m) for spec, m in self.loaded.items()})

    def window_for(self, spec: str) -> int:
        """The window K clipped to the model's depth."""
        return min(self.settings.window, self.info()[spec]["layers"])

    def census(self) -> dict:
        s = self.settings
        taus = sorted({float(s.tau), *TAU_SWEEP})
        return self._measure("census", lambda: {
            spec: sink_census(m, self._prompts(s.census_prompts), taus=taus, eps=s.eps, t_eps=s.t_eps)
            for spec, m in self.loaded.items()})

    def zero_k_tables(self) -> dict:
        return self._measure("zero_k", lambda: {spec: zero_k_effect(m, self._prompts(self.settings.zero_k_prompts))
                                                for spec, m in self.loaded.items()})

    def strength_results(self) -> dict:
        """G on the calibration prompts at every layer (so every window is a reduction of the same gaps)."""
        return self._measure("strength", lambda: {spec: sink_strength(m, self._prompts(self.settings.n_prompts),
                                                                      layers="all")
                                                  for spec, m in self.loaded.items()})

    def strength_summaries(self) -> dict:
        return {spec: r.summary(self.window_for(spec)) for spec, r in self.strength_results().items()}

    def strength_measured(self) -> dict:
        out = {}
        for spec, r in self.strength_results().items():
            k = self.window_for(spec)
            g = r.values(k)
            real = r.attention_mask.sum(-1)
            info = self.info()[spec]
            out[spec] = {"summary": r.summary(k), "qk_norm": info["qk_norm"], "heads": r.head_table(None),
                         "boxes": r.layer_quantiles(k), "n_gaps": int(g.numel()), "g_finite": bool(g.isfinite().all()),
                         # independent of how G was masked: each prompt's real tokens but its first, per head
                         "expected_gaps": int((real - 1).clamp_min(0).sum()) * info["heads"] * k}
        return out

    def strength_without_template(self) -> dict:
        """S over the chapter's window with every model scored without a chat template: the control that separates
        the template from the architecture when a base model (no template) is compared with an instruct model."""
        def measure():
            out = {}
            for spec, m in self.loaded.items():
                summary = self.strength_summaries()[spec]
                if not summary["chat"]:
                    out[spec] = float(summary["S"])
                    continue
                k = self.window_for(spec)
                out[spec] = float(sink_strength(m, self._prompts(self.settings.n_prompts), chat=False,
                                                window=k).strength(k))
            return out
        return self._measure("strength_without_template", measure)

    def timings(self) -> dict:
        def measure():
            out = {}
            for spec, m in self.loaded.items():
                batch = encode(m.tokenizer, self._prompts(self.settings.n_prompts), device=m.device)
                start = time.perf_counter()
                with torch.no_grad():
                    m.model(**batch, use_cache=False)
                out[spec] = {"forward_s": time.perf_counter() - start,
                             "strength_s": self.strength_results()[spec].seconds}
            return out
        self.strength_results()
        return self._measure("timings", measure)

    def sweep_models(self) -> list[str]:
        return list(self.settings.models) if self.settings.sweep_all_models else list(self.settings.models)[:1]

    def sample_sweeps(self) -> dict:
        """S on random subsets of the pool (or of the calibration prompts when ``pool_prompts`` is 0)."""
        s = self.settings

        def measure():
            out = {}
            for spec in self.sweep_models():
                result = (sink_strength(self.loaded[spec], self._prompts(s.pool_prompts, "pool"), layers="all")
                          if s.pool_prompts else self.strength_results()[spec])
                seeds = tuple(range(s.seed, s.seed + s.sweep_seeds))
                out[spec] = sample_size_sweep(result, tuple(s.sweep_sizes), seeds, self.window_for(spec))
            return out
        return self._measure("sample_sweeps", measure)

    def explorer_prompts(self) -> list[str]:
        """The shortest calibration prompts (the page grows with T^2), in their original order."""
        calibration = self._prompts(self.settings.n_prompts)
        shortest = sorted(range(len(calibration)), key=lambda i: len(calibration[i]))[:self.settings.explorer_prompts]
        return [calibration[i] for i in sorted(shortest)]

    def sink_strength_extra(self) -> dict:
        """What the predictor chapter reads: S and its companions per model."""
        n = self.settings.n_prompts
        return {spec: {"S": float(s["S"]), "strong_fraction": float(s["strong_fraction"]),
                       "mean_G": float(s["mean_G"]), "window": int(s["window"]), "n_prompts": n,
                       "chat": bool(s["chat"])} for spec, s in self.strength_summaries().items()}

    def explorer_data(self) -> list[dict]:
        """The explorer's arrays (``measures.attention_maps``) of every model on the explorer prompts."""
        return self._measure("explorer", lambda: explorer_datasets(self.loaded.values(), self.explorer_prompts(),
                                                                  max_tokens=self.settings.explorer_tokens))

"""Sink Strength of models named by spec, for the chapters that place models on the VL paper's fit: read from the
sink-criteria chapter's results file when it holds it, else measured here on the calibration prompts."""
from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pandas as pd

from ..core.arch import n_layers
from ..core.models import BUILTIN_MODELS, load_model
from ..core.paths import REPO_ROOT, results_dir
from ..core.prompts import prompt_texts
from ..measures.strength import sink_strength


def sink_strengths_from_results(models: list[str], path: str | Path) -> pd.DataFrame:
    """S per model from the sink-criteria chapter's results file (``extra.sink_strength[spec]["S"]``).

    Columns: model, S (NaN when the file does not hold it), source, note (why not)."""
    path = Path(path)
    entries, why = {}, ""
    if not path.exists():
        why = f"{_shown(path)} does not exist yet (build the sink-criteria chapter first)"
    else:
        try:
            entries = json.loads(path.read_text()).get("extra", {}).get("sink_strength", {}) or {}
            why = f"{_shown(path)} has no Sink Strength for this model"
        except (json.JSONDecodeError, AttributeError) as err:
            why = f"{_shown(path)} could not be read ({err})"
    rows = []
    for spec in models:
        entry = entries.get(spec) if isinstance(entries, dict) else None
        value = entry.get("S") if isinstance(entry, dict) else None
        if isinstance(value, (int, float)) and math.isfinite(value):
            rows.append({"model": spec, "S": float(value), "source": f"read from {_shown(path)}", "note": ""})
        else:
            rows.append({"model": spec, "S": np.nan, "source": "", "note": why})
    return pd.DataFrame(rows, columns=["model", "S", "source", "note"])


def _shown(path: Path) -> str:
    return str(path.relative_to(REPO_ROOT)) if path.is_relative_to(REPO_ROOT) else str(path)


class StrengthRuns:
    """S of each model the settings name (``models``, ``extra_s_values``, ``compute_missing_s``, ``s_prompts``,
    ``s_window``, ``device``): a value the reader gives wins, then the sink-criteria results, then a measurement."""

    def __init__(self, settings):
        self.settings = settings
        self._strengths: pd.DataFrame | None = None
        self.model_records: list[dict] = []

    def sink_strengths(self) -> pd.DataFrame:
        """S of each model: from the sink-criteria results file, else measured here, else NaN with the reason."""
        if self._strengths is None:
            s = self.settings
            given = dict(s.extra_s_values)          # a value the reader gives wins over ours
            models = [m for m in dict.fromkeys(s.models) if m not in given]
            strengths = sink_strengths_from_results(models, results_dir() / "sink_criteria.json")
            for i, row in strengths.iterrows():
                if np.isfinite(row.S):
                    self.model_records.append(_record_without_loading(row.model))
                    continue
                if not s.compute_missing_s:
                    strengths.loc[i, "note"] = f"{row.note}; measuring S here is off (compute_missing_s)"
                    continue
                value, source, why = self._measure_s(row.model)
                strengths.loc[i, ["S", "source", "note"]] = [value, source, f"{row.note}; {why}" if why else ""]
            for name, value in given.items():
                number = _number(value)
                why = "" if math.isfinite(number) else f"the S given, {value!r}, is not a number"
                strengths.loc[len(strengths)] = {"model": name, "S": number, "source": "given by the reader", "note": why}
            self._strengths = strengths
        return self._strengths

    def _measure_s(self, spec: str) -> tuple[float, str, str]:
        """S on the calibration prompts over the last ``s_window`` layers (all layers of a shallower model)."""
        try:
            loaded = load_model(spec, device=self.settings.device)
            window = min(int(self.settings.s_window), n_layers(loaded.model))
            result = sink_strength(loaded, prompt_texts(self.settings.s_prompts), window=window)
            value = float(result.strength(window))
        except Exception as err:  # any spec a reader passes: a failure is a reason, not a traceback
            return float("nan"), "", f"measuring S for {spec!r} failed: {type(err).__name__}: {err}"
        self.model_records.append(loaded.record())
        if not math.isfinite(value):
            return value, "", f"S of {spec!r} is not finite (no query sees two keys)"
        clipped = ("" if window == self.settings.s_window
                   else f", over all {window} layers: the model has fewer than {self.settings.s_window}")
        return value, f"measured here on {self.settings.s_prompts} prompts{clipped}", ""


def _number(value) -> float:
    try:
        return float(value)
    except (TypeError, ValueError):
        return float("nan")


def _record_without_loading(spec: str) -> dict:
    return {"spec": spec, "id": BUILTIN_MODELS.get(spec, spec), "files": {}}

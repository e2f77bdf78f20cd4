"""Chapters rerun, as a reader would, on models without the phenomenon: papermill on a tiny random model ends with
a results file whose claims say "not comparable" where a precondition is missing, never with a traceback."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from sinkbook.core.paths import REPO_ROOT

RUNS = {
    "outro": {"models": ["tiny-qwen2"]},
    "outro_multimodal": {"models": ["tiny-qwen2"]},
    "gradient_sinks_with_sink": {"real_models": ["tiny-olmo2"], "retrofit_model": "tiny-qwen2"},
    "sink_criteria": {"models": ["tiny-gemma3"]},
    "vl_protection": {"interventions": {"tiny-qwen2": ["protection", "inject_qk_norm"], "tiny-qwen3": ["fix_qk_norm"]},
                      "merge_models": ["tiny-qwen2"],
                      "merges": ["uniform", "ties"]},
}


@pytest.mark.parametrize("chapter", sorted(RUNS))
def test_chapter_notebook_runs_on_a_tiny_model(chapter, tmp_path):
    parameters = {"profile": "quick", **RUNS[chapter]}
    env = {**os.environ, "SINKBOOK_RESULTS_DIR": str(tmp_path), "PYTHONWARNINGS": "ignore"}
    notebook = REPO_ROOT / "notebooks" / f"{chapter}.ipynb"
    done = subprocess.run([sys.executable, "-m", "sinkbook.book.papermill_ipc", str(notebook), str(tmp_path / "out.ipynb"),
                           "--cwd", str(REPO_ROOT), "-k", "python3", "--no-progress-bar",
                           "-y", json.dumps(parameters)], env=env, capture_output=True, text=True, timeout=1200)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert "Traceback" not in (tmp_path / "out.ipynb").read_text()
    results = json.loads((tmp_path / f"{chapter}.json").read_text())
    claims = results["claims"]
    assert claims and any(c["holds"] == "not comparable" and c["why_not_comparable"] for c in claims)
    assert all(c["holds"] is True for c in claims if c.get("must_hold"))

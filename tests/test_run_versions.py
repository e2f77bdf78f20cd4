"""A cached trained run records the torch and transformers versions it was trained under, and loading it under
other versions says so (a rerun may not give the same numbers); under the same versions it is silent."""
from __future__ import annotations

import warnings

import pytest
import torch

from sinkbook.training.loop import CachedRunVersionWarning, report_version_drift, trained_with
from sinkbook.training.scratch import load_run, train
from test_trainer import CFG, _corpus


def test_loading_a_run_trained_under_other_versions_warns(tmp_path):
    corpus = _corpus()
    run = train(CFG, corpus, device="cpu", use_cache=True, save=True, progress=False, root=tmp_path)
    state = torch.load(run.path, map_location="cpu", weights_only=False)
    assert {k: state[k] for k in ("torch", "transformers")} == trained_with()
    with warnings.catch_warnings():
        warnings.simplefilter("error", CachedRunVersionWarning)     # same versions: no warning
        assert load_run(CFG, corpus, "cpu", root=tmp_path) is not None
    state["transformers"] = "4.0.0"
    torch.save(state, run.path)
    with pytest.warns(CachedRunVersionWarning, match=r"transformers 4\.0\.0 -> "):
        assert load_run(CFG, corpus, "cpu", root=tmp_path) is not None


def test_only_recorded_versions_are_compared():
    running = trained_with()
    assert report_version_drift({}, "old-run") == []
    assert report_version_drift({"torch": running["torch"]}, "run") == []
    with pytest.warns(CachedRunVersionWarning):
        assert report_version_drift({"torch": "1.0"}, "run") == [f"torch 1.0 -> {running['torch']}"]

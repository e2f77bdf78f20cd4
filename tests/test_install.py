"""The library installs alone: into a fresh virtual environment, ``pip install`` of the package without extras
(only the core dependencies, resolved from pyproject's ranges), and the installed ``sinkbook strength`` command
gives the same Sink Strength as the checkout. The book's stack (Jupyter Book, papermill, lm-eval, accelerate)
must not come with it.

torch is installed first, the way scripts/setup.sh does it (``pip install torch==2.13.0``), so pip takes it from
its cache or this machine's wheel rather than resolving a multi-GB CUDA build. The test prints its wall time."""
from __future__ import annotations

import json
import math
import os
import shutil
import subprocess
import sys
import time
import venv

import pytest

from sinkbook.core.paths import REPO_ROOT

pytestmark = pytest.mark.install
# what pip needs to build the package; nothing else of the repository goes along, so the test also shows that
# the package does not read files outside itself
PACKAGE_FILES = ("pyproject.toml", "README.md", "LICENSE", "LICENSE-docs", "lib")
NOT_CORE = ("accelerate", "jupyter_book", "papermill", "lm_eval", "peft", "matplotlib", "sphinx")


def _run(command, **kwargs) -> subprocess.CompletedProcess:
    done = subprocess.run([str(c) for c in command], capture_output=True, text=True, **kwargs)
    assert done.returncode == 0, f"{' '.join(map(str, command))} failed:\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}"
    return done


def test_installed_without_extras_the_strength_command_matches_the_checkout(tmp_path, capsys):
    import torch
    start = time.perf_counter()
    source = tmp_path / "source"
    source.mkdir()
    for name in PACKAGE_FILES:
        if (REPO_ROOT / name).is_dir():
            shutil.copytree(REPO_ROOT / name, source / name, ignore=shutil.ignore_patterns("__pycache__", "*.egg-info"))
        else:
            shutil.copy2(REPO_ROOT / name, source / name)
    env_dir = tmp_path / "venv"
    venv.create(env_dir, with_pip=True)
    python = env_dir / "bin" / "python"
    pip = [python, "-m", "pip", "--disable-pip-version-check", "-q"]
    _run(pip + ["install", f"torch=={torch.__version__.split('+')[0]}"])
    _run(pip + ["install", source])
    installed = time.perf_counter() - start

    elsewhere = tmp_path / "elsewhere"          # not the repository, and not the copy it was installed from
    elsewhere.mkdir()
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "SINKBOOK_RESULTS_DIR")}
    where = _run([python, "-c", "import sinkbook; print(sinkbook.__file__)"], cwd=elsewhere, env=env).stdout.strip()
    assert str(env_dir) in where, f"the fresh environment imported sinkbook from {where}"
    absent = _run([python, "-c", "import importlib.util as u; print(' '.join(m for m in " + repr(NOT_CORE)
                   + " if u.find_spec(m)))"], cwd=elsewhere, env=env).stdout.split()
    assert not absent, f"installing without extras also installed {absent}"

    done = _run([env_dir / "bin" / "sinkbook", "strength", "tiny-llama", "--n", "3", "--window", "2", "--json",
                 "--device", "cpu"], cwd=elsewhere, env=env)
    ran = time.perf_counter() - start - installed
    out = json.loads(done.stdout)
    assert out["n_prompts"] == 3 and out["window"] == 2 and out["n_gaps"] > 0 and math.isfinite(out["S"])

    # a command that needs an extra, or the repository, says so in one line
    adapt = subprocess.run([env_dir / "bin" / "sinkbook", "adapt", "tiny-llama", "--modality", "vision", "--steps",
                            "1", "--out", elsewhere / "adapted", "--device", "cpu"],
                           capture_output=True, text=True, cwd=elsewhere, env=env)
    assert adapt.returncode == 2 and "pip install 'sinkbook[train]'" in adapt.stderr, adapt.stderr[-2000:]
    toc = subprocess.run([python, "-m", "sinkbook.book", "toc"], capture_output=True, text=True, cwd=elsewhere, env=env)
    assert toc.returncode != 0 and "needs the sinkbook repository" in toc.stderr.strip().splitlines()[-1], toc.stderr

    from sinkbook.book.cli import main       # the same command from the checkout, in this process
    assert main(["strength", "tiny-llama", "--n", "3", "--window", "2", "--json", "--device", "cpu"]) == 0
    here = json.loads(capsys.readouterr().out)
    assert out["S"] == pytest.approx(here["S"], rel=1e-5) and out["n_gaps"] == here["n_gaps"]
    with capsys.disabled():
        print(f"\n[install test] fresh venv + pip install without extras {installed:.0f} s; "
              f"sinkbook strength {ran:.1f} s; total {time.perf_counter() - start:.0f} s", file=sys.stderr)

"""A model in a Hugging Face hub cache, loaded by its hub id with the hub switched off: the path a reader with a
hub takes, through ``load_model`` and the ``sinkbook`` command, exercised without a network.

The cache is laid out as huggingface_hub writes it: ``$HF_HOME/hub/models--<org>--<name>/`` with the files under
``blobs/`` (named by their hash), ``snapshots/<revision>/`` holding links to them, and ``refs/main`` naming the
revision. Both runs are subprocesses, since huggingface_hub reads ``HF_HOME`` once, when it is imported.
"""
from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from sinkbook.core.models import load_model

LIB = Path(__file__).resolve().parents[1] / "lib"
HUB_ID = "sinkbook-test/tiny-qwen3"
REVISION = "0123456789abcdef0123456789abcdef01234567"
IDS = [[256, 72, 101, 108, 108, 111], [256, 87, 111, 114, 108, 100]]


@pytest.fixture(scope="module")
def hub_home(tmp_path_factory):
    """HF_HOME with one tiny model in its hub cache, and the logits that model gives on IDS."""
    home = tmp_path_factory.mktemp("hf_home")
    loaded = load_model("tiny-qwen3", device="cpu")
    saved = tmp_path_factory.mktemp("saved")
    loaded.model.save_pretrained(saved)
    loaded.tokenizer.save_pretrained(saved)
    repo = home / "hub" / ("models--" + HUB_ID.replace("/", "--"))
    (repo / "blobs").mkdir(parents=True)
    snapshot = repo / "snapshots" / REVISION
    snapshot.mkdir(parents=True)
    for file in sorted(saved.iterdir()):
        digest = hashlib.sha256(file.read_bytes()).hexdigest()
        file.rename(repo / "blobs" / digest)
        (snapshot / file.name).symlink_to(Path("..", "..", "blobs", digest))
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(REVISION)
    with torch.no_grad():
        logits = loaded.model(input_ids=torch.tensor(IDS)).logits
    return home, logits


def _run(home: Path, cwd: Path, code: str, *args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "HF_HOME": str(home), "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1",
           "PYTHONPATH": os.pathsep.join([str(LIB), os.environ.get("PYTHONPATH", "")])}
    env.pop("HF_HUB_CACHE", None)
    env.pop("HUGGINGFACE_HUB_CACHE", None)
    return subprocess.run([sys.executable, "-c", code, *args], cwd=cwd, env=env, capture_output=True, text=True,
                          timeout=300)


def test_load_model_by_hub_id_offline(hub_home, tmp_path):
    home, expected = hub_home
    code = ("import json, sys, torch\n"
            "from sinkbook.core.models import load_model\n"
            "from sinkbook.core.arch import arch_for\n"
            f"lm = load_model({HUB_ID!r}, device='cpu')\n"
            f"logits = lm.model(input_ids=torch.tensor({IDS})).logits\n"
            "print(json.dumps({'id': lm.model_id, 'family': arch_for(lm.model).family, "
            "'text': lm.tokenizer.decode([72, 105]), 'logits': logits.tolist()}))\n")
    done = _run(home, tmp_path, code)             # tmp_path: no directory of that name can shadow the hub id
    assert done.returncode == 0, done.stderr[-2000:]
    out = json.loads(done.stdout.strip().splitlines()[-1])
    assert out["id"] == HUB_ID and out["family"] == "qwen3" and out["text"] == "Hi"
    torch.testing.assert_close(torch.tensor(out["logits"]), expected, rtol=1e-5, atol=1e-5)


_CLI = "import sys; from sinkbook.book.cli import main; sys.argv[0] = 'sinkbook'; sys.exit(main(sys.argv[1:]))"


def test_command_line_by_hub_id_offline(hub_home, tmp_path):
    home, _ = hub_home
    done = _run(home, tmp_path, _CLI, "strength", HUB_ID, "--json", "--n", "2", "--window", "2", "--device", "cpu")
    assert done.returncode == 0, done.stderr[-2000:]
    out = json.loads(done.stdout[done.stdout.index("{"):])
    assert out["n_prompts"] == 2 and out["n_gaps"] > 0 and isinstance(out["S"], float)


def test_a_hub_id_missing_from_the_cache_is_one_line_offline(hub_home, tmp_path):
    home, _ = hub_home
    done = _run(home, tmp_path, _CLI, "strength", "sinkbook-test/absent", "--json", "--device", "cpu")
    assert done.returncode != 0
    message = done.stderr.strip()
    assert len(message.splitlines()) == 1 and "not in the local Hugging Face cache" in message

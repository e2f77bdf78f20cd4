"""Where sinkbook reads and writes: the repository, the cache of models and trained runs, the results files."""
from __future__ import annotations

import os
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[3]


def cache_root() -> Path:
    """``$SINKBOOK_CACHE`` or ``~/.cache/sinkbook``: dequantised models, corpora, trained runs."""
    return Path(os.environ.get("SINKBOOK_CACHE", Path.home() / ".cache" / "sinkbook")).expanduser()


def results_dir() -> Path:
    """Where results files go: ``$SINKBOOK_RESULTS_DIR`` (the book build sets it per profile) or results/."""
    return Path(os.environ.get("SINKBOOK_RESULTS_DIR", REPO_ROOT / "results"))


def file_sha256(path: str | Path, chunk: int = 1 << 20) -> str:
    import hashlib
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(chunk), b""):
            h.update(block)
    return h.hexdigest()

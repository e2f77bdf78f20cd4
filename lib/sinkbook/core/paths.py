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


def jsonable(x, strict: bool = True):
    """Numbers, arrays, tensors, dataclasses and paths to plain JSON values. ``strict``: non-finite floats
    become strings (standard JSON); otherwise they stay floats (Python's json reads its NaN back)."""
    import dataclasses
    import math
    if isinstance(x, float) and not math.isfinite(x):
        return str(x) if strict else x
    if hasattr(x, "item") and getattr(x, "ndim", 1) == 0:
        return jsonable(x.item(), strict)
    if hasattr(x, "tolist"):
        return jsonable(x.tolist(), strict)
    if isinstance(x, dict):
        return {str(k): jsonable(v, strict) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [jsonable(v, strict) for v in x]
    if dataclasses.is_dataclass(x) and not isinstance(x, type):
        return jsonable(dataclasses.asdict(x), strict)
    if isinstance(x, Path):
        return str(x)
    return x


def write_json(path: str | Path, doc, strict: bool = True) -> Path:
    """Write atomically (a crash never leaves half a file); ``strict=False`` keeps NaN as a number."""
    import json
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_text(json.dumps(jsonable(doc, strict), indent=1))
    tmp.replace(path)
    return path

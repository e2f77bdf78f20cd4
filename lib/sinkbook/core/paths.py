"""Where sinkbook reads and writes: the repository, the cache of models and trained runs, the results files."""
from __future__ import annotations

import contextlib
import os
from glob import escape as glob_escape
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[3]
# True when the package runs from a clone (lib/sinkbook beside pyproject.toml). Installed with `pip install .`,
# this file lies in site-packages, REPO_ROOT means nothing, and the repository's data/, notebooks/ and book are
# not there: what needs them calls need_checkout, and results go to ./results.
IN_CHECKOUT = (REPO_ROOT / "pyproject.toml").is_file() and (REPO_ROOT / "lib" / "sinkbook").is_dir()


class NotInCheckout(FileNotFoundError):
    """A command that needs the repository ran from an installed copy of the library."""


def need_checkout(what: str) -> Path:
    """REPO_ROOT, or one line saying that ``what`` needs a clone of the repository."""
    if not IN_CHECKOUT:
        raise NotInCheckout(f"{what} needs the sinkbook repository: run it from a clone (pip install -e .), "
                            "not from an installed copy of the library")
    return REPO_ROOT


def cache_root() -> Path:
    """``$SINKBOOK_CACHE`` or ``~/.cache/sinkbook``: dequantised models, corpora, trained runs."""
    return Path(os.environ.get("SINKBOOK_CACHE", Path.home() / ".cache" / "sinkbook")).expanduser()


def cache_key(doc: dict, length: int = 12) -> str:
    """The one run-cache key: a hash of a configuration's JSON with sorted keys, so equal settings share an
    entry whatever order they were written in. Every cached run, evaluation and measurement is named by it."""
    import hashlib
    import json
    return hashlib.sha256(json.dumps(doc, sort_keys=True).encode()).hexdigest()[:length]


class NoRoom(OSError):
    """The disk under a cache entry has less free space than the entry will take."""


def check_room(path: str | Path, needed_bytes: int) -> None:
    """Refuse, in one line and before any work, to compute an entry whose files will not fit on the disk: a full
    disk found only when the weights are written loses the whole run."""
    import shutil
    existing = Path(path)
    while not existing.exists() and existing != existing.parent:
        existing = existing.parent
    free = shutil.disk_usage(existing).free
    if free < needed_bytes:
        raise NoRoom(f"{existing} has {free / 1e9:.1f} GB free and {Path(path).name} needs about "
                     f"{needed_bytes / 1e9:.1f} GB: free space (old runs in {cache_root() / 'adapt'}) or point "
                     f"SINKBOOK_CACHE at a larger disk")


def weight_bytes(module) -> int:
    """Bytes of a module's weights as saved (a tensor shared by two names, like tied embeddings, counted once)."""
    return sum({t.data_ptr(): t.numel() * t.element_size() for t in module.state_dict().values()}.values())


def results_dir() -> Path:
    """Where results files go: ``$SINKBOOK_RESULTS_DIR`` (the book build sets it per profile), else the clone's
    results/, else (an installed library) results/ in the working directory."""
    default = REPO_ROOT / "results" if IN_CHECKOUT else Path.cwd() / "results"
    return Path(os.environ.get("SINKBOOK_RESULTS_DIR", default))


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


def staging(path: str | Path) -> Path:
    """Where to write ``path`` before publishing it with ``os.replace`` (or a directory's rename): a sibling named
    by this process, so two writers never share a temporary file and a reader never sees half of one."""
    path = Path(path)
    _remove_orphans(path)
    return path.with_name(f"{path.name}.{os.getpid()}.tmp")


def _remove_orphans(path: Path) -> None:
    """Delete the staging files of ``path`` left by processes that no longer run (a killed build): they can never
    be published, and each may hold a model's weights."""
    import shutil
    for left in path.parent.glob(f"{glob_escape(path.name)}.*.tmp"):
        pid = left.name[len(path.name) + 1:-len(".tmp")]
        if pid.isdigit() and int(pid) != os.getpid() and not _alive(int(pid)):
            shutil.rmtree(left, ignore_errors=True) if left.is_dir() else left.unlink(missing_ok=True)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:         # another user's process: alive
        return True
    return True


def write_json(path: str | Path, doc, strict: bool = True) -> Path:
    """Write atomically (a crash never leaves half a file); ``strict=False`` keeps NaN as a number."""
    import json
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = staging(path)
    tmp.write_text(json.dumps(jsonable(doc, strict), indent=1))
    kill_point("cache-write")
    tmp.replace(path)
    return path


_visits: dict[str, int] = {}


def kill_point(name: str) -> None:
    """Fault injection for the fault suite (tests/test_kill_points.py), inert unless ``$SINKBOOK_KILL_AT`` is set.
    ``SINKBOOK_KILL_AT=<name>[:<n>]`` makes the n-th visit (default the first) of this process to point ``name``
    ("train": after an optimizer step, "evaluate" / "evaluate-adapted": inside the evaluation of an unadapted /
    adapted model, "save": a trained run's weights written but not its run.json, "cache-write": a record written but
    not yet renamed into place) SIGKILL the process
    ``$SINKBOOK_KILL_PID`` (default this one): the build or command a user would kill. A pool worker that kills
    its parent then waits for the kernel to end it too (``runs.pool.die_with_parent``); if that never came, the
    test that set the variable finds the worker still running."""
    wanted = os.environ.get("SINKBOOK_KILL_AT")
    if not wanted:
        return
    point, _, nth = wanted.partition(":")
    if point != name:
        return
    _visits[name] = _visits.get(name, 0) + 1
    if _visits[name] != int(nth or 1):
        return
    import signal
    import time
    target = int(os.environ.get("SINKBOOK_KILL_PID", os.getpid()))
    os.kill(target, signal.SIGKILL)
    if target != os.getpid():
        time.sleep(60)
        os.kill(os.getpid(), signal.SIGKILL)


@contextlib.contextmanager
def entry_lock(path: str | Path, waiting: str = ""):
    """Hold the lock of one cache entry (``<path>.lock``) while it is computed and written: a second process that
    wants the same entry waits here, then finds it written (check for the entry again after entering). The lock
    is an ``flock``, so it goes with the process that held it, however that process ended."""
    import fcntl
    import sys
    lock = Path(f"{path}.lock")
    lock.parent.mkdir(parents=True, exist_ok=True)
    with open(lock, "a+") as handle:
        try:
            fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            handle.seek(0)
            holder = handle.read().strip() or "another process"
            print(f"[sinkbook] waiting for {holder}, which is computing {waiting or path}", file=sys.stderr, flush=True)
            fcntl.flock(handle, fcntl.LOCK_EX)
        handle.seek(0)
        handle.truncate()
        handle.write(f"process {os.getpid()}")
        handle.flush()
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)

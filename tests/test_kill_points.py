"""Kill points (issue 25): a build killed during training, during an evaluation, during a save and during a cache
write, replayed. Each time the process a user would kill (here a small driver that runs the adaptation jobs of a
chapter, two pool workers, the book's code path) is SIGKILLed from inside a worker at that point
(``core.paths.kill_point``, armed by $SINKBOOK_KILL_AT). Then: every process it started is gone within seconds,
nothing in the cache is half-written, and a rerun on the same cache gives the records of a run that was never
interrupted. Tiny random models; an untrained digit encoder stands in for the trained one (what is tested is the
restart, not the adaptation).
"""
import json
import os
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")

DRIVER = r"""
import json, sys
import torch
from sinkbook.runs.adaptation import EVAL_FORMAT, PROBE_FORMAT, run_adaptation_jobs
from sinkbook.training import adapt as A
from sinkbook.training.vlm import DigitEncoder

encoder = A.encoder_path(0)
if not encoder.exists():
    encoder.parent.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(0)
    torch.save(DigitEncoder(A.ENCODER_WIDTH).state_dict(), encoder)
spec = {"format": EVAL_FORMAT, "arithmetic": 2, "knowledge": 2, "ifeval": 0, "ifeval_tokens": 8,
        "ifeval_base_models": False, "vision": 4, "heldout_windows": 1, "window": 2}
probe = {"format": PROBE_FORMAT, "arithmetic": 2, "vision": 0, "window": 2, "heldout_windows": 1,
         "heldout_length": 32, "prompts": 2}
cfg = A.AdaptConfig("tiny-llama", "vision", steps=3, stage1_steps=1, lr=2e-4, batch_size=2, seed=0, probe_every=3,
                    tasks=("caption", "identify"), align_steps=2)
jobs = [{"kind": "base", "model": "tiny-llama", "eval": spec, "device": "cpu"},
        {"kind": "run", "config": cfg.record(), "eval": spec, "probe": probe, "device": "cpu"}]
records = run_adaptation_jobs(jobs, workers=int(sys.argv[1]), device="cpu")
# a record names its run's folder, which lies in this cache
print(json.dumps(records, default=str).replace(str(A.cache_root()), "<cache>"))
"""
def _without_times(x):
    """What differs between two identical runs by design, wall-clock times ("seconds", "train_seconds",
    "probe_seconds", "generation_seconds", ...), left out."""
    if isinstance(x, dict):
        return {k: _without_times(v) for k, v in x.items() if not k.endswith("seconds")}
    if isinstance(x, list):
        return [_without_times(v) for v in x]
    return x


def _canonical(out: str) -> str:
    """The records as text: NaN, which a record may hold, equals itself only there."""
    return json.dumps(_without_times(json.loads(out)), sort_keys=True)


def _differences(a, b, where="records") -> list[str]:
    """Where two canonical records differ (the first few), for a failure message that says where."""
    if isinstance(a, dict) and isinstance(b, dict):
        found = [f"{where}: keys {sorted(set(a) ^ set(b))}"] if set(a) != set(b) else []
        for key in sorted(set(a) & set(b)):
            found += _differences(a[key], b[key], f"{where}.{key}")
        return found[:10]
    if isinstance(a, list) and isinstance(b, list) and len(a) == len(b):
        return [d for i, (x, y) in enumerate(zip(a, b)) for d in _differences(x, y, f"{where}[{i}]")][:10]
    return [] if json.dumps(a) == json.dumps(b) else [f"{where}: {str(a)[:80]} != {str(b)[:80]}"]


def _run(cache: Path, workers: int, token: str, kill_at: str | None = None):
    """The driver on ``cache``; with ``kill_at``, armed to be killed (it is the process a user would kill, so it
    names itself as the one a worker at the point kills)."""
    env = {**os.environ, "SINKBOOK_CACHE": str(cache), "SINKBOOK_FAULT_TOKEN": token, "PYTHONWARNINGS": "ignore"}
    env.pop("SINKBOOK_KILL_AT", None)
    code = DRIVER
    if kill_at:
        env["SINKBOOK_KILL_AT"] = kill_at
        code = "import os\nos.environ['SINKBOOK_KILL_PID'] = str(os.getpid())\n" + DRIVER
    proc = subprocess.Popen([sys.executable, "-c", code, str(workers)], env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    try:
        out, err = proc.communicate(timeout=600)
    finally:
        if proc.poll() is None:
            proc.kill()
    return proc, out, err


def _processes_with(token: str) -> list[int]:
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        try:
            if f"SINKBOOK_FAULT_TOKEN={token}".encode() in (entry / "environ").read_bytes().split(b"\0"):
                state = (entry / "status").read_text().split("State:\t", 1)[1]
                if not state.startswith("Z"):
                    found.append(int(entry.name))
        except (OSError, IndexError):
            continue
    return found


def _shared_files(cache: Path) -> None:
    """The Shakespeare corpus of the ambient cache, so that no test downloads it again."""
    from sinkbook.core.paths import cache_root
    corpus = cache_root() / "shakespeare"
    cache.mkdir(parents=True, exist_ok=True)
    if corpus.is_dir():
        (cache / "shakespeare").symlink_to(corpus, target_is_directory=True)


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
    cache = tmp_path_factory.mktemp("uninterrupted")
    _shared_files(cache)
    proc, out, err = _run(cache, 1, uuid.uuid4().hex)
    assert proc.returncode == 0, err[-3000:]
    return _canonical(out)


# evaluate-adapted: the evaluation after training, which a rerun repeats on the run read back from the cache
@pytest.mark.parametrize("point", ["evaluate-adapted", "train:2", "save", "cache-write"])
def test_a_build_killed_at_a_point_leaves_nothing_running_or_half_written_and_a_rerun_gives_the_same_records(
        point, tmp_path, uninterrupted):
    cache = tmp_path / "cache"
    _shared_files(cache)
    token = uuid.uuid4().hex
    proc, _, err = _run(cache, 2, token, kill_at=point)
    assert proc.returncode == -9, f"the kill point {point} was never reached: rc {proc.returncode}\n{err[-2000:]}"
    deadline = time.monotonic() + 15
    while left := _processes_with(token):
        assert time.monotonic() < deadline, f"processes {left} outlived the build killed at {point}"
        time.sleep(0.2)
    for path in cache.rglob("*.json"):          # what passes for an entry is whole
        json.loads(path.read_text())
    unfinished = [p.parent for p in cache.rglob("model") if not (p.parent / "run.json").exists()]
    if point == "save":
        assert unfinished, "the kill during the save left no run without run.json: did it hit the save?"
    rerun, out, err = _run(cache, 1, uuid.uuid4().hex)
    assert rerun.returncode == 0, err[-3000:]
    again = _canonical(out)
    assert again == uninterrupted, _differences(json.loads(again), json.loads(uninterrupted))


def test_two_processes_that_want_one_entry_compute_it_once(tmp_path):
    """entry_lock: the second waits, says for what, and then finds the entry written by the first."""
    entry, log = tmp_path / "entry.json", tmp_path / "computed.log"
    code = ("import sys, time\nfrom sinkbook.core.paths import entry_lock, write_json\n"
            f"entry = {str(entry)!r}\n"
            "with entry_lock(entry, 'the test entry'):\n"
            "    import os\n"
            "    if not os.path.exists(entry):\n"
            f"        open({str(log)!r}, 'a').write(str(os.getpid()) + '\\n')\n"
            "        time.sleep(1.5)\n"
            "        write_json(entry, {'by': os.getpid()})\n")
    first = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    while not log.exists():
        assert first.poll() is None, first.communicate()[1]
        time.sleep(0.05)
    second = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    first.communicate(timeout=60)
    assert log.read_text().split() == [str(first.pid)]
    assert "waiting for process" in second.stderr and "the test entry" in second.stderr
    assert json.loads(entry.read_text()) == {"by": first.pid}
    assert not list(tmp_path.glob("*.tmp"))

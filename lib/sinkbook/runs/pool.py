"""The one process pool: jobs in spawned worker processes, one torch thread each, results in order.

A worker dies with the process that started it: on Linux the kernel sends it SIGKILL when its parent ends
(``PR_SET_PDEATHSIG``), however the parent ended, so a killed build never leaves training running behind it;
elsewhere a thread in the worker watches for the parent to go. What a killed job had started to write is never
read: cache entries are published atomically, under a lock (``core.paths.entry_lock``).
"""
from __future__ import annotations

import os
import signal
import sys
import threading
import time
from typing import Callable


def die_with_parent(sig: int = signal.SIGKILL, parent: int | None = None) -> None:
    """Have this process receive ``sig`` when its parent process ends. ``parent``: the pid the parent had when it
    started this process; without it, a parent that ended before this call goes unnoticed (this process has
    already been handed to another parent, whose death the request would then follow)."""
    parent = os.getppid() if parent is None else parent
    if sys.platform.startswith("linux"):
        import ctypes
        PR_SET_PDEATHSIG = 1
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, sig)
        if os.getppid() != parent:          # the parent ended before the request took effect
            os.kill(os.getpid(), sig)
        return

    def watch():
        while os.getppid() == parent:
            time.sleep(1.0)
        os.kill(os.getpid(), sig)
    threading.Thread(target=watch, daemon=True).start()


def _worker_start(parent: int) -> None:
    die_with_parent(parent=parent)          # first: a parent killed while torch is imported must still end us
    import torch
    torch.set_num_threads(1)


def run_jobs(job_fn: Callable[[dict], object], jobs: list[dict], workers: int) -> list:
    """``job_fn(job)`` for every job, ``workers`` at a time in separate processes (spawned, so no state leaks
    between jobs and the parent's threads do not fork); with one worker or one job, in this process."""
    if workers <= 1 or len(jobs) <= 1:
        return [job_fn(job) for job in jobs]
    import multiprocessing as mp
    from concurrent.futures import ProcessPoolExecutor
    from concurrent.futures.process import BrokenProcessPool
    try:
        with ProcessPoolExecutor(max_workers=workers, mp_context=mp.get_context("spawn"),
                                 initializer=_worker_start, initargs=(os.getpid(),)) as pool:
            return list(pool.map(job_fn, jobs))
    except BrokenProcessPool:
        # A worker was killed from outside (most often the kernel's out-of-memory killer): its traceback is lost,
        # so say what the user can do. Finished jobs are already in the run cache; a rerun resumes from them.
        raise WorkerDied(f"a worker process was killed while running {len(jobs)} job(s) (most often the system ran "
                         f"out of memory: check `dmesg`); finished runs are cached, so rerun with fewer workers "
                         f"(workers={max(1, workers - 1)}) to resume") from None


class WorkerDied(RuntimeError):
    """A pool worker ended without reporting (killed by a signal): a one-line error for the user."""

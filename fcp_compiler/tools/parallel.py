"""Run independent jobs on every core (forked workers), in completion order."""

from __future__ import annotations

import multiprocessing
import os
import signal
import threading
from collections.abc import Callable, Iterator, Sequence


def _worker_start() -> None:
    """In each worker: leave Ctrl-C to the parent, and die with it (Linux: PR_SET_PDEATHSIG), so that no worker
    outlives a killed parent and keeps writing."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_DFL)  # not the parent's handler: terminate() must just end it
    try:
        import ctypes

        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(1, signal.SIGKILL, 0, 0, 0)  # 1 = PR_SET_PDEATHSIG
    except (OSError, AttributeError):  # not Linux: the parent's terminate() still ends the pool
        pass


def _terminate(signum, frame):
    raise KeyboardInterrupt


def map_on_cores(function: Callable, jobs: Sequence, processes: int | None = None) -> Iterator:
    """Yield function(job) for every job as each finishes, on `processes` forked workers (default: all cores).

    One process runs the jobs in order in this process. `function` must be a module-level function; with fork,
    workers inherit module state set before the call. Ctrl-C or SIGTERM in the parent stops every worker at once
    (the pool is terminated, not drained), and workers die with a parent that is killed.
    """
    processes = max(1, min(processes or os.cpu_count() or 1, len(jobs) or 1))
    if processes == 1:
        yield from map(function, jobs)
        return
    previous = signal.signal(signal.SIGTERM, _terminate) if threading.current_thread() is threading.main_thread() \
        else None
    pool = multiprocessing.get_context("fork").Pool(processes, initializer=_worker_start)
    finished = False
    try:
        yield from pool.imap_unordered(function, jobs, chunksize=1)
        finished = True
    finally:
        if finished:
            pool.close()
        else:
            pool.terminate()
        pool.join()
        if previous is not None:
            signal.signal(signal.SIGTERM, previous)

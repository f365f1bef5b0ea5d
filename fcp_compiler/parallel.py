"""Run independent jobs on every core (forked workers), in completion order."""

from __future__ import annotations

import multiprocessing
import os
from collections.abc import Callable, Iterator, Sequence


def map_on_cores(function: Callable, jobs: Sequence, processes: int | None = None) -> Iterator:
    """Yield function(job) for every job as each finishes, on `processes` forked workers (default: all cores).

    One process runs the jobs in order in this process. `function` must be a module-level function; with fork,
    workers inherit module state set before the call.
    """
    processes = max(1, min(processes or os.cpu_count() or 1, len(jobs) or 1))
    if processes == 1:
        yield from map(function, jobs)
        return
    pool = multiprocessing.get_context("fork").Pool(processes)
    try:
        yield from pool.imap_unordered(function, jobs, chunksize=1)
    finally:
        pool.close()
        pool.join()

"""Run independent jobs on every core (forked workers), in completion order."""

from __future__ import annotations

import multiprocessing
import os
import signal
import threading
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import FIRST_COMPLETED, ProcessPoolExecutor, wait
from concurrent.futures.process import BrokenProcessPool

from fcp_compiler.errors import InfeasibleError


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


def _request_stop(signum, frame) -> None:
    """The parent's Ctrl-C and SIGTERM while workers run: noted, and acted on between waits, where no pool state is
    half updated (an exception raised inside the pool's own calls can leave its threads unable to shut down)."""
    request_stop(signum)


_STOP: dict = {"signal": None}


def request_stop(signum: int) -> None:
    """Note a stop (Ctrl-C or SIGTERM) that :func:`map_on_cores` acts on before its next job. A handler that raises
    KeyboardInterrupt in one process notes it first: an interrupt that lands inside a finalizer (a file's __del__,
    a collected generator) is swallowed by Python ("Exception ignored ..."), and the map would run on to its end."""
    _STOP["signal"] = signum


def map_on_cores(function: Callable, jobs: Sequence, processes: int | None = None) -> Iterator:
    """Yield function(job) for every job as each finishes, on `processes` forked workers (default: all cores).

    One process runs the jobs in order in this process, stopping before the next job once a stop is noted
    (:func:`request_stop`). `function` must be a module-level function; with fork,
    workers inherit module state set before the call. Ctrl-C or SIGTERM in the parent stops every worker at once
    (they are killed, not drained), workers die with a parent that is killed, and a worker that dies (killed for
    memory, a crash) ends the map with one error naming its job, never a wait for a result that will not come.

    Raises:
        InfeasibleError: a worker died while running a job.
    """
    processes = max(1, min(processes or os.cpu_count() or 1, len(jobs) or 1))
    _STOP["signal"] = None
    if processes == 1:
        for job in jobs:
            if _STOP["signal"] is not None:  # a stop noted whose interrupt was swallowed (request_stop)
                raise KeyboardInterrupt
            yield function(job)
        return
    previous = {stop: signal.signal(stop, _request_stop) for stop in (signal.SIGINT, signal.SIGTERM)} \
        if threading.current_thread() is threading.main_thread() else {}
    context = multiprocessing.get_context("fork")
    # Each job's state as its worker sets it (1 running, 2 done), shared with the forked workers: when one dies, the
    # jobs still marked running are the ones in flight, its own among them.
    _RUNNING["states"], _RUNNING["function"] = context.Array("b", len(jobs), lock=False), function
    executor = ProcessPoolExecutor(processes, mp_context=context, initializer=_worker_start)
    finished = False
    try:
        pending = {executor.submit(_run_job, idx, job): job for idx, job in enumerate(jobs)}
        while pending:
            # A bounded wait: the parent's signal handlers run between waits, whatever the workers do.
            done, _ = wait(pending, timeout=POLL_SECONDS, return_when=FIRST_COMPLETED)
            if _STOP["signal"] is not None:
                raise KeyboardInterrupt
            for future in done:
                job = pending.pop(future)
                try:
                    result = future.result()
                except BrokenProcessPool:
                    states = _RUNNING["states"]
                    suspects = [jobs[idx] for idx in range(len(jobs)) if states[idx] == 1] or [job]
                    raise InfeasibleError(
                        f"a worker process died while running {_describe(suspects)} (killed, most often by the "
                        f"kernel for memory, or crashed): run fewer jobs at once (--jobs), or fewer or smaller "
                        f"scales") from None
                yield result
        finished = True
    finally:
        manager = getattr(executor, "_executor_manager_thread", None)
        if not finished:
            _kill_workers(executor)
        executor.shutdown(wait=finished, cancel_futures=True)
        if manager is not None:  # gone before the interpreter exits (its exit hook would wake a closed pipe)
            manager.join(timeout=MANAGER_JOIN_SECONDS)
        for stop, handler in previous.items():
            signal.signal(stop, handler)


POLL_SECONDS = 0.5
MANAGER_JOIN_SECONDS = 10.0  # the pool's manager thread ends once its killed workers are reaped
_RUNNING: dict = {}  # the map's job states and function, inherited by its forked workers


def _run_job(idx: int, job):
    """In a worker: run one job, marking it running, then done."""
    states = _RUNNING["states"]
    states[idx] = 1
    result = _RUNNING["function"](job)
    states[idx] = 2
    return result


def _describe(jobs: list) -> str:
    """The job a worker died running, or the few it may have been."""
    texts = [repr(job) if len(repr(job)) <= 80 else repr(job)[:77] + "..." for job in jobs[:4]]
    return f"job {texts[0]}" if len(texts) == 1 else f"one of the jobs {', '.join(texts)}"


def _kill_workers(executor: ProcessPoolExecutor) -> None:
    """Stop every worker now: an interrupted map does not wait for jobs in flight."""
    for process in list((getattr(executor, "_processes", None) or {}).values()):
        if process.is_alive():
            process.kill()

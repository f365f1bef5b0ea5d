"""The exact optimum of one pass's schedule for a fixed placement, as a job shop solved by CP-SAT (ortools).

The problem, on plain arrays (:class:`JobShop`; :mod:`fcp_compiler.core.schedule_problem` builds it from a plan):

- machines: each rank's compute stream, and each rank's send and receive end of each link class (NVLink, the NIC);
- a job runs on its rank's compute stream for its seconds, no earlier than its rank's release (its linear layers
  before attention) and the arrival of every message it reads;
- a message holds its sender's send end and its receiver's receive end of its link class for its seconds (one
  message at a time on each), no earlier than its release (when its data exists on the sender), the arrival of the
  message it relays and the end of every job whose result it carries; it arrives `latency_s` after it ends;
- each rank ends its pass when its jobs are done and every message it waits for has arrived, and then runs its tail
  (its linear layers after attention); the makespan is the latest rank's end plus tail;
- memory: a message's buffer occupies `tokens` on its receiver from the message's start until the last job that
  reads it ends and every message that must leave before it is freed has started; each rank's buffers never
  exceed `budget_tokens` (None: no budget).

There are no rounds or stages: every staged schedule of the same work is one of these schedules (a stage's
messages sent one after another on each link end), so the optimum bounds each of them, up to the simulator's
sharing of a link end between messages of one stage (modelled here as one after another).

Objective: minimise the makespan. CP-SAT on integer time in units of `TIME_UNIT_S`; NP-hard in general, solved
exactly (or to a proven gap) on plans of a few hundred messages.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import numpy as np

TIME_UNIT_S = 1e-8  # 10 ns: a chain of a thousand rounded durations drifts by at most 5 us


@dataclass(frozen=True, slots=True, kw_only=True)
class JobShop:
    """One pass of a placed plan as a job shop (module docstring). Dependencies are CSR lists: the entries of item
    i are `indices[offsets[i]:offsets[i + 1]]`."""

    num_ranks: int
    rank_release_s: np.ndarray  # float [ranks]: when each rank's jobs may start
    rank_tail_s: np.ndarray  # float [ranks]: seconds each rank runs after its pass
    job_rank: np.ndarray  # int [jobs]
    job_seconds: np.ndarray  # float [jobs]
    job_needs: tuple[np.ndarray, np.ndarray]  # (offsets [jobs + 1], message indices): messages a job reads
    msg_src: np.ndarray  # int [messages]
    msg_dst: np.ndarray
    msg_link: np.ndarray  # int: 0 NVLink, 1 the NIC
    msg_seconds: np.ndarray  # float: time on each of its link ends
    msg_release_s: np.ndarray  # float: when its data exists on the sender (before any dependency)
    msg_after_msgs: tuple[np.ndarray, np.ndarray]  # messages that must arrive first (a relay's parent, pushes summed)
    msg_after_jobs: tuple[np.ndarray, np.ndarray]  # jobs that must end first (a push's tiles)
    msg_awaited: np.ndarray  # bool: its receiver's pass ends only once it has arrived
    msg_tokens: np.ndarray  # int: its buffer on the receiver
    msg_frees_after: tuple[np.ndarray, np.ndarray]  # messages that must start before its buffer is freed
    latency_s: float
    budget_tokens: int | None = None

    @property
    def num_jobs(self) -> int:
        return int(self.job_rank.size)

    @property
    def num_messages(self) -> int:
        return int(self.msg_src.size)


@dataclass(frozen=True, slots=True, kw_only=True)
class JobShopResult:
    """What CP-SAT found: the best makespan, its proven lower bound (both seconds), whether it is proven optimal, the
    best schedule's starts and the solver's wall time."""

    makespan_s: float
    lower_bound_s: float
    optimal: bool
    job_start_s: np.ndarray
    msg_start_s: np.ndarray
    solve_seconds: float

    @property
    def gap(self) -> float:
        """makespan / lower bound - 1 (0 when proven optimal)."""
        return self.makespan_s / self.lower_bound_s - 1.0 if self.lower_bound_s > 0 else 0.0


def _units(seconds) -> np.ndarray:
    return np.rint(np.asarray(seconds, dtype=np.float64) / TIME_UNIT_S).astype(np.int64)


def _csr(pair: tuple[np.ndarray, np.ndarray], item: int) -> list[int]:
    offsets, indices = pair
    return indices[offsets[item]:offsets[item + 1]].tolist()


def _horizon(problem: JobShop) -> int:
    """A makespan every feasible schedule can meet: everything one after another after every release."""
    total = (_units(problem.job_seconds).sum() + _units(problem.msg_seconds).sum()
             + (_units(problem.latency_s) + 1) * problem.num_messages)
    latest = max(int(_units(problem.rank_release_s).max(initial=0)), int(_units(problem.msg_release_s).max(initial=0)))
    return int(total + latest + _units(problem.rank_tail_s).max(initial=0) + 1)


def solve_job_shop(problem: JobShop, time_limit_s: float = 30.0, workers: int = 1, hint: JobShopResult | None = None,
                   relative_gap: float = 0.0) -> JobShopResult:
    """The least makespan of `problem` (module docstring), by CP-SAT.

    Args:
        problem: the job shop.
        time_limit_s: CP-SAT's wall-time limit.
        workers: CP-SAT's search workers (1: deterministic).
        hint: a schedule to start from (its starts).
        relative_gap: stop once the best schedule is within this of the proven bound (0: prove it optimal).
    Returns:
        the JobShopResult.
    Raises:
        RuntimeError: CP-SAT found no schedule within the time limit (none can be infeasible without a budget; a
            budget below one message's buffer can).
    """
    from ortools.sat.python import cp_model

    model, horizon = cp_model.CpModel(), _horizon(problem)
    latency = int(_units(problem.latency_s))
    job_units, msg_units = _units(problem.job_seconds), _units(problem.msg_seconds)
    job_start = [model.NewIntVar(0, horizon, f"j{j}") for j in range(problem.num_jobs)]
    msg_start = [model.NewIntVar(0, horizon, f"m{m}") for m in range(problem.num_messages)]
    machines: dict = {}
    release = _units(problem.rank_release_s)
    for j, rank in enumerate(problem.job_rank.tolist()):
        model.Add(job_start[j] >= int(release[rank]))
        interval = model.NewFixedSizeIntervalVar(job_start[j], int(job_units[j]), f"ji{j}")
        machines.setdefault(("compute", rank), []).append(interval)
        for m in _csr(problem.job_needs, j):
            model.Add(job_start[j] >= msg_start[m] + int(msg_units[m]) + latency)
    for m, (src, dst, link) in enumerate(zip(problem.msg_src.tolist(), problem.msg_dst.tolist(),
                                              problem.msg_link.tolist())):
        model.Add(msg_start[m] >= int(_units(problem.msg_release_s[m])))
        interval = model.NewFixedSizeIntervalVar(msg_start[m], int(msg_units[m]), f"mi{m}")
        machines.setdefault(("send", src, link), []).append(interval)
        machines.setdefault(("recv", dst, link), []).append(interval)
        for parent in _csr(problem.msg_after_msgs, m):
            model.Add(msg_start[m] >= msg_start[parent] + int(msg_units[parent]) + latency)
        for j in _csr(problem.msg_after_jobs, m):
            model.Add(msg_start[m] >= job_start[j] + int(job_units[j]))
    for intervals in machines.values():
        if len(intervals) > 1:
            model.AddNoOverlap(intervals)
    makespan = model.NewIntVar(0, horizon, "makespan")
    _rank_ends(model, problem, job_start, msg_start, job_units, msg_units, latency, makespan)
    if problem.budget_tokens is not None:
        _memory(model, problem, job_start, msg_start, job_units, horizon)
    model.Minimize(makespan)
    if hint is not None:
        for var, value in zip(job_start + msg_start, np.concatenate((hint.job_start_s, hint.msg_start_s))):
            model.AddHint(var, int(_units(value)))
    solver = cp_model.CpSolver()
    solver.parameters.max_time_in_seconds = time_limit_s
    solver.parameters.num_workers = workers
    solver.parameters.relative_gap_limit = relative_gap
    started = time.perf_counter()
    status = solver.Solve(model)
    if status not in (cp_model.OPTIMAL, cp_model.FEASIBLE):
        raise RuntimeError(f"CP-SAT found no schedule in {time_limit_s} s (status {solver.StatusName(status)})")
    return JobShopResult(makespan_s=solver.ObjectiveValue() * TIME_UNIT_S,
                         lower_bound_s=solver.BestObjectiveBound() * TIME_UNIT_S,
                         optimal=status == cp_model.OPTIMAL,
                         job_start_s=np.array([solver.Value(v) for v in job_start], dtype=np.float64) * TIME_UNIT_S,
                         msg_start_s=np.array([solver.Value(v) for v in msg_start], dtype=np.float64) * TIME_UNIT_S,
                         solve_seconds=time.perf_counter() - started)


def _rank_ends(model, problem: JobShop, job_start, msg_start, job_units, msg_units, latency: int, makespan) -> None:
    """makespan >= each rank's last job end and awaited arrival, plus its tail."""
    tail = _units(problem.rank_tail_s)
    for j, rank in enumerate(problem.job_rank.tolist()):
        model.Add(makespan >= job_start[j] + int(job_units[j]) + int(tail[rank]))
    for m in np.flatnonzero(problem.msg_awaited).tolist():
        dst = int(problem.msg_dst[m])
        model.Add(makespan >= msg_start[m] + int(msg_units[m]) + latency + int(tail[dst]))
    release = _units(problem.rank_release_s)
    model.Add(makespan >= int((release + tail).max(initial=0)))


def _memory(model, problem: JobShop, job_start, msg_start, job_units, horizon: int) -> None:
    """Each rank's buffers within the budget: a buffer from its message's start until its readers end and the
    messages it waits for have started."""
    readers: dict[int, list[int]] = {}
    for j in range(problem.num_jobs):
        for m in _csr(problem.job_needs, j):
            readers.setdefault(m, []).append(j)
    per_rank: dict[int, tuple[list, list]] = {}
    for m in range(problem.num_messages):
        tokens = int(problem.msg_tokens[m])
        if tokens <= 0:
            continue
        freed = model.NewIntVar(0, horizon, f"free{m}")
        model.Add(freed >= msg_start[m])
        for j in readers.get(m, []):
            model.Add(freed >= job_start[j] + int(job_units[j]))
        for later in _csr(problem.msg_frees_after, m):
            model.Add(freed >= msg_start[later])
        size = model.NewIntVar(0, horizon, f"held{m}")
        interval = model.NewIntervalVar(msg_start[m], size, freed, f"buf{m}")
        intervals, demands = per_rank.setdefault(int(problem.msg_dst[m]), ([], []))
        intervals.append(interval)
        demands.append(tokens)
    for intervals, demands in per_rank.values():
        if sum(demands) > problem.budget_tokens:
            model.AddCumulative(intervals, demands, int(problem.budget_tokens))

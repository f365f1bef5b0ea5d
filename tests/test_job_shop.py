"""The job shop's CP-SAT optimum (fcp_compiler/algorithms/job_shop.py) against brute force on tiny instances: every
order of every machine's items, each order's earliest schedule by longest paths (the optimum of a regular objective
is one of these), the least makespan over the orders that have no cycle."""

from __future__ import annotations

import itertools

import numpy as np
import pytest

pytest.importorskip("ortools")

from fcp_compiler.algorithms.job_shop import TIME_UNIT_S, JobShop, solve_job_shop  # noqa: E402


def _csr(lists):
    counts = np.array([len(items) for items in lists], dtype=np.int64)
    return np.concatenate(([0], np.cumsum(counts))).astype(np.int64), np.array(
        [i for items in lists for i in items], dtype=np.int64)


def _items(pair, item):
    offsets, indices = pair
    return indices[offsets[item]:offsets[item + 1]].tolist()


def _instance(rng: np.random.Generator, budget: bool = False) -> JobShop:
    """2 or 3 ranks, up to 4 jobs and 4 messages (pulls read by jobs, a relay, a push after a job)."""
    num_ranks = int(rng.integers(2, 4))
    num_jobs, num_pulls = int(rng.integers(1, 4)), int(rng.integers(1, 3))
    job_rank = rng.integers(0, num_ranks, num_jobs)
    src, dst = rng.integers(0, num_ranks, num_pulls), rng.integers(0, num_ranks, num_pulls)
    dst = np.where(dst == src, (src + 1) % num_ranks, dst)
    after_msgs = [[] for _ in range(num_pulls)]
    if num_pulls == 2 and rng.random() < 0.5:  # the second re-sends the first from its receiver
        src[1] = dst[0]
        dst[1] = (dst[0] + 1) % num_ranks
        after_msgs[1].append(0)
    needs = [[m for m in range(num_pulls) if dst[m] == job_rank[j] and rng.random() < 0.7] for j in range(num_jobs)]
    after_jobs = [[] for _ in range(num_pulls)]
    awaited = [False] * num_pulls
    readers = [j for j in range(num_jobs) if needs[j]]
    if readers and rng.random() < 0.6:  # a push back along the first pull a job read, after that job
        job = readers[0]
        pull = needs[job][0]
        src, dst = np.append(src, dst[pull]), np.append(dst, src[pull])
        after_msgs.append([])
        after_jobs.append([job])
        awaited.append(True)
    num_messages = src.size
    return JobShop(num_ranks=num_ranks, rank_release_s=rng.uniform(0, 2e-5, num_ranks),
                   rank_tail_s=rng.uniform(0, 2e-5, num_ranks), job_rank=job_rank,
                   job_seconds=rng.uniform(1e-5, 5e-5, num_jobs), job_needs=_csr(needs), msg_src=src, msg_dst=dst,
                   msg_link=rng.integers(0, 2, num_messages), msg_seconds=rng.uniform(1e-5, 4e-5, num_messages),
                   msg_release_s=rng.uniform(0, 2e-5, num_messages), msg_after_msgs=_csr(after_msgs),
                   msg_after_jobs=_csr(after_jobs), msg_awaited=np.array(awaited),
                   msg_tokens=np.full(num_messages, 10), msg_frees_after=_csr([[] for _ in range(num_messages)]),
                   latency_s=float(rng.uniform(0, 1e-5)), budget_tokens=10 if budget else None)


def _brute_force(problem: JobShop) -> float:
    """The least makespan over every order of every machine (no budget), in seconds."""
    jobs, msgs = range(problem.num_jobs), range(problem.num_messages)
    duration = {("j", j): problem.job_seconds[j] for j in jobs} | {("m", m): problem.msg_seconds[m] for m in msgs}
    release = {("j", j): problem.rank_release_s[problem.job_rank[j]] for j in jobs} | {
        ("m", m): problem.msg_release_s[m] for m in msgs}
    edges = []  # (before, after, delay after before's start)
    for j in jobs:
        edges += [(("m", m), ("j", j), problem.msg_seconds[m] + problem.latency_s) for m in _items(problem.job_needs, j)]
    for m in msgs:
        edges += [(("m", p), ("m", m), problem.msg_seconds[p] + problem.latency_s)
                  for p in _items(problem.msg_after_msgs, m)]
        edges += [(("j", j), ("m", m), problem.job_seconds[j]) for j in _items(problem.msg_after_jobs, m)]
    machines: dict = {}
    for j in jobs:
        machines.setdefault(("c", int(problem.job_rank[j])), []).append(("j", j))
    for m in msgs:
        machines.setdefault(("s", int(problem.msg_src[m]), int(problem.msg_link[m])), []).append(("m", m))
        machines.setdefault(("r", int(problem.msg_dst[m]), int(problem.msg_link[m])), []).append(("m", m))
    best = np.inf
    for orders in itertools.product(*(itertools.permutations(items) for items in machines.values())):
        chain = [(a, b, duration[a]) for order in orders for a, b in zip(order, order[1:])]
        start = _longest_paths(release, edges + chain)
        if start is None:
            continue
        ends = [start[("j", j)] + problem.job_seconds[j] + problem.rank_tail_s[problem.job_rank[j]] for j in jobs]
        ends += [start[("m", m)] + problem.msg_seconds[m] + problem.latency_s + problem.rank_tail_s[problem.msg_dst[m]]
                 for m in msgs if problem.msg_awaited[m]]
        ends.append(float((problem.rank_release_s + problem.rank_tail_s).max()))
        best = min(best, max(ends))
    return best


def _longest_paths(release: dict, edges: list):
    """Earliest starts under the precedence edges (None on a cycle): Bellman-Ford style relaxation."""
    start = dict(release)
    for _ in range(len(start) + 1):
        changed = False
        for a, b, delay in edges:
            if start[a] + delay > start[b] + 1e-15:
                start[b] = start[a] + delay
                changed = True
        if not changed:
            return start
    return None


@pytest.mark.parametrize("seed", range(40))
def test_cp_sat_finds_the_brute_force_optimum(seed):
    problem = _instance(np.random.default_rng(seed))
    result = solve_job_shop(problem, time_limit_s=20)
    assert result.optimal
    # Each duration is rounded to TIME_UNIT_S: a path of k of them drifts by at most k / 2 units.
    slack = (problem.num_jobs + 2 * problem.num_messages + 4) * TIME_UNIT_S
    assert result.makespan_s == pytest.approx(_brute_force(problem), abs=slack)


@pytest.mark.parametrize("seed", range(10))
def test_the_schedule_found_keeps_every_constraint(seed):
    """Its starts respect releases, dependencies and one item at a time per machine, and reach its makespan."""
    problem = _instance(np.random.default_rng(100 + seed))
    result = solve_job_shop(problem, time_limit_s=20)
    job, msg, eps = result.job_start_s, result.msg_start_s, 4 * TIME_UNIT_S
    arrival = msg + problem.msg_seconds + problem.latency_s
    for j in range(problem.num_jobs):
        assert job[j] >= problem.rank_release_s[problem.job_rank[j]] - eps
        assert all(job[j] >= arrival[m] - eps for m in _items(problem.job_needs, j))
    for m in range(problem.num_messages):
        assert msg[m] >= problem.msg_release_s[m] - eps
        assert all(msg[m] >= arrival[p] - eps for p in _items(problem.msg_after_msgs, m))
        assert all(msg[m] >= job[j] + problem.job_seconds[j] - eps for j in _items(problem.msg_after_jobs, m))
    spans = [(job[j], job[j] + problem.job_seconds[j], ("c", problem.job_rank[j])) for j in range(problem.num_jobs)]
    for m in range(problem.num_messages):
        for end in (("s", problem.msg_src[m]), ("r", problem.msg_dst[m])):
            spans.append((msg[m], msg[m] + problem.msg_seconds[m], (*end, problem.msg_link[m])))
    for (a0, a1, ma), (b0, b1, mb) in itertools.combinations(spans, 2):
        assert ma != mb or a1 <= b0 + eps or b1 <= a0 + eps


def test_a_budget_of_one_buffer_sends_a_ranks_pulls_one_after_another():
    """Two pulls into one rank, each read by its own job, with room for one buffer: the second pull starts only
    after the first buffer's reader ends, which the unbudgeted optimum does not wait for."""
    problem = JobShop(num_ranks=3, rank_release_s=np.zeros(3), rank_tail_s=np.zeros(3), job_rank=np.array([0, 0]),
                      job_seconds=np.array([5e-5, 5e-5]), job_needs=_csr([[0], [1]]), msg_src=np.array([1, 2]),
                      msg_dst=np.array([0, 0]), msg_link=np.array([0, 1]), msg_seconds=np.array([1e-5, 1e-5]),
                      msg_release_s=np.zeros(2), msg_after_msgs=_csr([[], []]), msg_after_jobs=_csr([[], []]),
                      msg_awaited=np.zeros(2, dtype=bool), msg_tokens=np.array([10, 10]),
                      msg_frees_after=_csr([[], []]), latency_s=0.0)
    free = solve_job_shop(problem)
    budgeted = solve_job_shop(JobShop(**{**{f: getattr(problem, f) for f in problem.__dataclass_fields__},
                                        "budget_tokens": 10}))
    assert free.makespan_s == pytest.approx(1e-5 + 1e-4, abs=1e-7)  # both pulls at once on two link classes
    assert budgeted.makespan_s == pytest.approx(1e-5 + 5e-5 + 1e-5 + 5e-5, abs=1e-7)
    first, second = np.argsort(budgeted.msg_start_s)
    assert budgeted.msg_start_s[second] >= budgeted.job_start_s[first] + 5e-5 - 1e-7

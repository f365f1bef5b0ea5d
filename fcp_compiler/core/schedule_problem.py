"""A compiled plan's placement as the job shop whose optimum bounds every schedule of it
(:mod:`fcp_compiler.algorithms.job_shop`): the same tiles on the same ranks, the same pulls (relays included) and
pushes, each pass apart, with the simulator's durations.

What it keeps of the simulator (:mod:`fcp_compiler.algorithms.timeline`): message seconds per link class (bytes as
the simulator counts them for each pass, over NVLink or the NIC) and its latency; each rank's linear layers before
and after attention (:class:`~fcp_compiler.core.layer_model.LayerCosts`); a tile's seconds at its kernel call's
efficiency, as if its rank ran all its tiles in one launch (each query segment's pairs in one call: the largest
calls any schedule makes, so no staged schedule's tiles are cheaper; or, with `staged_calls`, at the efficiency of
the call the plan's own stages put it in, which separates what a plan's order loses from what its call sizes lose).
What it drops, each only adding time to a schedule: kernel launches, the data the runtime moves outside the kernels
and the SMs messages take from compute (:func:`ideal_profile` removes them from the simulator too, so that a staged
plan and the optimum are compared on the same durations), and a message waiting for its receiver to begin a stage.

When a message may leave: a K,V pull from its owner once the owner has projected K and V (forward; with K,V
prefetch, before Q), else once its owner's linear layers before attention are done; in the backward K,V are the
forward's, so at the backward's start; a relayed pull once its parent has arrived; a push once every tile on its
sender that read its pull has run, and the pushes it sums (a relay's children) have arrived.
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING

import numpy as np

from fcp_compiler.algorithms.job_shop import JobShop
from fcp_compiler.algorithms.keys import unique_keys
from fcp_compiler.algorithms.ranges import offsets
from fcp_compiler.core.ir import PassSchedule, Reshuffle
from fcp_compiler.core.launches import PassLaunches, sweep
from fcp_compiler.core.layer_model import BACKWARD_WORK, LSE_BYTES, LayerCosts
from fcp_compiler.errors import InvalidInputError
from fcp_compiler.format.inputs import HardwareProfile, Layout
from fcp_compiler.format.models import load_model
from fcp_compiler.format.plan_format import TransferKind

if TYPE_CHECKING:
    from fcp_compiler.core.pipeline import CompiledPlan

PASSES = ("fwd", "bwd")
# The HBM bandwidth of ideal_profile: data moved outside the kernels then costs nothing the figures show.
UNBOUNDED_GBPS = 1e12


def ideal_profile(profile: HardwareProfile) -> HardwareProfile:
    """`profile` without what the job shop does not model: no kernel launch cost, no SMs given to messages, and the
    runtime's copies outside the kernels free (HBM bandwidth unbounded)."""
    return profile.model_copy(update={"launch_us": 0.0, "comm_sm_fraction": 0.0, "hbm_gbps": UNBOUNDED_GBPS})


def _csr(lists: list[list[int]]) -> tuple[np.ndarray, np.ndarray]:
    counts = np.array([len(items) for items in lists], dtype=np.int64)
    flat = np.array([item for items in lists for item in items], dtype=np.int64)
    return offsets(counts), flat


def _call_seconds(final: Reshuffle, backward: bool, as_staged: bool) -> np.ndarray:
    """Each tile's seconds at its kernel call's efficiency: with every tile of its rank in one launch, or
    (`as_staged`) in its stage's launch, as the plan's own stages make its calls."""
    tiles, tile_rank = final.tiles, final.assignment.tile_rank
    if as_staged:
        program = final.schedule.backward if backward else final.schedule.forward
        launch = program.tile_stage.astype(np.int64)
    else:
        launch = np.zeros(tiles.num_tiles, dtype=np.int64)
    launches = PassLaunches(rank=tile_rank.astype(np.int64), launch=launch,
                            num_launches=int(launch.max(initial=0)) + 1, num_ranks=final.num_ranks, split=backward,
                            count_calls=False)
    sweep(tiles, [launches], tiles.profile)
    return launches.seconds * (BACKWARD_WORK if backward else 1.0)


def _phases(final: Reshuffle, model_name: str | None) -> dict[str, np.ndarray]:
    model = load_model(model_name)
    if model is None:
        zeros = np.zeros(final.num_ranks)
        return {"fwd_before": zeros, "fwd_after": zeros, "bwd_before": zeros, "bwd_after": zeros, "fwd_kv": zeros}
    return LayerCosts.of(model, final.tiles.profile).phases(final.assignment.rank_tokens.astype(np.float64))


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class _Jobs:
    """Tiles grouped into jobs: on one rank, those reading the same pulls (their order among themselves never
    matters, so merging them loses no schedule)."""

    rank: np.ndarray
    seconds: np.ndarray
    q_edge: np.ndarray  # the Q pull its tiles read, -1: local
    kv_edge: np.ndarray


def _jobs(final: Reshuffle, seconds: np.ndarray) -> _Jobs:
    schedule, n = final.schedule, final.num_ranks
    num_edges = final.transfers.num_edges + 1
    q_edge, kv_edge = schedule.tile_q_edge.astype(np.int64) + 1, schedule.tile_kv_edge.astype(np.int64) + 1
    key = (final.assignment.tile_rank.astype(np.int64) * num_edges + q_edge) * num_edges + kv_edge
    keys, job_of = unique_keys(key, n * num_edges * num_edges, return_inverse=True)
    return _Jobs(rank=keys // (num_edges * num_edges), seconds=np.bincount(job_of, weights=seconds,
                                                                          minlength=keys.size),
                 q_edge=(keys // num_edges) % num_edges - 1, kv_edge=keys % num_edges - 1)


def _message_bytes(final: Reshuffle, program: PassSchedule, backward: bool) -> tuple[np.ndarray, np.ndarray]:
    """(bytes of each pull, bytes of each push): what the simulator charges each in the pass."""
    transfers, shape = final.transfers, final.tiles.shape
    tokens = transfers.edge_tokens.astype(np.float64)
    is_kv = transfers.edge_kind == TransferKind.KV
    q_bytes, kv_bytes, lse_bytes = shape.q_bytes_per_token, shape.kv_bytes_per_token, LSE_BYTES * shape.q_heads
    if backward:
        pull = tokens * np.where(is_kv, kv_bytes, 3 * q_bytes + lse_bytes)
        push = tokens * np.where(is_kv, kv_bytes, q_bytes)
    else:
        pull = tokens * np.where(is_kv, kv_bytes, q_bytes)
        push = tokens * (q_bytes + lse_bytes)
    return pull, push[program.push_edge]


def pass_problem(final: Reshuffle, pass_name: str, model_name: str | None, kv_prefetch: bool,
                 budget_tokens: int | None = None, staged_calls: bool = False) -> JobShop:
    """One pass of a placed plan as a job shop (module docstring).

    Args:
        final: the plan's IR (its placement, pulls, relays and pushes; its stages are not read), in the plan layout
            (a user layout's reshuffles are not modelled: :func:`problems_of` refuses one).
        pass_name: "fwd" or "bwd".
        model_name: the model preset around attention (its linear layers: each rank's release and tail), or "none".
        kv_prefetch: whether K,V pulls may leave once K and V are projected, before Q (the plan's header says).
        budget_tokens: each rank's live buffer budget in tokens (pulled buffers), None for none.
        staged_calls: charge each tile at the efficiency of the kernel call the plan's own stages put it in, not at
            one launch a rank: the optimum then bounds only schedules that make the plan's calls, and the plan's
            distance to it is what its order and waiting lose, apart from what its call sizes lose.
    Returns:
        the JobShop: messages are the pulls (edge order) then the pass's pushes (its push order).
    Raises:
        InvalidInputError: an unknown pass.
    """
    if pass_name not in PASSES:
        raise InvalidInputError(f"pass {pass_name!r} is not one of {', '.join(PASSES)}")
    backward = pass_name == "bwd"
    transfers, n = final.transfers, final.num_ranks
    profile = final.tiles.profile
    jobs = _jobs(final, _call_seconds(final, backward, staged_calls))
    program = final.schedule.backward if backward else final.schedule.forward
    pull_bytes, push_bytes = _message_bytes(final, program, backward)
    num_pulls, push_edge = transfers.num_edges, program.push_edge.astype(np.int64)
    src = np.concatenate((transfers.edge_src, transfers.edge_dst[push_edge])).astype(np.int64)
    dst = np.concatenate((transfers.edge_dst, transfers.edge_src[push_edge])).astype(np.int64)
    node = np.arange(n) // profile.gpus_per_node
    link = (node[src] != node[dst]).astype(np.int64)
    bandwidth = np.where(link == 1, profile.network_gbps, profile.nvlink_gbps) * 1e9
    phases = _phases(final, model_name)
    before, after = phases[f"{pass_name}_before"], phases[f"{pass_name}_after"]
    release = _releases(final, phases, before, backward, kv_prefetch, push_edge.size)
    after_msgs, after_jobs, frees_after = _dependencies(final, jobs, push_edge)
    job_needs = [[int(e) for e in (q, kv) if e >= 0] for q, kv in zip(jobs.q_edge.tolist(), jobs.kv_edge.tolist())]
    return JobShop(num_ranks=n, rank_release_s=before, rank_tail_s=after, job_rank=jobs.rank,
                   job_seconds=jobs.seconds, job_needs=_csr(job_needs), msg_src=src, msg_dst=dst, msg_link=link,
                   msg_seconds=np.concatenate((pull_bytes, push_bytes)) / bandwidth, msg_release_s=release,
                   msg_after_msgs=after_msgs, msg_after_jobs=after_jobs,
                   msg_awaited=np.arange(num_pulls + push_edge.size) >= num_pulls,
                   msg_tokens=np.concatenate((transfers.edge_tokens, np.zeros(push_edge.size, dtype=np.int64))),
                   msg_frees_after=frees_after, latency_s=profile.latency_us * 1e-6, budget_tokens=budget_tokens)


def _releases(final: Reshuffle, phases: dict, before: np.ndarray, backward: bool, kv_prefetch: bool,
              num_pushes: int) -> np.ndarray:
    """When each message's data exists on its sender (module docstring); relays and pushes wait on dependencies."""
    transfers = final.transfers
    is_kv = transfers.edge_kind == TransferKind.KV
    src = transfers.edge_src
    if backward:
        kv_ready = np.zeros(final.num_ranks) if kv_prefetch else before
    else:
        kv_ready = phases["fwd_kv"] if kv_prefetch else before
    pull = np.where(is_kv, kv_ready[src], before[src])
    pull = np.where(transfers.edge_parent >= 0, 0.0, pull)
    return np.concatenate((pull, np.zeros(num_pushes)))


def _dependencies(final: Reshuffle, jobs: _Jobs, push_edge: np.ndarray):
    """(messages each message waits for, jobs each waits for, messages that must start before each buffer is
    freed), as CSR lists over the messages (pulls, then pushes)."""
    transfers = final.transfers
    num_pulls = transfers.num_edges
    push_of_edge = np.full(num_pulls, -1, dtype=np.int64)
    push_of_edge[push_edge] = num_pulls + np.arange(push_edge.size)
    after_msgs: list[list[int]] = [[] for _ in range(num_pulls + push_edge.size)]
    after_jobs: list[list[int]] = [[] for _ in range(num_pulls + push_edge.size)]
    frees_after: list[list[int]] = [[] for _ in range(num_pulls + push_edge.size)]
    for edge, parent in enumerate(transfers.edge_parent.tolist()):
        if parent < 0:
            continue
        after_msgs[edge].append(parent)  # a relay re-sends what it received
        frees_after[parent].append(edge)
        if push_of_edge[edge] >= 0 and push_of_edge[parent] >= 0:  # the relay sums its children's pushes
            after_msgs[int(push_of_edge[parent])].append(int(push_of_edge[edge]))
            frees_after[parent].append(int(push_of_edge[parent]))
    for job, (q_edge, kv_edge) in enumerate(zip(jobs.q_edge.tolist(), jobs.kv_edge.tolist())):
        for edge in (q_edge, kv_edge):
            if edge >= 0 and push_of_edge[edge] >= 0:
                after_jobs[int(push_of_edge[edge])].append(job)
    for edge in push_edge.tolist():
        frees_after[edge].append(int(push_of_edge[edge]))
    return _csr(after_msgs), _csr(after_jobs), _csr(frees_after)


def problems_of(plan: CompiledPlan, budget_tokens: int | None = None,
                staged_calls: bool = False) -> dict[str, JobShop]:
    """Both passes of a compiled plan (plan layout) as job shops, on its own model and K,V prefetch.

    Args:
        plan: the CompiledPlan (its IR and header).
        budget_tokens: each rank's live buffer budget in tokens (pulled buffers), None for none.
        staged_calls: as :func:`pass_problem` takes it.
    Returns:
        {"fwd": JobShop, "bwd": JobShop}.
    Raises:
        InvalidInputError: a plan in the user layout.
    """
    header = plan.header
    if header.layout is not Layout.PLAN:
        raise InvalidInputError(f"layout {header.layout.value!r}: the job shop models the plan layout only "
                                "(the user layout's reshuffles are not in it)")
    return {name: pass_problem(plan.ir, name, header.model, header.kv_prefetch, budget_tokens, staged_calls)
            for name in PASSES}

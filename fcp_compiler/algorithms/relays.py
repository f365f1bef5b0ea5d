"""Relays: a rank that has received a block re-sends it to a later puller, so a hot block's senders form a tree.

Plain arrays in, plain arrays out. A pull keeps its rounds in both passes: only its sender changes, so every round
stays congestion-free per link class as long as the new sender has a free slot of the pull's new class in those
rounds (and, where the class changes, its receiver has one too), and no tile moves.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from fcp_compiler.algorithms.keys import stable_argsort

NO_PARENT = -1
# Pulls of one sender tried in a row without a move before the sender is given up for the stage (bounds the work
# on senders whose blocks have no free holder).
MAX_FAILURES = 8


@dataclass(frozen=True, slots=True, kw_only=True)
class RelayEdges:
    """The pulls, as the relay choice sees them; all arrays are indexed by edge.

    `colour` and `bwd_round` are the pull's rounds in each pass; `stage` and `bwd_stage` its stage in each pass;
    `seg_mask` the segments it carries as a bit mask relative to its block's first segment (a child may take a
    parent's data only if its mask is a subset); `relayable` marks the pulls that may be re-sourced or serve as
    parents (K,V pulls from their owner of blocks whose segments fit the mask); `parent` the pulls already re-sent
    by an earlier receiver (node fan-out), -1 for the others."""

    block: np.ndarray
    src: np.ndarray
    dst: np.ndarray
    colour: np.ndarray
    bwd_round: np.ndarray
    parent: np.ndarray
    stage: np.ndarray
    bwd_stage: np.ndarray
    nbytes: np.ndarray
    seg_mask: np.ndarray
    relayable: np.ndarray


@dataclass(frozen=True, slots=True, kw_only=True)
class RelayLinks:
    """Link model of the choice: node of each rank, the bandwidths across nodes (NIC) and inside one, and how many
    NVLink messages an end may carry a round."""

    node: np.ndarray
    nic_bytes_per_s: float
    nvlink_bytes_per_s: float
    nvlink_lanes: int = 1


class _StageLoads:
    """Seconds each rank's four link ends (NIC and NVLink, send and receive) are busy in one stage."""

    def __init__(self, edges: RelayEdges, src: np.ndarray, idx: np.ndarray, links: RelayLinks, num_ranks: int):
        self.links = links
        self.node = links.node.tolist()
        senders, receivers = src[idx], edges.dst[idx]
        link = self.link(senders, receivers)
        seconds = self.seconds(senders, receivers, edges.nbytes[idx])
        self.send = np.bincount(senders * 2 + link, weights=seconds, minlength=2 * num_ranks).reshape(num_ranks, 2)
        self.recv = np.bincount(receivers * 2 + link, weights=seconds, minlength=2 * num_ranks).reshape(num_ranks, 2)

    def link(self, a, b):
        """0 for the NIC (different nodes), 1 for NVLink; vectorised over `a`."""
        return (self.links.node[a] == self.links.node[b]).astype(np.int64)

    def seconds(self, a, b, nbytes):
        same = self.links.node[a] == self.links.node[b]
        return nbytes / np.where(same, self.links.nvlink_bytes_per_s, self.links.nic_bytes_per_s)

    def add(self, a: int, b: int, nbytes: float, sign: float) -> None:
        same = bool(self.links.node[a] == self.links.node[b])
        seconds = sign * nbytes / (self.links.nvlink_bytes_per_s if same else self.links.nic_bytes_per_s)
        self.send[a, int(same)] += seconds
        self.recv[b, int(same)] += seconds

    def send_time(self) -> np.ndarray:
        return self.send.max(axis=1)


def busiest_send_seconds(edges: RelayEdges, src: np.ndarray, links: RelayLinks, num_ranks: int) -> np.ndarray:
    """Per stage, the most seconds any rank's send link (NIC or NVLink) is busy with the stage's pulls, when they
    leave `src`."""
    by_stage = stable_argsort(edges.stage)
    bounds = np.searchsorted(edges.stage[by_stage], np.arange(int(edges.stage.max(initial=-1)) + 2))
    return np.array([_StageLoads(edges, src, by_stage[bounds[s]:bounds[s + 1]], links, num_ranks).send_time().max()
                     for s in range(bounds.size - 1)])


def _candidates(edges: RelayEdges, parent: np.ndarray, by_block: np.ndarray, block_start: np.ndarray, edge: int,
                max_gap: int) -> np.ndarray:
    """Pulls of the same block whose receiver may serve `edge`: pulls from the owner (trees of depth one: each
    level would delay the owner's backward gradient by a stage) that arrive in an earlier stage of both passes (at
    most max_gap stages earlier) and carry every segment it carries."""
    block = edges.block[edge]
    group = by_block[block_start[block]:block_start[block + 1]]
    stage, bwd_stage = edges.stage[edge], edges.bwd_stage[edge]
    ok = (edges.relayable[group] & (parent[group] == NO_PARENT)
          & (edges.stage[group] < stage) & (edges.stage[group] >= stage - max_gap)
          & (edges.bwd_stage[group] < bwd_stage) & (edges.bwd_stage[group] >= bwd_stage - max_gap)
          & (edges.dst[group] != edges.dst[edge]) & ((edges.seg_mask[edge] & ~edges.seg_mask[group]) == 0))
    return group[ok]


class _Busy:
    """How many messages each link end (rank * 2 + class) sends and receives in each round of each pass, against
    its slots (links.nvlink_lanes for NVLink, 1 for the NIC)."""

    def __init__(self, edges: RelayEdges, src: np.ndarray, links: RelayLinks, num_ranks: int):
        self.links = links
        rounds = (edges.colour, edges.bwd_round)
        width = [int(r.max(initial=-1)) + 1 for r in rounds]
        cls = (links.node[src] != links.node[edges.dst]).astype(np.int64)
        # Counts per (link end, round), by bincount over the flat cell (ufunc.at is many times slower).
        self.send, self.recv = ([np.bincount((ends * 2 + cls) * w + r, minlength=2 * num_ranks * w).astype(np.int32)
                                 .reshape(2 * num_ranks, w) for r, w in zip(rounds, width)]
                                for ends in (src, edges.dst))
        self.rounds = rounds
        self.slots = np.array([links.nvlink_lanes, 1])

    def free(self, rounds: list[int], holder: int, receiver: int, cls: int, old_cls: int) -> bool:
        """Whether `holder` may send a pull to `receiver` in class `cls` (1: the NIC) in the pull's rounds, `rounds`
        (one a pass), and, where the class changes from `old_cls`, its receiver receive it."""
        slots = int(self.slots[cls])
        for p in (0, 1):
            if self.send[p][holder * 2 + cls, rounds[p]] >= slots:
                return False
            if cls != old_cls and self.recv[p][receiver * 2 + cls, rounds[p]] >= slots:
                return False
        return True

    def move(self, edge: int, old: int, new: int, receiver: int) -> None:
        node = self.links.node
        old_cls, new_cls = int(node[old] != node[receiver]), int(node[new] != node[receiver])
        for p in (0, 1):
            rnd = int(self.rounds[p][edge])
            self.send[p][old * 2 + old_cls, rnd] -= 1
            self.send[p][new * 2 + new_cls, rnd] += 1
            self.recv[p][receiver * 2 + old_cls, rnd] -= 1
            self.recv[p][receiver * 2 + new_cls, rnd] += 1


def stage_gain_bounds(edges: RelayEdges, links: RelayLinks, num_ranks: int, stage_floor: np.ndarray,
                      max_gap: int, busiest: np.ndarray | None = None) -> np.ndarray:
    """Per stage, an upper bound on how much :func:`choose_relays` can lower the stage's busiest send link time
    (:func:`busiest_send_seconds`).

    The greedy leaves a stage alone whose busiest sender is at or under its floor and stops moving pulls off a sender
    once it is there, so a stage ends no lower than its floor less its longest message. Nor does it end lower than
    the busiest link end counting only pulls that cannot move: those not relayable, already re-sent, in stage 0, or
    of a block no relayable pull from its owner brings in the `max_gap` stages before (no candidate holder). O(E + S N)
    for E pulls, S stages, N ranks.

    `busiest`: busiest_send_seconds(edges, edges.src, links, num_ranks), where the caller has it.

    Returns:
        float64 [num_stages], seconds.
    """
    busiest = busiest_send_seconds(edges, edges.src, links, num_ranks) if busiest is None else busiest
    num_stages = busiest.size
    if num_stages == 0:
        return busiest
    across = links.node[edges.src] != links.node[edges.dst]
    seconds = edges.nbytes / np.where(across, links.nic_bytes_per_s, links.nvlink_bytes_per_s)
    root = edges.relayable & (edges.parent == NO_PARENT)
    num_blocks = int(edges.block.max()) + 1
    # (stage + max_gap, block) pairs some root pull arrives in; a pull may move only if one is 1..max_gap earlier.
    arrives = np.zeros((num_stages + max_gap) * num_blocks, dtype=bool)
    arrives[(edges.stage[root] + max_gap) * num_blocks + edges.block[root]] = True
    has_holder = np.zeros(edges.block.size, dtype=bool)
    for gap in range(1, max_gap + 1):
        has_holder |= arrives[(edges.stage + max_gap - gap) * num_blocks + edges.block]
    fixed = np.where(root & has_holder & (edges.stage > 0), 0.0, seconds)
    fixed_load = np.bincount((edges.stage * num_ranks + edges.src) * 2 + across, weights=fixed,
                             minlength=num_stages * num_ranks * 2).reshape(num_stages, -1)
    longest = np.zeros(num_stages)
    np.maximum.at(longest, edges.stage, seconds)
    floor = np.zeros(num_stages)
    floor[:min(num_stages, stage_floor.size)] = stage_floor[:num_stages]
    lowest = np.where(busiest > floor, np.maximum(fixed_load.max(axis=1), floor - longest), busiest)
    return np.maximum(busiest - lowest, 0.0)


def choose_relays(edges: RelayEdges, links: RelayLinks, num_ranks: int, stage_floor: np.ndarray,
                  max_gap: int, min_gain: float = 0.0, busiest: np.ndarray | None = None) -> np.ndarray:
    """Pick a parent pull for some pulls, so that they leave the parent's receiver instead of the block's owner.

    Objective, stage by stage: lower the busiest link end's seconds among the senders, down to `stage_floor[s]`
    (the stage's mean compute, under which traffic hides anyway). Greedy: take the sender whose busiest link end is
    slowest; move one of its relayable pulls (largest first; MAX_FAILURES in a row that cannot move end its turn)
    to the candidate holder (:func:`_candidates`) that is free in the pull's rounds and leaves the largest
    of (old sender, new sender, receiver) link times lowest; accept only if that is below the old sender's time. A
    stage ends once its busiest sender can shed no more (it then bounds the stage from below). Stages are taken in
    order, so a parent's own sender is final before its children are chosen. The greedy gives up (no relays) as
    soon as what it has gained plus what the later stages can gain (:func:`stage_gain_bounds`) is under
    `min_gain`.
    O(M * F) vectorised steps for M pulls tried and fan-out F.

    Args:
        edges: the pulls (:class:`RelayEdges`).
        links: ranks' nodes and bandwidths.
        num_ranks: N.
        stage_floor: float [num_stages], seconds under which a stage's sends need not go.
        max_gap: the most stages a parent may arrive before its child leaves (bounds how long relays hold).
        min_gain: seconds the sum over stages of the busiest send link time must drop by for relays to be kept.
        busiest: busiest_send_seconds(edges, edges.src, links, num_ranks), where the caller has it.
    Returns:
        int64 [num_edges], each pull's parent pull (edges.parent kept), or -1 for a pull from the owner.
    """
    parent = edges.parent.copy()
    if edges.block.size == 0:
        return parent
    # What each stage can still gain, from each stage on.
    to_gain = np.cumsum(stage_gain_bounds(edges, links, num_ranks, stage_floor, max_gap, busiest)[::-1])[::-1]
    if to_gain.size and to_gain[0] < min_gain:  # no stage can gain enough: the greedy's first step gives up
        return parent
    src = edges.src.copy()
    busy = _Busy(edges, src, links, num_ranks)
    by_block = np.lexsort((np.arange(edges.block.size), edges.block))
    block_start = np.searchsorted(edges.block[by_block], np.arange(int(edges.block.max()) + 2))
    by_stage = stable_argsort(edges.stage)
    stage_start = np.searchsorted(edges.stage[by_stage], np.arange(int(edges.stage.max()) + 2))
    gained = 0.0
    for stage in range(stage_start.size - 1):
        if gained + to_gain[stage] < min_gain:
            return edges.parent.copy()
        idx = by_stage[stage_start[stage]:stage_start[stage + 1]]
        gained += _relay_stage(edges, links, idx, src, parent, busy, by_block, block_start, num_ranks,
                               float(stage_floor[stage]) if stage < stage_floor.size else 0.0, max_gap)
    return parent if gained >= min_gain else edges.parent.copy()


def _relay_stage(edges: RelayEdges, links: RelayLinks, idx: np.ndarray, src: np.ndarray, parent: np.ndarray,
                 busy: _Busy, by_block: np.ndarray, block_start: np.ndarray, num_ranks: int, floor: float,
                 max_gap: int) -> float:
    """The greedy of :func:`choose_relays` for the pulls `idx` of one stage (updates src, parent, busy); returns
    how much it lowered the stage's busiest send link time."""
    loads = _StageLoads(edges, src, idx, links, num_ranks)
    before = float(loads.send_time().max(initial=0.0))
    # A pull in the backward's last pull stage is not re-sent: its relay's gradient would leave a stage later than
    # any other, lengthening the pass.
    movable = idx[edges.relayable[idx] & (parent[idx] == NO_PARENT) & (edges.stage[idx] > 0)
                  & (edges.bwd_stage[idx] < edges.bwd_stage.max())]
    # Each sender's pulls, largest first: a slice of one sorted array, walked with a cursor per sender.
    movable = movable[np.lexsort((movable, -edges.nbytes[movable], src[movable]))]
    sender = src[movable]
    cursor = np.searchsorted(sender, np.arange(num_ranks))
    end = np.searchsorted(sender, np.arange(num_ranks), side="right")
    while True:
        send_time = loads.send_time()
        top = int(np.argmax(send_time))
        if send_time[top] <= floor or cursor[top] == end[top]:
            break  # under the floor, or the busiest sender has nothing to move: the stage can go no lower
        failures = 0
        while cursor[top] < end[top] and failures < MAX_FAILURES:
            edge = int(movable[cursor[top]])
            cursor[top] += 1
            if _move_one(edges, loads, edge, top, float(send_time[top]), src, parent, busy, by_block, block_start,
                         max_gap):
                break
            failures += 1
        if cursor[top] == end[top] or failures == MAX_FAILURES:
            break  # the busiest sender can shed no more: the stage ends no lower than it is now
    return before - float(loads.send_time().max(initial=0.0))


def _move_one(edges: RelayEdges, loads: _StageLoads, edge: int, top: int, top_time: float, src: np.ndarray,
              parent: np.ndarray, busy: _Busy, by_block: np.ndarray, block_start: np.ndarray,
              max_gap: int) -> bool:
    """Re-source `edge` (sent by `top`) from its best holder if that lowers the busiest of the link ends involved:
    the holder, free in the pull's rounds, that leaves the largest of (old sender, holder, receiver) link times
    lowest, the first of equals. (Plain Python over the few candidates: a pull has a handful, and this runs once a
    pull tried.)"""
    candidates = _candidates(edges, parent, by_block, block_start, edge, max_gap)
    if candidates.size == 0:
        return False
    receiver, nbytes = int(edges.dst[edge]), float(edges.nbytes[edge])
    links, node = loads.links, loads.node
    bandwidth = (links.nic_bytes_per_s, links.nvlink_bytes_per_s)  # by link: 1 inside a node
    old_link = int(node[top] == node[receiver])
    old_seconds = nbytes / bandwidth[old_link]
    top_after = loads.send[top].tolist()
    top_after[old_link] -= old_seconds
    top_worst = max(top_after)
    receiver_times = loads.recv[receiver].tolist()
    receiver_times[old_link] -= old_seconds
    rounds = [int(busy.rounds[p][edge]) for p in (0, 1)]
    best, best_worst = -1, math.inf
    for index, holder in enumerate(edges.dst[candidates].tolist()):
        link = int(node[holder] == node[receiver])
        if not busy.free(rounds, holder, receiver, 1 - link, 1 - old_link):
            continue
        seconds = nbytes / bandwidth[link]
        holder_send = loads.send[holder].tolist()
        holder_send[link] += seconds
        after = receiver_times.copy()
        after[link] += seconds
        worst = max(max(max(holder_send), max(after)), top_worst)
        if worst < best_worst:
            best, best_worst = index, worst
    if best < 0 or best_worst >= top_time * (1.0 - 1e-9):
        return False
    chosen = int(candidates[best])
    holder = int(edges.dst[chosen])
    loads.add(top, receiver, nbytes, -1.0)
    loads.add(holder, receiver, nbytes, 1.0)
    busy.move(edge, top, holder, receiver)
    src[edge] = holder
    parent[edge] = chosen
    return True

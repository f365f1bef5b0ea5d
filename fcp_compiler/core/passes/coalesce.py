"""Pass 6: the forward and backward programs: rounds coalesced into stages, tiles pipelined, pushes placed."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import numpy as np

from fcp_compiler.algorithms.exchange import (backward_push_rounds, forward_push_rounds, link_capacity, link_ends,
                                              spread_messages)
from fcp_compiler.algorithms.keys import lookup, sorted_unique
from fcp_compiler.algorithms.leveling import (BufferLimit, Prepared, arrival_round_of, backward_earliest_stage,
                                              earliest_stage, level_stages, pipeline_order, prepare_levelling,
                                              pull_back, stage_loads, stage_message_seconds)
from fcp_compiler.algorithms.liveness import peak_live_tokens
from fcp_compiler.algorithms.round_order import order_rounds, rounds_first
from fcp_compiler.core.ir import PassSchedule, Rounds, Schedule, TransferKind, Transfers


# Live buffer tokens levelling may make a rank hold, in stages' worth of pulls (coalesce x block size), in either
# pass. The backward is levelled too since node fan-out: its pulls land a stage after their entry's, and without
# levelling their tiles bunched up (the MagiAttention-histogram batch at 256 GPUs: backward normalized MFU 0.69
# unlevelled, 0.86 with 2 stages). Under the floor's 4cB memory budget, 3 stages against 2 made the
# matrix's layer time 0.5% faster (geometric mean of 54 batches; 25 faster by up to 3.3%, 4 slower: one by 0.3%,
# three by at most 0.05%). Levelling bounds the pulled blocks its delays keep live, not the gradients pushed back to their owners,
# which land later with the delayed tiles (nor pushes that then find a free round later still: 41 of 6,662 on the
# paper batch at 64 GPUs, against 3 at 2 stages); where 3 stages lift a plan over the budget, its backward is
# levelled again with TIGHT_LEVELLING_STAGES before its stages shrink (schedule_search.fit_memory).
LEVELLING_STAGES = 3
TIGHT_LEVELLING_STAGES = 2
# The rounds carrying Q pulls go to the first stage when that lowers the sum over stages of the busiest rank's work
# (each tile in the stage after its data, before levelling) by at least this share. A tile run away from its query
# block's owner needs the Q pull and a K,V pull; ordering the rounds by the work they make runnable credits the tile
# to whichever of its pulls has the later colour, which says nothing of the order chosen, and a helper's Q landing
# late made every tile it runs runnable in one stage: ProLong + tail at 256 GPUs (seed 1) had FCP's own placement at
# 633.8 ms (forward plus backward) against 478.1 with its Q pulls first.
Q_PULLS_FIRST_GAIN = 0.02


def _edge_lookup(transfers, kind: TransferKind, blocks: np.ndarray, ranks: np.ndarray) -> np.ndarray:
    """Index of the pull edge (kind, block, receiving rank) for each query, -1 where there is none: int32, one entry
    a tile (millions at small blocks; a plan's edges are int32 rows)."""
    num_ranks = transfers.assignment.num_ranks
    of_kind = np.flatnonzero(transfers.edge_kind == kind)
    keys = transfers.edge_block[of_kind] * num_ranks + transfers.edge_dst[of_kind]
    assert (np.diff(keys) > 0).all()
    wanted = blocks * num_ranks + ranks
    space = transfers.assignment.tiles.sharding.num_blocks * num_ranks
    if space <= max(4 * wanted.size, 1 << 16):
        # A table over every (block, rank) beats a binary search per tile when there are as many tiles.
        table = np.full(space, -1, dtype=np.int32)
        table[keys] = of_kind
        return table[wanted]
    return lookup(keys, of_kind, wanted, -1).astype(np.int32)


def pass_buffers(program: PassSchedule, transfers: Transfers, tile_rank: np.ndarray, tile_kv_edge: np.ndarray,
                 tile_q_edge: np.ndarray) -> tuple[np.ndarray, ...]:
    """The received buffers of one pass under the liveness rule (:mod:`fcp_compiler.algorithms.liveness`).

    Returns:
        (rank, first stage, last stage, tokens) per buffer: each pull on its receiver, from its stage to its last
        tile or the push back along it, and each push on the owner it lands on, for its stage.
    """
    edge_stage = program.edge_stage
    last = edge_stage.copy()
    for edge in (tile_kv_edge, tile_q_edge):
        reads = edge >= 0
        np.maximum.at(last, edge[reads], program.tile_stage[reads])
    push_stage = program.push_stage
    np.maximum.at(last, program.push_edge, push_stage)
    # A relay holds its pulled block until it has re-sent it and, when a result comes back along the re-sent pull,
    # until that result has been folded into the block's own partial result.
    relayed = np.flatnonzero(transfers.edge_parent >= 0)
    np.maximum.at(last, transfers.edge_parent[relayed], edge_stage[relayed])
    pushed_relayed = transfers.edge_parent[program.push_edge] >= 0
    np.maximum.at(last, transfers.edge_parent[program.push_edge[pushed_relayed]], push_stage[pushed_relayed])
    tokens = transfers.edge_tokens
    return (np.concatenate((transfers.edge_dst, transfers.edge_src[program.push_edge])),
            np.concatenate((edge_stage, push_stage)), np.concatenate((last, push_stage)),
            np.concatenate((tokens, tokens[program.push_edge])))


def _pass_peak(program: PassSchedule, transfers: Transfers, tile_kv_edge: np.ndarray,
               tile_q_edge: np.ndarray) -> int:
    """The most live buffer tokens any rank holds in any stage of one pass."""
    assignment = transfers.assignment
    return int(peak_live_tokens(*pass_buffers(program, transfers, assignment.tile_rank, tile_kv_edge, tile_q_edge),
                                assignment.num_ranks).max())


def pass_peaks(schedule: Schedule) -> tuple[int, int]:
    """The most live buffer tokens any rank holds in any stage of the forward, and of the backward pass."""
    transfers = schedule.rounds.transfers
    return (_pass_peak(schedule.forward, transfers, schedule.tile_kv_edge, schedule.tile_q_edge),
            _pass_peak(schedule.backward, transfers, schedule.tile_kv_edge, schedule.tile_q_edge))


def max_buffer_tokens(schedule: Schedule) -> int:
    """The most live buffer tokens any rank holds in any stage of either pass."""
    return max(pass_peaks(schedule))


@dataclass(frozen=True, slots=True, kw_only=True)
class _Earliest:
    """Each tile's first stage (the one after its pulls arrive, 0 for a tile whose data is all local), the buffer
    delaying it keeps live, and what levelling derives from them (:class:`Prepared`: the tiles it may delay among
    them). Both passes share them: the backward's pulls take round 2r in stages of 2c rounds, the
    stage r // c of the forward's round r."""

    stage: np.ndarray
    tile_buffer: np.ndarray
    prepared: Prepared

    @classmethod
    def of(cls, arrival_round: np.ndarray, pull_round: np.ndarray, coalesce: int, tile_kv_edge: np.ndarray,
           assignment) -> _Earliest:
        return cls.of_stage(earliest_stage(arrival_round, coalesce), pull_round, coalesce, tile_kv_edge, assignment)

    @classmethod
    def of_stage(cls, stage: np.ndarray, pull_round: np.ndarray, coalesce: int, tile_kv_edge: np.ndarray,
                 assignment) -> _Earliest:
        """:meth:`of`, each tile's first stage given."""
        # Local tiles stay in stage 0 (they hide the first transfers); a delayed tile keeps its K,V pull live. Tiles
        # run for another rank move too: a helper's tiles for a heavy block all become runnable once its Q and the
        # first K,V land, and pinned there they made one stage as long as several (Wikipedia + tail at 256 GPUs:
        # 16 ms of one helper's tiles in each of two stages against 5 ms elsewhere, the forward 169 -> 156 ms when
        # they move; on the matrix 23 of 54 plans changed, none more than 0.38% slower, four 1.1-2.9% faster).
        movable = stage > 0
        tile_buffer = tile_kv_edge
        return cls(stage=stage, tile_buffer=tile_buffer, prepared=prepare_levelling(
            stage, assignment.tile_rank, assignment.tiles.tile_seconds, assignment.num_ranks, movable, tile_buffer,
            pull_round // coalesce))


@dataclass(slots=True, kw_only=True)
class ForwardSchedule:
    """:func:`coalesce_forward`'s result: the forward pass and what the backward derives from it. Not frozen:
    :func:`complete_backward` consumes it and drops its earliest stages (one entry a tile, millions at small blocks)
    before the tiles' order is sorted."""

    rounds: Rounds
    coalesce: int
    pipelined: bool
    forward: PassSchedule
    tile_kv_edge: np.ndarray
    tile_q_edge: np.ndarray
    arrival_round: np.ndarray
    earliest: _Earliest | None
    levelling_stages: int  # the backward's levelling budget, in stages' worth of pulls
    q_pulls_first: bool = False  # whether the rounds carrying Q pulls were moved into the first stage


def _tile_stages(transfers: Transfers, pull_round: np.ndarray, push_edge: np.ndarray, coalesce: int,
                 earliest: _Earliest | None, budget: int | None) -> np.ndarray:
    """Each tile's stage: at or after its earliest (None: not pipelined, every tile after the last pull), levelled
    within the buffer budget (None: not levelled)."""
    assignment = transfers.assignment
    tiles = assignment.tiles
    if earliest is None:
        return np.full(tiles.num_tiles, int(pull_round.max(initial=-1)) // coalesce + 1, dtype=np.int64)
    if budget is None:
        return earliest.stage.astype(np.int64)
    # Ranks whose data comes early would front-load their tiles while others wait for late data; delay some to
    # level each stage's busiest rank, as far as the buffers they read may stay live.
    pushed = np.zeros(transfers.num_edges, dtype=np.int64)
    pushed[push_edge] = 1
    limit = BufferLimit(tile_buffer=earliest.tile_buffer, buffer_rank=transfers.edge_dst,
                        buffer_first=pull_round // coalesce, buffer_tokens=transfers.edge_tokens, buffer_hold=pushed,
                        budget=budget)
    return level_stages(earliest.stage, assignment.tile_rank, tiles.tile_seconds, assignment.num_ranks,
                        limit=limit, prepared=earliest.prepared)


def _forward(transfers: Transfers, pull_round: np.ndarray, coalesce: int, earliest: _Earliest | None,
             tile_kv_edge: np.ndarray, tile_q_edge: np.ndarray, budget: int, nvlink_lanes: int) -> PassSchedule:
    """Pulls in their rounds, tiles levelled, partial outputs pushed back along Q pulls in free rounds
    (:func:`fcp_compiler.algorithms.exchange.forward_push_rounds`)."""
    is_q = transfers.edge_kind == TransferKind.Q
    tile_stage = _tile_stages(transfers, pull_round, np.flatnonzero(is_q), coalesce, earliest, budget)
    push_edge, push_round = forward_push_rounds(is_q, transfers.edge_src, transfers.edge_dst,
                                                transfers.assignment.num_ranks, pull_round, tile_stage, tile_kv_edge,
                                                tile_q_edge, coalesce, transfers.edge_link, nvlink_lanes)
    return PassSchedule(coalesce=coalesce, edge_round=pull_round, tile_stage=tile_stage, push_edge=push_edge,
                        push_round=push_round)


def _backward(transfers: Transfers, forward_round: np.ndarray, coalesce: int, earliest: _Earliest | None,
              tile_kv_edge: np.ndarray, tile_q_edge: np.ndarray, budget: int, nvlink_lanes: int) -> PassSchedule:
    """Pulls in the even rounds (round 2r for round r of the backward order); tiles after their data, levelled within
    the buffer budget (a later tile holds its block, and its gradient, longer); every gradient pushed back along its
    pull, relays after the pushes they sum
    (:func:`fcp_compiler.algorithms.exchange.backward_push_rounds`)."""
    pull_round = 2 * forward_round
    tile_stage = _tile_stages(transfers, pull_round, np.arange(transfers.num_edges), coalesce, earliest, budget)
    push_edge, push_round = backward_push_rounds(transfers.edge_src, transfers.edge_dst, transfers.edge_parent,
                                                 transfers.assignment.num_ranks, pull_round, tile_stage,
                                                 tile_kv_edge, tile_q_edge, coalesce, transfers.edge_link,
                                                 nvlink_lanes)
    return PassSchedule(coalesce=coalesce, edge_round=pull_round, tile_stage=tile_stage, push_edge=push_edge,
                        push_round=push_round)


def _round_work(rounds: Rounds, item: np.ndarray, num_items: int, tile_kv_edge: np.ndarray,
                tile_q_edge: np.ndarray) -> np.ndarray:
    """Work each round (item: a class's colour) makes runnable on each rank: a tile counts in the item of its
    later pull."""
    assignment = rounds.transfers.assignment
    arrival = arrival_round_of(item, tile_kv_edge, tile_q_edge)
    num_ranks = assignment.num_ranks
    # Local tiles (arrival -1) land in one extra bin, dropped: no compression of millions of tiles.
    key = np.multiply(arrival, num_ranks, dtype=np.int64)
    key += assignment.tile_rank
    np.maximum(key, -1, out=key)
    work = np.bincount(key + 1, weights=assignment.tiles.tile_seconds, minlength=num_items * num_ranks + 1)
    return work[1:].reshape(num_items, num_ranks)


def place_after_entries(edge_round: np.ndarray, transfers: Transfers, rounds_per_stage: int, nvlink_lanes: int,
                        tile_kv_edge: np.ndarray, tile_q_edge: np.ndarray) -> np.ndarray:
    """Rounds for the pulls re-sent inside a node (edge_round -1): each from the stage after its entry pull
    arrives, in a stage where the tiles it feeds do not pile onto its receiver
    (:func:`fcp_compiler.algorithms.exchange.spread_messages`), in a round with free slots at both ends in its link
    class (around every pull already placed; `nvlink_lanes` NVLink slots a round).

    Returns:
        int64 [E], every pull's round.
    """
    child = np.flatnonzero(edge_round < 0)
    if child.size == 0:
        return edge_round
    parent = transfers.edge_parent[child]
    assert (parent >= 0).all() and (edge_round[parent] >= 0).all()
    assignment = transfers.assignment
    num_ranks, seconds = assignment.num_ranks, assignment.tiles.tile_seconds
    fixed = np.flatnonzero(edge_round >= 0)
    # Work already runnable per (stage, rank): tiles of local data in stage 0, the others after their pulls.
    arrival = arrival_round_of(edge_round, tile_kv_edge, tile_q_edge)
    feeds_child = np.append(edge_round < 0, False)[tile_kv_edge]
    num_stages = int(edge_round.max()) // rounds_per_stage + 2
    stage = np.where(arrival >= 0, arrival // rounds_per_stage + 1, 0).astype(np.int64)
    load = np.bincount(stage[~feeds_child] * num_ranks + assignment.tile_rank[~feeds_child],
                       weights=seconds[~feeds_child], minlength=num_stages * num_ranks).reshape(num_stages, num_ranks)
    work = np.bincount(tile_kv_edge[feeds_child], weights=seconds[feeds_child], minlength=transfers.num_edges)
    src, dst = link_ends(transfers.edge_src, transfers.edge_dst, transfers.edge_link)
    placed = edge_round.copy()
    placed[child] = spread_messages(edge_round[parent] // rounds_per_stage + 1, src[child], dst[child], work[child],
                                    load, rounds_per_stage, edge_round[fixed], src[fixed], dst[fixed],
                                    link_capacity(num_ranks, nvlink_lanes), transfers.edge_dst[child])
    return placed


def coalesce(rounds: Rounds, coalesce: int, pipelined: bool = True, buffer_budget: int | None = None,
             levelling_stages: int = LEVELLING_STAGES, q_first: bool = True) -> Schedule:
    """Merge `coalesce` consecutive rounds into a stage and place every tile and push of both passes.

    Forward: pulls in their matching rounds, reordered so that stages carry even work (:func:`order_rounds`; stage s
    carries rounds [s * coalesce, (s + 1) * coalesce)), those carrying Q pulls first where that pays; partial outputs
    of tiles run away from their owner go back along the Q pull. Backward: the same pulls in every other round, so
    that the dK, dV and dQ pushes along every pull find free rounds soon after their tiles, in stages of 2 x coalesce
    rounds (as many pulls a stage as forward), each pulled block freed two or three stages after it arrives. Pushes
    take the earliest round after their tiles in which both ends
    are free, so every round stays a matching over all of the pass's messages. Local tiles run in stage 0 (hiding
    the first transfers); a tile that needs pulled data runs in the stage after its pulls arrive or, where that
    levels the stages' busiest ranks within the buffer budget (:func:`level_stages`), later.

    Args:
        rounds: the congestion-free rounds of the pulls.
        coalesce: c, rounds per stage (>= 1; the backward pass takes 2c).
        pipelined: False (an ablation) runs every tile after the last pull, as a pull-all, compute, push-all design.
        buffer_budget: most live buffer tokens the forward's levelling may make a rank hold (default
            levelling_stages x coalesce x block size).
        levelling_stages: the backward's levelling budget (and the forward's, unless buffer_budget is given), in
            stages' worth of pulls (LEVELLING_STAGES).
        q_first: move the rounds carrying Q pulls into the first stage where that levels the stages
            (Q_PULLS_FIRST_GAIN); False keeps order_rounds' order.
    Returns:
        the Schedule.
    """
    return complete_backward(coalesce_forward(rounds, coalesce, pipelined, buffer_budget, levelling_stages, q_first))


def coalesce_forward(rounds: Rounds, coalesce: int, pipelined: bool = True, buffer_budget: int | None = None,
                     levelling_stages: int = LEVELLING_STAGES, q_first: bool = True) -> ForwardSchedule:
    """The forward half of :func:`coalesce` (its arguments): the pulls' rounds, the tiles' stages and the partial
    outputs' pushes. Its live buffers are known before the backward is built (:func:`complete_backward`)."""
    transfers = rounds.transfers
    assignment = transfers.assignment
    tiles = assignment.tiles
    tile_rank = assignment.tile_rank
    kv_edge = _edge_lookup(transfers, TransferKind.KV, tiles.tile_kv_block, tile_rank)
    q_edge = _edge_lookup(transfers, TransferKind.Q, tiles.tile_q_block, tile_rank)
    # Every tile finds the pulls of exactly its remote blocks (checked on a sample: millions of tiles at small blocks).
    sample = slice(None, None, 1 + tiles.num_tiles // 100_000)
    assert ((kv_edge[sample] >= 0) == (assignment.block_rank[tiles.tile_kv_block[sample]] != tile_rank[sample])).all()
    assert ((q_edge[sample] >= 0) == (assignment.block_rank[tiles.tile_q_block[sample]] != tile_rank[sample])).all()
    block_size = tiles.sharding.block_size
    budget = buffer_budget if buffer_budget is not None else levelling_stages * coalesce * block_size
    fanned = transfers.edge_parent >= 0
    forward_round, q_pulls_first = _ordered_rounds(rounds, coalesce, pipelined, q_first, kv_edge, q_edge)
    # Backward pulls take the even rounds: in its own numbering (halved) a backward stage holds `coalesce` rounds,
    # so the pulls re-sent inside a node take the same rounds in both passes.
    lanes = rounds.nvlink_lanes
    forward_round = place_after_entries(np.where(fanned, -1, forward_round), transfers, coalesce, lanes, kv_edge,
                                        q_edge)
    arrival_round = arrival_round_of(forward_round, kv_edge, q_edge)
    earliest = _Earliest.of(arrival_round, forward_round, coalesce, kv_edge, assignment) if pipelined else None
    forward = _forward(transfers, forward_round, coalesce, earliest, kv_edge, q_edge, budget, lanes)
    return ForwardSchedule(rounds=rounds, coalesce=coalesce, pipelined=pipelined, forward=forward,
                           tile_kv_edge=kv_edge, tile_q_edge=q_edge, arrival_round=arrival_round, earliest=earliest,
                           levelling_stages=levelling_stages, q_pulls_first=q_pulls_first)


def _ordered_rounds(rounds: Rounds, coalesce: int, pipelined: bool, q_first: bool, kv_edge: np.ndarray,
                    q_edge: np.ndarray) -> tuple[np.ndarray, bool]:
    """Each pull's forward round before the pulls re-sent inside a node are placed (theirs is their entry's), in the
    order of :func:`order_rounds` (pipelined), with the rounds carrying Q pulls first where that pays
    (Q_PULLS_FIRST_GAIN; `q_first` False: never). Returns (rounds, whether the Q pulls were moved first)."""
    transfers = rounds.transfers
    fanned = transfers.edge_parent >= 0
    # Each class's colours are rounds of their own (item cls * R + colour); a pull its entry re-sends counts, for
    # ordering the rounds, in its entry's.
    width = int(rounds.edge_round.max(initial=-1)) + 1
    link, lanes = transfers.edge_link, rounds.nvlink_lanes
    item = np.where(fanned, -1, link * width + rounds.edge_round)
    item = np.where(fanned, item[np.maximum(transfers.edge_parent, 0)], item)
    item_class = np.repeat(np.arange(2), width)
    if not pipelined:  # unordered: NVLink colours `lanes` to a round
        return np.where(item_class == 0, np.arange(2 * width) % width // lanes, np.arange(2 * width) % width)[item], \
            False
    # Any order of the matchings is congestion-free; choose the one whose stages carry even work. The backward
    # takes the same order: in its own numbering (halved, its pulls take the even rounds) a stage holds
    # `coalesce` rounds too.
    work = _round_work(rounds, item, 2 * width, kv_edge, q_edge)
    position = order_rounds(work, coalesce, item_class, (lanes, 1))
    q_items = sorted_unique(item[transfers.edge_kind == TransferKind.Q])
    if not q_first or q_items.size == 0:
        return position[item], False
    moved = rounds_first(position, item_class, q_items, coalesce, (lanes, 1))
    if _earliest_levels(moved[item], coalesce, kv_edge, q_edge, transfers.assignment) < \
            (1.0 - Q_PULLS_FIRST_GAIN) * _earliest_levels(position[item], coalesce, kv_edge, q_edge,
                                                          transfers.assignment):
        return moved[item], True
    return position[item], False


def _earliest_levels(pull_round: np.ndarray, coalesce: int, kv_edge: np.ndarray, q_edge: np.ndarray,
                     assignment) -> float:
    """The sum over stages of the busiest rank's work when every tile runs in the stage after its pulls (order_rounds'
    objective, for these rounds)."""
    stage = earliest_stage(arrival_round_of(pull_round, kv_edge, q_edge), coalesce)
    loads = stage_loads(stage, assignment.tile_rank, assignment.tiles.tile_seconds, int(stage.max(initial=0)) + 1,
                        assignment.num_ranks)
    return float(loads.max(axis=1).sum())


def complete_backward(part: ForwardSchedule) -> Schedule:
    """The Schedule: the forward half with the backward pass (stages of 2c rounds) and the tiles' pipeline order."""
    rounds, coalesce, forward, earliest = part.rounds, part.coalesce, part.forward, part.earliest
    transfers = rounds.transfers
    tile_rank = transfers.assignment.tile_rank
    kv_edge, q_edge, arrival_round = part.tile_kv_edge, part.tile_q_edge, part.arrival_round
    forward_round, lanes = forward.edge_round, rounds.nvlink_lanes
    block_size = transfers.assignment.tiles.sharding.block_size
    # Backward pulls take every other round (their pushes the rest), so a backward stage of 2c rounds holds as many
    # pulls as a forward stage: half as many stages, each long enough to hide its messages under its tiles.
    backward = _backward(transfers, forward_round, 2 * coalesce, earliest, kv_edge, q_edge,
                         part.levelling_stages * coalesce * block_size, lanes)
    delayed = np.zeros(tile_rank.size, dtype=bool) if earliest is None else forward.tile_stage != earliest.stage
    part.earliest = None
    del earliest  # millions of entries at small blocks: gone before the order is sorted
    tile_order = pipeline_order(tile_rank, forward.tile_stage, arrival_round, delayed)
    return Schedule(rounds=rounds, coalesce=coalesce, forward=forward, backward=backward, tile_kv_edge=kv_edge,
                    tile_q_edge=q_edge, tile_order=tile_order)


def smaller_backward_rounds(coalesce_degree: int) -> int | None:
    """The most rounds a backward stage may hold that is at most the forward's c (half the usual 2c), even, and
    divides 2c; None for c = 1. Dividing 2c keeps every boundary of the usual backward stages a boundary: a pull
    re-sent inside a node, or relayed, arrives in a later forward stage than its entry, and so in a later
    backward stage too (its backward round is twice its forward round)."""
    return next((rounds for rounds in range(coalesce_degree // 2 * 2, 1, -2) if 2 * coalesce_degree % rounds == 0),
                None)


def deeper_backward_rounds(coalesce_degree: int, halved: int) -> list[int]:
    """Rounds a backward stage may hold below `halved` (:func:`smaller_backward_rounds`), most first: each even and
    dividing 2c, so that every boundary of the usual backward stages stays one."""
    return [rounds for rounds in range(halved - 2, 1, -2) if 2 * coalesce_degree % rounds == 0]


def with_backward_rounds(schedule: Schedule, backward_rounds: int,
                         levelling_stages: int = LEVELLING_STAGES) -> Schedule:
    """The same schedule with the backward pass in stages of `backward_rounds` rounds (even, dividing twice the
    forward's), levelled within `levelling_stages` stages' worth of pulls: the forward, the pulls' rounds and the
    tiles' order are kept.

    A backward pull stays live from its stage until its gradient leaves two stages later, so fewer rounds a stage
    hold fewer pulled blocks at a time.
    """
    rounds = schedule.rounds
    transfers, coalesce_degree = rounds.transfers, schedule.coalesce
    assert backward_rounds % 2 == 0 and 2 <= backward_rounds and 2 * coalesce_degree % backward_rounds == 0
    forward_round, kv_edge, q_edge = schedule.forward.edge_round, schedule.tile_kv_edge, schedule.tile_q_edge
    stage = backward_earliest_stage(arrival_round_of(forward_round, kv_edge, q_edge), backward_rounds)
    earliest = _Earliest.of_stage(stage, 2 * forward_round, backward_rounds, kv_edge, transfers.assignment)
    del stage
    block_size = transfers.assignment.tiles.sharding.block_size
    backward = _backward(transfers, forward_round, backward_rounds, earliest, kv_edge, q_edge,
                         levelling_stages * coalesce_degree * block_size, rounds.nvlink_lanes)
    return dataclasses.replace(schedule, backward=backward)


def remote_tiles_out_of_last_stage(schedule: Schedule) -> Schedule | None:
    """The same schedule with the backward's tiles that read a pulled K,V and that levelling delayed into the
    backward's last stage back in their earliest stage, and the gradient pushes placed again; None where there is
    none.

    Such a tile's dK, dV leave in a stage after it, so in the last stage it adds a stage of pushes alone, with every
    rank waiting for its partners to finish; back in its earliest stage its push leaves under later stages' tiles,
    but the stage it returns to grows. Which is faster depends on the plan (applied to every schedule, it was faster
    on 30 of the 54 batches of benchmarks/layer_objective.py's matrix and slower on 17, by up to 1% each), so the
    floor simulates its winner both ways.
    Tiles only move earlier, so every buffer is freed as early or earlier; pushes move earlier, so the caller checks
    live buffers again.
    """
    backward = schedule.backward
    kv_edge, q_edge = schedule.tile_kv_edge, schedule.tile_q_edge
    earliest = backward_earliest_stage(arrival_round_of(schedule.forward.edge_round, kv_edge, q_edge),
                                        backward.coalesce)
    last = int(backward.tile_stage.max(initial=0))
    back = (kv_edge >= 0) & (q_edge < 0) & (backward.tile_stage == last) & (earliest < last)
    if not back.any():
        return None
    tile_stage = np.where(back, earliest, backward.tile_stage)
    transfers, rounds = schedule.rounds.transfers, schedule.rounds
    push_edge, push_round = backward_push_rounds(transfers.edge_src, transfers.edge_dst, transfers.edge_parent,
                                                 transfers.assignment.num_ranks, backward.edge_round, tile_stage,
                                                 kv_edge, q_edge, backward.coalesce, transfers.edge_link,
                                                 rounds.nvlink_lanes)
    return dataclasses.replace(schedule, backward=dataclasses.replace(backward, tile_stage=tile_stage,
                                                                      push_edge=push_edge, push_round=push_round))


def tiles_pulled_back(schedule: Schedule, backward_work: float) -> Schedule | None:
    """The same schedule with the tiles levelling delayed run earlier where a stage has room
    (:func:`fcp_compiler.algorithms.leveling.pull_back`), in both passes, and the pushes placed again; None where no
    tile moves. A stage's level is the longer of its busiest rank's tiles and its busiest link end's pulls: it lasts
    that long whatever its other ranks run. Tiles only move earlier (every buffer is freed as early or earlier);
    pushes move, so the caller checks live buffers again. `backward_work`: a backward tile's work against its
    forward's (its seconds are the forward's).
    """
    rounds, transfers = schedule.rounds, schedule.rounds.transfers
    assignment, kv_edge, q_edge = transfers.assignment, schedule.tile_kv_edge, schedule.tile_q_edge
    forward, backward, lanes = schedule.forward, schedule.backward, rounds.nvlink_lanes
    arrival = arrival_round_of(forward.edge_round, kv_edge, q_edge)
    forward_earliest = earliest_stage(arrival, forward.coalesce)
    seconds = assignment.tiles.tile_seconds
    forward_stage = _pulled_back(forward, forward_earliest, seconds, transfers)
    backward_stage = _pulled_back(backward, backward_earliest_stage(arrival.copy(), backward.coalesce),
                                  seconds * backward_work, transfers)
    if np.array_equal(forward_stage, forward.tile_stage) and np.array_equal(backward_stage, backward.tile_stage):
        return None
    is_q, num_ranks = transfers.edge_kind == TransferKind.Q, assignment.num_ranks
    forward_pushes = forward_push_rounds(is_q, transfers.edge_src, transfers.edge_dst, num_ranks, forward.edge_round,
                                         forward_stage, kv_edge, q_edge, forward.coalesce, transfers.edge_link, lanes)
    backward_pushes = backward_push_rounds(transfers.edge_src, transfers.edge_dst, transfers.edge_parent, num_ranks,
                                           backward.edge_round, backward_stage, kv_edge, q_edge, backward.coalesce,
                                           transfers.edge_link, lanes)
    tile_order = pipeline_order(assignment.tile_rank, forward_stage, arrival, forward_stage != forward_earliest)
    return dataclasses.replace(
        schedule, tile_order=tile_order,
        forward=dataclasses.replace(forward, tile_stage=forward_stage, push_edge=forward_pushes[0],
                                    push_round=forward_pushes[1]),
        backward=dataclasses.replace(backward, tile_stage=backward_stage, push_edge=backward_pushes[0],
                                     push_round=backward_pushes[1]))


def _pulled_back(program: PassSchedule, earliest: np.ndarray, seconds: np.ndarray, transfers: Transfers) -> np.ndarray:
    """One pass's tile stages pulled back (:func:`tiles_pulled_back`), its tiles' work `seconds`."""
    profile, tile_rank = transfers.assignment.tiles.profile, transfers.assignment.tile_rank
    num_stages, num_ranks = program.num_stages, transfers.assignment.num_ranks
    pulls = stage_message_seconds(program.edge_stage, transfers.edge_src, transfers.edge_dst, transfers.edge_bytes,
                                  transfers.edge_link == 1, num_stages, num_ranks, profile.network_gbps * 1e9,
                                  profile.nvlink_gbps * 1e9)
    level = np.maximum(pulls.max(axis=1), stage_loads(program.tile_stage, tile_rank, seconds, num_stages,
                                                      num_ranks).max(axis=1))
    return pull_back(program.tile_stage, earliest.astype(np.int64), tile_rank, seconds, level)


def forward_peak(part: ForwardSchedule) -> int:
    """The most live buffer tokens any rank holds in any stage of the forward half."""
    return _pass_peak(part.forward, part.rounds.transfers, part.tile_kv_edge, part.tile_q_edge)

"""Pass 6: pipeline order and coalescing of rounds into stages, for the forward and backward programs."""

from __future__ import annotations

import numpy as np

from fcp_compiler.algorithms.leveling import level_stages
from fcp_compiler.ir import Rounds, Schedule, TransferKind


def _edge_lookup(transfers, kind: TransferKind, blocks: np.ndarray, ranks: np.ndarray) -> np.ndarray:
    """Index of the pull edge (kind, block, receiving rank) for each query, -1 where there is none."""
    num_ranks = transfers.assignment.num_ranks
    of_kind = np.flatnonzero(transfers.edge_kind == kind)
    keys = transfers.edge_block[of_kind] * num_ranks + transfers.edge_dst[of_kind]
    assert (np.diff(keys) > 0).all()
    wanted = blocks * num_ranks + ranks
    pos = np.minimum(np.searchsorted(keys, wanted), max(keys.size - 1, 0))
    found = keys.size > 0
    hit = (keys[pos] == wanted) if found else np.zeros(wanted.size, dtype=bool)
    return np.where(hit, of_kind[pos] if found else -1, -1)


def schedule_pushes(ready_stage: np.ndarray, src: np.ndarray, dst: np.ndarray, capacity: int) -> np.ndarray:
    """Give each push the earliest stage >= its ready stage in which neither end exceeds `capacity` pushes.

    The pushes of a plan are usually the reverse of one stage's pulls and fit as they are; only when they do not
    does a greedy pass (by ready stage, then index) delay some. O(P) plus O(P * delay) in the greedy case.

    Args:
        ready_stage, src, dst: per push.
        capacity: most pushes a rank may send, and receive, in one stage (the coalescing degree).
    Returns:
        int64 stage of each push.
    """
    if ready_stage.size == 0:
        return ready_stage.astype(np.int64)
    num_stages = int(ready_stage.max()) + 1
    send_load = np.bincount(src * num_stages + ready_stage)
    recv_load = np.bincount(dst * num_stages + ready_stage)
    if send_load.max() <= capacity and recv_load.max() <= capacity:
        return ready_stage.astype(np.int64)
    # The greedy runs on Python ints (no numpy scalars in the loop) with one int key per (rank, stage).
    src_list, dst_list, ready_list = src.tolist(), dst.tolist(), ready_stage.tolist()
    stride = num_stages + ready_stage.size // capacity + 2  # no push can be delayed past this
    sends: dict[int, int] = {}
    recvs: dict[int, int] = {}
    # Pushes come in ready order, so per rank the stages before its first one with room never matter again: these
    # lower bounds on it only save scanning.
    num_ranks = int(max(src.max(), dst.max())) + 1
    send_room = [0] * num_ranks
    recv_room = [0] * num_ranks
    placed = [0] * ready_stage.size
    for push in np.lexsort((np.arange(ready_stage.size), ready_stage)).tolist():
        a, b, ready = src_list[push], dst_list[push], ready_list[push]
        s = max(ready, send_room[a], recv_room[b])
        send_key, recv_key = a * stride, b * stride
        while sends.get(send_key + s, 0) >= capacity or recvs.get(recv_key + s, 0) >= capacity:
            s += 1
        sent = sends[send_key + s] = sends.get(send_key + s, 0) + 1
        received = recvs[recv_key + s] = recvs.get(recv_key + s, 0) + 1
        placed[push] = s
        if sent >= capacity and s == max(send_room[a], ready):
            while sends.get(send_key + s, 0) >= capacity:
                s += 1
            send_room[a] = s
        s = placed[push]
        if received >= capacity and s == max(recv_room[b], ready):
            while recvs.get(recv_key + s, 0) >= capacity:
                s += 1
            recv_room[b] = s
    stage = np.array(placed, dtype=np.int64)
    return stage


def coalesce(rounds: Rounds, degree: int, pipelined: bool = True) -> Schedule:
    """Merge `degree` consecutive rounds into a stage and place every tile and push in the pipeline.

    Stage s carries rounds [s * degree, (s + 1) * degree): no rank sends or receives more than `degree` pulls in it.
    Local tiles run in stage 0 (hiding the first transfers); a tile that needs pulled data runs in the stage after
    its last pull arrives or, where that levels the stages' busiest ranks (:func:`level_stages`), later; within a
    stage tiles run in arrival order. A rank that ran tiles for another rank's query block pushes the partial
    output back (forward) and the dQ partial (backward) in the stage after its last such tile; every KV pull's
    dK, dV partial goes back along the same edge after the last tile that read it.

    Args:
        rounds: the congestion-free rounds.
        degree: c, rounds per stage (>= 1).
        pipelined: False (an ablation) runs every tile after the last pull, as a pull-all, compute, push-all design.
    Returns:
        the Schedule.
    """
    transfers = rounds.transfers
    assignment = transfers.assignment
    tiles = assignment.tiles
    edge_stage = rounds.edge_round // degree
    tile_rank = assignment.tile_rank
    kv_edge = _edge_lookup(transfers, TransferKind.KV, tiles.tile_kv_block, tile_rank)
    q_edge = _edge_lookup(transfers, TransferKind.Q, tiles.tile_q_block, tile_rank)
    kv_remote = assignment.block_rank[tiles.tile_kv_block] != tile_rank
    q_remote = assignment.block_rank[tiles.tile_q_block] != tile_rank
    assert ((kv_edge >= 0) == kv_remote).all() and ((q_edge >= 0) == q_remote).all()
    round_or_local = np.append(rounds.edge_round, -1)  # index -1 (no pull) reads -1 (local)
    arrival_round = np.maximum(round_or_local[kv_edge], round_or_local[q_edge])
    tile_stage = np.where(arrival_round >= 0, arrival_round // degree + 1, 0)
    if pipelined:
        # Ranks whose data comes early would front-load their tiles while others wait for late data; delay some to
        # level each stage's busiest rank. Local tiles stay in stage 0 (they hide the first transfers and the
        # reshuffle), and tiles run for another rank stay put so that their partial outputs leave early.
        tile_stage = level_stages(tile_stage, tile_rank, tiles.tile_seconds, assignment.num_ranks,
                                  movable=(tile_stage > 0) & ~q_remote)
    else:
        tile_stage = np.full(tiles.num_tiles, -(-rounds.num_rounds // degree), dtype=np.int64)
    tile_order = np.lexsort((np.arange(tiles.num_tiles), arrival_round, tile_stage, tile_rank))

    # A push is ready in the stage after the last tile that feeds it.
    num_edges = transfers.num_edges
    push_ready = np.zeros(num_edges, dtype=np.int64)
    np.maximum.at(push_ready, kv_edge[kv_remote], tile_stage[kv_remote] + 1)
    np.maximum.at(push_ready, q_edge[q_remote], tile_stage[q_remote] + 1)
    q_edges = np.flatnonzero(transfers.edge_kind == TransferKind.Q)
    # Pushes travel from the pulling rank back to the owner.
    fwd_push_stage = schedule_pushes(push_ready[q_edges], transfers.edge_dst[q_edges], transfers.edge_src[q_edges],
                                     degree)
    all_edges = np.arange(num_edges)
    bwd_push_stage = schedule_pushes(push_ready, transfers.edge_dst, transfers.edge_src, degree)

    def num_stages(*stage_arrays: np.ndarray) -> int:
        return max([int(a.max()) + 1 for a in stage_arrays if a.size] + [1])

    return Schedule(rounds=rounds, coalesce=degree, edge_stage=edge_stage, tile_stage=tile_stage,
                    tile_order=tile_order, fwd_push_edge=q_edges, fwd_push_stage=fwd_push_stage,
                    bwd_push_edge=all_edges, bwd_push_stage=bwd_push_stage,
                    num_fwd_stages=num_stages(edge_stage, tile_stage, fwd_push_stage),
                    num_bwd_stages=num_stages(edge_stage, tile_stage, bwd_push_stage))

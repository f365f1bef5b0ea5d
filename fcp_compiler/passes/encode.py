"""Pass 8: serialise the plan, one section per rank."""

from __future__ import annotations

import numpy as np

from fcp_compiler.ir import Reshuffle
from fcp_compiler.plan_format import assemble


def _rank_slices(rank_of_row: np.ndarray, num_ranks: int) -> np.ndarray:
    """Bounds of each rank's rows in an array sorted by rank."""
    return np.searchsorted(rank_of_row, np.arange(num_ranks + 1))


def _gather_segments(order: np.ndarray, seg_offsets: np.ndarray, segs: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Segments of edges `order`, concatenated, and the cumulative counts (len(order) + 1 entries)."""
    counts = np.diff(seg_offsets)[order]
    cumulative = np.concatenate(([0], np.cumsum(counts))).astype(np.int64)
    flat = np.repeat(seg_offsets[order] - cumulative[:-1], counts) + np.arange(int(cumulative[-1]))
    return segs[flat], cumulative


def encode(plan: Reshuffle, header_fields: dict) -> bytes:
    """Write the plan file bytes: header, batch-wide tables, then each rank's program.

    Rows of each rank are in execution order: pulls by round, tiles in pipeline order, pushes by stage.

    Args:
        plan: the last IR object (it holds all the earlier ones).
        header_fields: every PlanHeader field but the section table.
    Returns:
        the plan file's bytes (deterministic for the same IR and header).
    """
    schedule = plan.schedule
    rounds = schedule.rounds
    transfers = rounds.transfers
    assignment = transfers.assignment
    tiles = assignment.tiles
    sharding = tiles.sharding
    num_ranks = assignment.num_ranks
    num_edges = transfers.num_edges
    edge_ids = np.arange(num_edges)

    block_order = np.lexsort((np.arange(assignment.block_rank.size), assignment.block_rank))
    block_bounds = _rank_slices(assignment.block_rank[block_order], num_ranks)
    send_runs = np.arange(plan.run_user_rank.size)  # already sorted by (user rank, plan rank, start)
    send_bounds = _rank_slices(plan.run_user_rank, num_ranks)
    recv_runs = np.lexsort((plan.run_global_start, plan.run_user_rank, plan.run_plan_rank))
    recv_bounds = _rank_slices(plan.run_plan_rank[recv_runs], num_ranks)

    send_order = np.lexsort((edge_ids, rounds.edge_round, transfers.edge_src))
    recv_order = np.lexsort((edge_ids, rounds.edge_round, transfers.edge_dst))
    send_bounds_e = _rank_slices(transfers.edge_src[send_order], num_ranks)
    recv_bounds_e = _rank_slices(transfers.edge_dst[recv_order], num_ranks)
    # Row of each edge among its sender's pull_send rows and its receiver's pull_recv rows.
    send_row = np.empty(num_edges, dtype=np.int64)
    send_row[send_order] = np.arange(num_edges) - send_bounds_e[transfers.edge_src[send_order]]
    recv_row = np.empty(num_edges, dtype=np.int64)
    recv_row[recv_order] = np.arange(num_edges) - recv_bounds_e[transfers.edge_dst[recv_order]]
    send_segs, send_seg_cum = _gather_segments(send_order, transfers.edge_seg_offsets, transfers.edge_segs)
    recv_segs, recv_seg_cum = _gather_segments(recv_order, transfers.edge_seg_offsets, transfers.edge_segs)

    tile_order = schedule.tile_order
    tile_bounds = _rank_slices(assignment.tile_rank[tile_order], num_ranks)

    def push_tables(push_edge: np.ndarray, push_stage: np.ndarray):
        # A push goes from the pull's receiver back to its sender.
        sender = transfers.edge_dst[push_edge]
        receiver = transfers.edge_src[push_edge]
        by_sender = np.lexsort((send_row[push_edge], receiver, push_stage, sender))
        by_receiver = np.lexsort((recv_row[push_edge], sender, push_stage, receiver))
        return (by_sender, _rank_slices(sender[by_sender], num_ranks), by_receiver,
                _rank_slices(receiver[by_receiver], num_ranks))

    fwd = push_tables(schedule.fwd_push_edge, schedule.fwd_push_stage)
    bwd = push_tables(schedule.bwd_push_edge, schedule.bwd_push_stage)

    def rows(array: np.ndarray, order: np.ndarray, bounds: np.ndarray, rank: int) -> np.ndarray:
        return array[order[bounds[rank]:bounds[rank + 1]]]

    rank_arrays = []
    for rank in range(num_ranks):
        s0, s1 = send_bounds_e[rank], send_bounds_e[rank + 1]
        r0, r1 = recv_bounds_e[rank], recv_bounds_e[rank + 1]
        arrays = {
            "blocks": block_order[block_bounds[rank]:block_bounds[rank + 1]],
            "reshuffle_send_peer": rows(plan.run_plan_rank, send_runs, send_bounds, rank),
            "reshuffle_send_offset": rows(plan.run_user_offset, send_runs, send_bounds, rank),
            "reshuffle_send_length": rows(plan.run_length, send_runs, send_bounds, rank),
            "reshuffle_recv_peer": rows(plan.run_user_rank, recv_runs, recv_bounds, rank),
            "reshuffle_recv_offset": rows(plan.run_plan_offset, recv_runs, recv_bounds, rank),
            "reshuffle_recv_length": rows(plan.run_length, recv_runs, recv_bounds, rank),
            "pull_send_round": rows(rounds.edge_round, send_order, send_bounds_e, rank),
            "pull_send_kind": rows(transfers.edge_kind, send_order, send_bounds_e, rank),
            "pull_send_block": rows(transfers.edge_block, send_order, send_bounds_e, rank),
            "pull_send_peer": rows(transfers.edge_dst, send_order, send_bounds_e, rank),
            "pull_send_seg_offsets": send_seg_cum[s0:s1 + 1] - send_seg_cum[s0],
            "pull_send_segs": send_segs[send_seg_cum[s0]:send_seg_cum[s1]],
            "pull_recv_round": rows(rounds.edge_round, recv_order, recv_bounds_e, rank),
            "pull_recv_kind": rows(transfers.edge_kind, recv_order, recv_bounds_e, rank),
            "pull_recv_block": rows(transfers.edge_block, recv_order, recv_bounds_e, rank),
            "pull_recv_peer": rows(transfers.edge_src, recv_order, recv_bounds_e, rank),
            "pull_recv_seg_offsets": recv_seg_cum[r0:r1 + 1] - recv_seg_cum[r0],
            "pull_recv_segs": recv_segs[recv_seg_cum[r0]:recv_seg_cum[r1]],
            "tile_stage": rows(schedule.tile_stage, tile_order, tile_bounds, rank),
            "tile_q_block": rows(tiles.tile_q_block, tile_order, tile_bounds, rank),
            "tile_kv_block": rows(tiles.tile_kv_block, tile_order, tile_bounds, rank),
        }
        for prefix, (push_edge, push_stage), (by_sender, sender_bounds, by_receiver, receiver_bounds) in (
                ("fwd", (schedule.fwd_push_edge, schedule.fwd_push_stage), fwd),
                ("bwd", (schedule.bwd_push_edge, schedule.bwd_push_stage), bwd)):
            arrays[f"{prefix}_push_send_stage"] = rows(push_stage, by_sender, sender_bounds, rank)
            arrays[f"{prefix}_push_send_pull"] = recv_row[rows(push_edge, by_sender, sender_bounds, rank)]
            arrays[f"{prefix}_push_recv_stage"] = rows(push_stage, by_receiver, receiver_bounds, rank)
            arrays[f"{prefix}_push_recv_pull"] = send_row[rows(push_edge, by_receiver, receiver_bounds, rank)]
        rank_arrays.append(arrays)
    global_arrays = {"seq_lengths": sharding.batch.lengths, "seg_block": sharding.seg_block,
                     "seg_seq": sharding.seg_seq, "seg_start": sharding.seg_start, "seg_end": sharding.seg_end}
    return assemble(header_fields, global_arrays, rank_arrays)

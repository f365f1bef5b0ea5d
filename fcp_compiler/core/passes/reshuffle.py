"""Pass 7: the all-to-all maps between the user layout and the plan layout."""

from __future__ import annotations

import numpy as np

from fcp_compiler.algorithms.keys import lexsort_ints
from fcp_compiler.algorithms.ranges import user_layout_bounds
from fcp_compiler.core.ir import Reshuffle, Schedule


def plan_layout(block_rank: np.ndarray, seg_block: np.ndarray, seg_tokens: np.ndarray,
                num_ranks: int) -> tuple[np.ndarray, np.ndarray]:
    """Rank and local offset of every segment in the plan layout: a rank's blocks by id, segments in order."""
    seg_rank = block_rank[seg_block]
    order = lexsort_ints((np.arange(seg_block.size), seg_rank))  # segments are already sorted by block
    ordered_tokens = seg_tokens[order]
    cumulative = np.cumsum(ordered_tokens) - ordered_tokens
    rank_first = np.searchsorted(seg_rank[order], np.arange(num_ranks))
    offset = np.empty(seg_block.size, dtype=np.int64)
    offset[order] = cumulative - np.concatenate((cumulative, [0]))[rank_first][seg_rank[order]]
    return seg_rank, offset


def reshuffle(schedule: Schedule) -> Reshuffle:
    """Cut every segment at the user layout's rank bounds into runs that the two all-to-alls move.

    Forward, Q, K, V go from user rank to plan rank along the runs; O comes back along the same runs reversed.
    Runs that continue one another on both sides are merged. O(S + N) for S segments.

    Args:
        schedule: carries the block placement.
    Returns:
        the Reshuffle.
    """
    assignment = schedule.rounds.transfers.assignment
    sharding = assignment.tiles.sharding
    num_ranks = assignment.num_ranks
    batch = sharding.batch
    bounds = user_layout_bounds(batch.total_tokens, num_ranks)
    seg_rank, seg_offset = plan_layout(assignment.block_rank, sharding.seg_block, sharding.seg_tokens, num_ranks)
    global_start = batch.seq_offsets[sharding.seg_seq] + sharding.seg_start
    global_end = global_start + sharding.seg_tokens
    first_user = np.searchsorted(bounds, global_start, side="right") - 1
    last_user = np.searchsorted(bounds, global_end - 1, side="right") - 1
    pieces = last_user - first_user + 1
    seg_of_piece = np.repeat(np.arange(global_start.size), pieces)
    piece_first = np.concatenate(([0], np.cumsum(pieces)[:-1]))
    user_rank = first_user[seg_of_piece] + np.arange(seg_of_piece.size) - np.repeat(piece_first, pieces)
    start = np.maximum(global_start[seg_of_piece], bounds[user_rank])
    end = np.minimum(global_end[seg_of_piece], bounds[user_rank + 1])
    keep = end > start
    seg_of_piece, user_rank, start, end = seg_of_piece[keep], user_rank[keep], start[keep], end[keep]
    plan_rank = seg_rank[seg_of_piece]
    plan_offset = seg_offset[seg_of_piece] + start - global_start[seg_of_piece]
    order = lexsort_ints((start, plan_rank, user_rank))
    user_rank, plan_rank, start, end, plan_offset = (a[order] for a in (user_rank, plan_rank, start, end, plan_offset))
    length = end - start
    continues = np.zeros(start.size, dtype=bool)
    continues[1:] = ((user_rank[1:] == user_rank[:-1]) & (plan_rank[1:] == plan_rank[:-1])
                     & (start[1:] == end[:-1]) & (plan_offset[1:] == plan_offset[:-1] + length[:-1]))
    heads = np.flatnonzero(~continues)
    merged_length = np.add.reduceat(length, heads) if heads.size else length
    return Reshuffle(schedule=schedule, run_user_rank=user_rank[heads], run_plan_rank=plan_rank[heads],
                     run_global_start=start[heads], run_length=merged_length,
                     run_user_offset=start[heads] - bounds[user_rank[heads]], run_plan_offset=plan_offset[heads],
                     user_bounds=bounds)

"""Pass 3b: renumber ranks so that as many tokens as possible stay where the user layout has them."""

from __future__ import annotations

import numpy as np

from fcp_compiler.ir import Assignment
from fcp_compiler.passes.reshuffle import user_layout_bounds


def match_ranks(overlap: np.ndarray) -> np.ndarray:
    """A permutation perm with plan rank p becoming rank perm[p], greedily maximising the summed overlap[p, perm[p]].

    Greedy on the entries by decreasing overlap (ties by index), then the unmatched in order: at least half the
    optimum of the assignment problem, O(N^2 log N) on the dense matrix.
    """
    num = overlap.shape[0]
    flat = np.lexsort((np.arange(overlap.size), -overlap.ravel()))
    perm = np.full(num, -1, dtype=np.int64)
    taken = np.zeros(num, dtype=bool)
    for index in flat[overlap.ravel()[flat] > 0].tolist():
        plan_rank, user_rank = divmod(index, num)
        if perm[plan_rank] < 0 and not taken[user_rank]:
            perm[plan_rank] = user_rank
            taken[user_rank] = True
    perm[perm < 0] = np.flatnonzero(~taken)
    return perm


def localize(assignment: Assignment) -> Assignment:
    """Renumber the ranks of a placement (loads, balance and traffic volume are unchanged) so that the tokens a
    rank holds in the plan layout overlap most with those it holds in the user layout: the reshuffle moves less and
    more tiles can run while it is in flight. O(S + N^2 log N) for S segments."""
    sharding = assignment.tiles.sharding
    num_ranks = assignment.num_ranks
    bounds = user_layout_bounds(sharding.batch.total_tokens, num_ranks)
    start = sharding.batch.seq_offsets[sharding.seg_seq] + sharding.seg_start
    end = start + sharding.seg_tokens
    first = np.searchsorted(bounds, start, side="right") - 1
    last = np.searchsorted(bounds, end - 1, side="right") - 1
    pieces = last - first + 1
    seg = np.repeat(np.arange(start.size), pieces)
    user = first[seg] + np.arange(seg.size) - np.repeat(np.concatenate(([0], np.cumsum(pieces)[:-1])), pieces)
    tokens = np.minimum(end[seg], bounds[user + 1]) - np.maximum(start[seg], bounds[user])
    plan = assignment.block_rank[sharding.seg_block[seg]]
    overlap = np.bincount(plan * num_ranks + user, weights=np.maximum(tokens, 0),
                          minlength=num_ranks * num_ranks).reshape(num_ranks, num_ranks)
    perm = match_ranks(overlap)
    return Assignment(tiles=assignment.tiles, num_ranks=num_ranks, token_cap=assignment.token_cap,
                      block_rank=perm[assignment.block_rank], tile_rank=perm[assignment.tile_rank])

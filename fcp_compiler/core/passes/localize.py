"""Pass 3b: renumber ranks: in the user layout so that tokens stay where it has them, in the plan layout so that
the heaviest traffic stays inside a node."""

from __future__ import annotations

import numpy as np

from fcp_compiler.algorithms.keys import lexsort_ints, sorted_unique
from fcp_compiler.algorithms.node_groups import group_into_nodes
from fcp_compiler.algorithms.ranges import expand_ranges, user_layout_bounds
from fcp_compiler.core.ir import Assignment, Transfers


def match_ranks(plan_rank: np.ndarray, user_rank: np.ndarray, overlap: np.ndarray, num_ranks: int) -> np.ndarray:
    """A permutation perm with plan rank p becoming rank perm[p], greedily maximising the summed overlap.

    The overlap is sparse: entry i says plan rank plan_rank[i] and user rank user_rank[i] share overlap[i] > 0
    tokens (pairs unique). Greedy on the entries by decreasing overlap (ties by plan rank, then user rank), then the
    unmatched in order: at least half the optimum of the assignment problem, O(E log E + N) for E entries.
    """
    perm = np.full(num_ranks, -1, dtype=np.int64)
    taken = np.zeros(num_ranks, dtype=bool)
    order = np.lexsort((user_rank, plan_rank, -overlap))
    for plan, user in zip(plan_rank[order].tolist(), user_rank[order].tolist()):
        if perm[plan] < 0 and not taken[user]:
            perm[plan] = user
            taken[user] = True
    perm[perm < 0] = np.flatnonzero(~taken)
    return perm


def localize(assignment: Assignment) -> Assignment:
    """Renumber the ranks of a placement (loads, balance and traffic volume are unchanged) so that the tokens a
    rank holds in the plan layout overlap most with those it holds in the user layout: the reshuffle moves less and
    more tiles can run while it is in flight. O(S log S + N) for S segments."""
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
    shared = tokens > 0
    key, inverse = sorted_unique(plan[shared] * num_ranks + user[shared], return_inverse=True)
    overlap = np.bincount(inverse, weights=tokens[shared], minlength=key.size)
    perm = match_ranks(key // num_ranks, key % num_ranks, overlap, num_ranks)
    return Assignment(tiles=assignment.tiles, num_ranks=num_ranks, token_cap=assignment.token_cap,
                      block_rank=perm[assignment.block_rank], tile_rank=perm[assignment.tile_rank])


def group_nodes(transfers: Transfers) -> Transfers:
    """Renumber the ranks of a placement (loads, balance and traffic volume are unchanged) so that ranks that
    exchange the most data share a node, where it moves over NVLink rather than the NIC: the blocks of one long
    sequence, and the ranks that read them, end up together where a node can hold them. For the plan layout,
    where no rank's tokens need to stay where the user layout has them. Returns the pulls of the renumbered
    placement, the same as plan_transfers would list them. O(E log E + N) for E pulls."""
    assignment = transfers.assignment
    return renumber(transfers, group_into_nodes(transfers.edge_src, transfers.edge_dst,
                                                transfers.edge_bytes.astype(np.float64), assignment.num_ranks,
                                                assignment.tiles.profile.gpus_per_node))


def renumber(transfers: Transfers, perm: np.ndarray) -> Transfers:
    """The pulls (and placement) with rank r renamed perm[r], in plan_transfers' order. O(E log E)."""
    assignment = transfers.assignment
    assert transfers.num_relayed == 0, "renumber the pulls before relays are chosen"
    renumbered = Assignment(tiles=assignment.tiles, num_ranks=assignment.num_ranks, token_cap=assignment.token_cap,
                            block_rank=perm[assignment.block_rank], tile_rank=perm[assignment.tile_rank])
    # plan_transfers sorts by (kind, block, receiver); renumbering changes only the receiver order within a block.
    dst = perm[transfers.edge_dst]
    order = lexsort_ints((dst, transfers.edge_block, transfers.edge_kind))
    counts = np.diff(transfers.edge_seg_offsets)[order]
    starts = transfers.edge_seg_offsets[:-1][order]
    positions = expand_ranges(starts, counts)
    return Transfers(assignment=renumbered, edge_kind=transfers.edge_kind[order],
                     edge_block=transfers.edge_block[order], edge_src=perm[transfers.edge_src][order],
                     edge_dst=dst[order], edge_parent=transfers.edge_parent[order],
                     edge_seg_offsets=np.concatenate(([0], np.cumsum(counts))).astype(np.int64),
                     edge_segs=transfers.edge_segs[positions])

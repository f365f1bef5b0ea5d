"""Pass 4: the pull edges every rank needs, one per (remote block, receiving rank, kind)."""

from __future__ import annotations

import numpy as np

from fcp_compiler.algorithms.dense_zigzag import dense_zigzag_home_needs, dense_zigzag_pull_needs
from fcp_compiler.algorithms.keys import lexsort_ints, unique_keys
from fcp_compiler.algorithms.ranges import expand_ranges

from fcp_compiler.core.ir import Assignment, TransferKind, Transfers


def _edges_from_segment_needs(seg_needed: np.ndarray, rank_needing: np.ndarray, seg_block: np.ndarray,
                              num_segments: int, num_ranks: int) -> tuple[np.ndarray, ...]:
    """Deduplicate (segment, rank) needs into edges (block, rank) with the sorted segments each carries."""
    key = unique_keys(rank_needing * num_segments + seg_needed, num_ranks * num_segments)
    ranks, segs = key // num_segments, key % num_segments
    blocks = seg_block[segs]
    order = lexsort_ints((segs, ranks, blocks))
    ranks, segs, blocks = ranks[order], segs[order], blocks[order]
    new_edge = np.ones(segs.size, dtype=bool)
    new_edge[1:] = (blocks[1:] != blocks[:-1]) | (ranks[1:] != ranks[:-1])
    starts = np.flatnonzero(new_edge)
    offsets = np.append(starts, segs.size).astype(np.int64)
    return blocks[starts], ranks[starts], offsets, segs


def _whole_block_transfers(assignment: Assignment) -> Transfers:
    """Pulls of whole blocks, for a tile set without segment pairs: each remote block a rank's tiles read (K, V)
    or run for (Q), once, with no segment list (it carries every segment of the block)."""
    tiles = assignment.tiles
    num_ranks, num_blocks = assignment.num_ranks, tiles.sharding.num_blocks
    owner = assignment.block_rank
    found = []
    for kind, block in ((TransferKind.KV, tiles.tile_kv_block), (TransferKind.Q, tiles.tile_q_block)):
        remote = owner[block] != assignment.tile_rank
        key = unique_keys(block[remote] * num_ranks + assignment.tile_rank[remote], num_blocks * num_ranks)
        found.append((np.full(key.size, kind, dtype=np.int64), key // num_ranks, key % num_ranks))
    kinds, blocks, receivers = (np.concatenate(column) for column in zip(*found))
    return Transfers(assignment=assignment, edge_kind=kinds, edge_block=blocks, edge_src=owner[blocks],
                     edge_dst=receivers, edge_parent=np.full(blocks.size, -1, dtype=np.int64),
                     edge_seg_offsets=np.zeros(blocks.size + 1, dtype=np.int64), edge_segs=np.zeros(0, dtype=np.int64))


def _dense_needs(assignment: Assignment) -> tuple[np.ndarray, ...]:
    """(kv_seg, kv_rank, q_seg, q_rank): the remote segments the tiles of dense zig-zag sequences read, which list
    no pairs. In closed form: from the block owners where every tile of a sequence runs on its query block's owner,
    per tile in the (few) sequences with a tile offloaded elsewhere."""
    tiles, owner, num_ranks = assignment.tiles, assignment.block_rank, assignment.num_ranks
    dense, first_seg_of = tiles.dense, tiles.sharding.block_seg_offsets[:-1]
    tiles_per_seq = dense.num_blocks * dense.num_blocks
    offloaded = np.zeros(dense.num_blocks.size, dtype=bool)
    if offloaded.size:
        away = np.flatnonzero(assignment.tile_rank != owner[tiles.tile_q_block])
        seq_of_away = np.searchsorted(dense.tile_offset, away, side="right") - 1
        in_dense = (seq_of_away >= 0) & (away < (dense.tile_offset + tiles_per_seq)[np.maximum(seq_of_away, 0)])
        offloaded[seq_of_away[in_dense]] = True
    home_seg, home_rank = dense_zigzag_home_needs(dense.first_block[~offloaded], dense.num_blocks[~offloaded], owner,
                                                  first_seg_of, num_ranks)
    each = expand_ranges(dense.tile_offset[offloaded], tiles_per_seq[offloaded])
    kv_seg, kv_rank, q_seg, q_rank = dense_zigzag_pull_needs(
        tiles.tile_q_block[each], tiles.tile_kv_block[each], assignment.tile_rank[each], owner, first_seg_of,
        num_ranks)
    return np.concatenate((home_seg, kv_seg)), np.concatenate((home_rank, kv_rank)), q_seg, q_rank


def plan_transfers(assignment: Assignment) -> Transfers:
    """List the pulls: the K, V of each remote block a rank's tiles read, and the Q of each query block whose tiles
    run away from its owner.

    A rank pulls a block once however many of its tiles use it, and only the segments those tiles read. Edges are
    sorted by (kind, block, receiver). O(P log P) for P listed segment pairs; the tiles of dense zig-zag sequences
    in closed form (:mod:`~fcp_compiler.algorithms.dense_zigzag`): from the block owners, or per tile in a sequence
    with a tile run away from its query block's owner.

    Args:
        assignment: block owners and tile ranks.
    Returns:
        the Transfers.
    """
    tiles = assignment.tiles
    if not tiles.has_pairs:
        return _whole_block_transfers(assignment)
    sharding = tiles.sharding
    seg_block = sharding.seg_block
    num_segments, num_ranks = sharding.num_segments, assignment.num_ranks
    pair_rank = assignment.tile_rank[tiles.listed_pair_tile]
    seg_owner = assignment.block_rank[seg_block]
    remote_kv = seg_owner[tiles.listed_pair_kv_seg] != pair_rank
    remote_q = seg_owner[tiles.listed_pair_q_seg] != pair_rank
    kv_seg, kv_rank, q_seg, q_rank = _dense_needs(assignment)
    kv = _edges_from_segment_needs(np.concatenate((tiles.listed_pair_kv_seg[remote_kv], kv_seg)),
                                   np.concatenate((pair_rank[remote_kv], kv_rank)), seg_block, num_segments, num_ranks)
    q = _edges_from_segment_needs(np.concatenate((tiles.listed_pair_q_seg[remote_q], q_seg)),
                                  np.concatenate((pair_rank[remote_q], q_rank)), seg_block, num_segments, num_ranks)
    kinds = np.concatenate((np.full(kv[0].size, TransferKind.KV), np.full(q[0].size, TransferKind.Q)))
    blocks = np.concatenate((kv[0], q[0]))
    return Transfers(assignment=assignment, edge_kind=kinds.astype(np.int64), edge_block=blocks,
                     edge_src=assignment.block_rank[blocks], edge_dst=np.concatenate((kv[1], q[1])),
                     edge_parent=np.full(blocks.size, -1, dtype=np.int64),
                     edge_seg_offsets=np.concatenate((kv[2][:-1], kv[2][-1] + q[2])),
                     edge_segs=np.concatenate((kv[3], q[3])))

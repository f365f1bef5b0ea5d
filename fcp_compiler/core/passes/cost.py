"""Pass 2: enumerate tiles and model their cost."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from fcp_compiler.algorithms.chunk_pairs import chunk_pair_sums
from fcp_compiler.algorithms.dense_zigzag import dense_zigzag_sequences
from fcp_compiler.algorithms.keys import lexsort_ints, unique_keys
from fcp_compiler.algorithms.limits import MAX_SEGMENT_PAIRS, segment_pairs
from fcp_compiler.algorithms.ranges import expand_ranges
from fcp_compiler.algorithms.visibility import visible_pairs
from fcp_compiler.errors import InfeasibleError
from fcp_compiler.core.ir import AttentionShape, DenseTiles, HardwareProfile, MaskKind, Sharding, TileSet


# Compiling holds about 120 bytes per (query segment, key segment) pair at its peak: past MAX_SEGMENT_PAIRS
# (algorithms/limits.py, counted as the validator counts them) the plan is refused rather than left to exhaust
# memory. Only layouts that cut every sequence N ways (ring at hundreds of GPUs on batches of thousands of
# sequences) come near it; FCP's blocks stay far below.
# Past this many segment pairs the ring baseline is costed in closed form per sequence (ring_cost), without a list
# of segment pairs: a zig-zag ring cuts every sequence into 2N chunks, hundreds of millions of pairs at 256 GPUs.
RING_CLOSED_FORM_PAIRS = 4_000_000


def count_segment_pairs(sharding: Sharding) -> int:
    """(query segment, key segment) pairs of the same sequence, ordered, as the validator counts them
    (:func:`fcp_compiler.algorithms.limits.segment_pairs`): cost lists the visible ones among them."""
    return segment_pairs(sharding.seg_seq, sharding.batch.num_sequences)


def ring_in_closed_form(sharding: Sharding) -> bool:
    """Whether the ring baseline is costed in closed form (:func:`ring_cost`): past RING_CLOSED_FORM_PAIRS segment
    pairs, for a batch all causal or all full (windows are costed pair by pair)."""
    per_seq = np.bincount(sharding.seg_seq, minlength=sharding.batch.num_sequences).astype(np.int64)
    listed = int(np.where(sharding.batch.seq_causal, per_seq * (per_seq + 1) // 2, per_seq * per_seq).sum())
    return sharding.batch.mask in (MaskKind.CAUSAL, MaskKind.FULL) and listed > RING_CLOSED_FORM_PAIRS


def tile_efficiency(profile: HardwareProfile, tokens: np.ndarray) -> np.ndarray:
    """Fraction of peak a tile of `tokens` (geometric mean of its query and key lengths) reaches.

    Linear in log2(tokens) between the profile's curve points, flat above the last, and proportional to tokens
    below the first (a kernel on a tiny tile is latency bound).
    """
    curve_tokens = np.array([point.tokens for point in profile.efficiency_curve], dtype=np.float64)
    curve_eff = np.array([point.efficiency for point in profile.efficiency_curve], dtype=np.float64)
    tokens = np.maximum(np.asarray(tokens, dtype=np.float64), 1.0)
    interpolated = np.interp(np.log2(tokens), np.log2(curve_tokens), curve_eff)
    return np.where(tokens < curve_tokens[0], curve_eff[0] * tokens / curve_tokens[0], interpolated)


def cost(sharding: Sharding, shape: AttentionShape, profile: HardwareProfile) -> TileSet:
    """List every (query block, key/value block) tile with visible pairs, with its FLOPs and modelled time.

    A segment pair (query segment, key segment of the same sequence) is one kernel call; its forward FLOPs are
    4 * visible_pairs * q_heads * head_dim and its time FLOPs / (peak * efficiency(sqrt(q_len * k_len))). A tile
    sums the segment pairs of one block pair, in the order (sequence, query start, key start). Causal zig-zag
    sequences, whose n blocks make n^2 tiles, are listed in closed form (:mod:`fcp_compiler.algorithms.dense_zigzag`);
    the rest one segment pair at a time. O(sum over sequences of segments^2), vectorised.

    Args:
        sharding: blocks and segments.
        shape: head counts and head size.
        profile: peak and efficiency curve.
    Returns:
        the TileSet, tiles sorted by (q_block, kv_block).
    Raises:
        InfeasibleError: when the layout has more than MAX_SEGMENT_PAIRS segment pairs.
    """
    num_pairs = count_segment_pairs(sharding)
    if num_pairs > MAX_SEGMENT_PAIRS:
        raise InfeasibleError(
            f"the layout cuts the batch into {num_pairs:,} (query, key) segment pairs, over the "
            f"{MAX_SEGMENT_PAIRS:,} a plan may hold (~8 GB to compile, and what the validator enumerates); use a "
            f"larger block size, fewer GPUs or a planner that does not cut every sequence into 2N chunks")
    batch = sharding.batch
    first_block, num_blocks, first_seg = dense_zigzag_sequences(
        sharding.seg_block, sharding.seg_seq, sharding.seg_start, sharding.seg_end, batch.windows == batch.lengths,
        sharding.block_size // 2)
    in_dense = np.zeros(sharding.num_segments, dtype=bool)
    in_dense[expand_ranges(first_seg, 2 * num_blocks)] = True
    generic = _segment_pair_tiles(sharding, shape, profile, skip_queries=in_dense)
    return _with_dense_tiles(sharding, shape, profile, generic, first_block, num_blocks, first_seg)


def _pair_cost(shape: AttentionShape, profile: HardwareProfile, pairs: np.ndarray, q_len: np.ndarray,
               k_len: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(FLOPs, modelled seconds) of segment pairs with `pairs` visible token pairs between q_len and k_len tokens."""
    flops = 4.0 * pairs * shape.q_heads * shape.head_dim
    efficiency = tile_efficiency(profile, np.sqrt(q_len * k_len.astype(np.float64)))
    return flops, flops / (profile.peak_tflops * 1e12 * efficiency)


@dataclass(frozen=True, slots=True)
class _Tiles:
    """Tiles sorted by key (q_block * num_blocks + kv_block) and their segment pairs, grouped by tile in order."""

    key: np.ndarray
    flops: np.ndarray
    seconds: np.ndarray
    pair_tile: np.ndarray
    pair_q_seg: np.ndarray
    pair_kv_seg: np.ndarray
    pair_flops: np.ndarray


def _segment_pair_tiles(sharding: Sharding, shape: AttentionShape, profile: HardwareProfile,
                        skip_queries: np.ndarray) -> _Tiles:
    """Tiles from the segment pairs of every query segment not in skip_queries, enumerated one by one."""
    # Segments of one sequence never overlap, so in start order (causal) a later key segment is never seen; the
    # earlier ones and the query segment itself are counted in closed form, under the sequence's window.
    seg_seq = sharding.seg_seq
    by_seq = lexsort_ints((sharding.seg_start, seg_seq))
    group_count = np.bincount(seg_seq, minlength=sharding.batch.num_sequences)
    group_first = np.concatenate(([0], np.cumsum(group_count)[:-1]))
    sorted_seq = seg_seq[by_seq]
    window = sharding.batch.windows[sorted_seq]
    position = np.arange(by_seq.size) - group_first[sorted_seq]
    pairs_per_seg = np.where(window > 0, position + 1, group_count[sorted_seq])
    pairs_per_seg[skip_queries[by_seq]] = 0
    q_pos = np.repeat(np.arange(by_seq.size), pairs_per_seg)
    pair_first = np.concatenate(([0], np.cumsum(pairs_per_seg)[:-1]))
    k_pos = np.repeat(group_first[sorted_seq], pairs_per_seg) + np.arange(q_pos.size) - np.repeat(pair_first,
                                                                                                    pairs_per_seg)
    start, end = sharding.seg_start[by_seq], sharding.seg_end[by_seq]
    pairs = visible_pairs(start[q_pos], end[q_pos], start[k_pos], end[k_pos], window[q_pos])
    seen = pairs > 0  # under a window, earlier segments past its reach have no tile
    q_pos, k_pos, pairs = q_pos[seen], k_pos[seen], pairs[seen]
    sorted_tokens = sharding.seg_tokens[by_seq]
    flops, seconds = _pair_cost(shape, profile, pairs, sorted_tokens[q_pos], sorted_tokens[k_pos])
    q_seg, k_seg = by_seq[q_pos], by_seq[k_pos]
    num_blocks = sharding.num_blocks
    tile_key, pair_tile = unique_keys(sharding.seg_block[q_seg] * num_blocks + sharding.seg_block[k_seg],
                                      num_blocks * num_blocks, return_inverse=True)
    return _Tiles(key=tile_key, flops=np.bincount(pair_tile, weights=flops, minlength=tile_key.size),
                  seconds=np.bincount(pair_tile, weights=seconds, minlength=tile_key.size), pair_tile=pair_tile,
                  pair_q_seg=q_seg, pair_kv_seg=k_seg, pair_flops=flops)


def _with_dense_tiles(sharding: Sharding, shape: AttentionShape, profile: HardwareProfile, generic: _Tiles,
                      first_block: np.ndarray, num_blocks: np.ndarray, first_seg: np.ndarray) -> TileSet:
    """The TileSet of the generic tiles and those of dense causal zig-zag sequences, in closed form.

    A dense sequence's n^2 tiles are the rows of its own blocks, which no generic tile has: they go in whole, between
    the generic tiles; their segment pairs are not stored (TileSet.dense). Every pair of one is h x h tokens, all
    visible but for a chunk against itself (h (h + 1) / 2); a tile's sums are taken in the order the pair-by-pair
    listing adds them (a diagonal tile: self, whole, self; any other: whole, whole), so the figures are those of the
    generic path to the last bit.
    """
    total_blocks = sharding.num_blocks
    tiles_per_seq = num_blocks * num_blocks
    first_key = first_block * total_blocks
    dense_before = np.concatenate(([0], np.cumsum(tiles_per_seq)))
    offset = np.searchsorted(generic.key, first_key) + dense_before[:-1]
    generic_index = np.arange(generic.key.size) + dense_before[np.searchsorted(first_key, generic.key, side="right")]
    num_tiles = generic.key.size + int(dense_before[-1])
    key, flops, seconds = np.empty(num_tiles, dtype=np.int64), np.empty(num_tiles), np.empty(num_tiles)
    key[generic_index], flops[generic_index], seconds[generic_index] = generic.key, generic.flops, generic.seconds
    half = sharding.block_size // 2
    # [a whole chunk pair, a chunk against itself]
    pair_flops, pair_seconds = _pair_cost(shape, profile, np.array([half * half, half * (half + 1) // 2]),
                                          np.full(2, half, dtype=np.int64), np.full(2, half, dtype=np.int64))
    for block, num, first in zip(first_block.tolist(), num_blocks.tolist(), offset.tolist()):
        rows = np.arange(block, block + num, dtype=np.int64)
        part = slice(first, first + num * num)
        np.add(rows[:, None] * total_blocks, rows[None, :], out=key[part].reshape(num, num))
        diagonal = slice(first, first + num * num, num + 1)
        flops[part], seconds[part] = pair_flops[0] + pair_flops[0], pair_seconds[0] + pair_seconds[0]
        flops[diagonal] = (pair_flops[1] + pair_flops[0]) + pair_flops[1]
        seconds[diagonal] = (pair_seconds[1] + pair_seconds[0]) + pair_seconds[1]
    return TileSet(sharding=sharding, shape=shape, profile=profile, tile_q_block=key // total_blocks,
                   tile_kv_block=key % total_blocks, tile_flops=flops, tile_seconds=seconds,
                   listed_pair_tile=generic_index[generic.pair_tile], listed_pair_q_seg=generic.pair_q_seg,
                   listed_pair_kv_seg=generic.pair_kv_seg, listed_pair_flops=generic.pair_flops,
                   dense=DenseTiles(first_block=first_block, num_blocks=num_blocks, first_seg=first_seg,
                                    tile_offset=offset, whole_flops=float(pair_flops[0]),
                                    self_flops=float(pair_flops[1])))


def ring_cost(sharding: Sharding, block_rank: np.ndarray, num_ranks: int, shape: AttentionShape,
              profile: HardwareProfile) -> TileSet:
    """The ring baseline's tiles in closed form per sequence: no list of segment pairs (the TileSet's pair arrays
    are empty; its tiles then read whole blocks, as a ring step moves a whole shard).

    In a zig-zag ring every sequence has the same 2N chunk positions and rank r holds chunks r and 2N-1-r of each
    (:func:`~fcp_compiler.core.baselines.ring`), so tile (q rank i, kv rank j) sums, over the sequences, the visible
    pairs between those chunks (:func:`chunk_pair_sums`: one matrix product). Its time charges each sequence's pairs
    at the efficiency of its chunk size, max(L / 2N, 1) (the pair path uses each segment pair's own sizes, which
    differ from it by at most a token). FLOPs are exact. O(S N + N^2 S) in BLAS for S sequences. Only for a batch
    whose sequences are all causal or all full (:func:`ring_in_closed_form` says when).

    Args:
        sharding: the ring's blocks (one per rank that holds tokens) and segments.
        block_rank: the rank of each block.
        num_ranks: N.
        shape, profile: as for :func:`cost`.
    Returns:
        the TileSet, tiles sorted by (q_block, kv_block), pair arrays empty.
    """
    lengths = sharding.batch.lengths
    num_chunks = 2 * num_ranks
    rank = block_rank[sharding.seg_block]
    first_half = sharding.seg_start < lengths[sharding.seg_seq] // 2
    chunk = np.where(first_half, rank, num_chunks - 1 - rank)
    chunk_tokens = np.zeros((lengths.size, num_chunks))
    np.add.at(chunk_tokens, (sharding.seg_seq, chunk), sharding.seg_tokens)
    chunk_size = np.maximum(lengths / num_chunks, 1.0)
    per_pair = 4.0 * shape.q_heads * shape.head_dim
    assert sharding.batch.mask in (MaskKind.CAUSAL, MaskKind.FULL)
    causal = sharding.batch.mask is MaskKind.CAUSAL
    by_rank = []
    for weights in (np.ones(lengths.size), 1.0 / tile_efficiency(profile, chunk_size)):
        sums = chunk_pair_sums(chunk_tokens, weights, causal)
        rows = sums[:num_ranks] + sums[::-1][:num_ranks]  # query chunks r and 2N-1-r of rank r
        by_rank.append(rows[:, :num_ranks] + rows[:, ::-1][:, :num_ranks])  # key chunks likewise
    pairs, weighted = by_rank
    block_of_rank = np.full(num_ranks, -1, dtype=np.int64)
    block_of_rank[block_rank] = np.arange(block_rank.size)
    q_rank, kv_rank = np.nonzero(pairs > 0)
    q_block, kv_block = block_of_rank[q_rank], block_of_rank[kv_rank]
    order = lexsort_ints((kv_block, q_block))
    empty = np.zeros(0, dtype=np.int64)
    return TileSet(sharding=sharding, shape=shape, profile=profile, tile_q_block=q_block[order],
                   tile_kv_block=kv_block[order], tile_flops=per_pair * pairs[q_rank, kv_rank][order],
                   tile_seconds=per_pair * weighted[q_rank, kv_rank][order] / (profile.peak_tflops * 1e12),
                   listed_pair_tile=empty, listed_pair_q_seg=empty, listed_pair_kv_seg=empty,
                   listed_pair_flops=np.zeros(0))

"""The block pairs of causal zig-zag sequences, in closed form: every block of such a sequence sees every other.

A sequence cut into n zig-zag blocks (block i holds chunks i and 2n-1-i of h tokens, as the shard pass cuts them)
under a causal mask makes all n^2 block pairs tiles, each with the same few segment pairs: query chunk i sees key
chunks 0..i, query chunk 2n-1-i every first chunk and the second chunks 2n-1-j for j >= i. Enumerating those
pairs one segment pair at a time and sorting them into tiles is what made 64-token blocks slow; here they come out
in tile order, with their kinds, in a few vector passes.
"""

from __future__ import annotations

import numpy as np

from fcp_compiler.algorithms.keys import stable_argsort, unique_keys
from fcp_compiler.algorithms.ranges import expand_ranges

# Segment pair kinds inside a tile (i, j): in the order the pairs of a tile are listed (query chunk, then key chunk
# by position), the first chunks (i, j), the second query chunk with the first key chunk, the second chunks.
FIRST_FIRST, SECOND_FIRST, SECOND_SECOND = 0, 1, 2


def dense_zigzag_sequences(seg_block: np.ndarray, seg_seq: np.ndarray, seg_start: np.ndarray, seg_end: np.ndarray,
                           causal: np.ndarray, half: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The sequences whose blocks are exact zig-zag pairs under a causal mask, checked segment by segment.

    A sequence qualifies when some n >= 1 consecutive blocks f..f+n-1 each hold exactly two segments of it,
    [i h, (i+1) h) then [(2n-1-i) h, (2n-i) h) for block f+i, and its mask is causal (a window as long as the
    sequence). Whatever else it has (a tail) starts at 2 n h, after every chunk, so no chunk sees it. O(segments).

    Args:
        seg_block, seg_seq, seg_start, seg_end: the segment table, sorted by block (two segments of a block in
            start order).
        causal: bool per sequence, a causal mask.
        half: h, the chunk size (half a block).
    Returns:
        (first block, blocks n, first segment) of each such sequence, int64, in block order; segment first + 2 i
        is chunk i and first + 2 i + 1 chunk 2n-1-i.
    """
    empty = np.zeros(0, dtype=np.int64)
    if seg_block.size < 2:
        return empty, empty, empty
    num_blocks = int(seg_block[-1]) + 1
    counts = np.bincount(seg_block, minlength=num_blocks)
    first_seg = np.concatenate(([0], np.cumsum(counts)[:-1]))
    block = np.flatnonzero(counts == 2)
    low, high = first_seg[block], first_seg[block] + 1
    seq = seg_seq[low]
    pair = ((seg_seq[high] == seq) & (seg_end[low] - seg_start[low] == half) & (seg_end[high] - seg_start[high] == half)
            & causal[seq])
    block, low, high, seq = block[pair], low[pair], high[pair], seq[pair]
    if block.size == 0:
        return empty, empty, empty
    num_sequences = causal.size
    num = np.bincount(seq, minlength=num_sequences)
    first = np.full(num_sequences, num_blocks, dtype=np.int64)
    np.minimum.at(first, seq, block)
    position = block - first[seq]
    wrong = ((seg_start[low] != position * half) | (seg_start[high] != (2 * num[seq] - 1 - position) * half)
             | (position >= num[seq]))
    bad = np.bincount(seq[wrong], minlength=num_sequences) > 0
    chosen = np.flatnonzero((num > 0) & ~bad)
    order = stable_argsort(first[chosen])
    chosen = chosen[order]
    return first[chosen], num[chosen].astype(np.int64), first_seg[first[chosen]].astype(np.int64)


def _by_offset(num: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Per offset t = p - 2i of pair p in row i (t in [-2(n-1), 2n]): the kind, the key block's distance j - i, and
    whether the pair is a chunk against itself. Row i of a sequence's pair matrix reads these at t = p - 2i."""
    t = np.arange(-2 * (num - 1), 2 * num + 1, dtype=np.int64)
    kind = np.where(t < 0, t % 2, np.where(t <= 2, t, 1 + (t - 1) % 2))
    step = (t - (t >= 2)) // 2
    return kind, step, (t == 0) | (t == 2)


def _rows(values: np.ndarray, num: int) -> np.ndarray:
    """The n x (2n + 1) view whose row i is values[2(n - 1 - i) : 2(n - 1 - i) + 2n + 1] (no copy)."""
    stride = values.strides[0]
    return np.lib.stride_tricks.as_strided(values[2 * (num - 1):], shape=(num, 2 * num + 1),
                                           strides=(-2 * stride, stride), writeable=False)


def num_dense_pairs(num_blocks: np.ndarray) -> int:
    """Segment pairs of dense zig-zag sequences of these block counts: n (2n + 1) each."""
    return int((num_blocks * (2 * num_blocks + 1)).sum())


def dense_zigzag_pairs(first_seg: np.ndarray, num_blocks: np.ndarray, tile_offset: np.ndarray, head: int = 0):
    """Every segment pair of dense zig-zag sequences (:func:`dense_zigzag_sequences`), grouped by tile in tile
    order: sequence m's n^2 tiles (i, j), row by row, are tiles tile_offset[m] + i n + j.

    Tile (i, j) lists FIRST_FIRST when j <= i, SECOND_FIRST always, SECOND_SECOND when j >= i (query chunk i sees key
    chunks up to itself, chunk 2n-1-i every first chunk and second chunks from its own on): row i holds 2n + 1
    pairs, and pair p of it depends on p - 2i alone, so each sequence's pairs are a few broadcast writes over one
    strided view. O(sum of n^2).

    Args:
        first_seg, num_blocks: as :func:`dense_zigzag_sequences` returns them.
        tile_offset: int64, the index of each sequence's first tile.
        head: rows left unwritten before the pairs, for a caller that lists other pairs first (the arrays hold
            tens of millions of pairs at small blocks: joined after the fact, each would be copied whole).
    Returns:
        (pair_tile, pair_q_seg, pair_kv_seg) int64 [head + P] and pair_self bool [head + P] (a chunk against
        itself), the pairs from row `head` on.
    """
    return dense_zigzag_rows([(seg0, num, offset, 0, num) for seg0, num, offset in
                              zip(first_seg.tolist(), num_blocks.tolist(), tile_offset.tolist())], head)


def dense_zigzag_rows(spans: list[tuple[int, int, int, int, int]], head: int = 0):
    """The segment pairs of some rows of dense zig-zag sequences, in :func:`dense_zigzag_pairs`' order: each span
    (first segment, blocks n, first tile, first row, end row) lists rows first row .. end row - 1 of one sequence
    (all its rows: 0, n), the spans one after another. What a caller reads a part at a time (a sequence of 2,048
    blocks has 8.4 million pairs) is cut into spans of rows. Returns the arrays :func:`dense_zigzag_pairs` does,
    `head` rows unwritten before the pairs."""
    num_pairs = head + sum((high - low) * (2 * num + 1) for _, num, _, low, high in spans)
    pair_tile, pair_q_seg, pair_kv_seg = (np.empty(num_pairs, dtype=np.int64) for _ in range(3))
    pair_self = np.empty(num_pairs, dtype=bool)
    first = head
    for seg0, num, offset, low, high in spans:
        kind, step, itself = _by_offset(num)
        shape = (high - low, 2 * num + 1)
        row = np.arange(low, high, dtype=np.int64)[:, None]
        part = slice(first, first + shape[0] * shape[1])
        np.add(_rows(step, num)[low:high], offset + row * (num + 1), out=pair_tile[part].reshape(shape))
        np.add(_rows((kind != FIRST_FIRST).astype(np.int64), num)[low:high], seg0 + 2 * row,
               out=pair_q_seg[part].reshape(shape))
        np.add(_rows(2 * step + (kind == SECOND_SECOND), num)[low:high], seg0 + 2 * row,
               out=pair_kv_seg[part].reshape(shape))
        pair_self[part].reshape(shape)[...] = _rows(itself, num)[low:high]
        first = part.stop
    return pair_tile, pair_q_seg, pair_kv_seg, pair_self


def dense_row_spans(first_seg: np.ndarray, num_blocks: np.ndarray, tile_offset: np.ndarray, most: int):
    """The rows of dense zig-zag sequences in parts of about `most` segment pairs (at least one row each), in order:
    each part a list of :func:`dense_zigzag_rows` spans, whole short sequences together and a long one's rows over
    several parts. Yields the parts."""
    spans, size = [], 0
    for seg0, num, offset in zip(first_seg.tolist(), num_blocks.tolist(), tile_offset.tolist()):
        per_row, low = 2 * num + 1, 0
        while low < num:
            if spans and size + per_row > most:
                yield spans
                spans, size = [], 0
            high = min(num, low + max(1, (most - size) // per_row))
            spans.append((seg0, num, offset, low, high))
            size += (high - low) * per_row
            low = high
    if spans:
        yield spans


def num_dense_needs(num_blocks: np.ndarray) -> np.ndarray:
    """Per dense zig-zag sequence, the (block, segment) needs :func:`dense_zigzag_needs` lists: sum over its n
    blocks i of 2n - 2 - i."""
    return num_blocks * (2 * num_blocks - 2) - num_blocks * (num_blocks - 1) // 2


def dense_zigzag_needs(first_block: np.ndarray, num_blocks: np.ndarray, first_seg: np.ndarray,
                       out: tuple[np.ndarray, np.ndarray] | None = None,
                       out_offset: np.ndarray | None = None) -> tuple[np.ndarray, np.ndarray]:
    """(block, segment of another block) pairs that dense zig-zag sequences' query blocks read, sorted.

    Block i of n reads chunk j of every block j < i (its chunk i sees chunks up to itself; chunk 2n-1-i sees no
    second chunk before its own) and both chunks of every block j > i: 2n - 2 - i segments, the first i of them
    every other segment, the rest one run. O(sum of n^2).

    Args:
        first_block, num_blocks, first_seg: as :func:`dense_zigzag_sequences` returns them.
        out, out_offset: arrays (need_block, need_seg) to write into, sequence m's needs from out_offset[m] on
            (default: new arrays, the sequences one after another).
    Returns:
        (need_block, need_seg) int64, sorted by (block, segment) within each sequence.
    """
    sizes = num_dense_needs(num_blocks)
    if out is None:
        total = int(sizes.sum())
        out = (np.empty(total, dtype=np.int64), np.empty(total, dtype=np.int64))
        out_offset = np.cumsum(sizes) - sizes
    need_block, need_seg = out
    for block0, num, seg0, first in zip(first_block.tolist(), num_blocks.tolist(), first_seg.tolist(),
                                        out_offset.tolist()):
        firsts, every = seg0 + 2 * np.arange(num, dtype=np.int64), seg0 + np.arange(2 * num, dtype=np.int64)
        for i in range(num):
            after = first + i + 2 * (num - 1 - i)
            need_block[first:after] = block0 + i
            need_seg[first:first + i] = firsts[:i]
            need_seg[first + i:after] = every[2 * i + 2:]
            first = after
    return need_block, need_seg


def dense_zigzag_pull_needs(q_block: np.ndarray, kv_block: np.ndarray, rank: np.ndarray, owner: np.ndarray,
                            block_first_seg: np.ndarray, num_ranks: int) -> tuple[np.ndarray, ...]:
    """The (segment, rank) needs of tiles of dense zig-zag sequences run where a block they read is remote.

    Tile (i, j) reads chunk j of key block j (first segment) always and chunk 2n-1-j (second) when j >= i; it reads
    the second chunk of query block i always and the first when j <= i (:func:`dense_zigzag_pairs`). So a rank
    pulls K, V of block j's first segment if any of its tiles reads j, its second if one of those has i <= j;
    Q of block i's second segment if it runs any tile of i away from i's owner, its first if one of those has
    j <= i. Block ids of one sequence are consecutive, so i <= j is q_block <= kv_block. O(T) for T tiles (by
    counting; sorting where the (block, rank) space is much larger than T).

    Args:
        q_block, kv_block, rank: int64 [T], the tiles (all of dense sequences) and the ranks running them.
        owner: int64 per block, its rank.
        block_first_seg: int64 per block, its first segment (a dense block's second is the next one).
        num_ranks: N.
    Returns:
        (kv_seg, kv_rank, q_seg, q_rank), int64, unique (segment, rank) needs of each kind.
    """
    space = owner.size * num_ranks
    out = []
    for needed, other in ((kv_block, q_block), (q_block, kv_block)):
        remote = owner[needed] != rank
        keys, inverse = unique_keys(needed[remote] * num_ranks + rank[remote], space, return_inverse=True)
        least_other = np.full(keys.size, np.iinfo(np.int64).max, dtype=np.int64)
        np.minimum.at(least_other, inverse, other[remote])
        block, receiver = keys // num_ranks, keys % num_ranks
        both = least_other <= block
        out.append((block, receiver, both))
    (kv_blocks, kv_ranks, kv_both), (q_blocks, q_ranks, q_both) = out
    # K, V: the first segment always, the second where both; Q: the second always, the first where both.
    kv_seg = np.concatenate((block_first_seg[kv_blocks], block_first_seg[kv_blocks[kv_both]] + 1))
    q_seg = np.concatenate((block_first_seg[q_blocks] + 1, block_first_seg[q_blocks[q_both]]))
    return kv_seg, np.concatenate((kv_ranks, kv_ranks[kv_both])), q_seg, np.concatenate((q_ranks, q_ranks[q_both]))


def dense_zigzag_home_needs(first_block: np.ndarray, num_blocks: np.ndarray, owner: np.ndarray,
                            block_first_seg: np.ndarray, num_ranks: int) -> tuple[np.ndarray, np.ndarray]:
    """The K, V (segment, rank) needs of dense zig-zag sequences' tiles run by their query block's owner, from the
    block owners alone.

    A rank running every tile of the query blocks it owns reads all of a sequence's blocks it holds any block of:
    :func:`dense_zigzag_pull_needs` with tile (i, j) on owner[i], so block j's first segment, and its second from
    the rank's first block of the sequence on. O(sum over sequences of blocks x ranks holding one), not O(tiles).

    Args:
        first_block, num_blocks: as :func:`dense_zigzag_sequences` returns them.
        owner: int64 per block, its rank.
        block_first_seg: int64 per block, its first segment (a dense block's second is the next one).
        num_ranks: N.
    Returns:
        (kv_seg, kv_rank), int64, unique.
    """
    blocks = expand_ranges(first_block, num_blocks)
    seq = np.repeat(np.arange(num_blocks.size, dtype=np.int64), num_blocks)
    # Each (sequence, rank holding one of its blocks) once, with the rank's first block of it.
    keys, inverse = unique_keys(seq * num_ranks + owner[blocks], num_blocks.size * num_ranks, return_inverse=True)
    first_held = np.full(keys.size, np.iinfo(np.int64).max, dtype=np.int64)
    np.minimum.at(first_held, inverse, blocks)
    holder_seq, holder = keys // num_ranks, keys % num_ranks
    read = expand_ranges(first_block[holder_seq], num_blocks[holder_seq])  # every block of the sequence ...
    reader = np.repeat(holder, num_blocks[holder_seq])  # ... by each rank holding one
    from_block = np.repeat(first_held, num_blocks[holder_seq])
    remote = owner[read] != reader
    read, reader, both = read[remote], reader[remote], from_block[remote] <= read[remote]
    return (np.concatenate((block_first_seg[read], block_first_seg[read[both]] + 1)),
            np.concatenate((reader, reader[both])))

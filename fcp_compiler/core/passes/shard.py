"""Pass 1: cut sequences into fixed-size blocks."""

from __future__ import annotations

import numpy as np

from fcp_compiler.algorithms.keys import lexsort_ints
from fcp_compiler.algorithms.packing import best_fit_decreasing
from fcp_compiler.core.ir import Batch, Sharding


def pairs_chunks(batch: Batch) -> np.ndarray:
    """Per sequence, whether zig-zag pairing pays under its mask: always for causal and full ones (as asked), and
    for a sliding window only when it reaches back half the sequence or more. Under a shorter window every block
    past the first window carries the same work already, and pairing a chunk with its mirror would make the block
    read keys at both ends of the sequence. Layer kinds that share one layout pair by the narrowest kind's window
    (`batch.pairing_windows`), so that every kind is cut alike."""
    windows = batch.windows if batch.pairing_windows is None else batch.pairing_windows
    return (windows == 0) | (2 * windows >= batch.lengths)


def shard(batch: Batch, block_size: int, zigzag: bool) -> Sharding:
    """Cut every sequence into blocks of at most `block_size` tokens.

    A sequence of length L >= B gives floor(L / B) full blocks; with `zigzag`, at least two full blocks and a mask
    under which pairing pays (:func:`pairs_chunks`), its first floor(L / B) * B tokens are cut into 2n chunks of
    B / 2 and block i holds chunks i and 2n - 1 - i, so that every block of the sequence carries the same causal
    work. Short sequences and tails are packed whole into as few
    blocks as best-fit decreasing finds, the tails of the longest sequences in blocks of their own where that
    costs no extra block. Full blocks come first in batch order, then packed blocks.

    Args:
        batch: the lengths and mask.
        block_size: B, a positive multiple of 64 (checked at the boundary).
        zigzag: pair chunks as above.
    Returns:
        the Sharding, segments sorted by block and, inside a block, by (sequence, start).
    """
    full = _full_block_segments(batch, block_size, zigzag)
    num_full_blocks = int((batch.lengths // block_size).sum())
    segments = np.concatenate((full, _packed_tail_segments(batch.lengths, block_size, num_full_blocks)), axis=1)
    seg_block, seg_seq, seg_start, seg_end = segments[:, lexsort_ints((segments[2], segments[1], segments[0]))]
    return Sharding(batch=batch, block_size=block_size, zigzag=bool(zigzag), seg_block=seg_block, seg_seq=seg_seq,
                    seg_start=seg_start, seg_end=seg_end)


def _full_block_segments(batch: Batch, block_size: int, zigzag: bool) -> np.ndarray:
    """The segments of every sequence's full blocks, rows block, sequence, start, end ([4, segments] int64), zig-zag
    paired where :func:`shard` says; full block ids count from 0 in batch order."""
    lengths = batch.lengths
    num_full = lengths // block_size
    full_seq = np.repeat(np.arange(lengths.size, dtype=np.int64), num_full)
    full_first_block = np.concatenate(([0], np.cumsum(num_full)[:-1]))
    full_idx = np.arange(full_seq.size, dtype=np.int64) - np.repeat(full_first_block, num_full)
    num_full_blocks = int(full_seq.size)
    pays = pairs_chunks(batch)
    paired = zigzag & (num_full[full_seq] >= 2) & pays[full_seq] if num_full_blocks else np.zeros(0, dtype=bool)
    half = block_size // 2
    chunks_of_seq = 2 * num_full[full_seq]
    # Unpaired full blocks: one segment [i * B, (i + 1) * B). Paired: [i * h, (i + 1) * h) and its mirror chunk.
    first_start = np.where(paired, full_idx * half, full_idx * block_size)
    first_end = np.where(paired, (full_idx + 1) * half, (full_idx + 1) * block_size)
    mirror_start = (chunks_of_seq - 1 - full_idx) * half
    full_blocks = np.arange(num_full_blocks, dtype=np.int64)
    return np.array([np.concatenate(column) for column in ((full_blocks, full_blocks[paired]),
                                                           (full_seq, full_seq[paired]),
                                                           (first_start, mirror_start[paired]),
                                                           (first_end, mirror_start[paired] + half))],
                    dtype=np.int64).reshape(4, -1)


def _packed_tail_segments(lengths: np.ndarray, block_size: int, num_full_blocks: int) -> np.ndarray:
    """The tails and short sequences packed into blocks numbered from `num_full_blocks`: rows block, sequence,
    start, end ([4, segments] int64; no columns where every length is a multiple of the block)."""
    num_full = lengths // block_size
    tail_start = num_full * block_size
    has_rest = lengths > tail_start
    rest_seq = np.arange(lengths.size, dtype=np.int64)[has_rest]
    if not rest_seq.size:
        return np.zeros((4, 0), dtype=np.int64)
    rest_start = tail_start[has_rest]
    rest_end = lengths[has_rest]
    # A tail reads every full block of its sequence: many pulls for little work. Tails in blocks of their own
    # (filled up with short sequences) keep any one block from reading several long sequences, which the
    # placement needs to balance traffic. The tails of the longest sequences get their own block, as many as
    # fit without costing a block more than plain best-fit decreasing.
    rest_sizes = rest_end - rest_start
    bin_of = best_fit_decreasing(rest_sizes, block_size)
    reads = np.where(rest_start > 0, num_full[rest_seq], 0)  # full blocks each piece's tail reads
    by_reads = np.lexsort((np.arange(reads.size), -reads))
    num_apart = int((reads > 0).sum())
    while num_apart > 1:
        seeded = np.zeros(reads.size, dtype=bool)
        seeded[by_reads[:num_apart]] = True
        tails_apart = best_fit_decreasing(rest_sizes, block_size, seeded=seeded)
        if tails_apart.max() <= bin_of.max():
            bin_of = tails_apart
            break
        num_apart //= 2
    return np.array([num_full_blocks + bin_of, rest_seq, rest_start, rest_end], dtype=np.int64)

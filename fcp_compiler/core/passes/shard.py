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
    read keys at both ends of the sequence."""
    return (batch.windows == 0) | (2 * batch.windows >= batch.lengths)


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
    lengths = batch.lengths
    num_full = lengths // block_size
    seq_ids = np.arange(lengths.size, dtype=np.int64)
    full_seq = np.repeat(seq_ids, num_full)
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
    seg_block = [full_blocks, full_blocks[paired]]
    seg_seq = [full_seq, full_seq[paired]]
    seg_start = [first_start, mirror_start[paired]]
    seg_end = [first_end, mirror_start[paired] + half]

    tail_start = num_full * block_size
    has_rest = lengths > tail_start
    rest_seq = seq_ids[has_rest]
    rest_start = tail_start[has_rest]
    rest_end = lengths[has_rest]
    if rest_seq.size:
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
        seg_block.append(num_full_blocks + bin_of)
        seg_seq.append(rest_seq)
        seg_start.append(rest_start)
        seg_end.append(rest_end)
    seg_block_all = np.concatenate(seg_block)
    seg_seq_all = np.concatenate(seg_seq)
    seg_start_all = np.concatenate(seg_start)
    order = lexsort_ints((seg_start_all, seg_seq_all, seg_block_all))
    return Sharding(batch=batch, block_size=block_size, zigzag=bool(zigzag), seg_block=seg_block_all[order],
                    seg_seq=seg_seq_all[order], seg_start=seg_start_all[order],
                    seg_end=np.concatenate(seg_end)[order])

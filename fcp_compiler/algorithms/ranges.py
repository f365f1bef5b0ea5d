"""Integer ranges laid end to end: the expansion behind every offsets-and-counts (CSR) gather."""

from __future__ import annotations

import numpy as np


def expand_ranges(starts: np.ndarray, lengths: np.ndarray) -> np.ndarray:
    """Concatenate the integer ranges [starts[i], starts[i] + lengths[i]) (token runs to row indices, or the rows
    of chosen items in an offsets array). O(total length)."""
    lengths = np.asarray(lengths, dtype=np.int64)
    offsets = np.repeat(np.asarray(starts, dtype=np.int64) - np.concatenate(([0], np.cumsum(lengths)[:-1])), lengths)
    return offsets + np.arange(int(lengths.sum()))


def offsets(counts) -> np.ndarray:
    """Group bounds (a CSR's offsets, len(counts) + 1 entries, from 0) from group sizes. O(n)."""
    return np.concatenate(([0], np.cumsum(np.asarray(counts, dtype=np.int64)))).astype(np.int64)


def group_sums(values: np.ndarray, ptr: np.ndarray) -> np.ndarray:
    """Sums of values[ptr[i]:ptr[i + 1]] for each i (0 for an empty group): the totals of a CSR's groups. O(n)."""
    sums = np.concatenate(([0], np.cumsum(values, dtype=np.int64)))
    ptr = np.asarray(ptr, dtype=np.int64)
    return sums[ptr[1:]] - sums[ptr[:-1]]


def offsets_within(lengths: np.ndarray, counts: np.ndarray) -> np.ndarray:
    """Each item's start within its group, its group's items laid end to end from 0 (groups of `counts` consecutive
    items): a segment's first row in a message that carries several. O(n)."""
    lengths, counts = np.asarray(lengths, dtype=np.int64), np.asarray(counts, dtype=np.int64)
    before = np.cumsum(lengths) - lengths
    return before - np.repeat(np.append(before, 0)[np.cumsum(counts) - counts], counts)


def user_layout_bounds(total_tokens: int, num_ranks: int) -> np.ndarray:
    """Rank r of the user layout holds global tokens [bounds[r], bounds[r + 1]) = [floor(rT/N), floor((r+1)T/N))."""
    return (np.arange(num_ranks + 1, dtype=np.int64) * total_tokens) // num_ranks

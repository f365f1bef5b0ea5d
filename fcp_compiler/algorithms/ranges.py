"""Integer ranges laid end to end: the expansion behind every offsets-and-counts (CSR) gather."""

from __future__ import annotations

import numpy as np


def expand_ranges(starts: np.ndarray, lengths: np.ndarray) -> np.ndarray:
    """Concatenate the integer ranges [starts[i], starts[i] + lengths[i]) (token runs to row indices, or the rows
    of chosen items in an offsets array). O(total length)."""
    lengths = np.asarray(lengths, dtype=np.int64)
    offsets = np.repeat(np.asarray(starts, dtype=np.int64) - np.concatenate(([0], np.cumsum(lengths)[:-1])), lengths)
    return offsets + np.arange(int(lengths.sum()))


def user_layout_bounds(total_tokens: int, num_ranks: int) -> np.ndarray:
    """Rank r of the user layout holds global tokens [bounds[r], bounds[r + 1]) = [floor(rT/N), floor((r+1)T/N))."""
    return (np.arange(num_ranks + 1, dtype=np.int64) * total_tokens) // num_ranks

"""Sorted unique integer keys, by counting when the key space is small enough (O(n + space), no sort)."""

from __future__ import annotations

import numpy as np

# Counting needs arrays as large as the key space: above this many keys, or when the space dwarfs the keys (a
# sort of n keys is then cheaper than sweeping the space), sort instead.
COUNTING_LIMIT = 1 << 26
SPARSE_FACTOR = 8


def unique_keys(keys: np.ndarray, space: int, return_inverse: bool = False):
    """np.unique for non-negative int keys below `space`: counting when the space is at most COUNTING_LIMIT and
    SPARSE_FACTOR times the number of keys (or 2^20), sorting otherwise.

    Returns the sorted unique keys, and with return_inverse the index of each key among them.
    """
    keys = np.asarray(keys, dtype=np.int64)
    if space > COUNTING_LIMIT or space > max(SPARSE_FACTOR * keys.size, 1 << 20):
        return np.unique(keys, return_inverse=return_inverse)
    present = np.bincount(keys, minlength=space) > 0
    unique = np.flatnonzero(present)
    if not return_inverse:
        return unique
    position = np.cumsum(present) - 1
    return unique, position[keys]

"""Sorted unique integer keys, by counting when the key space is small enough (O(n + space), no sort)."""

from __future__ import annotations

import numpy as np

# Counting needs arrays as large as the key space: above this many keys, or when the space dwarfs the keys (a
# sort of n keys is then cheaper than sweeping the space), sort instead.
COUNTING_LIMIT = 1 << 26
SPARSE_FACTOR = 8
SEARCH_IN_ORDER = 1 << 10  # values from which search_sorted sorts them first


def unique_keys(keys: np.ndarray, space: int, return_inverse: bool = False):
    """np.unique for non-negative int keys below `space`: counting when the space is at most COUNTING_LIMIT and
    SPARSE_FACTOR times the number of keys, sorting otherwise (a sweep of 2^20 counts takes 4 ms; a sort of 20,000
    keys 0.3 ms).

    Returns the sorted unique keys, and with return_inverse the index of each key among them.
    """
    keys = np.asarray(keys, dtype=np.int64)
    if space > COUNTING_LIMIT or space > SPARSE_FACTOR * keys.size:
        return sorted_unique(keys, return_inverse)
    present = np.bincount(keys, minlength=space) > 0
    unique = np.flatnonzero(present)
    if not return_inverse:
        return unique
    position = np.cumsum(present, dtype=np.int32)  # the space is below 2^31: half the pages of int64
    position -= 1
    return unique, position[keys].astype(np.int64)


def stable_argsort(keys: np.ndarray) -> np.ndarray:
    """np.argsort(keys, kind="stable"), the same permutation, for integer keys by one sort of values: each key, less
    the least, shifted above its index, so that ties keep index order. Sorting int64 values runs on SIMD where
    argsort does not: 3-9x faster on 40 thousand to 15 million keys (the compiler's sorts). Keys whose range and
    index need more than 62 bits together, and non-integer keys, are argsorted as they are. O(n log n).

    Args:
        keys: a 1-D array.
    Returns:
        int64 [n], the stable order.
    """
    keys = np.asarray(keys)
    if keys.dtype.kind not in "iub" or keys.size < 2:
        return np.argsort(keys, kind="stable").astype(np.int64, copy=False)
    low, high = int(keys.min()), int(keys.max())
    shift = (keys.size - 1).bit_length()
    if (high - low).bit_length() + shift > 62 or high >= 1 << 63:  # (unsigned keys past int64 too)
        return np.argsort(keys, kind="stable").astype(np.int64, copy=False)
    packed = np.subtract(keys, low, dtype=np.int64)
    packed <<= shift
    packed |= np.arange(keys.size, dtype=np.int64)
    packed.sort()
    packed &= (1 << shift) - 1
    return packed


def run_starts(ordered: np.ndarray) -> np.ndarray:
    """bool per entry of a sorted array: whether it starts a run of equal keys (differs from the one before)."""
    return np.concatenate(([True], ordered[1:] != ordered[:-1])) if ordered.size else np.zeros(0, dtype=bool)


def sorted_unique(keys: np.ndarray, return_inverse: bool = False, return_index: bool = False):
    """np.unique for int keys by one sort (numpy's hash-based unique is several times slower on millions of int64
    keys). Returns the sorted unique keys, with return_index the position of each one's first occurrence, and with
    return_inverse the index of each key among them (in np.unique's order)."""
    keys = np.asarray(keys, dtype=np.int64)
    if not return_inverse and not return_index:
        ordered = np.sort(keys)
        return ordered[run_starts(ordered)]
    order = stable_argsort(keys)
    ordered = keys[order]
    first = run_starts(ordered)
    out = [ordered[first]] + ([order[first]] if return_index else [])
    if return_inverse:
        inverse = np.empty(keys.size, dtype=np.int64)
        inverse[order] = np.cumsum(first) - 1
        out.append(inverse)
    return tuple(out)


def stable_order(keys: np.ndarray, bound: int) -> np.ndarray:
    """np.argsort(keys, kind="stable") for int keys in [0, bound): by one 16-bit radix pass where bound allows
    (numpy sorts 16-bit keys by radix in O(n)), else by :func:`stable_argsort` (two radix passes and the gather
    between them cost 2-6x its one sort of values)."""
    keys = np.asarray(keys)
    if bound <= 1 << 16:
        return np.argsort(keys.astype(np.uint16), kind="stable")
    return stable_argsort(keys)


def lexsort_ints(keys) -> np.ndarray:
    """np.lexsort(keys) for int arrays (the last key primary, ties by position), by one stable sort of a single
    int64 key where the keys' ranges fit in 63 bits together (several times faster than np.lexsort on millions of
    rows), else np.lexsort itself. O(n k) to pack, plus one sort.

    Args:
        keys: int arrays of one length, as np.lexsort takes them.
    Returns:
        int64, the permutation np.lexsort gives.
    """
    keys = [np.asarray(key) for key in keys]
    if not keys or keys[0].size == 0:
        return np.zeros(0 if not keys else keys[0].size, dtype=np.int64)
    packed = pack_columns(keys)
    return np.lexsort(keys) if packed is None else stable_order(*packed)


def lexsort_first(keys) -> int:
    """np.lexsort(keys)[0] without the sort: the position of the least key tuple (the last key primary), the first
    among equal tuples. Each key narrows the positions tied on the keys before it: O(n k) comparisons, where the
    sort of a few thousand candidate actions a step was most of a local search.

    Args:
        keys: arrays of one length (> 0), as np.lexsort takes them (ints or floats without NaN).
    Returns:
        the position.
    """
    keys = [np.asarray(key) for key in keys]
    assert keys and keys[0].size > 0
    tied = None  # positions tied so far, in order (None: every position)
    for key in reversed(keys):
        values = key if tied is None else key[tied]
        least = np.flatnonzero(values == values.min())
        tied = least if tied is None else tied[least]
        if tied.size == 1:
            break
    return int(tied[0])


def pack_columns(columns: list[np.ndarray]) -> tuple[np.ndarray, int] | None:
    """Int columns of one length (at least one row) as one int64 key per row that orders rows as
    np.lexsort(columns) does (the last column primary) and is equal exactly where every column is: each column less
    its least value, side by side, the first lowest. Returns (the keys, a bound above them), or None where the
    columns' ranges need more than 62 bits together. O(n k)."""
    lows = [int(column.min()) for column in columns]
    widths = [(int(column.max()) - low).bit_length() for column, low in zip(columns, lows)]
    if sum(widths) > 62:
        return None
    packed = np.zeros(columns[0].size, dtype=np.int64)
    shift = 0
    for column, low, width in zip(columns, lows, widths):
        packed |= (column.astype(np.int64) - low) << shift
        shift += width
    return packed, 1 << shift


def sorted_unique_counts(keys: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """np.unique(keys, return_counts=True) for int keys by one sort (see :func:`sorted_unique`)."""
    ordered = np.sort(np.asarray(keys, dtype=np.int64))
    first = np.flatnonzero(run_starts(ordered))
    return ordered[first], np.diff(np.append(first, ordered.size))


def search_sorted(ordered: np.ndarray, values, side: str = "left") -> np.ndarray:
    """np.searchsorted(ordered, values, side): the same positions, any shape. From SEARCH_IN_ORDER values on they
    are searched in sorted order (one sort, :func:`stable_argsort` for integers), so each binary search starts where
    the one before ended and stays in cache: random probes into a large array miss it at every step, and sorting
    first was 2-8x faster from a thousand values on, against arrays of a thousand to millions (8x on a million
    against a million). O(n log n + n log m) for n values into m."""
    values = np.asarray(values)
    if values.size < SEARCH_IN_ORDER:
        return np.searchsorted(ordered, values, side=side)
    flat = values.ravel()
    if (flat[1:] >= flat[:-1]).all():  # in order already (ranges, group starts): nothing to sort
        return np.searchsorted(ordered, values, side=side)
    order = stable_argsort(flat)
    found = np.empty(flat.size, dtype=np.intp)
    found[order] = np.searchsorted(ordered, flat[order], side=side)
    return found.reshape(values.shape)


def lookup(keys: np.ndarray, values: np.ndarray, wanted: np.ndarray, missing: int) -> np.ndarray:
    """values at the positions of `wanted` in the sorted `keys`, `missing` where a key is absent (any shape).
    O(len(wanted) log len(keys))."""
    if keys.size == 0:
        return np.full(np.shape(wanted), missing, dtype=np.int64)
    pos = np.minimum(search_sorted(keys, wanted), keys.size - 1)
    return np.where(keys[pos] == wanted, values[pos], missing)

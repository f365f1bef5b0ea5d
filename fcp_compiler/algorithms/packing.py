"""Bin packing of short items into fixed-capacity bins."""

from __future__ import annotations

import bisect

import numpy as np


def best_fit_decreasing(sizes: np.ndarray, capacity: int, seeded: np.ndarray | None = None) -> np.ndarray:
    """Pack items into as few bins of `capacity` as best-fit decreasing finds.

    Objective: minimise the number of bins (NP-hard); BFD uses at most 11/9 OPT + 6/9 bins and, for the many small
    items of a long-tail batch, usually meets the ceil(sum / capacity) lower bound. Ties break by item index, so the
    result is deterministic. O(n log n) plus list insertions.

    Args:
        sizes: positive int array, each <= capacity.
        capacity: bin capacity.
        seeded: optional bool mask of items that each open a bin of their own before the others are packed
            (largest first); the rest are packed best-fit decreasing into those bins and new ones.
    Returns:
        int64 array, the bin index of each item; bins are numbered in order of opening.
    """
    sizes = np.asarray(sizes, dtype=np.int64)
    assert sizes.size == 0 or (sizes.min() >= 1 and sizes.max() <= capacity)
    order = np.lexsort((np.arange(sizes.size), -sizes))
    bin_of = np.empty(sizes.size, dtype=np.int64)
    # Sorted (remaining capacity, bin index) of open bins: best fit is the first with room >= size.
    open_bins: list[tuple[int, int]] = []
    num_bins = 0
    if seeded is not None:
        seeded = np.asarray(seeded, dtype=bool)
        for item_idx in order[seeded[order]].tolist():
            bin_of[item_idx] = num_bins
            if capacity - int(sizes[item_idx]) > 0:
                bisect.insort(open_bins, (capacity - int(sizes[item_idx]), num_bins))
            num_bins += 1
        order = order[~seeded[order]]
    for item_idx in order.tolist():
        size = int(sizes[item_idx])
        pos = bisect.bisect_left(open_bins, (size, -1))
        if pos < len(open_bins):
            remaining, bin_idx = open_bins.pop(pos)
        else:
            remaining, bin_idx = capacity, num_bins
            num_bins += 1
        bin_of[item_idx] = bin_idx
        if remaining - size > 0:
            bisect.insort(open_bins, (remaining - size, bin_idx))
    return bin_of

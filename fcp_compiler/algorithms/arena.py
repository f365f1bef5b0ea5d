"""Buffers placed in one arena: offsets for buffers with lifetimes, none overlapping another live at the same time.

A rank receives its pulls into one arena per kind, so that a range kernel reads them in place: keys that are
consecutive in a sequence and arrive together should be consecutive rows of the arena too.
"""

from __future__ import annotations

import heapq
import math
from collections.abc import Iterator

import numpy as np

# Units an arena may hold at most and be placed as a bitmask (each shift of the mask is a pass over its words: at
# odd sizes, units of one row, a list of free gaps is faster).
MAX_MASK_UNITS = 1 << 12


def place_buffers(rows, first, last, order) -> tuple[np.ndarray, int]:
    """Offsets in one arena for buffers live over stages [first, last].

    Objective: a small arena whose buffers posted in one stage sit side by side, in `order`. Stage by stage, the
    buffers freed before it are released, then its buffers are placed: all of them as one run in the first free gap
    that holds them, else each in the first free gap that holds it, else at the arena's end. With equal sizes this
    is first-fit colouring of an interval graph in order of start, which needs exactly the most buffers ever live
    at once; with unequal sizes the arena may exceed the live peak (fragmentation), never the sum of all buffers.
    :func:`place_arena` does it, O(B log B) to sort and O(B log S) big-integer operations on words of the arena's
    units (S: the largest buffer in units of the sizes' greatest common divisor).

    Args:
        rows: int [B], each buffer's rows (>= 0).
        first, last: int [B], the first and last stage it is live in (first <= last).
        order: int [B], where it goes among the buffers of its stage (lower first; ties by index).
    Returns:
        (offset per buffer (int64 [B]), the arena's rows).
    """
    rows, first, last, order = (np.asarray(a, dtype=np.int64) for a in (rows, first, last, order))
    assert (rows >= 0).all() and (first <= last).all()
    offset = [0] * rows.size
    by_start = np.lexsort((np.arange(rows.size), order, first)).tolist()
    extent = place_arena(by_start, rows.tolist(), first.tolist(), last.tolist(), offset)
    return np.asarray(offset, dtype=np.int64), extent


def place_arena(buffers: list[int], size_of: list[int], first_of: list[int], last_of: list[int],
                offset: list[int]) -> int:
    """:func:`place_buffers` of the buffers `buffers` (indices into the per-buffer lists, in placement order: by
    first stage, then by order within it), written into `offset`; returns the arena's rows.

    The arena is a bitmask of units (the sizes' greatest common divisor), a set bit a unit in use: the first free
    gap that holds n units starts at the lowest bit that begins n clear bits, found with log2(n) shifts of the
    clear mask. The first gap by start and the lowest such bit are the same place, since gaps are maximal runs.
    """
    unit = total = 0
    for buffer in buffers:
        unit = math.gcd(unit, size_of[buffer])
        total += size_of[buffer]
    if unit == 0:  # nothing but empty buffers
        for buffer in buffers:
            offset[buffer] = 0
        return 0
    if total // unit > MAX_MASK_UNITS:
        return _place_by_gaps(buffers, size_of, first_of, last_of, offset)
    clear = extent = 0  # the free units below the arena's end (bits), the arena's units
    freed: dict[int, int] = {}  # last stage -> the units of the buffers live until it
    for stage, group in _stage_groups(buffers, first_of):
        for done in [last for last in freed if last < stage]:
            clear |= freed.pop(done)
        sizes = [size_of[buffer] // unit for buffer in group]
        total = sum(sizes)
        start = _first_fit(clear, total)
        if start is not None:
            clear ^= ((1 << total) - 1) << start
        for buffer, size in zip(group, sizes):
            if start is None:
                at = _first_fit(clear, size)
                if at is None:  # at the arena's end, from the start of the free tail (if any)
                    at = (~clear & ((1 << extent) - 1)).bit_length()
                    clear &= (1 << at) - 1
                    extent = max(extent, at + size)
                else:
                    clear ^= ((1 << size) - 1) << at
            else:
                at, start = start, start + size
            last = last_of[buffer]
            freed[last] = freed.get(last, 0) | ((1 << size) - 1) << at
            offset[buffer] = at * unit
    return extent * unit


def _first_fit(clear: int, size: int) -> int | None:
    """The lowest bit of `clear` that begins `size` set bits (None if none does); for size 0, the lowest set bit."""
    if clear == 0:
        return None
    if size <= 1:
        return (clear & -clear).bit_length() - 1
    have = 1
    while have < size:
        step = min(have, size - have)
        clear &= clear >> step
        have += step
    return (clear & -clear).bit_length() - 1 if clear else None


def _place_by_gaps(buffers: list[int], size_of: list[int], first_of: list[int], last_of: list[int],
                   offset: list[int]) -> int:
    """:func:`place_arena` over a sorted list of free gaps, [start, end) each, and a heap of the live buffers."""
    gaps: list[list[int]] = []
    live: list[tuple[int, int]] = []
    extent = 0
    for stage, group in _stage_groups(buffers, first_of):
        extent = _place_stage(gaps, live, extent, stage, group, size_of, last_of, offset)
    return extent


def _stage_groups(buffers: list[int], first_of: list[int]) -> Iterator[tuple[int, list[int]]]:
    """The runs of `buffers` (in placement order) first live in one stage: (that stage, the run)."""
    count, low = len(buffers), 0
    while low < count:
        stage = first_of[buffers[low]]
        high = low + 1
        while high < count and first_of[buffers[high]] == stage:
            high += 1
        yield stage, buffers[low:high]
        low = high


def _place_stage(gaps: list[list[int]], live: list[tuple[int, int]], extent: int, stage: int, group: list[int],
                 size_of, last_of, offset) -> int:
    """One stage of :func:`_place_by_gaps`: free the buffers last live before `stage`, then place `group` (the
    buffers first live in it, in order) in one gap that holds them all, else each first fit, growing the arena at
    its end. Writes their offsets into `offset` and pushes them on `live` (a heap of (last stage, buffer)).

    Returns:
        the arena's rows after the stage.
    """
    while live and live[0][0] < stage:
        _, done = heapq.heappop(live)
        _release(gaps, int(offset[done]), int(offset[done]) + size_of[done])
    start = _take(gaps, sum(size_of[buffer] for buffer in group))
    for buffer in group:
        size = size_of[buffer]
        if start is None:
            at = _take(gaps, size)
            if at is None:
                at, extent = _take_end(gaps, size, extent)
        else:
            at, start = start, start + size
        offset[buffer] = at
        if size:  # an empty buffer holds no rows to free (freeing it would leave an empty gap in the list)
            heapq.heappush(live, (last_of[buffer], buffer))
    return extent


def _take(gaps: list[list[int]], size: int) -> int | None:
    """The start of `size` rows cut from the front of the first gap that holds them; None if none does."""
    for index, gap in enumerate(gaps):
        if gap[1] - gap[0] >= size:
            start = gap[0]
            gap[0] += size
            if gap[0] == gap[1]:
                del gaps[index]
            return start
    return None


def _take_end(gaps: list[list[int]], size: int, extent: int) -> tuple[int, int]:
    """`size` rows at the arena's end, starting in the free gap that ends there if one does: (start, new extent)."""
    if gaps and gaps[-1][1] == extent:
        start = gaps.pop()[0]
    else:
        start = extent
    return start, start + size


def _release(gaps: list[list[int]], start: int, end: int) -> None:
    """Free [start, end), merged with the gaps it touches (the arena never shrinks: a freed tail is a gap)."""
    index = 0
    while index < len(gaps) and gaps[index][0] < start:
        index += 1
    gaps.insert(index, [start, end])
    if index + 1 < len(gaps) and gaps[index + 1][0] == end:
        gaps[index][1] = gaps.pop(index + 1)[1]
    if index > 0 and gaps[index - 1][1] == start:
        gaps[index - 1][1] = gaps.pop(index)[1]


def max_live(rows, first, last) -> int:
    """The most rows live at once, over stages: a lower bound on any arena (O(B log B))."""
    rows, first, last = (np.asarray(a, dtype=np.int64) for a in (rows, first, last))
    if rows.size == 0:
        return 0
    stages = int(last.max()) + 2
    change = np.bincount(first, weights=rows, minlength=stages) - np.bincount(last + 1, weights=rows,
                                                                               minlength=stages)
    return int(np.cumsum(change).max())

"""Buffers placed in one arena: offsets for buffers with lifetimes, none overlapping another live at the same time.

A rank receives its pulls into one arena per kind, so that a range kernel reads them in place: keys that are
consecutive in a sequence and arrive together should be consecutive rows of the arena too.
"""

from __future__ import annotations

import heapq

import numpy as np


def place_buffers(rows, first, last, order) -> tuple[np.ndarray, int]:
    """Offsets in one arena for buffers live over stages [first, last].

    Objective: a small arena whose buffers posted in one stage sit side by side, in `order`. Stage by stage, the
    buffers freed before it are released, then its buffers are placed: all of them as one run in the first free gap
    that holds them, else each in the first free gap that holds it, else at the arena's end. With equal sizes this
    is first-fit colouring of an interval graph in order of start, which needs exactly the most buffers ever live
    at once; with unequal sizes the arena may exceed the live peak (fragmentation), never the sum of all buffers.
    O(B log B + B G) for B buffers and at most G free gaps.

    Args:
        rows: int [B], each buffer's rows (>= 0).
        first, last: int [B], the first and last stage it is live in (first <= last).
        order: int [B], where it goes among the buffers of its stage (lower first; ties by index).
    Returns:
        (offset per buffer (int64 [B]), the arena's rows).
    """
    rows, first, last, order = (np.asarray(a, dtype=np.int64) for a in (rows, first, last, order))
    assert (rows >= 0).all() and (first <= last).all()
    offset = np.zeros(rows.size, dtype=np.int64)
    gaps: list[list[int]] = []  # free [start, end), sorted by start, never touching each other
    live: list[tuple[int, int]] = []  # (last stage, buffer)
    extent = 0
    by_start = np.lexsort((np.arange(rows.size), order, first))
    bounds = np.flatnonzero(np.diff(first[by_start])) + 1
    size_of, last_of = rows.tolist(), last.tolist()
    for group in np.split(by_start, bounds) if rows.size else []:
        extent = place_stage(gaps, live, extent, int(first[group[0]]), group.tolist(), size_of, last_of, offset)
    return offset, extent


def place_stage(gaps: list[list[int]], live: list[tuple[int, int]], extent: int, stage: int, group: list[int],
                size_of, last_of, offset) -> int:
    """One stage of :func:`place_buffers`: free the buffers last live before `stage`, then place `group` (the
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

"""Buffers placed in one arena: offsets for buffers with lifetimes, none overlapping another live at the same time.

A rank receives its pulls into one arena per kind, so that a range kernel reads them in place: keys that are
consecutive in a sequence and arrive together should be consecutive rows of the arena too.
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass

import numpy as np

# Units an arena may hold at most and be placed as a bitmask (each shift of the mask is a pass over its words: at
# odd sizes, units of one row, a list of free gaps is faster).
MAX_MASK_UNITS = 1 << 12


@dataclass(frozen=True, slots=True, kw_only=True)
class ArenaPlacement:
    """Where buffers sit in their arenas: each buffer's first row (int64 per buffer) and each arena's rows (int64 per
    arena: its extent, the end of its last-placed buffer's rows at most)."""

    offset: np.ndarray
    arena_rows: np.ndarray


def place_buffers(rows, first, last, order) -> ArenaPlacement:
    """Offsets in one arena for buffers live over stages [first, last].

    Objective: a small arena whose buffers posted in one stage sit side by side, in `order`. Stage by stage, the
    buffers freed before it are released, then its buffers are placed: all of them as one run in the first free gap
    that holds them, else each in the first free gap that holds it, else at the arena's end. With equal sizes this
    is first-fit colouring of an interval graph in order of start, which needs exactly the most buffers ever live
    at once; with unequal sizes the arena may exceed the live peak (fragmentation), never the sum of all buffers.
    :func:`place_arenas` does it for one arena.

    Args:
        rows: int [B], each buffer's rows (>= 0).
        first, last: int [B], the first and last stage it is live in (first <= last).
        order: int [B], where it goes among the buffers of its stage (lower first; ties by index).
    Returns:
        the ArenaPlacement (one arena).
    """
    rows, first, last, order = (np.asarray(a, dtype=np.int64) for a in (rows, first, last, order))
    assert (rows >= 0).all() and (first <= last).all()
    return place_arenas(np.zeros(rows.size, dtype=np.int64), rows, first, last, order, 1)


def place_arenas(arena: np.ndarray, rows: np.ndarray, first: np.ndarray, last: np.ndarray, order: np.ndarray,
                 num_arenas: int) -> ArenaPlacement:
    """:func:`place_buffers` of each arena's buffers (`arena`: int64 per buffer, in [0, num_arenas)), all at once:
    hundreds of thousands of pulls at hundreds of ranks.

    Each arena is a bitmask of units (the greatest common divisor of its sizes), a set bit a free unit below its
    end: the first free gap that holds n units starts at the lowest bit that begins n set bits, found with log2(n)
    shifts of the mask (the first gap by start and the lowest such bit are the same place, since gaps are maximal
    runs). The sort, the units and the stage groups are made for every arena in NumPy; one loop a stage group and
    one a buffer placed apart remain. An arena over MAX_MASK_UNITS units keeps a list of free gaps instead.
    O(B log B) to sort and O(B log S) big-integer operations on words of an arena's units (S: its largest buffer in
    units).

    Args:
        arena, rows, first, last, order: int64 [B] each: the buffer's arena and :func:`place_buffers`'s arrays.
        num_arenas: the number of arenas.
    Returns:
        the ArenaPlacement.
    """
    count = arena.size
    by_start = np.lexsort((np.arange(count), order, first, arena))
    sorted_arena, sorted_rows, sorted_first = arena[by_start], rows[by_start], first[by_start]
    bounds = np.searchsorted(sorted_arena, np.arange(num_arenas + 1))
    unit, total = np.zeros(num_arenas, dtype=np.int64), np.zeros(num_arenas, dtype=np.int64)
    held = np.flatnonzero(bounds[1:] > bounds[:-1])
    if held.size:
        unit[held] = np.gcd.reduceat(sorted_rows, bounds[held])
        total[held] = np.add.reduceat(sorted_rows, bounds[held])
    unit = np.maximum(unit, 1)  # (an arena of empty buffers: offsets and rows 0)
    masked = (total > 0) & (total // unit <= MAX_MASK_UNITS)
    groups = _StageGroups.of(sorted_arena, sorted_first, last[by_start], sorted_rows // unit[sorted_arena],
                             bounds)
    units_at = [0] * count
    arena_units = [0] * num_arenas
    for which in np.flatnonzero(total > 0).tolist():
        place = groups.place_masked if masked[which] else groups.place_by_gaps
        arena_units[which] = place(which, units_at)
    offset = np.empty(count, dtype=np.int64)
    offset[by_start] = np.asarray(units_at, dtype=np.int64) * unit[sorted_arena]
    arena_rows = np.asarray(arena_units, dtype=np.int64) * unit
    return ArenaPlacement(offset=offset, arena_rows=arena_rows)


@dataclass(frozen=True, slots=True, kw_only=True)
class _StageGroups:
    """Buffers sorted by arena, first stage and order (lists, for the placement loop): each one's units and last
    stage; each stage group's (the run of an arena's buffers first live in one stage) first buffer, end, units
    and stage; each arena's first group and the end of its groups (arena_group[a]:arena_group[a + 1])."""

    units: list[int]
    last: list[int]
    group_start: list[int]
    group_end: list[int]
    group_units: list[int]
    group_stage: list[int]
    arena_group: list[int]

    @classmethod
    def of(cls, sorted_arena: np.ndarray, sorted_first: np.ndarray, sorted_last: np.ndarray, units: np.ndarray,
           bounds: np.ndarray) -> "_StageGroups":
        """The groups of buffers sorted by (arena, first stage, order), with their units and arena bounds."""
        count = sorted_arena.size
        starts = np.ones(count, dtype=bool)
        starts[1:] = (sorted_arena[1:] != sorted_arena[:-1]) | (sorted_first[1:] != sorted_first[:-1])
        group_start = np.flatnonzero(starts)
        group_units = np.add.reduceat(units, group_start) if count else units[:0]
        return cls(units=units.tolist(), last=sorted_last.tolist(), group_start=group_start.tolist(),
                   group_end=np.append(group_start[1:], count).tolist(), group_units=group_units.tolist(),
                   group_stage=sorted_first[group_start].tolist(),
                   arena_group=np.searchsorted(group_start, bounds).tolist())

    def place_masked(self, which: int, units_at: list[int]) -> int:
        """Place arena `which`'s buffers on a bitmask (:func:`place_arenas`), writing each one's first unit into
        `units_at` (by sorted position); returns the arena's units."""
        units, last_of, group_end, group_units = self.units, self.last, self.group_end, self.group_units
        group_start, group_stage = self.group_start, self.group_stage
        clear = extent = 0  # the free units below the arena's end (bits), the arena's units
        freed: dict[int, int] = {}  # last stage -> the units of the buffers live until it
        for group in range(self.arena_group[which], self.arena_group[which + 1]):
            stage = group_stage[group]
            for done in [last for last in freed if last < stage]:
                clear |= freed.pop(done)
            total = group_units[group]
            start = _first_fit(clear, total) if clear else None
            if start is not None:  # the whole group as one run
                clear ^= ((1 << total) - 1) << start
                # Consecutive buffers live until the same stage are freed as one span (one big-integer op).
                span_start, span_last = start, last_of[group_start[group]]
                for buffer in range(group_start[group], group_end[group]):
                    if (last := last_of[buffer]) != span_last:
                        freed[span_last] = freed.get(span_last, 0) | ((1 << (start - span_start)) - 1) << span_start
                        span_start, span_last = start, last
                    units_at[buffer] = start
                    start += units[buffer]
                freed[span_last] = freed.get(span_last, 0) | ((1 << (start - span_start)) - 1) << span_start
                continue
            no_gap = total + 1  # the least size found no gap below the end: `clear` only shrinks within a group
            for buffer in range(group_start[group], group_end[group]):
                size = units[buffer]
                if not clear:  # nothing free below the end
                    at, extent = extent, extent + size
                    taken = ((1 << size) - 1) << at
                elif size == 1:  # the lowest free unit (_first_fit of one unit)
                    taken = clear & -clear
                    at = taken.bit_length() - 1
                    clear ^= taken
                elif size < no_gap and (at := _first_fit(clear, size)) is not None:
                    taken = ((1 << size) - 1) << at
                    clear ^= taken
                else:  # at the arena's end, from the start of the free tail (if any)
                    no_gap = min(no_gap, size)
                    at = (~clear & ((1 << extent) - 1)).bit_length()
                    clear &= (1 << at) - 1
                    extent = max(extent, at + size)
                    taken = ((1 << size) - 1) << at
                units_at[buffer] = at
                freed[last_of[buffer]] = freed.get(last_of[buffer], 0) | taken
        return extent

    def place_by_gaps(self, which: int, units_at: list[int]) -> int:
        """:meth:`place_masked` over a sorted list of free gaps, [start, end) each, and a heap of the live buffers
        (an arena of more units than a bitmask holds cheaply)."""
        gaps: list[list[int]] = []
        live: list[tuple[int, int]] = []
        extent = 0
        for group in range(self.arena_group[which], self.arena_group[which + 1]):
            extent = _place_stage(gaps, live, extent, self.group_stage[group],
                                  range(self.group_start[group], self.group_end[group]), self.units, self.last,
                                  units_at)
        return extent


def _first_fit(clear: int, size: int) -> int | None:
    """The lowest bit of `clear` (not 0) that begins `size` set bits (None if none does); for size 0, the lowest
    set bit."""
    have = 1
    while have < size:
        step = have if have < size - have else size - have
        clear &= clear >> step
        if not clear:
            return None
        have += step
    return (clear & -clear).bit_length() - 1


def _place_stage(gaps: list[list[int]], live: list[tuple[int, int]], extent: int, stage: int, group: range,
                 size_of, last_of, offset) -> int:
    """One stage of :meth:`_StageGroups.place_by_gaps`: free the buffers last live before `stage`, then place
    `group` (the buffers first live in it, in order) in one gap that holds them all, else each first fit, growing
    the arena at its end. Writes their offsets into `offset` and pushes them on `live` (a heap of (last stage,
    buffer)). Sizes, offsets and gaps are in the arena's units.

    Returns:
        the arena's units after the stage.
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

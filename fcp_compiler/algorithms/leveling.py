"""Delaying tiles to later pipeline stages so that every stage's busiest rank carries less."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from fcp_compiler.algorithms.keys import stable_order
from fcp_compiler.algorithms.liveness import live_tokens


def _below(values: np.ndarray) -> np.ndarray:
    """float32 values at or below float64 `values`, each the nearest such."""
    near = values.astype(np.float32)
    over = near > values
    near[over] = np.nextafter(near[over], np.float32(-np.inf))
    return near


def stage_loads(stage: np.ndarray, rank: np.ndarray, seconds: np.ndarray, num_stages: int,
                num_ranks: int) -> np.ndarray:
    """Work per (stage, rank), float64 [num_stages, num_ranks]."""
    return np.bincount(np.multiply(stage, num_ranks, dtype=np.int64) + rank, weights=seconds,
                       minlength=num_stages * num_ranks).reshape(num_stages, num_ranks)


# Tiles read at a time where a pass over every tile needs int64 temporaries (a few MB each, reused).
PART_TILES = 1 << 20
MAX_SKIPS = 8  # per rank and target stage, candidates passed over (too long for the gap, or over the budget)
# Ranks still scanning a target stage at or under which they finish it one at a time in Python (a numpy step over
# all of them costs about as much as a dozen candidates one by one: at small blocks a stage has thousands of steps).
PYTHON_RANKS = 16


@dataclass(frozen=True, slots=True, kw_only=True)
class BufferLimit:
    """What delaying a tile costs in memory: the received buffer it reads stays live until it runs.

    Buffer b lives on rank buffer_rank[b] from stage buffer_first[b] to its last reader's stage plus buffer_hold[b]
    (1 where a result is pushed back along it in the stage after its last tile): the rule of
    :mod:`fcp_compiler.algorithms.liveness`. No delay may lift a rank's live tokens in any stage above `budget`.
    """

    tile_buffer: np.ndarray  # int64 [T], the buffer each tile reads, -1 for none
    buffer_rank: np.ndarray
    buffer_first: np.ndarray
    buffer_tokens: np.ndarray
    buffer_hold: np.ndarray
    budget: int


@dataclass(frozen=True, slots=True, kw_only=True)
class Prepared:
    """What :func:`level_stages` derives from the earliest stages alone, shared by callers that level the same
    tiles from the same stages twice (a plan's two passes): the movable tiles per rank by earliest stage (ties in
    tile order; those of rank r that may run before stage s are order[before[r * (S + 1)] : before[r * (S + 1) +
    s]] for S stages), the work per (stage, rank), and, under a BufferLimit, each buffer's last reader's stage."""

    order: np.ndarray
    before: np.ndarray
    load: np.ndarray
    buffer_first: np.ndarray | None = None
    buffer_last: np.ndarray | None = None


def prepare_levelling(earliest: np.ndarray, rank: np.ndarray, seconds: np.ndarray, num_ranks: int,
                      movable: np.ndarray, tile_buffer: np.ndarray | None = None,
                      buffer_first: np.ndarray | None = None) -> Prepared:
    """The Prepared of :func:`level_stages` for these earliest stages (tile_buffer and buffer_first: a BufferLimit's,
    when levelling under one): one stable sort of one key (rank, earliest stage), by radix, and two passes over the
    tiles. O(T)."""
    num_stages = int(earliest.max(initial=0)) + 1
    key = np.multiply(rank[movable], num_stages + 1, dtype=np.int64)
    key += earliest[movable]
    order = stable_order(key, num_ranks * (num_stages + 1))
    before = np.concatenate(([0], np.cumsum(np.bincount(key, minlength=num_ranks * (num_stages + 1)))))
    del key
    # Tile rows are int32 (millions at small blocks: no int64 column of them is kept, nor gathered).
    order = np.take(np.flatnonzero(movable).astype(np.int32), order)
    last = None
    if tile_buffer is not None:
        last = buffer_first.astype(np.int64)  # a copy
        for low in range(0, tile_buffer.size, PART_TILES):  # a part at a time: int64 columns of a few MB
            buffer, stage = tile_buffer[low:low + PART_TILES], earliest[low:low + PART_TILES]
            reads = buffer >= 0
            np.maximum.at(last, buffer[reads], stage[reads].astype(np.int64))  # ufunc.at is slow on mixed types
    return Prepared(order=order, before=before, load=stage_loads(earliest, rank, seconds, num_stages, num_ranks),
                    buffer_first=buffer_first, buffer_last=last)


def level_stages(earliest: np.ndarray, rank: np.ndarray, seconds: np.ndarray, num_ranks: int,
                 movable: np.ndarray | None = None, limit: BufferLimit | None = None,
                 prepared: Prepared | None = None) -> np.ndarray:
    """Stages for tiles, each at or after its earliest stage, that lower the sum over stages of the busiest rank.

    Ranks exchange data every stage, so a stage lasts about as long as its busiest rank computes; a rank whose data
    arrives early would otherwise front-load its work while another waits for late data, and the pipeline pays
    both. Going from the last stage back, the stage's level is its busiest rank's work; every other rank fills up
    to that level with tiles from its latest earlier stages (a tile may always run later than its data arrives),
    passing over (up to MAX_SKIPS times) those that do not fit the remaining gap or, under `limit`, would keep a
    buffer live past the budget. No tile goes past the last stage that already holds one, so the number of stages
    is unchanged.

    Within a target stage the ranks fill independently (a rank's tiles read only buffers on that rank), so every
    rank takes its next candidate in one numpy step: the steps a stage takes are the longest rank's scan, not the
    sum over ranks. Once PYTHON_RANKS or fewer are still scanning, each finishes alone in plain Python (at 8 ranks
    and 64-token blocks a stage takes thousands of steps over one or two ranks).

    Objective: sum over stages of max over ranks of work (greedy, not optimal with indivisible tiles; never worse
    than the earliest placement), subject to the buffer budget. O(T log T + S * (T + N * K * S)) for T tiles, S
    stages, N ranks and K tiles scanned a rank and stage (a handful), in O(S * K) numpy steps.

    Args:
        earliest: int64 [T], the first stage each tile may run in.
        rank: int64 [T], the rank running it.
        seconds: float64 [T], its work.
        num_ranks: N.
        movable: bool [T], tiles that may be delayed (default all; with `prepared`, the ones it was prepared for).
        limit: the buffers tiles read and the budget on live tokens (default: no limit); a tile's buffer is on
            the tile's rank.
        prepared: prepare_levelling(earliest, rank, seconds, num_ranks, movable, limit.tile_buffer,
            limit.buffer_first), when the caller has it already.
    Returns:
        int64 [T] stage of each tile.
    """
    stage = np.array(earliest, dtype=np.int64)  # a copy: the stages it returns
    if stage.size == 0:
        return stage
    num_stages = int(stage.max()) + 1
    if prepared is None:
        movable = np.ones(stage.size, dtype=bool) if movable is None else movable
        prepared = prepare_levelling(earliest, rank, seconds, num_ranks, movable,
                                     *((limit.tile_buffer, limit.buffer_first) if limit is not None else ()))
    assert limit is None or np.array_equal(prepared.buffer_first, limit.buffer_first)
    if limit is not None:  # the ranks fill independently only because no two ranks share a buffer
        reads = limit.tile_buffer >= 0
        assert np.array_equal(limit.buffer_rank[limit.tile_buffer[reads]], rank[reads])
    order = prepared.order
    if order.size == 0:  # nothing may move
        return stage
    buffers = None if limit is None else _LiveBuffers(limit, prepared.buffer_last, order, num_ranks, num_stages)
    earliest = np.asarray(earliest)  # (unchanged: each candidate's load is taken from its earliest stage's)
    scan = _Scan(order=order, seconds=seconds, before=prepared.before, num_stages=num_stages, num_ranks=num_ranks)
    load = prepared.load.copy()
    for target in range(num_stages - 1, 0, -1):
        row = load[target]  # a view: filling a rank raises its row in place
        gap = row.max() - row
        ranks = np.flatnonzero(gap > 0)
        ranks, position, gap = scan.start(ranks, target, gap[ranks])
        skips = np.zeros(ranks.size, dtype=np.int64)
        while ranks.size:
            if ranks.size <= PYTHON_RANKS:  # a numpy step would cost more than these few ranks' candidates
                for rank, at, room, skipped in zip(ranks.tolist(), position.tolist(), gap.tolist(), skips.tolist()):
                    _fill_rank(scan, buffers, load, stage, earliest, order, target, rank, at, room, skipped)
                break
            work = seconds[order[position]]
            fits = work <= gap
            if buffers is not None and fits.any():
                fits[fits] = buffers.extend(position[fits], ranks[fits], target)
            moved, moved_ranks, moved_work = position[fits], ranks[fits], work[fits]
            gap -= work * fits  # (minus zero where it does not fit: the same gap)
            load[earliest[order[moved]], moved_ranks] -= moved_work
            row[moved_ranks] += moved_work
            stage[order[moved]] = target
            scan.move(moved)
            skips += ~fits
            ranks, position, gap, skips = scan.step(ranks, position, gap, skips)
    return stage


def _fill_rank(scan: _Scan, buffers: _LiveBuffers | None, load: np.ndarray, stage: np.ndarray, earliest: np.ndarray,
               order: np.ndarray, target: int, rank: int, position: int, gap: float, skips: int) -> None:
    """One rank's fill of `target` from scan position `position` on, as the numpy steps of :func:`level_stages` make
    it (a rank's fill reads and writes only its own tiles, loads and buffers), one candidate at a time."""
    seconds, low = scan.seconds, int(scan.low[rank])
    row = load[target]
    while True:
        tile = int(order[position])
        tile_work = float(seconds[tile])
        fits = tile_work <= gap
        if fits and buffers is not None:
            fits = buffers.extend_one(position, rank, target)
        if fits:
            gap -= tile_work
            load[earliest[tile], rank] -= tile_work
            row[rank] += tile_work
            stage[tile] = target
            scan.move_one(position)
        else:
            skips += 1
        position = scan.unmoved_one(position - 1)
        if position < low or skips >= MAX_SKIPS or float(scan.least[position]) > gap:  # (compared as float64)
            return


class _Scan:
    """Each rank's movable tiles, by earliest stage, scanned from the latest back: where a rank's candidates for a
    target stage begin, and the next unmoved one before a position.

    Moved tiles are skipped through pointers: `skip[p]` is p for an unmoved position, and for a moved one a
    position at or before p - 1 with every position between the two moved (a union-find without ranks, the
    pointers shortened as they are followed). A lookup follows a few pointers, not the whole scan order: recomputing
    the last unmoved position of every position once a stage was O(T x S), most of a compile at small blocks."""

    def __init__(self, order: np.ndarray, seconds: np.ndarray, before: np.ndarray, num_stages: int, num_ranks: int):
        """`seconds`: each tile's work (a candidate's is seconds[order[position]], looked up a step at a time: a
        column a scan position is millions at small blocks)."""
        self.seconds, self.before, self.width = seconds, before, num_stages + 1
        self.low = before[np.arange(num_ranks) * self.width]  # each rank's first position
        self.skip = np.arange(order.size, dtype=np.int32)  # positions, as tile rows, are int32
        # At most the least work at or before each position within its rank's tiles: a rank whose gap is below it at
        # its next candidate can fit nothing more in the target (it would only pass over candidates), so it stops.
        # A float32 bound (half the memory) rounded down: a rank it keeps scanning only passes over what does not fit.
        self.least = np.empty(order.size, dtype=np.float32)
        bounds = np.append(self.low, order.size).tolist()
        for low, high in zip(bounds[:-1], bounds[1:]):
            for part in range(low, high, PART_TILES):
                least = np.minimum.accumulate(seconds[order[part:min(part + PART_TILES, high)]])
                if part > low:
                    np.minimum(least, self.least[part - 1], out=least)  # (still a bound: the one before is)
                self.least[part:part + least.size] = _below(least)

    def start(self, ranks: np.ndarray, target: int, gap: np.ndarray) -> tuple[np.ndarray, ...]:
        """The ranks with candidates for `target` (tiles whose earliest stage is before it): ranks, each one's last
        unmoved candidate's position, and its gap."""
        position = self._unmoved(self.before[ranks * self.width + target] - 1)
        keep = position >= self.low[ranks]
        keep[keep] = self.least[position[keep]] <= gap[keep]
        return ranks[keep], position[keep], gap[keep]

    def step(self, ranks, position, gap, skips) -> tuple[np.ndarray, ...]:
        """Every rank on to its previous unmoved candidate; those out of candidates or skips drop out."""
        position = self._unmoved(position - 1)
        keep = position >= self.low[ranks]
        keep &= skips < MAX_SKIPS
        keep &= self.least[position] <= gap  # (a position before its rank's first, -1 at most, reads any entry)
        return ranks[keep], position[keep], gap[keep], skips[keep]

    def move(self, positions: np.ndarray) -> None:
        """Mark the tiles at `positions` (distinct) moved: each now skips to where its predecessor does."""
        self.skip[positions] = np.where(positions > 0, self.skip[np.maximum(positions - 1, 0)], -1)

    def move_one(self, position: int) -> None:
        """:meth:`move` of one position."""
        self.skip[position] = self.skip[position - 1] if position > 0 else -1

    def unmoved_one(self, position: int) -> int:
        """:meth:`_unmoved` of one position."""
        found, passed = position, []
        while found >= 0:
            to = int(self.skip[found])
            if to == found:
                break
            passed.append(found)
            found = to
        for moved in passed:  # path compression, as _unmoved
            self.skip[moved] = found
        return found

    def _unmoved(self, position: np.ndarray) -> np.ndarray:
        """The last unmoved position at or before each (-1 for none)."""
        # Most steps land on unmoved tiles: then there is no pointer to follow or shorten.
        if position.size and position.min() >= 0 and (self.skip[position] == position).all():
            return position
        found = position.copy()
        pending = np.flatnonzero(found >= 0)
        passed, passed_by = [], []  # the moved positions each lookup went through
        while pending.size:
            at = found[pending]
            to = self.skip[at]
            moving = to != at
            if not moving.any():
                break
            pending = pending[moving]
            passed.append(at[moving])
            passed_by.append(pending)
            found[pending] = to[moving]
            pending = pending[found[pending] >= 0]
        if passed:
            # Every pointer followed is shortened to where its lookup ended (every position between is moved), so
            # later lookups through it take one step (path compression).
            self.skip[np.concatenate(passed)] = found[np.concatenate(passed_by)]
        return found


class _LiveBuffers:
    """Live tokens per rank and stage, and each buffer's last stage of use; checked and extended for one tile of
    each of many ranks at once (distinct ranks hold distinct buffers)."""

    def __init__(self, limit: BufferLimit, last: np.ndarray, order: np.ndarray, num_ranks: int, num_stages: int):
        """`last`: each buffer's last reader's stage before any delay (Prepared.buffer_last); `order`: the tile at
        each scan position (Prepared.order), whose buffers are looked up once."""
        end = last + limit.buffer_hold
        self.live = live_tokens(limit.buffer_rank, limit.buffer_first, end, limit.buffer_tokens, num_ranks,
                                int(max(end.max(initial=0), num_stages)) + 2)
        self.columns = np.arange(self.live.shape[1])
        # A copy, with one more entry that no target reaches: the last stage of "buffer -1" (a tile reading none).
        self.last = np.append(last.astype(np.int64), np.iinfo(np.int64).max)
        self.budget = limit.budget
        self.tile_buffer, self.order = limit.tile_buffer, order  # a scan position's buffer: looked up, not kept
        # A window's bounds are (end + hold + 1, target + hold + 1): hold + 1 a buffer (looked up a step at a time,
        # not kept per scan position: millions at small blocks), and at most `reach` past its target (a bound: the
        # columns past a window's own are read and written unchanged).
        self.after_of = limit.buffer_hold.astype(np.int64) + 1
        self.reach = int(self.after_of.max(initial=1))
        self.tokens_of = limit.buffer_tokens.astype(np.int64)  # token counts, whatever array they came in

    def extend_one(self, position: int, rank: int, target: int) -> bool:
        """:meth:`extend` of one scan position."""
        buffer = int(self.tile_buffer[self.order[position]])
        if buffer < 0 or self.last[buffer] >= target:
            return True
        after = int(self.after_of[buffer])
        window = self.live[rank, max(int(self.last[buffer]) + after, 0):target + after]
        tokens = int(self.tokens_of[buffer])
        if max(window.tolist(), default=0) + tokens > self.budget:  # (a few stages: a list's max is cheaper)
            return False
        window += tokens
        self.last[buffer] = target
        return True

    def extend(self, positions: np.ndarray, ranks: np.ndarray, target: int) -> np.ndarray:
        """Keep the buffer of the tile at each scan position, on its rank (distinct ranks), live until `target`
        where the budget allows; bool per position, True where the tile may run there (its buffer extended, or
        none needed)."""
        buffer = self.tile_buffer[self.order[positions]]
        end = self.last[buffer]
        need = end < target  # a tile without a buffer reads the entry no target reaches
        if need.all():  # (most steps: every tile's buffer would outlive its last use so far)
            ok, rank = None, ranks
        elif not need.any():
            return np.ones(positions.size, dtype=bool)
        else:
            ok = ~need
            need = np.flatnonzero(need)
            positions, buffer, rank, end = positions[need], buffer[need], ranks[need], end[need]
        after, tokens = self.after_of[buffer], self.tokens_of[buffer]
        # The stages the buffer would newly be live in: after its current end, up to the target's (plus its hold);
        # only the columns some window spans are read and written (a few of the pass's stages).
        low = end + after
        high = after + target
        first, last = int(low.min()), target + self.reach
        if first < last:
            columns = self.columns[first:last]
            window = (columns >= low[:, None]) & (columns < high[:, None])
            rows = self.live[rank, first:last]
            fits = np.where(window, rows, 0).max(axis=1) + tokens <= self.budget  # live tokens are never negative
            rows += window * np.where(fits, tokens, 0)[:, None]
            self.live[rank, first:last] = rows
        else:
            fits = tokens <= self.budget
        self.last[buffer[fits]] = target
        if ok is None:
            return fits
        ok[need] = fits
        return ok

"""Delaying tiles to later pipeline stages so that every stage's busiest rank carries less."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from fcp_compiler.algorithms.keys import stable_argsort, stable_order
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


def arrival_round_of(pull_round: np.ndarray, tile_kv_edge: np.ndarray, tile_q_edge: np.ndarray) -> np.ndarray:
    """Per tile, the round of the later of its pulls, -1 for a tile whose data is all local: int32 (one entry a
    tile; rounds are int32 in the plan), so arithmetic on it that may grow widens first."""
    round_or_local = np.append(pull_round, -1).astype(np.int32)  # index -1 (no pull) reads -1 (local)
    arrival = round_or_local[tile_kv_edge]
    return np.maximum(arrival, round_or_local[tile_q_edge], out=arrival)


def earliest_stage(arrival_round: np.ndarray, coalesce: int) -> np.ndarray:
    """Each tile's first stage: the one after its later pull's, 0 for a tile whose data is all local."""
    return np.where(arrival_round >= 0, arrival_round // coalesce + 1, 0)


def backward_earliest_stage(arrival_round: np.ndarray, coalesce: int) -> np.ndarray:
    """Each tile's first stage in the backward (stages of `coalesce` rounds), whose pulls take round 2r for the
    forward's round r (`arrival_round`: the forward's, -1 for a tile whose data is all local): written over
    `arrival_round` (a column a tile, millions at small blocks: one held, not three)."""
    local = arrival_round < 0
    arrival_round *= 2
    arrival_round //= coalesce
    arrival_round += 1
    arrival_round[local] = 0
    return arrival_round


def stage_message_seconds(stage: np.ndarray, src: np.ndarray, dst: np.ndarray, nbytes: np.ndarray,
                          across: np.ndarray, num_stages: int, num_ranks: int, nic_bytes_per_s: float,
                          nvlink_bytes_per_s: float) -> np.ndarray:
    """Per (stage, rank), the longer of its link ends' message time: the bytes it sends or receives in the stage on
    each link class (`across`: the message crosses nodes, on the NIC; else NVLink) over that class's bandwidth.

    Args:
        stage, src, dst, nbytes, across: per message.
        num_stages, num_ranks: the shape of the result.
        nic_bytes_per_s, nvlink_bytes_per_s: each class's bandwidth a link end.
    Returns:
        float64 [num_stages, num_ranks] seconds.
    """
    seconds = np.zeros(num_stages * num_ranks)
    for link, bytes_per_s in ((across, nic_bytes_per_s), (~across, nvlink_bytes_per_s)):
        key = np.multiply(stage[link], num_ranks, dtype=np.int64)
        weights = np.asarray(nbytes, dtype=np.float64)[link]
        sent = np.bincount(key + src[link], weights=weights, minlength=num_stages * num_ranks)
        received = np.bincount(key + dst[link], weights=weights, minlength=num_stages * num_ranks)
        np.maximum(seconds, np.maximum(sent, received) / bytes_per_s, out=seconds)
    return seconds.reshape(num_stages, num_ranks)


def pull_back(stage: np.ndarray, earliest: np.ndarray, rank: np.ndarray, seconds: np.ndarray,
              level: np.ndarray) -> np.ndarray:
    """Tiles a schedule runs after their earliest stage moved earlier, each no earlier than its earliest, while its
    rank's work in the stage it moves to stays at or under that stage's level.

    :func:`level_stages` delays tiles so that each stage's busiest rank carries less, but a stage also lasts as long
    as its messages take: where they take longer than its tiles, work up to that time is free there, and a tile run
    earlier frees the buffer it reads sooner and leaves a later stage shorter. Greedy: stages from the first, each
    rank's delayed tiles latest stage first (then by index), each moved where it fits the room left.

    Objective: none proven (a heuristic the floor keeps only where it simulates faster). O(T log T + sum over ranks
    of S x D) for T tiles, S stages and D the rank's delayed tiles.

    Args:
        stage: int64 [T], each tile's stage.
        earliest: int64 [T], the first stage it may run in (at most its stage).
        rank: int64 [T], the rank running it.
        seconds: float64 [T], its work.
        level: float64 [S], the most work a rank may carry in each stage.
    Returns:
        int64 [T] stage of each tile (a copy).
    """
    stage = np.array(stage, dtype=np.int64)
    num_stages, num_ranks = int(level.size), int(rank.max(initial=-1)) + 1
    assert (earliest <= stage).all() and int(stage.max(initial=0)) < max(num_stages, 1)
    work = stage_loads(stage, rank, seconds, num_stages, num_ranks)
    delayed = np.flatnonzero(stage > earliest)
    delayed = delayed[np.lexsort((delayed, -stage[delayed], rank[delayed]))]  # by rank, latest stage first
    bounds = np.searchsorted(rank[delayed], np.arange(num_ranks + 1)).tolist()
    stage_of, earliest_of, seconds_of = stage.tolist(), np.asarray(earliest).tolist(), seconds.tolist()
    room_of = (level[:, None] - work).tolist()
    for owner in range(num_ranks):
        mine = delayed[bounds[owner]:bounds[owner + 1]].tolist()
        first = min((earliest_of[tile] for tile in mine), default=num_stages)  # no tile of it may run before
        for target in range(first, num_stages):
            room = room_of[target][owner]
            if not mine or room <= 0:
                continue
            moved = False
            for tile in mine:  # unmoved, latest stage first: none from the first at or before the target on
                if stage_of[tile] <= target:
                    break
                if target >= earliest_of[tile] and seconds_of[tile] <= room:
                    room_of[stage_of[tile]][owner] += seconds_of[tile]  # (a later target gains the room)
                    stage_of[tile] = target
                    room -= seconds_of[tile]
                    moved = True
                    if room <= 0:
                        break
            if moved:  # a moved tile never moves again: every later target is past its stage
                mine = [tile for tile in mine if stage_of[tile] > target]
    return np.asarray(stage_of, dtype=np.int64)


def pipeline_order(tile_rank: np.ndarray, tile_stage: np.ndarray, arrival_round: np.ndarray,
                   delayed: np.ndarray) -> np.ndarray:
    """Tiles by (rank, stage, round their data arrives, index).

    A tile's earliest stage never decreases with its arrival round, so the tiles levelling left there are in this
    order once sorted by (rank, arrival round): one radix pass over millions of tiles. The few it delayed are sorted
    apart and merged in; none shares a (rank, stage, round) with a tile left in place, whose stage is the earliest
    of that round. `delayed`: the tiles moved past their earliest stage.
    """
    if tile_rank.size == 0:
        return np.zeros(0, dtype=np.int64)
    num_ranks = int(tile_rank.max()) + 1
    num_stages, num_rounds = int(tile_stage.max()) + 1, int(arrival_round.max()) + 2
    if num_ranks * num_stages * num_rounds >= 2**62:
        return np.lexsort((np.arange(tile_rank.size), arrival_round, tile_stage, tile_rank))
    # int32: one entry a tile, an index into the plan's int32 tile rows.
    kept = stable_order(tile_rank * num_rounds + (arrival_round + 1), num_ranks * num_rounds).astype(np.int32)
    if not delayed.any():
        return kept
    kept = kept[~delayed[kept]]
    moved = np.flatnonzero(delayed)
    key = (tile_rank * num_stages + tile_stage) * num_rounds + (arrival_round + 1)
    moved = moved[stable_argsort(key[moved])]
    return np.insert(kept, np.searchsorted(key[kept], key[moved]), moved)


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

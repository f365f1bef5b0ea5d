"""Delaying tiles to later pipeline stages so that every stage's busiest rank carries less."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from fcp_compiler.algorithms.keys import stable_order
from fcp_compiler.algorithms.liveness import live_tokens


def stage_loads(stage: np.ndarray, rank: np.ndarray, seconds: np.ndarray, num_stages: int,
                num_ranks: int) -> np.ndarray:
    """Work per (stage, rank), float64 [num_stages, num_ranks]."""
    return np.bincount(np.multiply(stage, num_ranks, dtype=np.int64) + rank, weights=seconds,
                       minlength=num_stages * num_ranks).reshape(num_stages, num_ranks)


MAX_SKIPS = 8  # per rank and target stage, candidates passed over (too long for the gap, or over the budget)


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
    before: list[int]
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
    key = rank[movable] * (num_stages + 1)
    key += earliest[movable]
    order = stable_order(key, num_ranks * (num_stages + 1))
    order = np.flatnonzero(movable)[order].astype(np.int32)  # tile rows are int32
    before = np.concatenate(([0], np.cumsum(np.bincount(key, minlength=num_ranks * (num_stages + 1)))))
    del key
    last = None
    if tile_buffer is not None:
        reads = tile_buffer >= 0
        values = earliest[reads].astype(np.int64)  # ufunc.at is many times slower on mixed types
        last = buffer_first.astype(np.int64)  # a copy
        np.maximum.at(last, tile_buffer[reads], values)
    return Prepared(order=order, before=before.tolist(), load=stage_loads(earliest, rank, seconds, num_stages,
                                                                          num_ranks),
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

    Objective: sum over stages of max over ranks of work (greedy, not optimal with indivisible tiles; never worse
    than the earliest placement), subject to the buffer budget. O(T log T + S * N + T * S) for T tiles, S stages,
    N ranks (the last term only for buffer checks).

    Args:
        earliest: int64 [T], the first stage each tile may run in.
        rank: int64 [T], the rank running it.
        seconds: float64 [T], its work.
        num_ranks: N.
        movable: bool [T], tiles that may be delayed (default all; with `prepared`, the ones it was prepared for).
        limit: the buffers tiles read and the budget on live tokens (default: no limit).
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
    buffers = None if limit is None else _LiveBuffers(limit, prepared.buffer_last, num_ranks, num_stages)
    order, before = prepared.order, prepared.before
    load = prepared.load.tolist()
    # Few tiles move (a handful a rank and stage, next to where its arrivals end), so the loop reads the arrays
    # where it scans instead of copying millions of tiles into lists. A moved tile is marked by pointing left;
    # scans jump over moved tiles (path compression keeps that O(1) amortised).
    moved: dict[int, int] = {}
    for target in range(num_stages - 1, 0, -1):
        row = load[target]
        level = max(row)
        for r in range(num_ranks):
            gap = level - row[r]
            if gap <= 0:
                continue
            low = before[r * (num_stages + 1)]
            idx = _unmoved(moved, before[r * (num_stages + 1) + target] - 1, low)
            skips = 0  # tiles that do not fit are passed over, a few per rank and stage (bounded scan)
            while idx >= low and skips < MAX_SKIPS:
                tile = int(order[idx])
                work = float(seconds[tile])
                if work > gap or (buffers is not None and not buffers.extend(tile, target)):
                    skips += 1
                    idx = _unmoved(moved, idx - 1, low)
                    continue
                gap -= work
                load[int(stage[tile])][r] -= work
                row[r] += work
                stage[tile] = target
                moved[idx] = idx - 1
                idx = _unmoved(moved, idx - 1, low)
    return stage


def _unmoved(moved: dict[int, int], idx: int, low: int) -> int:
    """The last position at or before idx (and at or after low) whose tile has not moved, low - 1 if none; the
    path there is compressed."""
    root = idx
    while root >= low and root in moved:
        root = moved[root]
    while idx > root:
        following = moved[idx]
        moved[idx] = root
        idx = following
    return max(root, low - 1)


class _LiveBuffers:
    """Live tokens per rank and stage, and each buffer's last stage of use, as Python lists: each check touches a
    few stages of one rank, where list slices beat numpy calls."""

    def __init__(self, limit: BufferLimit, last: np.ndarray, num_ranks: int, num_stages: int):
        """`last`: each buffer's last reader's stage before any delay (Prepared.buffer_last)."""
        end = last + limit.buffer_hold
        self.live = live_tokens(limit.buffer_rank, limit.buffer_first, end, limit.buffer_tokens, num_ranks,
                                int(max(end.max(initial=0), num_stages)) + 2).tolist()
        self.last = last.tolist()
        self.tile_buffer = limit.tile_buffer  # one entry a tile (millions at small blocks): read in place
        self.rank, self.tokens = limit.buffer_rank.tolist(), limit.buffer_tokens.tolist()
        self.hold, self.budget = limit.buffer_hold.tolist(), limit.budget

    def extend(self, tile: int, target: int) -> bool:
        """Keep the tile's buffer live until `target` if the budget allows; False (and no change) if not."""
        buffer = int(self.tile_buffer[tile])
        if buffer < 0 or self.last[buffer] >= target:
            return True
        row = self.live[self.rank[buffer]]
        hold, tokens = self.hold[buffer], self.tokens[buffer]
        begin, end = self.last[buffer] + hold + 1, target + hold + 1
        if max(row[begin:end], default=0) + tokens > self.budget:
            return False
        for stage in range(begin, end):
            row[stage] += tokens
        self.last[buffer] = target
        return True

"""Delaying tiles to later pipeline stages so that every stage's busiest rank carries less."""

from __future__ import annotations

import numpy as np


def stage_loads(stage: np.ndarray, rank: np.ndarray, seconds: np.ndarray, num_stages: int,
                num_ranks: int) -> np.ndarray:
    """Work per (stage, rank), float64 [num_stages, num_ranks]."""
    return np.bincount(stage * num_ranks + rank, weights=seconds,
                       minlength=num_stages * num_ranks).reshape(num_stages, num_ranks)


def level_stages(earliest: np.ndarray, rank: np.ndarray, seconds: np.ndarray, num_ranks: int,
                 movable: np.ndarray | None = None) -> np.ndarray:
    """Stages for tiles, each at or after its earliest stage, that lower the sum over stages of the busiest rank.

    Ranks exchange data every stage, so a stage lasts about as long as its busiest rank computes; a rank whose data
    arrives early would otherwise front-load its work while another waits for late data, and the pipeline pays
    both. Going from the last stage back, the stage's level is its busiest rank's forced work; every other rank
    fills up to that level with tiles from its latest earlier stages (a tile may always run later than its data
    arrives). No tile goes past the last stage that already holds one, so the number of stages is unchanged.

    Objective: sum over stages of max over ranks of work (greedy, not optimal with indivisible tiles; never worse
    than the earliest placement). O(T log T + S * N log T) for T tiles, S stages, N ranks, vectorised over ranks.

    Args:
        earliest: int64 [T], the first stage each tile may run in.
        rank: int64 [T], the rank running it.
        seconds: float64 [T], its work.
        num_ranks: N.
        movable: bool [T], tiles that may be delayed (default all).
    Returns:
        int64 [T] stage of each tile.
    """
    stage = earliest.astype(np.int64).copy()
    if stage.size == 0:
        return stage
    num_stages = int(stage.max()) + 1
    movable = np.ones(stage.size, dtype=bool) if movable is None else movable
    load = stage_loads(stage, rank, seconds, num_stages, num_ranks)
    # Per rank, its movable tiles by earliest stage: the candidates for stage s are a prefix (earliest < s), and
    # taking from the latest stages first keeps the unmoved ones a prefix too. Every stage handles all ranks at once.
    candidates = np.flatnonzero(movable)
    order = candidates[np.lexsort((candidates, earliest[candidates], rank[candidates]))]
    order_key = rank[order] * (num_stages + 1) + earliest[order]
    ranks = np.arange(num_ranks)
    first = np.searchsorted(order_key, ranks * (num_stages + 1))
    prefix = np.concatenate(([0.0], np.cumsum(seconds[order])))
    unmoved_end = np.searchsorted(order_key, (ranks + 1) * (num_stages + 1))  # per rank, [first, end) unmoved
    for target in range(num_stages - 1, 0, -1):
        gaps = load[target].max() - load[target]
        # Unmoved candidates with earliest stage < target, then the longest run ending there that fits the gap.
        end = np.minimum(unmoved_end, np.searchsorted(order_key, ranks * (num_stages + 1) + target))
        begin = np.maximum(first, np.searchsorted(prefix, prefix[end] - gaps, side="left"))
        begin = np.where(gaps > 0, np.minimum(begin, end), end)
        counts = end - begin
        if not counts.any():
            continue
        moved = order[np.repeat(begin - np.cumsum(np.concatenate(([0], counts[:-1]))), counts)
                      + np.arange(int(counts.sum()))]
        np.subtract.at(load, (stage[moved], rank[moved]), seconds[moved])
        load[target] += prefix[end] - prefix[begin]
        stage[moved] = target
        unmoved_end = np.where(counts > 0, begin, unmoved_end)
    return stage

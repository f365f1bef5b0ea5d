"""Ordering congestion-free rounds so that every stage's busiest rank carries little work."""

from __future__ import annotations

import numpy as np


def order_rounds(round_work: np.ndarray, rounds_per_stage: int) -> np.ndarray:
    """A new position for each round (a permutation) that groups rounds into stages of `rounds_per_stage` with a
    small sum over stages of the busiest rank's work.

    Each round is a matching, so any order of the rounds keeps every round congestion-free; what the order changes
    is which work becomes runnable together. Objective: sum over stages of max over ranks of the summed work of the
    stage's rounds (NP-hard in general). Greedy: rounds by decreasing largest work, each into the unfilled stage
    whose busiest rank grows least (ties: the one whose busiest rank ends lowest, then the earliest); then, within
    each stage, rounds in their old order.
    O(R * S * N) for R rounds, S stages, N ranks, vectorised over stages and ranks.

    Args:
        round_work: float [R, N], work each round makes runnable on each rank.
        rounds_per_stage: c >= 1.
    Returns:
        int64 [R], the new index of each round (a permutation of 0..R-1).
    """
    num_rounds, num_ranks = round_work.shape
    if num_rounds == 0:
        return np.zeros(0, dtype=np.int64)
    num_stages = -(-num_rounds // rounds_per_stage)
    load = np.zeros((num_stages, num_ranks))
    room = np.full(num_stages, rounds_per_stage)
    room[-1] = num_rounds - (num_stages - 1) * rounds_per_stage
    stage_of = np.empty(num_rounds, dtype=np.int64)
    for rnd in np.lexsort((np.arange(num_rounds), -round_work.max(axis=1))).tolist():
        new_max = (load + round_work[rnd]).max(axis=1)
        growth = new_max - load.max(axis=1)
        growth[room == 0] = np.inf
        stage = int(np.lexsort((np.arange(num_stages), new_max, growth))[0])
        stage_of[rnd] = stage
        load[stage] += round_work[rnd]
        room[stage] -= 1
    order = np.lexsort((np.arange(num_rounds), stage_of))
    position = np.empty(num_rounds, dtype=np.int64)
    position[order] = np.arange(num_rounds)
    return position

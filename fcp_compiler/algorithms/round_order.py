"""Ordering congestion-free rounds so that every stage's busiest rank carries little work."""

from __future__ import annotations

import numpy as np


def order_rounds(round_work: np.ndarray, rounds_per_stage: int, round_class: np.ndarray | None = None,
                 class_lanes: tuple[int, int] = (1, 1)) -> np.ndarray:
    """A new position for each round that groups rounds into stages of `rounds_per_stage` with a small sum over
    stages of the busiest rank's work.

    Each round is a matching (of one link class), so any order of the rounds keeps every round congestion-free;
    what the order changes is which work becomes runnable together. Rounds of different classes run at the same
    time: a stage s holds up to c = `rounds_per_stage` positions s * c .. s * c + c - 1, and each position
    class_lanes[k] rounds of class k (rounds of a class whose links are that much faster share a position; positions
    no round takes stay empty). Objective: sum over stages of max over ranks of the summed work of the stage's
    rounds (NP-hard in general). Greedy: rounds by decreasing largest work, each into the stage with room for its
    class whose busiest rank grows least (ties: the one whose busiest rank ends lowest, then the earliest); then,
    within each stage, a class's rounds in their old order.
    O(R * S * N) for R rounds, S stages, N ranks, vectorised over stages and ranks.

    Args:
        round_work: float [R, N], work each round makes runnable on each rank.
        rounds_per_stage: c >= 1.
        round_class: int [R], each round's link class (0 or 1); default: all one class.
        class_lanes: per class, rounds a position holds.
    Returns:
        int64 [R], the new position of each round (distinct within a class).
    """
    num_rounds, num_ranks = round_work.shape
    round_class = np.zeros(num_rounds, dtype=np.int64) if round_class is None else round_class
    if num_rounds == 0:
        return np.zeros(0, dtype=np.int64)
    per_class = np.bincount(round_class, minlength=2)
    lanes = np.asarray(class_lanes, dtype=np.int64)
    num_stages = int(max(-(-per_class // (rounds_per_stage * lanes))))
    load = np.zeros((num_stages, num_ranks))
    room = np.repeat((rounds_per_stage * lanes)[:, None], num_stages, axis=1)
    # A class that fills its stages fills all but the last (the rest stays in the last).
    rest = per_class - (num_stages - 1) * rounds_per_stage * lanes
    room[:, -1] = np.where(rest > 0, rest, room[:, -1])
    stage_of = np.empty(num_rounds, dtype=np.int64)
    busiest = np.zeros(num_stages)  # load.max(axis=1), kept up to date stage by stage
    most = round_work.max(axis=1)
    by_work = np.lexsort((np.arange(num_rounds), -most))
    num_busy = int((most > 0).sum())
    for rnd in by_work[:num_busy].tolist():
        cls = int(round_class[rnd])
        new_max = (load + round_work[rnd]).max(axis=1)
        growth = new_max - busiest
        growth[room[cls] <= 0] = np.inf
        # The least growth, then the lowest new busiest rank, then the earliest stage.
        tied = np.flatnonzero(growth == growth.min())
        stage = int(tied[np.argmin(new_max[tied])]) if tied.size > 1 else int(tied[0])
        stage_of[rnd] = stage
        load[stage] += round_work[rnd]
        busiest[stage] = load[stage].max()
        room[cls, stage] -= 1
    # Rounds without work come last and change no load: each takes the stage with room for its class whose busiest
    # rank is lowest (the earliest of equals), as the loop would, so they fill the stages in that order.
    best_first = np.lexsort((np.arange(num_stages), busiest))
    idle = by_work[num_busy:]  # in index order
    for cls in (0, 1):
        mine = idle[round_class[idle] == cls]
        stage_of[mine] = np.repeat(best_first, room[cls, best_first])[:mine.size]
    position = np.empty(num_rounds, dtype=np.int64)
    for cls in (0, 1):
        mine = np.flatnonzero(round_class == cls)
        order = mine[np.lexsort((mine, stage_of[mine]))]
        first = np.searchsorted(stage_of[order], stage_of[order])  # each round's stage's first in `order`
        position[order] = stage_of[order] * rounds_per_stage + (np.arange(order.size) - first) // lanes[cls]
    return position


def rounds_first(position: np.ndarray, round_class: np.ndarray, first: np.ndarray, rounds_per_stage: int,
                 class_lanes: tuple[int, int] = (1, 1)) -> np.ndarray:
    """The same order with the rounds `first` moved into the first stage of their class.

    Positions 0 .. c - 1 (c = `rounds_per_stage`) are the first stage; a position holds class_lanes[k] rounds of class
    k. Each round of `first` outside the first stage, in order of position (then index), takes a free slot there (the
    lowest position first) or, when none is left, swaps positions with the round of the first stage not in `first`
    at the highest position (then the highest index). Rounds of `first` the first stage cannot take stay where they
    are. Any order of the rounds keeps every round congestion-free, so this one does too. O(R log R) for R rounds.

    Args:
        position: int [R], each round's position (order_rounds'; distinct within a class up to its lanes).
        round_class: int [R], each round's link class (0 or 1).
        first: int, the rounds to move.
        rounds_per_stage: c >= 1.
        class_lanes: per class, rounds a position holds.
    Returns:
        int64 [R], the new positions.
    """
    position = np.array(position, dtype=np.int64)
    is_first = np.zeros(position.size, dtype=bool)
    is_first[first] = True
    for cls in (0, 1):
        lanes = int(class_lanes[cls])
        mine = np.flatnonzero(round_class == cls)
        early = position[mine] < rounds_per_stage
        movers = mine[is_first[mine] & ~early]
        movers = movers[np.lexsort((movers, position[movers]))].tolist()
        if not movers:
            continue
        taken = np.bincount(position[mine[early]], minlength=rounds_per_stage)
        free = np.repeat(np.arange(rounds_per_stage), np.maximum(lanes - taken, 0)).tolist()
        victims = mine[~is_first[mine] & early]
        victims = victims[np.lexsort((-victims, -position[victims]))].tolist()
        for mover in movers:
            if free:
                position[mover] = free.pop(0)
            elif victims:
                victim = victims.pop(0)
                position[mover], position[victim] = position[victim], position[mover]
            else:
                break
    return position

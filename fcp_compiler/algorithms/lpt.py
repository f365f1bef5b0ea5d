"""Makespan scheduling under a per-bin size cap: LPT greedy and a move/swap refinement."""

from __future__ import annotations

import heapq

import numpy as np

UNPLACED = -1


def lpt_with_cap(weights: np.ndarray, sizes: np.ndarray, num_bins: int, capacity: int,
                 preferred: np.ndarray | None = None, slack: float = 0.0) -> np.ndarray:
    """Longest-processing-time-first onto the least-loaded bin that has room.

    Objective: minimise the largest bin weight subject to every bin's total size <= capacity. Items go in order
    of decreasing weight (ties by index, or taking the preferred bins in turn) to the least-loaded bin (ties by bin
    index) whose size stays within the cap, or to the item's preferred bin when that has room and is within
    `slack` of the least load. O(K log N)
    when bins rarely fill; a full bin is skipped and put back.

    Args:
        weights: float array, work of each item.
        sizes: int array, tokens of each item.
        num_bins: number of bins (ranks).
        capacity: size cap per bin.
        preferred: optional bin per item (-1: none), e.g. where its tokens already are.
        slack: how much more loaded than the least-loaded bin the preferred bin may be.
    Returns:
        int64 array, the bin of each item, UNPLACED (-1) where no bin had room.
    """
    weights = np.asarray(weights, dtype=np.float64)
    sizes = np.asarray(sizes, dtype=np.int64)
    if preferred is None:
        order = np.lexsort((np.arange(weights.size), -weights))
    else:
        # Among items of equal weight, take one per preferred bin in turn, so that each can go home.
        by_home = np.lexsort((np.arange(weights.size), preferred))
        first = np.searchsorted(preferred[by_home], preferred[by_home])
        turn = np.empty(weights.size, dtype=np.int64)
        turn[by_home] = np.arange(weights.size) - first
        order = np.lexsort((np.arange(weights.size), turn, -weights))
    bin_of = np.full(weights.size, UNPLACED, dtype=np.int64)
    used = [0] * num_bins
    loads = [0.0] * num_bins
    heap = [(0.0, bin_idx) for bin_idx in range(num_bins)]  # lazy: entries whose load is stale are skipped
    sizes_list = sizes.tolist()
    weights_list = weights.tolist()
    preferred_list = preferred.tolist() if preferred is not None else None
    for item_idx in order.tolist():
        size = sizes_list[item_idx]
        skipped = []
        while heap and (heap[0][0] != loads[heap[0][1]] or used[heap[0][1]] + size > capacity):
            entry = heapq.heappop(heap)
            if entry[0] == loads[entry[1]]:
                skipped.append(entry)
        if heap:
            bin_idx = heap[0][1]
            if preferred_list is not None:
                home = preferred_list[item_idx]
                if home >= 0 and used[home] + size <= capacity and loads[home] <= loads[bin_idx] + slack:
                    bin_idx = home
            bin_of[item_idx] = bin_idx
            used[bin_idx] += size
            loads[bin_idx] += weights_list[item_idx]
            heapq.heappush(heap, (loads[bin_idx], bin_idx))
        for entry in skipped:
            heapq.heappush(heap, entry)
    return bin_of


def refine_moves_swaps(weights: np.ndarray, sizes: np.ndarray, bin_of: np.ndarray, num_bins: int, capacity: int,
                       max_steps: int | None = None) -> np.ndarray:
    """Local search on the most loaded bin: the best single move or pairwise swap that lowers it.

    Objective: lower the largest bin weight while keeping every bin within the size cap. Each step looks at every
    item of the most loaded bin against every other bin (moves) and every other item (swaps), and applies the one
    that leaves the smaller of the two touched bins' new maximum, if that is below the current maximum. Each step
    is O(k * (N + K)) vectorised for k items on the top bin; it stops at a local optimum or after max_steps.

    Args:
        weights, sizes: per-item work and tokens.
        bin_of: a feasible assignment (every item placed).
        num_bins, capacity: as in :func:`lpt_with_cap`.
        max_steps: step limit (default 4 * num_bins + 64).
    Returns:
        a new assignment array, never worse than bin_of in max load.
    """
    weights = np.asarray(weights, dtype=np.float64)
    sizes = np.asarray(sizes, dtype=np.int64)
    bin_of = np.array(bin_of, dtype=np.int64)
    assert (bin_of >= 0).all()
    loads = np.bincount(bin_of, weights=weights, minlength=num_bins)
    used = np.bincount(bin_of, weights=sizes, minlength=num_bins).astype(np.int64)
    tolerance = 1e-12 * max(float(loads.max()), 1e-300)
    steps = max_steps if max_steps is not None else 4 * num_bins + 64
    for _ in range(steps):
        top = int(np.argmax(loads))
        top_load = loads[top]
        on_top = np.flatnonzero(bin_of == top)
        best_score, best_action = top_load - tolerance, None
        # Moves: item x of the top bin to bin r.
        w_x = weights[on_top][:, None]
        new_r = loads[None, :] + w_x
        move_ok = used[None, :] + sizes[on_top][:, None] <= capacity
        move_ok[:, top] = False
        move_score = np.where(move_ok, np.maximum(top_load - w_x, new_r), np.inf)
        flat = int(np.argmin(move_score))
        if move_score.flat[flat] < best_score:
            best_score = move_score.flat[flat]
            best_action = ("move", int(on_top[flat // num_bins]), flat % num_bins)
        # Swaps: item x of the top bin with item y elsewhere, lighter than x.
        other = bin_of != top
        delta = weights[on_top][:, None] - weights[None, :]
        other_bins = bin_of[None, :]
        swap_ok = other[None, :] & (delta > 0)
        swap_ok &= used[top] - sizes[on_top][:, None] + sizes[None, :] <= capacity
        swap_ok &= used[other_bins] - sizes[None, :] + sizes[on_top][:, None] <= capacity
        swap_score = np.where(swap_ok, np.maximum(top_load - delta, loads[other_bins] + delta), np.inf)
        flat = int(np.argmin(swap_score))
        if swap_score.flat[flat] < best_score:
            best_score = swap_score.flat[flat]
            best_action = ("swap", int(on_top[flat // weights.size]), flat % weights.size)
        if best_action is None:
            break
        kind, x, target = best_action
        if kind == "move":
            _move(x, top, target, bin_of, loads, used, weights, sizes)
        else:
            y_bin = int(bin_of[target])
            _move(x, top, y_bin, bin_of, loads, used, weights, sizes)
            _move(target, y_bin, top, bin_of, loads, used, weights, sizes)
    return bin_of


def _move(item: int, source: int, target: int, bin_of: np.ndarray, loads: np.ndarray, used: np.ndarray,
          weights: np.ndarray, sizes: np.ndarray) -> None:
    bin_of[item] = target
    loads[source] -= weights[item]
    loads[target] += weights[item]
    used[source] -= sizes[item]
    used[target] += sizes[item]


def level_sizes(weights: np.ndarray, sizes: np.ndarray, bin_of: np.ndarray, num_bins: int,
                capacity: int) -> np.ndarray:
    """Move and swap items off bins above `capacity` until they fit, disturbing the weights little.

    Objective: every bin's total size within `capacity` (a tighter cap than the one the assignment was made
    under), shifting little weight between bins; the weights are rebalanced afterwards (by swaps within the cap).
    A bin above the cap considers the moves of one of its items to a bin with room and the swaps of one of its
    items with a smaller item elsewhere, and takes, first among those that bring it within the cap (failing that,
    those that lower it most), the one that leaves its target the least room (best fit, so that large gaps stay
    for the bins that need them), then the one that shifts the least weight, then the least-weighted target. Items
    of no size never move. Bins no move or swap can lower stay above the cap. O(steps * k * K) for k items on the
    bin.

    Args:
        weights, sizes: per-item work and tokens.
        bin_of: a full assignment (every item placed).
        num_bins: number of bins.
        capacity: the size cap to reach.
    Returns:
        a new assignment array.
    """
    weights = np.asarray(weights, dtype=np.float64)
    sizes = np.asarray(sizes, dtype=np.int64)
    bin_of = np.array(bin_of, dtype=np.int64)
    loads = np.bincount(bin_of, weights=weights, minlength=num_bins)
    used = np.bincount(bin_of, weights=sizes, minlength=num_bins).astype(np.int64)
    for source in np.flatnonzero(used > capacity).tolist():
        while used[source] > capacity:
            mine = np.flatnonzero((bin_of == source) & (sizes > 0))
            # Candidates (x, y): y = -1 moves x to bin `target`; else x and y swap. Size leaving the source: gap.
            others = np.flatnonzero((bin_of != source) & (sizes > 0))  # items of no size never move
            gap = sizes[mine][:, None] - sizes[others][None, :]
            fits = (gap > 0) & (used[bin_of[others]][None, :] + gap <= capacity)
            x_idx, y_idx = np.nonzero(fits)
            swap_gap = gap[x_idx, y_idx]
            swap_shift = np.abs(weights[mine[x_idx]] - weights[others[y_idx]])
            swap_target = bin_of[others[y_idx]]
            room = used[None, :] + sizes[mine][:, None] <= capacity
            mx, mt = np.nonzero(room)
            gaps = np.concatenate((sizes[mine[mx]], swap_gap))
            if gaps.size == 0:
                break
            shifts = np.concatenate((weights[mine[mx]], swap_shift))
            targets = np.concatenate((mt, swap_target))
            # Prefer actions that bring the bin within the cap; among them the one that leaves its target the
            # least room (best fit: large gaps stay for the bins that need them), then the least weight shifted.
            short = (used[source] - gaps > capacity).astype(np.int64)
            room_left = capacity - used[targets] - gaps
            best = int(np.lexsort((loads[targets], shifts, room_left, short * -gaps))[0])
            x = int(mine[np.concatenate((mx, x_idx))[best]])
            target = int(targets[best])
            _move(x, source, target, bin_of, loads, used, weights, sizes)
            if best >= mx.size:
                y = int(others[y_idx[best - mx.size]])
                _move(y, target, source, bin_of, loads, used, weights, sizes)
    return bin_of

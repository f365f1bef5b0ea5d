"""Makespan scheduling under a per-bin size cap: LPT greedy and a move/swap refinement."""

from __future__ import annotations

import heapq

import numpy as np

from fcp_compiler.algorithms.keys import lexsort_first

UNPLACED = -1
# Bounds on the dense (top-bin item x candidate) matrices the local searches build, so that memory scales with the
# items, not with bins x items: evaluated PAIRS_AT_ONCE at a time, and past SWAP_PAIRS in all, swaps look only at the
# items of the least-loaded bins (moves, with one column a bin, always see every bin).
PAIRS_AT_ONCE = 1 << 18
SWAP_PAIRS = 1 << 20
# Items under which the swap search's window test compares them at once rather than a run at a time (numpy calls
# cost more than the comparisons below this).
SMALL_RUNS = 8192


def lpt_with_cap(weights: np.ndarray, sizes: np.ndarray, num_bins: int, capacity: int,
                 preferred: np.ndarray | None = None, slack: float = 0.0) -> np.ndarray:
    """Longest-processing-time-first onto the least-loaded bin that has room.

    Objective: minimise the largest bin weight subject to every bin's total size <= capacity. Items go in order
    of decreasing weight (ties by index, or taking the preferred bins in turn) to the least-loaded bin (ties by bin
    index) whose size stays within the cap, or to the item's preferred bin when that has room and is within
    `slack` of the least load. A bin too full for an item waits, by room, until an item small enough comes:
    O((K + W) log N) for K items, N bins and W such waits (at most N each time the item size falls).

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
    # Bins too full for an item wait here, by room (most first), until an item small enough comes: a bin's load
    # and room cannot change while it waits (only a bin with room for the item is ever chosen), and each bin
    # waits or returns once per change of the sizes, not once per item as when it is put back after every item.
    parked: list[tuple[int, float, int]] = []  # (-room, load, bin)
    sizes_list = sizes.tolist()
    weights_list = weights.tolist()
    preferred_list = preferred.tolist() if preferred is not None else None
    for item_idx in order.tolist():
        size = sizes_list[item_idx]
        while parked and -parked[0][0] >= size:
            _, load, bin_idx = heapq.heappop(parked)
            heapq.heappush(heap, (load, bin_idx))
        while heap and (heap[0][0] != loads[heap[0][1]] or used[heap[0][1]] + size > capacity):
            entry = heapq.heappop(heap)
            if entry[0] == loads[entry[1]]:
                heapq.heappush(parked, (used[entry[1]] - capacity, entry[0], entry[1]))
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
    return bin_of


def refine_moves_swaps(weights: np.ndarray, sizes: np.ndarray, bin_of: np.ndarray, num_bins: int, capacity: int,
                       max_steps: int | None = None) -> np.ndarray:
    """Local search on the most loaded bin: the best single move or pairwise swap that lowers it.

    Objective: lower the largest bin weight while keeping every bin within the size cap. Each step looks at every
    item of the most loaded bin against every other bin (moves) and every other item (swaps), and applies the one
    that leaves the smaller of the two touched bins' new maximum, if that is below the current maximum. Each step
    is O(k * (N + K)) vectorised for k items on the top bin, in slices of PAIRS_AT_ONCE entries; past SWAP_PAIRS
    (top item, other item) pairs, swaps are sought among the items of the least-loaded bins only. It stops at a
    local optimum or after max_steps.

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
    by_weight = _ByWeight(weights, bin_of)
    for _ in range(steps):
        top = int(np.argmax(loads))
        top_load = loads[top]
        on_top = np.flatnonzero(bin_of == top)
        best_score, best_action = top_load - tolerance, None
        move = _best_move(on_top, top, weights, sizes, loads, used, capacity)
        if move is not None and move[0] < best_score:
            best_score, best_action = move[0], ("move", move[1], move[2])
        swap = _best_swap(on_top, top, weights, sizes, bin_of, loads, used, capacity, best_score, by_weight)
        if swap is not None and swap[0] < best_score:
            best_score, best_action = swap[0], ("swap", swap[1], swap[2])
        if best_action is None:
            break
        kind, x, target = best_action
        if kind == "move":
            _move(x, top, target, bin_of, loads, used, weights, sizes)
            by_weight.moved(x, target)
        else:
            y_bin = int(bin_of[target])
            _move(x, top, y_bin, bin_of, loads, used, weights, sizes)
            _move(target, y_bin, top, bin_of, loads, used, weights, sizes)
            by_weight.moved(x, y_bin)
            by_weight.moved(target, top)
    return bin_of


def _row_chunks(num_rows: int, num_columns: int):
    """Row ranges whose (rows x columns) matrices hold at most PAIRS_AT_ONCE entries (at least one row each)."""
    step = max(1, PAIRS_AT_ONCE // max(num_columns, 1))
    return ((start, min(start + step, num_rows)) for start in range(0, num_rows, step))


def _best_move(on_top: np.ndarray, top: int, weights: np.ndarray, sizes: np.ndarray, loads: np.ndarray,
               used: np.ndarray, capacity: int) -> tuple[float, int, int] | None:
    """The move of an item of the top bin to another bin that leaves the lower maximum of the two: (score, item,
    bin), the first in (item, bin) order among equals; None when no move fits."""
    best = None
    for start, stop in _row_chunks(on_top.size, loads.size):
        rows = on_top[start:stop]
        w_x = weights[rows][:, None]
        score = loads[None, :] + w_x
        np.maximum(score, loads[top] - w_x, out=score)
        refused = used[None, :] + sizes[rows][:, None] > capacity
        refused[:, top] = True
        np.copyto(score, np.inf, where=refused)
        flat = int(np.argmin(score))
        if np.isfinite(score.flat[flat]) and (best is None or score.flat[flat] < best[0]):
            best = (float(score.flat[flat]), int(rows[flat // loads.size]), flat % loads.size)
    return best


def _lightest_partners(on_top: np.ndarray, top: int, bin_of: np.ndarray, loads: np.ndarray) -> np.ndarray:
    """The items a top-bin item may swap with where (top items x every item elsewhere) is past SWAP_PAIRS: the items
    of the least-loaded bins (the partners that lower the top the most), about SWAP_PAIRS pairs' worth."""
    others = np.flatnonzero(bin_of != top)
    lightest = np.lexsort((np.arange(loads.size), loads))
    return _items_of_first_bins(others, bin_of, lightest[lightest != top], loads.size, SWAP_PAIRS // on_top.size)


class _ByWeight:
    """The items in order of weight (ties by index), their weights and their bins in that order (the bins kept up to
    date by :meth:`moved`): the swap search's window test finds, for every item at once, the lightest top item
    heavier than a bound that rises with the item's weight."""

    __slots__ = ("order", "weights", "bins", "position")

    def __init__(self, weights: np.ndarray, bin_of: np.ndarray):
        self.order = np.argsort(weights, kind="stable")
        self.weights = weights[self.order]
        self.bins = bin_of[self.order]
        self.position = np.empty_like(self.order)
        self.position[self.order] = np.arange(self.order.size)

    def moved(self, item: int, target: int) -> None:
        """Record that `item` is now in bin `target`."""
        self.bins[self.position[item]] = target


def _window_partners(top: int, top_load: float, top_weights: np.ndarray, num_items: int, loads: np.ndarray,
                     below: float, slack: float, by_weight: _ByWeight) -> np.ndarray:
    """The items elsewhere that a top item x may swap with for a score below `below` (the window test of
    :func:`_best_swap`, slack included), in item order: y, in a bin of load L, where the lightest top weight above
    w_y + (top - below) - slack is below w_y + (below - L) + slack. The bounds rise with w_y, so in weight order each
    top weight (ascending) is the lightest one above the bound for a run of items, found by one binary search a top
    item: the same test as a binary search an item, at a fraction of the cost (tens of thousands of items a step)."""
    bounds = by_weight.weights + (top_load - below) - slack  # non-decreasing, as the weights are
    ends = np.searchsorted(bounds, top_weights, side="left")  # where each top weight's run ends
    reached = int(ends[-1])  # the later items have no top weight above their bound
    item_bins = by_weight.bins[:reached]
    # w_y + (below - L) + slack, as the test adds it up, with (below - L) once a bin
    reach = by_weight.weights[:reached] + (below - loads)[item_bins]
    reach += slack
    if reached <= SMALL_RUNS:  # one comparison against each item's next top weight, spelled out
        keep = np.repeat(top_weights, np.diff(ends, prepend=0)) < reach
    else:  # a comparison a run, in place (tens of thousands of items)
        keep = np.empty(reached, dtype=bool)
        low = 0
        for weight, high in zip(top_weights.tolist(), ends.tolist()):
            np.less(weight, reach[low:high], out=keep[low:high])
            low = high
    keep &= item_bins != top
    chosen = np.zeros(num_items, dtype=bool)
    chosen[by_weight.order[:reached][keep]] = True
    return np.flatnonzero(chosen)


def _items_of_first_bins(items: np.ndarray, bin_of: np.ndarray, bin_order: np.ndarray, num_bins: int,
                         at_least: int) -> np.ndarray:
    """The items (of `items`, in their order) in the first bins of `bin_order`, whole bins, until there are at
    least `at_least` of them (or every bin of the order is taken)."""
    per_bin = np.bincount(bin_of[items], minlength=num_bins)
    enough = int(np.searchsorted(np.cumsum(per_bin[bin_order]), max(at_least, 1))) + 1
    chosen = np.zeros(num_bins, dtype=bool)
    chosen[bin_order[:enough]] = True
    return items[chosen[bin_of[items]]]


def _best_swap(on_top: np.ndarray, top: int, weights: np.ndarray, sizes: np.ndarray, bin_of: np.ndarray,
               loads: np.ndarray, used: np.ndarray, capacity: int, below: float,
               by_weight: _ByWeight) -> tuple[float, int, int] | None:
    """The swap of an item x of the top bin with a lighter item y elsewhere that leaves the lower maximum of the
    two bins: (score, x, y), the first in (x, y) order among equals, among the swaps that score below `below`
    (the best move's score: only a lower one is taken); None when no such swap fits."""
    if on_top.size == 0:  # an empty top bin (every load zero) has nothing to swap
        return None
    # A swap moving delta = w_x - w_y scores below `below` only if top - delta < below and L + delta < below (L: y's
    # bin's load): w_x in (w_y + top - below, w_y + below - L). Partners with no top item's weight in that window
    # cannot win, and are dropped before the (top items x partners) matrices: balanced bins leave windows far
    # narrower than the weights. A slack covers the rounding of the scores.
    top_load, top_weights = float(loads[top]), np.sort(weights[on_top])
    slack = 1e-9 * max(abs(top_load), 1.0)
    partners = _window_partners(top, top_load, top_weights, bin_of.size, loads, below, slack, by_weight)
    if on_top.size * (bin_of.size - on_top.size) > SWAP_PAIRS:  # those of the least-loaded bins only
        partners = np.intersect1d(partners, _lightest_partners(on_top, top, bin_of, loads), assume_unique=True)
    if partners.size == 0:
        return None
    partner_bins = bin_of[partners]
    partner_weights, partner_sizes = weights[partners][None, :], sizes[partners][None, :]
    partner_loads = loads[partner_bins][None, :]
    # The size checks as one comparison each: x's size against the room y's bin has once y leaves it, and y's size
    # against the room the top bin has once x leaves it (integers: the same test as summing, without the sums).
    partner_room = (capacity - used[partner_bins] + sizes[partners])[None, :]
    best = None
    for start, stop in _row_chunks(on_top.size, partners.size):
        rows = on_top[start:stop]
        row_weights, row_sizes = weights[rows][:, None], sizes[rows][:, None]
        delta = row_weights - partner_weights
        score = loads[top] - delta
        np.maximum(score, np.add(partner_loads, delta, out=delta), out=score)
        refused = row_weights <= partner_weights  # delta <= 0
        refused |= partner_sizes > capacity - used[top] + row_sizes
        refused |= row_sizes > partner_room
        np.copyto(score, np.inf, where=refused)
        flat = int(np.argmin(score))
        if np.isfinite(score.flat[flat]) and (best is None or score.flat[flat] < best[0]):
            best = (float(score.flat[flat]), int(rows[flat // partners.size]), int(partners[flat % partners.size]))
    return best


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
    bin; past SWAP_PAIRS (item, other item) pairs, swaps look only at the items of the bins with the most room.

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
            if mine.size * others.size > SWAP_PAIRS:  # the bins with the most room take a swap most easily
                roomiest = np.lexsort((np.arange(num_bins), used - capacity))
                others = _items_of_first_bins(others, bin_of, roomiest, num_bins, SWAP_PAIRS // mine.size)
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
            best = lexsort_first((loads[targets], shifts, room_left, short * -gaps))
            x = int(mine[np.concatenate((mx, x_idx))[best]])
            target = int(targets[best])
            _move(x, source, target, bin_of, loads, used, weights, sizes)
            if best >= mx.size:
                y = int(others[y_idx[best - mx.size]])
                _move(y, target, source, bin_of, loads, used, weights, sizes)
    return bin_of

"""Balance measures and lower bounds (DESIGN section 5)."""

from __future__ import annotations

import numpy as np


def imbalance_ratio(loads: np.ndarray) -> float:
    """(max - mean) / max of a per-rank load vector; 0 for an all-zero vector."""
    loads = np.asarray(loads, dtype=np.float64)
    peak = float(loads.max()) if loads.size else 0.0
    return 0.0 if peak <= 0 else (peak - float(loads.mean())) / peak


def makespan_lower_bound(total_work: float, num_ranks: int, largest_unsplittable: float) -> tuple[float, str]:
    """Lower bound on the largest per-rank load, and which bound applies.

    Args:
        total_work: sum of all work.
        num_ranks: number of ranks sharing it.
        largest_unsplittable: the largest piece of work that cannot be split across ranks (a tile when tiles may
            run away from their block's owner, a whole block otherwise).
    Returns:
        (bound, name) with name "mean" or "largest_piece".
    """
    mean = total_work / num_ranks
    return (mean, "mean") if mean >= largest_unsplittable else (largest_unsplittable, "largest_piece")


def indivisible_lower_bound(piece_work: np.ndarray, num_ranks: int) -> float:
    """Lower bound on the largest per-rank load when every piece (a tile) runs whole on one rank.

    Objective: the best bound of the form "some rank holds k + 1 of the k N + 1 largest pieces" (pigeonhole), so the
    largest load is at least the sum of the k + 1 smallest of them, for every k; and at least the mean. With k = 0
    it is the largest piece. Tight when pieces are near-equal and their count is just past a multiple of N: 15
    pieces of one size on a rank when the mean is 14.6 of them. O(P log P) for P pieces.

    Args:
        piece_work: the work of each indivisible piece.
        num_ranks: N.
    Returns:
        the bound (0 for no pieces).
    """
    work = np.sort(np.asarray(piece_work, dtype=np.float64))[::-1]
    if work.size == 0:
        return 0.0
    mean = float(work.sum()) / num_ranks
    k = np.arange((work.size - 1) // num_ranks + 1)
    last = k * num_ranks  # index of the (k N + 1)-th largest piece
    prefix = np.concatenate(([0.0], np.cumsum(work)))
    # The k + 1 smallest of the k N + 1 largest are work[last - k .. last].
    pigeonhole = prefix[last + 1] - prefix[last - k]
    return max(mean, float(pigeonhole.max()))

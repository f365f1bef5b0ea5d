"""Balance measures and lower bounds (docs/DESIGN.md section 5)."""

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


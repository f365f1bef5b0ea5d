"""Counting visible (query, key) token pairs between position ranges of one sequence."""

from __future__ import annotations

import numpy as np


def visible_pairs(q_start: np.ndarray, q_end: np.ndarray, k_start: np.ndarray, k_end: np.ndarray,
                  causal: bool) -> np.ndarray:
    """Number of (query, key) pairs with query in [q_start, q_end) that see a key in [k_start, k_end).

    Positions are token indices inside one sequence. Under a causal mask query i sees key j iff j <= i; under a
    full mask every pair is visible. Closed form per range pair, O(1) each, vectorised.

    Args:
        q_start, q_end, k_start, k_end: int arrays of equal shape (half-open ranges).
        causal: mask kind.
    Returns:
        int64 array of visible pair counts.
    """
    q_start = np.asarray(q_start, dtype=np.int64)
    q_end = np.asarray(q_end, dtype=np.int64)
    k_start = np.asarray(k_start, dtype=np.int64)
    k_end = np.asarray(k_end, dtype=np.int64)
    k_len = k_end - k_start
    if not causal:
        return (q_end - q_start) * k_len
    # Queries in [max(q_start, k_start), min(q_end, k_end)) see a growing prefix of the key range: i + 1 - k_start.
    ramp_lo = np.maximum(q_start, k_start)
    ramp_hi = np.minimum(q_end, k_end)
    ramp_n = np.maximum(ramp_hi - ramp_lo, 0)
    ramp = ramp_n * (ramp_lo + 1 - k_start) + ramp_n * (ramp_n - 1) // 2
    # Queries at or after k_end see the whole key range.
    full_n = np.maximum(q_end - np.maximum(q_start, k_end), 0)
    return ramp + full_n * k_len

"""Visible (query, key) token pairs between two ranges of one sequence, under a causal, windowed or full mask."""

from __future__ import annotations

import numpy as np


def _tail_sums(q_start: np.ndarray, q_end: np.ndarray, x: np.ndarray) -> np.ndarray:
    """sum over q in [q_start, q_end) of max(q - x, 0), elementwise."""
    first = np.maximum(q_start, x + 1)
    count = np.maximum(q_end - first, 0)
    return count * (first - x) + count * (count - 1) // 2


def _pairs_at_least(q_start, q_end, k_start, k_end, gap) -> np.ndarray:
    """How many (q, k) in the ranges have q - k >= gap: sum over q of #{k : k <= q - gap}, as two tail sums."""
    return _tail_sums(q_start, q_end, gap + k_start - 1) - _tail_sums(q_start, q_end, gap + k_end - 1)


def visible_pairs(q_start, q_end, k_start, k_end, window) -> np.ndarray:
    """Visible token pairs between query positions [q_start, q_end) and key positions [k_start, k_end) of one
    sequence, elementwise.

    Objective: count (q, k) with k <= q and q - k < window (window >= 1: causal, within the `window` most recent
    keys, a query itself included; a causal mask is a window as long as the sequence), or every pair (window 0: a
    full mask). Closed form: pairs with q - k >= 0 minus those with q - k >= window, each a difference of two sums of
    a clamped linear function. O(1) per element in exact int64 arithmetic.

    Args:
        q_start, q_end, k_start, k_end: int arrays (or scalars) of positions inside the sequence, ends exclusive.
        window: int array or scalar, as above.
    Returns:
        int64 array of pair counts.
    """
    q_start, q_end, k_start, k_end, window = np.broadcast_arrays(*(np.asarray(a, dtype=np.int64) for a in (
        q_start, q_end, k_start, k_end, window)))
    # Most pairs of a long causal sequence are whole rectangles: every key at or before every query, and the
    # farthest pair inside the window. Only the rest (diagonals, pairs a window cuts) need the closed form.
    shape = q_start.shape
    q_start, q_end, k_start, k_end, window = (x.reshape(-1) for x in (q_start, q_end, k_start, k_end, window))
    pairs = np.maximum(q_end - q_start, 0) * np.maximum(k_end - k_start, 0)
    partial = np.flatnonzero((window > 0) & ((k_end - 1 > q_start) | (q_end - 1 - k_start >= window)))
    if partial.size:
        q_start, q_end, k_start, k_end, window = (x[partial] for x in (q_start, q_end, k_start, k_end, window))
        pairs[partial] = (_pairs_at_least(q_start, q_end, k_start, k_end, np.zeros_like(window))
                          - _pairs_at_least(q_start, q_end, k_start, k_end, window))
    return pairs.reshape(shape)


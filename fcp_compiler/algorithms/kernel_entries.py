"""How a (query segment, key segment) pair of one sequence enters a varlen attention call under its mask.

flash-attn's varlen contract aligns masks bottom-right: in an entry of Lq query rows and Lk key rows, row i sees key
j when i + Lk - Lq - left <= j <= i + Lk - Lq + right (-1: unbounded; causal sets right = 0). Under a causal mask a
key segment is wholly before the query segment (all visible) or is the query segment (the diagonal), so one entry
packs all of a query segment's keys, the diagonal last. A sliding window of w keys splits that: a key segment
partly out of reach gets an entry of its own, its rows trimmed to those that see something, with the window that
makes bottom-right alignment exact; so does a diagonal longer than the window.
"""

from __future__ import annotations

import numpy as np

UNMASKED = 0  # every key seen: packed into the query segment's entry (a full mask, or an earlier key within reach)
CAUSAL = 1  # the diagonal within one window: packed last into the entry, which runs causal
WINDOW_DIAGONAL = 2  # the diagonal longer than the window: its own entry, causal with window (w - 1, 0)
WINDOW_BEFORE = 3  # an earlier key segment partly out of reach: its own trimmed entry, window (left, -1)


def sees_any(q_start, q_end, k_start, k_end, window) -> np.ndarray:
    """Whether some query of each segment pair (same sequence; ends exclusive) sees some key of it: every pair
    under a full mask (window 0), else keys that start before the queries end and end within the window of the
    first query. Bool array; the pairs :func:`classify_pairs` takes are those where it holds."""
    return (window == 0) | ((k_start < q_end) & (q_start - k_end + 1 < window))


def classify_pairs(q_start, q_end, k_start, k_end, window) -> tuple[np.ndarray, ...]:
    """Classify visible segment pairs (same sequence, keys not after the queries under a causal-type mask).

    Args:
        q_start, q_end, k_start, k_end: int arrays, positions inside the sequence (ends exclusive).
        window: int array: keys a query sees back, itself included; 0 for a full mask.
    Returns:
        (kind, left, q_rows, k_first): kind as above; left, the window's left extent for WINDOW_* entries (w - 1,
        or k_end - trimmed query end + w - 1), -1 otherwise; q_rows, how many query rows from the segment's start
        the entry keeps (rows past k_end + w - 2 see no key of the segment); k_first, the first key row kept
        (keys before q_start - w + 1 are seen by no query). O(1) per pair.
    """
    columns = [np.asarray(a, dtype=np.int64) for a in (q_start, q_end, k_start, k_end, window)]
    shape = np.broadcast_shapes(*(column.shape for column in columns))
    q_start, q_end, k_start, k_end, window = (np.broadcast_to(column, shape).ravel() for column in columns)
    diagonal = (q_start == k_start) & (window > 0)
    within = q_end - 1 - k_start <= window - 1  # the farthest pair is within reach: no key masked by the window
    kind = np.where(window == 0, UNMASKED, np.where(
        diagonal, np.where(within, CAUSAL, WINDOW_DIAGONAL), np.where(within, UNMASKED, WINDOW_BEFORE)))
    # Only the pairs a window cuts have trimmed rows and a left extent (none under causal and full masks).
    q_stop, left, k_first = q_end.copy(), np.full(kind.size, -1, dtype=np.int64), np.zeros(kind.size, dtype=np.int64)
    cut = np.flatnonzero(kind >= WINDOW_DIAGONAL)
    if cut.size:
        before = kind[cut] == WINDOW_BEFORE
        w, start = window[cut], k_start[cut]
        stop = np.where(before, np.minimum(q_end[cut], k_end[cut] + w - 1), q_end[cut])
        q_stop[cut] = stop
        k_first[cut] = np.where(before, np.maximum(start, q_start[cut] - w + 1) - start, 0)
        left[cut] = np.where(before, k_end[cut] - stop + w - 1, w - 1)
    return tuple(column.reshape(shape) for column in (kind, left, q_stop - q_start, k_first))

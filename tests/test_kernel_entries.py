"""classify_pairs: each entry, as flash-attn's bottom-right window reads it, sees exactly the visible pairs."""

import numpy as np
from hypothesis import given
from hypothesis import strategies as st

from fcp_compiler.algorithms.kernel_entries import CAUSAL, UNMASKED, WINDOW_BEFORE, WINDOW_DIAGONAL, classify_pairs


def bottom_right(lq: int, lk: int, causal: bool, left: int, right: int) -> np.ndarray:
    """flash-attn's varlen mask of one entry."""
    right = 0 if causal else right
    i, j = np.arange(lq)[:, None], np.arange(lk)[None, :]
    seen = np.ones((lq, lk), dtype=bool)
    if right >= 0:
        seen &= j <= i + lk - lq + right
    if left >= 0:
        seen &= j >= i + lk - lq - left
    return seen


@given(st.integers(0, 50), st.integers(1, 30), st.integers(1, 30), st.integers(0, 40), st.integers(1, 90))
def test_entries_see_exactly_the_visible_pairs(k_start, k_len, q_len, gap, window):
    # A key segment before (or, with gap 0 and equal lengths, equal to) the query segment, under a window.
    diagonal = gap == 0 and k_len == q_len
    q_start = k_start if diagonal else k_start + k_len + gap
    q_end, k_end = q_start + q_len, k_start + k_len
    q = np.arange(q_start, q_end)[:, None]
    k = np.arange(k_start, k_end)[None, :]
    visible = (k <= q) & (q - k < window)
    if not visible.any():
        return
    kind, left, q_rows, k_first = (int(a) for a in classify_pairs(q_start, q_end, k_start, k_end, window))
    if kind in (UNMASKED, CAUSAL):  # the whole segments, no window: all seen, or the causal triangle
        assert q_rows == q_len and k_first == 0
        assert np.array_equal(visible, bottom_right(q_len, k_len, kind == CAUSAL, -1, -1))
        assert kind == CAUSAL or visible.all()
        return
    assert left >= 0 and kind in (WINDOW_DIAGONAL, WINDOW_BEFORE)
    kept = bottom_right(q_rows, k_len - k_first, kind == WINDOW_DIAGONAL, left, -1)
    assert kept.any(axis=1).all()  # no row of the entry sees nothing (its LSE would be infinite)
    expected = np.zeros_like(visible)
    expected[:q_rows, k_first:] = kept
    assert np.array_equal(expected, visible)


def test_full_masks_are_unmasked_entries():
    kind, left, q_rows, k_first = classify_pairs([0, 512], [512, 1024], [512, 0], [1024, 512], [0, 0])
    assert kind.tolist() == [UNMASKED, UNMASKED] and q_rows.tolist() == [512, 512] and k_first.tolist() == [0, 0]

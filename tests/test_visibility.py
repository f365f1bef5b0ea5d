"""visible_pairs against brute force over every (query, key) pair."""

import numpy as np
from hypothesis import given
from hypothesis import strategies as st

from fcp_compiler.algorithms.visibility import visible_pairs


def brute_force(q_start, q_end, k_start, k_end, window) -> int:
    q = np.arange(q_start, q_end)[:, None]
    k = np.arange(k_start, k_end)[None, :]
    seen = np.ones((q.size, k.size), dtype=bool) if window == 0 else (k <= q) & (q - k < window)
    return int(seen.sum())


ranges = st.tuples(st.integers(0, 60), st.integers(1, 40)).map(lambda t: (t[0], t[0] + t[1]))


@given(ranges, ranges, st.integers(0, 80))
def test_visible_pairs_match_brute_force(queries, keys, window):
    expected = brute_force(*queries, *keys, window)
    assert int(visible_pairs(*queries, *keys, window)) == expected


def test_vectorised_and_causal_is_a_window_as_long_as_the_sequence():
    rng = np.random.default_rng(0)
    starts = rng.integers(0, 500, size=(4, 200))
    lengths = rng.integers(1, 300, size=(2, 200))
    q_start, k_start = starts[0], starts[1]
    q_end, k_end = q_start + lengths[0], k_start + lengths[1]
    windows = rng.integers(0, 900, size=200)
    got = visible_pairs(q_start, q_end, k_start, k_end, windows)
    assert got.tolist() == [brute_force(*args) for args in zip(q_start, q_end, k_start, k_end, windows)]
    # A window past every difference is the causal mask: a diagonal block is a triangle, an earlier one whole.
    assert int(visible_pairs(0, 4096, 0, 4096, 10**6)) == 4096 * 4097 // 2
    assert int(visible_pairs(8192, 12288, 0, 4096, 10**6)) == 4096 * 4096
    # 512K tokens against themselves fit int64 exactly.
    assert int(visible_pairs(0, 524288, 0, 524288, 4096)) == 4096 * 4097 // 2 + (524288 - 4096) * 4096

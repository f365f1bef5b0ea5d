import numpy as np
from hypothesis import given
from hypothesis import strategies as st

from fcp_compiler.algorithms.intervals import visible_pairs


def brute(qs, qe, ks, ke, causal):
    return sum(1 for i in range(qs, qe) for j in range(ks, ke) if (j <= i or not causal))


ranges = st.tuples(st.integers(0, 40), st.integers(1, 20)).map(lambda t: (t[0], t[0] + t[1]))


@given(ranges, ranges, st.booleans())
def test_visible_pairs_matches_brute_force(q, k, causal):
    got = visible_pairs(np.array([q[0]]), np.array([q[1]]), np.array([k[0]]), np.array([k[1]]), causal)
    assert int(got[0]) == brute(q[0], q[1], k[0], k[1], causal)


def test_causal_diagonal_block_is_half_plus_diagonal():
    assert int(visible_pairs(np.array([0]), np.array([4096]), np.array([0]), np.array([4096]), True)[0]) \
        == 4096 * 4097 // 2

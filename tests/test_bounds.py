"""Lower bounds on the largest per-rank load, against exhaustive search on small cases."""

import itertools

import numpy as np
from hypothesis import given
from hypothesis import strategies as st

from fcp_compiler.algorithms.bounds import indivisible_lower_bound


def _optimal_makespan(work, num_ranks):
    """Exhaustive: every assignment of pieces to ranks (tiny cases)."""
    best = float("inf")
    for ranks in itertools.product(range(num_ranks), repeat=len(work)):
        loads = [0.0] * num_ranks
        for piece, rank in zip(work, ranks):
            loads[rank] += piece
        best = min(best, max(loads))
    return best


@given(st.lists(st.integers(1, 20), min_size=1, max_size=7), st.integers(1, 3))
def test_indivisible_lower_bound_never_exceeds_the_optimum(work, num_ranks):
    bound = indivisible_lower_bound(np.array(work, dtype=float), num_ranks)
    assert max(max(work), sum(work) / num_ranks) <= bound + 1e-9
    assert bound <= _optimal_makespan(work, num_ranks) + 1e-9


def test_indivisible_lower_bound_sees_equal_pieces_past_a_multiple_of_the_ranks():
    # 2 * 4 + 1 equal pieces on 4 ranks: one rank runs 3 of them, whatever the mean (2.25) says.
    assert indivisible_lower_bound(np.ones(9), 4) == 3.0

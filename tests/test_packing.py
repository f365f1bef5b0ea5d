import numpy as np
from hypothesis import given
from hypothesis import strategies as st

from fcp_compiler.algorithms.packing import best_fit_decreasing


@given(st.lists(st.integers(1, 100), min_size=1, max_size=60), st.integers(100, 160))
def test_bins_never_overflow_and_meet_lower_bound(sizes, capacity):
    sizes = np.array(sizes)
    bins = best_fit_decreasing(sizes, capacity)
    loads = np.bincount(bins, weights=sizes)
    assert loads.max() <= capacity and (loads > 0).all()
    assert bins.max() + 1 >= -(-sizes.sum() // capacity)
    # Any-fit packing never leaves two bins at most half full (the second's items would fit the first).
    assert (2 * loads <= capacity).sum() <= 1


def test_seeded_items_open_their_own_bins():
    sizes = np.array([60, 50, 10, 10, 10, 10])
    seeded = np.array([True, True, False, False, False, False])
    bins = best_fit_decreasing(sizes, 100, seeded=seeded)
    assert bins[0] != bins[1]
    assert np.bincount(bins).max() <= 100


def test_small_items_fill_exactly():
    sizes = np.full(64, 64)
    assert best_fit_decreasing(sizes, 4096).max() == 0

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
    # Any-fit packing never leaves two bins at most half full (the second's items would fit the first).
    assert (2 * loads <= capacity).sum() <= 1


def fewest_bins(sizes: list[int], capacity: int) -> int:
    """The optimum, by exhaustive search: items placed largest first into an open bin or a new one."""
    sizes = sorted(sizes, reverse=True)
    best = len(sizes)

    def place(i: int, loads: list[int]) -> None:
        nonlocal best
        if len(loads) >= best:
            return
        if i == len(sizes):
            best = len(loads)
            return
        for b in range(len(loads)):
            if loads[b] + sizes[i] <= capacity and loads[b] not in loads[:b]:  # equal loads are the same choice
                loads[b] += sizes[i]
                place(i + 1, loads)
                loads[b] -= sizes[i]
        place(i + 1, loads + [sizes[i]])

    place(0, [])
    return best


@given(st.lists(st.integers(1, 100), min_size=1, max_size=9), st.integers(100, 160))
def test_bins_are_within_best_fit_decreasing_bound_of_the_optimum(sizes, capacity):
    # BFD uses at most 11/9 OPT + 6/9 bins (Johnson; Dosa 2007); the exhaustive optimum is the reference.
    optimum = fewest_bins(sizes, capacity)
    used = int(best_fit_decreasing(np.array(sizes), capacity).max()) + 1
    assert optimum <= used <= 11 * optimum / 9 + 6 / 9


def test_seeded_items_open_their_own_bins():
    sizes = np.array([60, 50, 10, 10, 10, 10])
    seeded = np.array([True, True, False, False, False, False])
    bins = best_fit_decreasing(sizes, 100, seeded=seeded)
    assert bins[0] != bins[1]
    assert np.bincount(bins).max() <= 100


def test_small_items_fill_exactly():
    sizes = np.full(64, 64)
    assert best_fit_decreasing(sizes, 4096).max() == 0

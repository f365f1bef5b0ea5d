import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from fcp_compiler.algorithms import keys as keys_module
from fcp_compiler.algorithms.keys import unique_keys


@pytest.mark.parametrize("num_keys, space", [(1000, 50), (20000, 1 << 16), (1000, 1 << 20), (50, 1 << 24), (0, 10)])
def test_unique_keys_equals_numpy_unique_by_counting_and_by_sorting(num_keys, space, monkeypatch):
    rng = np.random.default_rng(num_keys + space)
    keys = rng.integers(0, space, size=num_keys)
    expected, expected_inverse = np.unique(keys, return_inverse=True)
    for limit in (keys_module.COUNTING_LIMIT, 0):  # as configured, then forced to sort
        monkeypatch.setattr(keys_module, "COUNTING_LIMIT", limit)
        unique, inverse = unique_keys(keys, space, return_inverse=True)
        assert np.array_equal(unique, expected) and np.array_equal(inverse, expected_inverse.ravel())
        assert np.array_equal(unique_keys(keys, space), expected)


@given(st.lists(st.integers(-5, 10**12), max_size=200))
def test_sorted_unique_is_np_unique(values):
    from fcp_compiler.algorithms.keys import sorted_unique

    keys = np.array(values, dtype=np.int64)
    unique, inverse = np.unique(keys, return_inverse=True)
    ours, our_inverse = sorted_unique(keys, return_inverse=True)
    assert np.array_equal(ours, unique) and np.array_equal(our_inverse, inverse.reshape(-1))
    assert np.array_equal(sorted_unique(keys), unique)
    _, first, inverse = np.unique(keys, return_index=True, return_inverse=True)
    ours, our_first, our_inverse = sorted_unique(keys, return_index=True, return_inverse=True)
    assert np.array_equal(our_first, first) and np.array_equal(our_inverse, inverse.reshape(-1))
    assert np.array_equal(sorted_unique(keys, return_index=True)[1], first)


@pytest.mark.parametrize("bound", [1, 300, 1 << 16, (1 << 16) + 1, 5_000_000, 1 << 32, (1 << 32) + 7])
def test_stable_order_is_a_stable_argsort_in_every_radix_regime(bound):
    from fcp_compiler.algorithms.keys import stable_order

    rng = np.random.default_rng(bound % 1000)
    for size in (0, 1, 5000):
        # Few distinct values, so the order among equal keys (index order) is what is being tested.
        keys = rng.choice(rng.integers(0, bound, size=40), size=size).astype(np.int64)
        assert np.array_equal(stable_order(keys, bound), np.argsort(keys, kind="stable"))


@given(st.lists(st.integers(-5, 10**12), max_size=200))
def test_sorted_unique_counts_is_np_unique_with_counts(values):
    from fcp_compiler.algorithms.keys import sorted_unique_counts

    keys = np.array(values, dtype=np.int64)
    unique, counts = np.unique(keys, return_counts=True)
    ours, our_counts = sorted_unique_counts(keys)
    assert np.array_equal(ours, unique) and np.array_equal(our_counts, counts)


@given(st.lists(st.integers(0, 40), unique=True, max_size=30), st.lists(st.integers(-5, 45), max_size=30))
def test_lookup_finds_each_present_key_and_gives_the_missing_value_otherwise(present, wanted):
    from fcp_compiler.algorithms.keys import lookup

    keys = np.sort(np.asarray(present, dtype=np.int64))
    values = keys * 10 + 3
    got = lookup(keys, values, np.asarray(wanted, dtype=np.int64), -1)
    assert got.tolist() == [w * 10 + 3 if w in present else -1 for w in wanted]


@given(st.lists(st.lists(st.integers(1, 9), max_size=5), max_size=8))
def test_group_sums_and_offsets_within_are_per_group_sums_and_prefixes(groups):
    from fcp_compiler.algorithms.ranges import group_sums, offsets, offsets_within

    values = np.asarray([v for g in groups for v in g], dtype=np.int64)
    counts = np.asarray([len(g) for g in groups], dtype=np.int64)
    ptr = np.concatenate(([0], np.cumsum(counts))).astype(np.int64)
    assert group_sums(values, ptr).tolist() == [sum(g) for g in groups]
    assert offsets_within(values, counts).tolist() == [sum(g[:i]) for g in groups for i in range(len(g))]
    assert offsets(counts).tolist() == [sum(len(g) for g in groups[:i]) for i in range(len(groups) + 1)]


@pytest.mark.parametrize("seed", range(12))
def test_lexsort_ints_is_np_lexsort(seed):
    from fcp_compiler.algorithms.keys import lexsort_ints

    rng = np.random.default_rng(seed)
    size = int(rng.integers(0, 400))
    # Narrow keys (packed into one sort, radix or not), keys with negatives, and keys too wide to pack together.
    high = [3, 1 << 20, 1 << 40][seed % 3]
    keys = [rng.integers(-5 if seed % 2 else 0, high, size) for _ in range(1 + seed % 3)]
    assert np.array_equal(lexsort_ints(keys), np.lexsort(keys))


@given(st.lists(st.integers(-(2**62), 2**62 - 1), max_size=300), st.integers(0, 3))
def test_stable_argsort_is_numpys_stable_argsort(values, kind):
    """One sort of packed values gives argsort's stable order: ties by index, negative keys, keys too wide to pack
    beside their index (argsort itself then), booleans and floats (argsort itself)."""
    from fcp_compiler.algorithms.keys import stable_argsort

    keys = np.asarray(values, dtype=np.int64)
    keys = (keys % 7 - 3, keys, keys > 0, keys.astype(np.float64))[kind]  # many ties; full range; bool; float
    got = stable_argsort(keys)
    assert got.dtype == np.int64 and np.array_equal(got, np.argsort(keys, kind="stable"))


def test_stable_argsort_of_unsigned_keys_past_int64_is_numpys():
    from fcp_compiler.algorithms.keys import stable_argsort

    for keys in (np.array([2**63 + 5, 2**63 + 1, 2**63 + 5, 7], dtype=np.uint64),
                 np.array([9, 3, 9, 0], dtype=np.uint64)):
        assert np.array_equal(stable_argsort(keys), np.argsort(keys, kind="stable"))


@given(st.integers(0, 10_000), st.integers(0, 3000), st.sampled_from(["left", "right"]), st.integers(0, 2))
def test_search_sorted_is_numpys_searchsorted(seed, num_values, side, kind):
    """Values searched in sorted order (from SEARCH_IN_ORDER on) land where np.searchsorted puts them: ties, values
    outside the array, floats, a 2-D array of values."""
    from fcp_compiler.algorithms.keys import search_sorted

    rng = np.random.default_rng(seed)
    ordered = np.sort(rng.integers(-50, 50, rng.integers(0, 200)))
    values = rng.integers(-60, 60, num_values)
    values = (values, values + 0.5, values.reshape(-1, 1) if num_values % 2 == 0 else values)[kind]
    got = search_sorted(ordered, values, side)
    assert got.shape == values.shape and np.array_equal(got, np.searchsorted(ordered, values, side=side))


@given(st.lists(st.tuples(st.integers(-2, 2), st.sampled_from([0.0, -0.0, 0.5, 1.5]), st.integers(0, 1)),
                min_size=1, max_size=60), st.integers(1, 3))
def test_lexsort_first_is_the_first_of_np_lexsort(rows, num_keys):
    """Ties on every key (the first wins), floats with signed zeros, ints: the least key tuple, last key primary."""
    from fcp_compiler.algorithms.keys import lexsort_first

    columns = [np.array(column) for column in zip(*rows)][:num_keys]
    assert lexsort_first(columns) == int(np.lexsort(columns)[0])
    assert lexsort_first(columns[::-1]) == int(np.lexsort(columns[::-1])[0])

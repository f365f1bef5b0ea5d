import numpy as np
import pytest

from fcp_compiler.errors import InvalidInputError
from fcp_compiler.tools.traces import empirical_batch, histogram_batch, lognormal_batch


def test_lognormal_is_seeded_and_exact():
    a = lognormal_batch(100_000, 4096, 1.8, 64, 524288, seed=5)
    assert a == lognormal_batch(100_000, 4096, 1.8, 64, 524288, seed=5)
    assert sum(a) == 100_000 and max(a) <= 524288 and min(a[:-1]) >= 64
    assert a != lognormal_batch(100_000, 4096, 1.8, 64, 524288, seed=6)


def test_empirical_and_histogram_fill_exactly():
    assert sum(empirical_batch(np.array([5, 7, 11]), 1000, seed=0)) == 1000
    assert max(empirical_batch(np.array([500, 700]), 5000, seed=0, max_len=600)) <= 600
    lengths = histogram_batch(np.array([1, 10, 100]), np.array([1, 1]), 5000, seed=0)
    assert sum(lengths) == 5000 and max(lengths) < 100


def test_a_long_tail_takes_its_share_of_the_tokens():
    edges, counts = np.array([1, 100, 1000]), np.array([3, 1])
    for lengths in (histogram_batch(edges, counts, 2_000_000, seed=1, tail_fraction=0.2),
                    empirical_batch(np.array([50, 500]), 2_000_000, seed=1, tail_fraction=0.2)):
        lengths = np.array(lengths)
        assert lengths.sum() == 2_000_000
        tail = lengths[lengths >= 131072]
        assert 0.2 * 2_000_000 - 524288 < tail.sum() <= 0.2 * 2_000_000 and tail.max() <= 524288
    assert histogram_batch(edges, counts, 5000, seed=0) == histogram_batch(edges, counts, 5000, seed=0,
                                                                           tail_fraction=0.0)
    with pytest.raises(InvalidInputError, match="tail fraction 1.5"):
        histogram_batch(edges, counts, 5000, seed=0, tail_fraction=1.5)


def test_bad_generator_parameters():
    with pytest.raises(InvalidInputError):
        lognormal_batch(10, -1, 1.0, 1, 10, 0)
    with pytest.raises(InvalidInputError):
        histogram_batch(np.array([5, 1]), np.array([1]), 10, 0)

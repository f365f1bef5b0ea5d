import itertools

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from fcp_compiler.core.passes.localize import match_ranks


@given(st.integers(1, 5), st.integers(0, 2**32 - 1))
def test_greedy_rank_matching_is_a_permutation_within_half_of_the_optimum(num_ranks, seed):
    rng = np.random.default_rng(seed)
    dense = rng.integers(0, 4, size=(num_ranks, num_ranks)) * rng.integers(0, 2, size=(num_ranks, num_ranks))
    plan_rank, user_rank = np.nonzero(dense)
    perm = match_ranks(plan_rank, user_rank, dense[plan_rank, user_rank].astype(float), num_ranks)
    assert sorted(perm.tolist()) == list(range(num_ranks))
    best = max(sum(dense[p, q[p]] for p in range(num_ranks)) for q in itertools.permutations(range(num_ranks)))
    assert sum(dense[p, perm[p]] for p in range(num_ranks)) >= best / 2


def test_largest_overlaps_are_kept_and_ties_go_to_the_lower_rank():
    # Plan rank 0 shares 5 tokens with user rank 1; ranks 1 and 2 tie for user rank 0 (3 each): rank 1 wins.
    perm = match_ranks(np.array([0, 1, 2]), np.array([1, 0, 0]), np.array([5.0, 3.0, 3.0]), 3)
    assert perm.tolist() == [1, 0, 2]


@pytest.mark.parametrize("gpus", [4, 16])
def test_renumbered_pulls_are_what_plan_transfers_lists_for_the_renumbered_placement(gpus):
    from fcp_compiler import compile_plan
    from fcp_compiler.core.passes.localize import renumber
    from fcp_compiler.core.passes.transfers import plan_transfers
    from fcp_compiler.tools.traces import lognormal_batch

    # The pulls before fan-out (renumbering comes before it).
    plan = compile_plan(lognormal_batch(gpus * 32768, 4096, 1.8, 64, 262144, seed=2), gpus, node_fan_out=False)
    before = plan.ir.transfers
    perm = np.random.default_rng(gpus).permutation(gpus)
    assert not np.array_equal(perm, np.arange(gpus))
    shuffled = renumber(before, perm)
    listed = plan_transfers(shuffled.assignment)
    assert np.array_equal(shuffled.assignment.block_rank, perm[before.assignment.block_rank])
    for field in ("edge_kind", "edge_block", "edge_src", "edge_dst", "edge_seg_offsets", "edge_segs"):
        assert np.array_equal(getattr(shuffled, field), getattr(listed, field)), field

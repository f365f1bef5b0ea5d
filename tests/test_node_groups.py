import numpy as np
from hypothesis import given
from hypothesis import strategies as st

from fcp_compiler.algorithms import node_groups
from fcp_compiler.algorithms.node_groups import group_into_nodes


def intra_node(perm, src, dst, volume, ranks_per_node):
    return volume[perm[src] // ranks_per_node == perm[dst] // ranks_per_node].sum()


@given(st.integers(1, 12), st.integers(1, 4), st.integers(0, 2**32 - 1))
def test_renumbering_is_a_permutation_that_keeps_the_heaviest_pair_together(num_ranks, ranks_per_node, seed):
    rng = np.random.default_rng(seed)
    src, dst = rng.integers(0, num_ranks, size=30), rng.integers(0, num_ranks, size=30)
    volume = rng.integers(1, 100, size=30).astype(float)
    perm = group_into_nodes(src, dst, volume, num_ranks, ranks_per_node)
    assert sorted(perm.tolist()) == list(range(num_ranks))
    apart = src != dst
    if apart.any() and ranks_per_node >= 2:
        pair_volume = {}
        for a, b, v in zip(src[apart].tolist(), dst[apart].tolist(), volume[apart].tolist()):
            key = (min(a, b), max(a, b))
            pair_volume[key] = pair_volume.get(key, 0.0) + v
        heaviest = max(pair_volume.values())
        first = min(key for key, value in pair_volume.items() if value == heaviest)
        assert perm[first[0]] // ranks_per_node == perm[first[1]] // ranks_per_node


def test_two_talking_cliques_each_get_a_node():
    # Ranks {0, 2, 4, 6} and {1, 3, 5, 7} talk only among themselves; numbered as given, every node splits both.
    clique_a, clique_b = [0, 2, 4, 6], [1, 3, 5, 7]
    pairs = [(a, b) for clique in (clique_a, clique_b) for a in clique for b in clique if a < b]
    src = np.array([a for a, _ in pairs])
    dst = np.array([b for _, b in pairs])
    volume = np.ones(len(pairs))
    perm = group_into_nodes(src, dst, volume, 8, 4)
    assert intra_node(perm, src, dst, volume, 4) == volume.sum()
    assert intra_node(np.arange(8), src, dst, volume, 4) < volume.sum()


def plain_joins(low, high, num_ranks, ranks_per_node):
    """Kruskal's joins with a size cap, pair by pair (the reference for the batched joins)."""
    parent, size = list(range(num_ranks)), [1] * num_ranks

    def find(rank):
        while parent[rank] != rank:
            rank = parent[rank]
        return rank

    for a_rank, b_rank in zip(low, high):
        a, b = find(a_rank), find(b_rank)
        if a != b and size[a] + size[b] <= ranks_per_node:
            a, b = min(a, b), max(a, b)
            parent[b] = a
            size[a] += size[b]
    return [find(rank) for rank in range(num_ranks)]


@given(st.integers(2, 40), st.integers(1, 9), st.integers(1, 7), st.integers(0, 2**32 - 1))
def test_batched_joins_are_the_plain_loops_joins(num_ranks, ranks_per_node, batch, seed):
    # Batches of a few pairs, so that pairs refused against a batch's start and joins within a batch both occur.
    rng = np.random.default_rng(seed)
    low = rng.integers(0, num_ranks, size=3 * num_ranks)
    high = rng.integers(0, num_ranks, size=3 * num_ranks)
    low, high = np.minimum(low, high), np.maximum(low, high)
    original = node_groups.JOIN_BATCH
    node_groups.JOIN_BATCH = batch
    try:
        roots = node_groups._join_pairs(low, high, num_ranks, ranks_per_node)
    finally:
        node_groups.JOIN_BATCH = original
    assert roots.tolist() == plain_joins(low.tolist(), high.tolist(), num_ranks, ranks_per_node)

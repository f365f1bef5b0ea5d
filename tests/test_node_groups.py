import numpy as np
from hypothesis import given
from hypothesis import strategies as st

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

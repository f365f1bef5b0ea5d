import networkx as nx
import numpy as np
from hypothesis import given
from hypothesis import strategies as st

from fcp_compiler.algorithms import edge_colouring
from fcp_compiler.algorithms.edge_colouring import bipartite_edge_colouring


def max_degree(left, right):
    return max(np.bincount(left).max(), np.bincount(right).max())


def assert_proper(left, right, colour):
    delta = max_degree(left, right)
    assert colour.min() >= 0 and colour.max() < delta  # exactly Delta colours at most, and Delta is a lower bound
    for c in np.unique(colour):
        edges = np.flatnonzero(colour == c)
        graph = nx.Graph()
        graph.add_edges_from((("L", int(left[e])), ("R", int(right[e]))) for e in edges)
        assert graph.number_of_edges() == edges.size  # no two parallel edges in one colour
        matching = {(("L", int(left[e])), ("R", int(right[e]))) for e in edges}
        assert nx.is_matching(graph, matching)


@given(st.integers(1, 8), st.integers(1, 8), st.lists(st.tuples(st.integers(0, 7), st.integers(0, 7)),
                                                         min_size=1, max_size=80))
def test_random_multigraphs_use_exactly_delta_colours(num_left, num_right, edges):
    left = np.array([u % num_left for u, _ in edges])
    right = np.array([v % num_right for _, v in edges])
    colour = bipartite_edge_colouring(left, right, num_left, num_right)
    assert_proper(left, right, colour)
    assert colour.max() + 1 == max_degree(left, right)


def first_fit_colours(left, right):
    """Greedy: lowest colour free at both ends, no repair."""
    used_l, used_r, colours = {}, {}, []
    for u, v in zip(left.tolist(), right.tolist()):
        c = 0
        while c in used_l.get(u, set()) or c in used_r.get(v, set()):
            c += 1
        used_l.setdefault(u, set()).add(c)
        used_r.setdefault(v, set()).add(c)
        colours.append(c)
    return max(colours) + 1


def iterated_maximal_matchings(left, right):
    """Rounds of greedy maximal matchings in edge order, until every edge is used."""
    remaining = list(range(left.size))
    rounds = 0
    while remaining:
        busy_l, busy_r, rest = set(), set(), []
        for e in remaining:
            if left[e] in busy_l or right[e] in busy_r:
                rest.append(e)
            else:
                busy_l.add(left[e])
                busy_r.add(right[e])
        remaining = rest
        rounds += 1
    return rounds


def adversarial_graph(copies: int = 5):
    """Edges ordered so that greedy colouring and iterated maximal matchings both need Delta + 1 = 3 rounds.

    Gadget (Delta = 2): (u0, v1) and (u1, v2) take colour 0, so (u1, v0) takes 1 and (u0, v0) finds 0 used at u0
    and 1 used at v0. Disjoint copies keep the order adversarial on a larger graph.
    """
    pairs = []
    for copy in range(copies):
        u0, u1 = 2 * copy, 2 * copy + 1
        v0, v1, v2 = 3 * copy, 3 * copy + 1, 3 * copy + 2
        pairs += [(u0, v1), (u1, v2), (u1, v0), (u0, v0)]
    left = np.array([u for u, _ in pairs])
    right = np.array([v for _, v in pairs])
    return left, right, 2 * copies, 3 * copies


def test_adversarial_graph_defeats_greedy_but_not_us():
    left, right, num_left, num_right = adversarial_graph()
    delta = max_degree(left, right)
    assert first_fit_colours(left, right) > delta
    assert iterated_maximal_matchings(left, right) > delta
    colour = bipartite_edge_colouring(left, right, num_left, num_right)
    assert_proper(left, right, colour)
    assert colour.max() + 1 == delta


def test_dense_regular_multigraph_in_random_order():
    rng = np.random.default_rng(0)
    n, degree = 16, 24
    left = np.repeat(np.arange(n), degree)
    right = np.concatenate([rng.permutation(n) for _ in range(degree)])
    order = rng.permutation(left.size)
    left, right = left[order], np.array([right[i] for i in order])
    assert first_fit_colours(left, right) > degree  # greedy alone needs more
    colour = bipartite_edge_colouring(left, right, n, n)
    assert_proper(left, right, colour)
    assert colour.max() + 1 == degree


def colours_with_tables(left, right, num_left, num_right):
    """The greedy with alternating paths written plainly (the reference): each edge takes the lowest colour free at
    both ends, else the a/b path from its right end is swapped, read from tables of each vertex's edge by colour."""
    delta = int(max_degree(left, right))
    at = {"L": [[-1] * delta for _ in range(num_left)], "R": [[-1] * delta for _ in range(num_right)]}
    colour = [-1] * left.size
    for edge, (u, v) in enumerate(zip(left.tolist(), right.tolist())):
        free = [c for c in range(delta) if at["L"][u][c] < 0 and at["R"][v][c] < 0]
        if free:
            chosen = free[0]
        else:
            a = next(c for c in range(delta) if at["L"][u][c] < 0)
            b = next(c for c in range(delta) if at["R"][v][c] < 0)
            path, side, vertex, want = [], "R", v, a
            while at[side][vertex][want] >= 0:
                step = at[side][vertex][want]
                path.append(step)
                side, vertex = ("L", int(left[step])) if side == "R" else ("R", int(right[step]))
                want = b if want == a else a
            for step in path:
                at["L"][int(left[step])][colour[step]] = at["R"][int(right[step])][colour[step]] = -1
            for step in path:
                colour[step] = b if colour[step] == a else a
                at["L"][int(left[step])][colour[step]] = at["R"][int(right[step])][colour[step]] = step
            chosen = a
        colour[edge] = chosen
        at["L"][u][chosen] = at["R"][v][chosen] = edge
    return np.asarray(colour)


@given(st.integers(1, 10), st.integers(1, 10), st.integers(0, 2**32 - 1), st.sampled_from([0, 1]))
def test_paths_found_by_scans_and_by_tables_colour_alike(num_left, num_right, seed, scans_per_edge):
    # Dense random multigraphs need many alternating paths; at 0 scans an edge the tables take over after the first
    # path, so both ways of finding a path, and the switch between them, meet the plain greedy's colours.
    rng = np.random.default_rng(seed)
    size = int(rng.integers(1, 150))
    left, right = rng.integers(0, num_left, size=size), rng.integers(0, num_right, size=size)
    original = edge_colouring.SCANS_PER_EDGE
    edge_colouring.SCANS_PER_EDGE = scans_per_edge
    try:
        colour = bipartite_edge_colouring(left, right, num_left, num_right)
    finally:
        edge_colouring.SCANS_PER_EDGE = original
    assert_proper(left, right, colour)
    assert colour.max() + 1 == max_degree(left, right)
    assert colour.tolist() == colours_with_tables(left, right, num_left, num_right).tolist()

"""Bipartite edge colouring with exactly Delta colours (Konig's theorem)."""

from __future__ import annotations

import numpy as np


def bipartite_edge_colouring(left: np.ndarray, right: np.ndarray, num_left: int, num_right: int) -> np.ndarray:
    """Colour the edges of a bipartite multigraph so that no vertex sees a colour twice, with Delta colours.

    Objective: a proper edge colouring with the minimum number of colours, which for a bipartite multigraph is its
    largest degree Delta (Konig); each colour class is a matching. Algorithm: edges in order; an edge (u, v) takes
    a colour free at both ends if one exists; otherwise, with a free at u and b free at v, the a/b alternating path
    from v is recoloured (it cannot reach u in a bipartite graph), which frees a at v. Free colours are found with
    bit tricks on per-vertex masks. An alternating path has at most V edges, so O(E * V) worst case (E edges, V
    vertices); on the graphs the planner makes the paths are short and it runs near O(E).

    Args:
        left, right: int arrays, the endpoints of each edge (left in [0, num_left), right in [0, num_right)).
        num_left, num_right: vertex counts of the two sides.
    Returns:
        int64 array, the colour of each edge, in [0, Delta).
    """
    left_list = np.asarray(left, dtype=np.int64).tolist()
    right_list = np.asarray(right, dtype=np.int64).tolist()
    num_edges = len(left_list)
    colour = [-1] * num_edges
    if num_edges == 0:
        return np.zeros(0, dtype=np.int64)
    max_degree = int(max(np.bincount(left_list, minlength=num_left).max(),
                         np.bincount(right_list, minlength=num_right).max()))
    # at_left[u][c] is the edge of colour c at left vertex u, or -1; same for at_right.
    at_left = [[-1] * max_degree for _ in range(num_left)]
    at_right = [[-1] * max_degree for _ in range(num_right)]
    used_left = [0] * num_left
    used_right = [0] * num_right
    all_colours = (1 << max_degree) - 1
    for edge in range(num_edges):
        u, v = left_list[edge], right_list[edge]
        mask_u, mask_v = used_left[u], used_right[v]
        common = all_colours & ~(mask_u | mask_v)
        if common:
            c = (common & -common).bit_length() - 1
        else:
            a = (~mask_u & (mask_u + 1)).bit_length() - 1  # free at u, used at v
            b = (~mask_v & (mask_v + 1)).bit_length() - 1  # free at v, used at u
            _flip_path(v, a, b, at_left, at_right, left_list, right_list, colour, used_left, used_right)
            c = a
        colour[edge] = c
        at_left[u][c] = edge
        at_right[v][c] = edge
        used_left[u] |= 1 << c
        used_right[v] |= 1 << c
    return np.asarray(colour, dtype=np.int64)


def _flip_path(start: int, a: int, b: int, at_left: list[list[int]], at_right: list[list[int]],
               left_list: list[int], right_list: list[int], colour: list[int], used_left: list[int],
               used_right: list[int]) -> None:
    """Swap colours a and b along the alternating path that leaves right vertex `start` by colour a."""
    path = []
    vertex, on_right, want = start, True, a
    while True:
        table = at_right[vertex] if on_right else at_left[vertex]
        edge = table[want]
        if edge < 0:
            break
        path.append(edge)
        vertex = left_list[edge] if on_right else right_list[edge]
        on_right = not on_right
        want = b if want == a else a
    end_vertex, end_on_right = vertex, on_right
    for edge in path:
        u, v = left_list[edge], right_list[edge]
        old = colour[edge]
        new = b if old == a else a
        if at_left[u][old] == edge:
            at_left[u][old] = -1
        if at_right[v][old] == edge:
            at_right[v][old] = -1
    for edge in path:
        u, v = left_list[edge], right_list[edge]
        new = b if colour[edge] == a else a
        colour[edge] = new
        at_left[u][new] = edge
        at_right[v][new] = edge
    # Interior vertices keep both colours; only the two ends change which of a, b they use.
    both = (1 << a) | (1 << b)
    used_right[start] ^= both
    if end_on_right:
        used_right[end_vertex] ^= both
    else:
        used_left[end_vertex] ^= both

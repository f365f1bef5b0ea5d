"""Bipartite edge colouring with exactly Delta colours (Konig's theorem)."""

from __future__ import annotations

from collections.abc import Callable, Iterator

import numpy as np

from fcp_compiler.algorithms.keys import stable_argsort

# Entries of vertices' edge lists the path scans may read, per edge, before the colouring builds its tables.
SCANS_PER_EDGE = 1


def bipartite_edge_colouring(left: np.ndarray, right: np.ndarray, num_left: int, num_right: int) -> np.ndarray:
    """Colour the edges of a bipartite multigraph so that no vertex sees a colour twice, with Delta colours.

    Objective: a proper edge colouring with the minimum number of colours, which for a bipartite multigraph is its
    largest degree Delta (Konig); each colour class is a matching. Algorithm: edges in order; an edge (u, v) takes
    a colour free at both ends if one exists; otherwise, with a free at u and b free at v, the a/b alternating path
    from v is recoloured (it cannot reach u in a bipartite graph), which frees a at v. Free colours are found with
    bit tricks on per-vertex masks. An alternating path has at most V edges, so O(E * V) worst case (E edges, V
    vertices); on the graphs the planner makes the paths are short and rare (one in a million edges at 4096
    ranks), and it runs near O(E).

    Most edges only need the masks, so the edges are first coloured without any table of which edge has which
    colour at a vertex (:func:`_first_fit`, about two thirds of the time with the tables); a path is followed by
    scanning its vertices' edges (:class:`_Incidence`), until the scans have read SCANS_PER_EDGE entries an edge,
    after which the tables are built once and kept (:func:`_with_tables`), so the worst case stays the
    tables' O(E * V).

    Args:
        left, right: int arrays, the endpoints of each edge (left in [0, num_left), right in [0, num_right)).
        num_left, num_right: vertex counts of the two sides.
    Returns:
        int64 array, the colour of each edge, in [0, Delta).
    """
    left, right = np.asarray(left, dtype=np.int64), np.asarray(right, dtype=np.int64)
    num_edges = left.size
    if num_edges == 0:
        return np.zeros(0, dtype=np.int64)
    max_degree = int(max(np.bincount(left, minlength=num_left).max(), np.bincount(right, minlength=num_right).max()))
    left_list, right_list = left.tolist(), right.tolist()
    state = _State(left=left_list, right=right_list, colour=[-1] * num_edges, used_left=[0] * num_left,
                   used_right=[0] * num_right, all_colours=(1 << max_degree) - 1)
    # One iterator over the edges for every run of first fits: each run goes on where the last one stopped (a
    # slice a run would cost O(E) a path).
    incidence, edge, ends = None, 0, zip(left_list, right_list)
    while (edge := _first_fit(state, ends, edge)) < num_edges:
        incidence = incidence or _Incidence(left, right, num_left, num_right)
        if incidence.scanned > SCANS_PER_EDGE * num_edges:
            _with_tables(state, edge, max_degree, num_left, num_right)
            break
        a, b = state.free_colours(edge)
        state.flip(_path_by_scan(state, incidence, state.right[edge], a, b), state.right[edge], a, b)
        state.take(edge, a)
        edge += 1
    return np.asarray(state.colour, dtype=np.int64)


class _State:
    """The colouring so far: each edge's colour (-1: not coloured yet), and per vertex the mask of the colours its
    edges have."""

    __slots__ = ("left", "right", "colour", "used_left", "used_right", "all_colours")

    def __init__(self, *, left: list[int], right: list[int], colour: list[int], used_left: list[int],
                 used_right: list[int], all_colours: int):
        self.left, self.right, self.colour = left, right, colour
        self.used_left, self.used_right, self.all_colours = used_left, used_right, all_colours

    def free_colours(self, edge: int) -> tuple[int, int]:
        """For an edge with no colour free at both ends: a colour free at its left end (used at its right one), and
        one free at its right end."""
        mask_u, mask_v = self.used_left[self.left[edge]], self.used_right[self.right[edge]]
        return (~mask_u & (mask_u + 1)).bit_length() - 1, (~mask_v & (mask_v + 1)).bit_length() - 1

    def take(self, edge: int, colour: int) -> None:
        """Colour `edge` (the colour free at both its ends)."""
        self.colour[edge] = colour
        self.used_left[self.left[edge]] |= 1 << colour
        self.used_right[self.right[edge]] |= 1 << colour

    def path(self, start: int, a: int, b: int, edge_at: Callable[[int, bool, int], int]) -> list[int]:
        """The a/b alternating path that leaves right vertex `start` by colour a; `edge_at(vertex, on_right, colour)`
        gives a vertex's edge of a colour, -1 for none."""
        path, vertex, on_right, want = [], start, True, a
        while (edge := edge_at(vertex, on_right, want)) >= 0:
            path.append(edge)
            vertex = self.left[edge] if on_right else self.right[edge]
            on_right = not on_right
            want = b if want == a else a
        return path

    def flip(self, path: list[int], start: int, a: int, b: int) -> None:
        """Swap colours a and b along `path`, the alternating path that leaves right vertex `start` by colour a:
        interior vertices keep both colours; only the two ends change which of a, b they use."""
        both = (1 << a) | (1 << b)
        for edge in path:
            self.colour[edge] = b if self.colour[edge] == a else a
        self.used_right[start] ^= both
        if len(path) % 2:  # an odd path ends on the left
            self.used_left[self.left[path[-1]]] ^= both
        else:
            self.used_right[self.right[path[-1]] if path else start] ^= both


def _first_fit(state: _State, ends: Iterator[tuple[int, int]], edge: int) -> int:
    """Colour edges from `edge` on, each with the lowest colour free at both its ends, up to the first that has
    none (returned; the number of edges when every edge is coloured). `ends`: the (left, right) ends of the edges
    from `edge` on, which it consumes up to and including the edge returned."""
    used_left, used_right, colour, all_colours = state.used_left, state.used_right, state.colour, state.all_colours
    for u, v in ends:
        mask_u, mask_v = used_left[u], used_right[v]
        common = all_colours & ~(mask_u | mask_v)
        if not common:
            return edge
        bit = common & -common
        used_left[u] = mask_u | bit
        used_right[v] = mask_v | bit
        colour[edge] = bit.bit_length() - 1
        edge += 1
    return edge


class _Incidence:
    """Each vertex's edges in edge order (built by one sort a side), and how many entries the path scans read."""

    def __init__(self, left: np.ndarray, right: np.ndarray, num_left: int, num_right: int):
        self.sides = []
        for ends, count in ((left, num_left), (right, num_right)):
            order = stable_argsort(ends)
            self.sides.append((order, np.concatenate(([0], np.cumsum(np.bincount(ends, minlength=count))))))
        self.scanned = 0

    def edges_at(self, vertex: int, on_right: bool) -> list[int]:
        """The edges at a vertex, in edge order."""
        order, bounds = self.sides[on_right]
        self.scanned += int(bounds[vertex + 1] - bounds[vertex])
        return order[bounds[vertex]:bounds[vertex + 1]].tolist()


def _path_by_scan(state: _State, incidence: _Incidence, start: int, a: int, b: int) -> list[int]:
    """The a/b alternating path that leaves right vertex `start` by colour a, each vertex's edge of the colour
    wanted found by a scan of its edges."""
    return state.path(start, a, b, lambda vertex, on_right, want: next(
        (edge for edge in incidence.edges_at(vertex, on_right) if state.colour[edge] == want), -1))


def _with_tables(state: _State, edge: int, max_degree: int, num_left: int, num_right: int) -> None:
    """Colour the edges from `edge` on as :func:`bipartite_edge_colouring` does, with tables of which edge has each
    colour at each vertex (built from the colours so far), where many paths have been followed."""
    at_left = [[-1] * max_degree for _ in range(num_left)]
    at_right = [[-1] * max_degree for _ in range(num_right)]
    for done, colour in enumerate(state.colour[:edge]):
        at_left[state.left[done]][colour] = done
        at_right[state.right[done]][colour] = done
    all_colours = state.all_colours
    for edge in range(edge, len(state.colour)):
        u, v = state.left[edge], state.right[edge]
        common = all_colours & ~(state.used_left[u] | state.used_right[v])
        if common:
            c = (common & -common).bit_length() - 1
        else:
            c, b = state.free_colours(edge)
            state.flip(_path_by_tables(state, at_left, at_right, v, c, b), v, c, b)
        state.take(edge, c)
        at_left[u][c] = edge
        at_right[v][c] = edge


def _path_by_tables(state: _State, at_left: list[list[int]], at_right: list[list[int]], start: int, a: int,
                    b: int) -> list[int]:
    """:func:`_path_by_scan` read from the tables, which it updates to the swapped colours."""
    path = state.path(start, a, b, lambda vertex, on_right, want: (at_right if on_right else at_left)[vertex][want])
    for edge in path:  # cleared first: an edge's new colour may be a neighbour's old one in the same row
        old = state.colour[edge]
        if at_left[state.left[edge]][old] == edge:
            at_left[state.left[edge]][old] = -1
        if at_right[state.right[edge]][old] == edge:
            at_right[state.right[edge]][old] = -1
    for edge in path:
        new = b if state.colour[edge] == a else a
        at_left[state.left[edge]][new] = edge
        at_right[state.right[edge]][new] = edge
    return path

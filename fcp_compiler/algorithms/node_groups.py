"""Grouping ranks into nodes so that the heaviest traffic stays on the fast links inside a node."""

from __future__ import annotations

import numpy as np

from fcp_compiler.algorithms.keys import sorted_unique, stable_argsort


def group_into_nodes(src: np.ndarray, dst: np.ndarray, volume: np.ndarray, num_ranks: int,
                     ranks_per_node: int) -> np.ndarray:
    """A renumbering of ranks that puts the pairs exchanging the most data in the same node.

    Objective: maximise the traffic between ranks of the same node (nodes are blocks of `ranks_per_node`
    consecutive rank numbers). Greedy, as Kruskal's algorithm with a size cap: rank pairs by decreasing volume
    (ties by pair), each joining the two groups that hold them when their sizes sum to at most a node; then the
    groups first-fit decreasing into nodes (ties by their lowest rank), a group that fits no node split into its
    ranks. O(E log E + N) for E messages.

    Args:
        src, dst: ranks of each message (either direction counts the same).
        volume: bytes (or tokens) of each message.
        num_ranks: N.
        ranks_per_node: ranks a node holds (the last node holds the rest when N is not a multiple).
    Returns:
        int64 array perm: rank r becomes rank perm[r] (a permutation).
    """
    low, high = np.minimum(src, dst), np.maximum(src, dst)
    apart = low != high
    key, inverse = sorted_unique(low[apart] * num_ranks + high[apart], return_inverse=True)
    pair_volume = np.bincount(inverse, weights=volume[apart], minlength=key.size)
    parent = list(range(num_ranks))
    size = [1] * num_ranks

    def find(rank: int) -> int:
        while parent[rank] != rank:
            parent[rank] = parent[parent[rank]]
            rank = parent[rank]
        return rank

    # Each join leaves one group fewer, and no fewer than a node's worth of ranks each can remain: past that many
    # joins the rest of the pairs (most of them, at hundreds of ranks) can join nothing.
    joins_left = num_ranks - -(-num_ranks // ranks_per_node)
    for pair in key[np.lexsort((key, -pair_volume))].tolist():
        if joins_left == 0:
            break
        a, b = find(pair // num_ranks), find(pair % num_ranks)
        if a != b and size[a] + size[b] <= ranks_per_node:
            a, b = min(a, b), max(a, b)
            parent[b] = a
            size[a] += size[b]
            joins_left -= 1
    roots = np.array([find(rank) for rank in range(num_ranks)], dtype=np.int64)
    members = stable_argsort(roots)
    bounds = np.flatnonzero(np.diff(roots[members])) + 1
    groups = sorted(np.split(members, bounds), key=lambda group: (-group.size, int(group[0])))
    room = [ranks_per_node] * (num_ranks // ranks_per_node) + ([num_ranks % ranks_per_node]
                                                               if num_ranks % ranks_per_node else [])
    node_members: list[list[int]] = [[] for _ in room]
    leftovers: list[int] = []
    for group in groups:
        node = next((n for n, free in enumerate(room) if free >= group.size), None)
        if node is None:
            leftovers.extend(group.tolist())
            continue
        node_members[node].extend(group.tolist())
        room[node] -= group.size
    for rank in sorted(leftovers):
        node = next(n for n, free in enumerate(room) if free > 0)
        node_members[node].append(rank)
        room[node] -= 1
    perm = np.empty(num_ranks, dtype=np.int64)
    perm[np.array([rank for ranks in node_members for rank in ranks], dtype=np.int64)] = np.arange(num_ranks)
    return perm

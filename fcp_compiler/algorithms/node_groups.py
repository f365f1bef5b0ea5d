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
    order = np.lexsort((key, -pair_volume))
    roots = _join_pairs((key // num_ranks)[order], (key % num_ranks)[order], num_ranks, ranks_per_node)
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


# Pairs tested together against the groups as they stood before the batch (_join_pairs).
JOIN_BATCH = 512


def _join_pairs(low: np.ndarray, high: np.ndarray, num_ranks: int, ranks_per_node: int) -> np.ndarray:
    """Kruskal's joins with a size cap: each pair (low[i], high[i]), in order, joins the two groups that hold its
    ranks when they differ and their sizes sum to at most `ranks_per_node`. Returns each rank's group as its lowest
    rank (int64 [num_ranks]).

    Groups only grow, so a pair refused against the groups as they stood earlier is refused later too: a batch of
    JOIN_BATCH pairs is tested at once in numpy, and only the pairs that pass are tested again one at a time (at
    thousands of ranks most pairs come after their groups are full). Each rank holds its group's label, and a join
    relabels the smaller group's ranks, so no parent chain is followed. The same joins as the plain loop, pair by
    pair. O(P + N log N) for P pairs and N ranks."""
    label = np.arange(num_ranks)  # each rank's group
    size = np.ones(num_ranks, dtype=np.int64)  # per label: its group's ranks
    members = [[rank] for rank in range(num_ranks)]  # per label
    name = list(range(num_ranks))  # per label: its group's lowest rank
    label_list, size_list = label.tolist(), size.tolist()
    # Each join leaves one group fewer, and no fewer than a node's worth of ranks each can remain: past that many
    # joins the rest of the pairs (most of them, at hundreds of ranks) can join nothing.
    joins_left = num_ranks - -(-num_ranks // ranks_per_node)
    for start in range(0, low.size, JOIN_BATCH):
        if joins_left == 0:
            break
        batch_low, batch_high = low[start:start + JOIN_BATCH], high[start:start + JOIN_BATCH]
        group_low, group_high = label[batch_low], label[batch_high]
        open_pairs = (group_low != group_high) & (size[group_low] + size[group_high] <= ranks_per_node)
        for a_rank, b_rank in zip(batch_low[open_pairs].tolist(), batch_high[open_pairs].tolist()):
            kept, joined = label_list[a_rank], label_list[b_rank]
            if kept == joined or size_list[kept] + size_list[joined] > ranks_per_node:
                continue
            if size_list[kept] < size_list[joined]:
                kept, joined = joined, kept
            for rank in members[joined]:
                label_list[rank] = kept
            label[members[joined]] = kept
            members[kept] += members[joined]
            size_list[kept] += size_list[joined]
            size[kept] = size_list[kept]
            name[kept] = min(name[kept], name[joined])
            joins_left -= 1
            if joins_left == 0:
                break
    return np.asarray(name, dtype=np.int64)[label]

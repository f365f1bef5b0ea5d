"""Node fan-out: a block that several GPUs of one node need from another node crosses the NIC once.

Plain arrays in, plain arrays out. One receiver of each (block, node) group takes the NIC pull (the entry) and
re-sends the block over NVLink to the others; the entry is chosen so that the NICs of a node share the load.
"""

from __future__ import annotations

import numpy as np

NO_PARENT = -1
# NVLink rounds that fit in one round (a NIC round): NVLink is that many times faster (9x on H100: 450 against
# 50 GB/s), but every slot can bring a block to receive, so the buffers a stage may fill grow with it. Measured on
# four 256-GPU batches: 1 lane cost the paper-like batch's backward 13% (27 stages against 17), 4 lanes gained
# nothing over 2 and held 44% more live buffers on the 128-GPU paper trace.
MAX_NVLINK_LANES = 2


def nvlink_lanes(nvlink_gbps: float, network_gbps: float) -> int:
    """How many NVLink messages a GPU may send (and receive) in one round: the NVLink to NIC bandwidth ratio,
    floored, from 1 to MAX_NVLINK_LANES."""
    return int(max(1, min(MAX_NVLINK_LANES, nvlink_gbps // network_gbps)))


def link_class(src: np.ndarray, dst: np.ndarray, gpus_per_node: int) -> np.ndarray:
    """Per message, 1 where it crosses nodes (the NIC) and 0 where it stays inside one (NVLink); nodes are runs of
    `gpus_per_node` consecutive ranks."""
    return (src // gpus_per_node != dst // gpus_per_node).astype(np.int64)


def node_fan_out(block: np.ndarray, src: np.ndarray, dst: np.ndarray, eligible: np.ndarray, nbytes: np.ndarray,
                 gpus_per_node: int, num_ranks: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Pick, for each group of eligible pulls of one block into one node other than the sender's, the GPU of that
    node whose NIC takes the block (the entry); every pull of the group then leaves the entry instead.

    Objective: each block crosses into a node once, and a node's NIC receive load spreads over its GPUs. Greedy
    (LPT): groups by decreasing bytes (ties by block, then node) each go to the member whose NIC has received least
    so far (ties: the lowest rank), or to another GPU of the node (a forwarder, which needs the block for no tile
    of its own) where that GPU, even with the block, stays at or below the best member; a group of one pull too, so a GPU
    that alone in its node reads many remote blocks does not take them all on its own NIC. O(E log E) for E pulls,
    plus O(E + G * g) Python steps for G groups and g GPUs a node.

    Args:
        block, src, dst: int [E], each pull's block, sender and receiver.
        eligible: bool [E], pulls that may be routed (the rest are left alone and never parents).
        nbytes: float [E], bytes the entry would carry for each pull's group (its group's union).
        gpus_per_node: ranks a node holds.
        num_ranks: N.
    Returns:
        (parent, forward_group, forward_rank): parent int64 [E], each pull's entry pull, -1 for a pull left from its
        sender (entries included), or -2 - f for a pull whose entry is new pull f; new pull f brings the block of
        pull forward_group[f] (any pull of its group) to forwarder forward_rank[f].
    """
    parent = np.full(block.size, NO_PARENT, dtype=np.int64)
    no_forwarders = (np.zeros(0, dtype=np.int64), np.zeros(0, dtype=np.int64))
    node = dst // gpus_per_node
    candidates = np.flatnonzero(eligible & (src // gpus_per_node != node))
    if candidates.size == 0:
        return (parent,) + no_forwarders
    num_nodes = -(-num_ranks // gpus_per_node)
    key = block[candidates] * num_nodes + node[candidates]
    order = np.lexsort((dst[candidates], key))
    candidates, key = candidates[order], key[order]
    starts = np.flatnonzero(np.concatenate(([True], key[1:] != key[:-1])))
    sizes = np.diff(np.append(starts, key.size))
    load = [0.0] * num_ranks
    grouped = np.arange(starts.size)
    group_bytes = nbytes[candidates[starts[grouped]]]
    grouped = grouped[np.lexsort((key[starts[grouped]], -group_bytes))]
    members_all, dst_all = candidates.tolist(), dst[candidates].tolist()
    nbytes_list = nbytes.tolist()
    forward_group, forward_rank = [], []
    for group in grouped.tolist():
        first, size = int(starts[group]), int(sizes[group])
        members = members_all[first:first + size]
        receivers = dst_all[first:first + size]
        best = min(range(size), key=lambda i: (load[receivers[i]], receivers[i]))
        weight = nbytes_list[members[0]]
        base = receivers[0] // gpus_per_node * gpus_per_node
        idle = min(range(base, min(base + gpus_per_node, num_ranks)), key=lambda r: (load[r], r))
        if load[idle] + weight <= load[receivers[best]]:
            load[idle] += weight
            for edge in members:
                parent[edge] = -2 - len(forward_group)
            forward_group.append(members[0])
            forward_rank.append(idle)
            continue
        entry = members[best]
        load[receivers[best]] += weight
        for i, edge in enumerate(members):
            if i != best:
                parent[edge] = entry
    return parent, np.asarray(forward_group, dtype=np.int64), np.asarray(forward_rank, dtype=np.int64)


def class_degrees(src: np.ndarray, dst: np.ndarray, link: np.ndarray, num_ranks: int) -> tuple[int, int]:
    """(NVLink, NIC): per link class, the most messages of that class any rank sends or receives (the class's
    Delta, the fewest rounds its messages can take)."""
    degrees = []
    for cls in (0, 1):
        mine = link == cls
        degrees.append(int(max(np.bincount(src[mine], minlength=num_ranks).max(initial=0),
                               np.bincount(dst[mine], minlength=num_ranks).max(initial=0))) if mine.any() else 0)
    return degrees[0], degrees[1]

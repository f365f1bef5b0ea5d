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
                 gpus_per_node: int, num_ranks: int) -> np.ndarray:
    """Pick, for each group of eligible pulls of one block into one node other than the sender's, one entry pull;
    every other pull of the group leaves the entry's receiver instead (a child of the entry).

    Objective: each block crosses into a node once, and a node's NIC receive load spreads over its GPUs. Greedy:
    pulls that are alone in their group fix their receiver's NIC load first; then groups by decreasing bytes (ties
    by block, then node) each give the entry to the member whose NIC has received least so far (ties: the lowest
    rank). O(E log E) for E pulls, plus O(M) Python steps for the M pulls in groups of two or more.

    Args:
        block, src, dst: int [E], each pull's block, sender and receiver.
        eligible: bool [E], pulls that may be grouped (the rest are left alone and never parents).
        nbytes: float [E], bytes the entry would carry for each pull's group (its group's union); used for the
            NIC load, per pull.
        gpus_per_node: ranks a node holds.
        num_ranks: N.
    Returns:
        int64 [E], each pull's entry pull (its parent), or -1 for a pull left from its sender (entries included).
    """
    parent = np.full(block.size, NO_PARENT, dtype=np.int64)
    node = dst // gpus_per_node
    candidates = np.flatnonzero(eligible & (src // gpus_per_node != node))
    if candidates.size == 0:
        return parent
    num_nodes = -(-num_ranks // gpus_per_node)
    key = block[candidates] * num_nodes + node[candidates]
    order = np.lexsort((dst[candidates], key))
    candidates, key = candidates[order], key[order]
    starts = np.flatnonzero(np.concatenate(([True], key[1:] != key[:-1])))
    sizes = np.diff(np.append(starts, key.size))
    load = np.bincount(dst[candidates[starts[sizes == 1]]], weights=nbytes[candidates[starts[sizes == 1]]],
                       minlength=num_ranks).tolist()
    grouped = np.flatnonzero(sizes > 1)
    group_bytes = nbytes[candidates[starts[grouped]]]
    grouped = grouped[np.lexsort((key[starts[grouped]], -group_bytes))]
    members_all, dst_all = candidates.tolist(), dst[candidates].tolist()
    nbytes_list = nbytes.tolist()
    for group in grouped.tolist():
        first, size = int(starts[group]), int(sizes[group])
        members = members_all[first:first + size]
        receivers = dst_all[first:first + size]
        best = min(range(size), key=lambda i: (load[receivers[i]], receivers[i]))
        entry = members[best]
        load[receivers[best]] += nbytes_list[entry]
        for i, edge in enumerate(members):
            if i != best:
                parent[edge] = entry
    return parent


def class_degrees(src: np.ndarray, dst: np.ndarray, link: np.ndarray, num_ranks: int) -> tuple[int, int]:
    """(NVLink, NIC): per link class, the most messages of that class any rank sends or receives (the class's
    Delta, the fewest rounds its messages can take)."""
    degrees = []
    for cls in (0, 1):
        mine = link == cls
        degrees.append(int(max(np.bincount(src[mine], minlength=num_ranks).max(initial=0),
                               np.bincount(dst[mine], minlength=num_ranks).max(initial=0))) if mine.any() else 0)
    return degrees[0], degrees[1]

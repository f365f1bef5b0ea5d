"""Node fan-out: a block that several GPUs of one node need from another node crosses the NIC once.

Plain arrays in, plain arrays out. One receiver of each (block, node) group takes the NIC pull (the entry) and
re-sends the block over NVLink to the others; the entry is chosen so that the NICs of a node share the load.
"""

from __future__ import annotations

import numpy as np

from fcp_compiler.algorithms.keys import stable_argsort

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
    of its own) where that GPU, even with the block, stays at or below the best member; a group of one pull too, so
    a GPU that alone in its node reads many remote blocks does not take them all on its own NIC. Nodes share no NIC,
    so each node's groups run as their own LPT, all nodes a step at a time in numpy. O(E log E + G * g) for E
    pulls, G groups and g GPUs a node, in as many numpy steps as the most groups one node has.

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
    group_node, group_bytes = node[candidates[starts]], nbytes[candidates[starts]]
    offset = dst[candidates] % gpus_per_node
    member = np.zeros((starts.size, gpus_per_node), dtype=bool)
    member[np.repeat(np.arange(starts.size), sizes), offset] = True
    # LPT order: groups by decreasing bytes, ties by block, then node; forwarders are numbered in it too.
    lpt_order = np.lexsort((key[starts], -group_bytes))
    chosen, by_forwarder = _lpt_entries(group_node, group_bytes, lpt_order, member, num_nodes, gpus_per_node,
                                        num_ranks)
    # A reader entry's position in candidates: its group's members lie sorted by rank from the group's start.
    entry_at = starts + np.cumsum(member, axis=1)[np.arange(starts.size), chosen] - 1
    forwarded = lpt_order[by_forwarder[lpt_order]]
    forwarder_id = np.zeros(starts.size, dtype=np.int64)
    forwarder_id[forwarded] = np.arange(forwarded.size)
    # Every member leaves its entry pull, or the new pull -2 - f that brings the block to forwarder f.
    parent[candidates] = np.repeat(np.where(by_forwarder, -2 - forwarder_id, candidates[entry_at]), sizes)
    parent[candidates[entry_at[~by_forwarder]]] = NO_PARENT
    forward_rank = group_node[forwarded] * gpus_per_node + chosen[forwarded]
    return parent, candidates[starts[forwarded]], forward_rank.astype(np.int64)


def _lpt_entries(group_node: np.ndarray, group_bytes: np.ndarray, lpt_order: np.ndarray, member: np.ndarray,
                 num_nodes: int, gpus_per_node: int, num_ranks: int) -> tuple[np.ndarray, np.ndarray]:
    """The LPT of :func:`node_fan_out` over groups taken in `lpt_order`, given each group's node, bytes and member
    GPUs (bool [G, gpus_per_node], by rank within the node): (chosen, by_forwarder), the GPU (within its node) that
    takes each group and whether it is a forwarder rather than the least-loaded member.

    Nodes share no NIC, so each node's groups form their own LPT; step k takes the k-th group of every node at
    once, in numpy (each rank's load sums in the same order as a loop over all groups would)."""
    by_node = lpt_order[stable_argsort(group_node[lpt_order])]
    node_start = np.searchsorted(group_node[by_node], np.arange(num_nodes + 1))
    step = np.arange(by_node.size) - node_start[group_node[by_node]]
    by_step = by_node[stable_argsort(step)]
    step_start = np.searchsorted(np.sort(step), np.arange(int(step.max(initial=-1)) + 2))
    load = np.zeros((num_nodes, gpus_per_node))
    load.reshape(-1)[num_ranks:] = np.inf  # a last node with fewer GPUs
    chosen = np.zeros(group_node.size, dtype=np.int64)
    by_forwarder = np.zeros(group_node.size, dtype=bool)
    for k in range(step_start.size - 1):
        groups = by_step[step_start[k]:step_start[k + 1]]
        nodes, weight = group_node[groups], group_bytes[groups]
        rows = load[nodes]
        readers = np.where(member[groups], rows, np.inf)
        best, idle = readers.argmin(axis=1), rows.argmin(axis=1)  # ties: the lowest rank
        line = np.arange(groups.size)
        forward = rows[line, idle] + weight <= readers[line, best]
        chosen[groups] = np.where(forward, idle, best)
        by_forwarder[groups] = forward
        load[nodes, chosen[groups]] += weight
    return chosen, by_forwarder


def class_degrees(src: np.ndarray, dst: np.ndarray, link: np.ndarray, num_ranks: int) -> tuple[int, int]:
    """(NVLink, NIC): per link class, the most messages of that class any rank sends or receives (the class's
    Delta, the fewest rounds its messages can take)."""
    degrees = []
    for cls in (0, 1):
        mine = link == cls
        degrees.append(int(max(np.bincount(src[mine], minlength=num_ranks).max(initial=0),
                               np.bincount(dst[mine], minlength=num_ranks).max(initial=0))) if mine.any() else 0)
    return degrees[0], degrees[1]

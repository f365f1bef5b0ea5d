"""Pass 4b: node fan-out. A K,V block that several GPUs of one node need from another node crosses the NIC once,
into one of them (the entry), and fans out from there over NVLink; in the backward pass the entry sums the dK, dV
its fan-out returns before its one push back across the NIC."""

from __future__ import annotations

import dataclasses

import numpy as np

from fcp_compiler.algorithms.fan_out import node_fan_out
from fcp_compiler.algorithms.keys import lexsort_ints, sorted_unique
from fcp_compiler.algorithms.ranges import expand_ranges
from fcp_compiler.core.ir import TransferKind, Transfers


def _group_union_tokens(transfers: Transfers, group: np.ndarray) -> np.ndarray:
    """Per pull, the tokens of the union of the segments its group's pulls carry (groups by id, -1: none)."""
    sharding = transfers.assignment.tiles.sharding
    counts = np.diff(transfers.edge_seg_offsets)
    edge_of_seg = np.repeat(np.arange(transfers.num_edges), counts)
    grouped = group[edge_of_seg] >= 0
    key = sorted_unique(group[edge_of_seg[grouped]] * sharding.num_segments + transfers.edge_segs[grouped])
    union = np.bincount(key // sharding.num_segments, weights=sharding.seg_tokens[key % sharding.num_segments],
                        minlength=int(group.max(initial=-1)) + 1)
    return np.where(group >= 0, union[np.maximum(group, 0)] if union.size else 0, transfers.edge_tokens)


def _entry_segments(transfers: Transfers, parent: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Segment lists with each entry carrying the union of its own and its children's: (offsets, segs)."""
    num_segments = transfers.assignment.tiles.sharding.num_segments
    counts = np.diff(transfers.edge_seg_offsets)
    edge_of_seg = np.repeat(np.arange(transfers.num_edges), counts)
    carrier = parent[edge_of_seg]  # -1 for a pull no entry carries
    extra = carrier >= 0
    key = sorted_unique(np.concatenate((edge_of_seg * num_segments + transfers.edge_segs,
                                        carrier[extra] * num_segments + transfers.edge_segs[extra])))
    edges = key // num_segments
    offsets = np.concatenate(([0], np.cumsum(np.bincount(edges, minlength=transfers.num_edges)))).astype(np.int64)
    return offsets, key % num_segments


def _with_forwarders(transfers: Transfers, parent: np.ndarray, forward_group: np.ndarray,
                     forward_rank: np.ndarray) -> tuple[Transfers, np.ndarray]:
    """The pulls plus one new pull per forwarder (to a GPU of the node that needs the block for no tile of its
    own), in plan_transfers' order (kind, block, receiver), and each pull's entry in that order."""
    num_edges, num_new = transfers.num_edges, forward_rank.size
    parent = np.concatenate((np.where(parent <= -2, num_edges - 2 - parent, parent),
                             np.full(num_new, -1, dtype=np.int64)))
    kind = np.concatenate((transfers.edge_kind, np.full(num_new, TransferKind.KV, dtype=np.int64)))
    block = np.concatenate((transfers.edge_block, transfers.edge_block[forward_group]))
    dst = np.concatenate((transfers.edge_dst, forward_rank))
    src = np.concatenate((transfers.edge_src, transfers.edge_src[forward_group]))
    counts = np.concatenate((np.diff(transfers.edge_seg_offsets), np.zeros(num_new, dtype=np.int64)))
    order = lexsort_ints((dst, block, kind))
    position = np.empty(order.size, dtype=np.int64)
    position[order] = np.arange(order.size)
    segs = transfers.edge_segs[expand_ranges(transfers.edge_seg_offsets[:-1][order[order < num_edges]],
                                             counts[order[order < num_edges]])]
    listed = dataclasses.replace(
        transfers, edge_kind=kind[order], edge_block=block[order], edge_src=src[order], edge_dst=dst[order],
        edge_parent=np.full(order.size, -1, dtype=np.int64),
        edge_seg_offsets=np.concatenate(([0], np.cumsum(counts[order]))).astype(np.int64), edge_segs=segs)
    moved = parent[order]
    return listed, np.where(moved >= 0, position[np.maximum(moved, 0)], -1)


def fan_out(transfers: Transfers) -> Transfers:
    """Route K,V pulls into a node through one entry pull per (block, node).

    Each group of K,V pulls of one block into one node other than the owner's keeps one pull from the owner (the
    entry), which now carries the union of the group's segments; the others are re-sent by the entry's receiver
    over NVLink (edge_parent names the entry, edge_src its receiver). The entry is one of the group's
    receivers or, where that spreads the node's NIC load better, another GPU of the node that forwards the block
    without reading it (a new pull; :func:`fcp_compiler.algorithms.fan_out.node_fan_out` picks). Q pulls (tiles
    run away from their block's owner) are left as they are: their partial outputs would need merging on the way
    back.

    Args:
        transfers: the pulls from the owners (no relays yet).
    Returns:
        the Transfers with fan-out, in plan_transfers' order; the same object when nothing is re-routed or the tile
        set has no segments.
    """
    assignment = transfers.assignment
    tiles = assignment.tiles
    if transfers.num_edges == 0 or not tiles.has_pairs:
        return transfers
    assert transfers.num_relayed == 0
    gpus_per_node, num_ranks = tiles.profile.gpus_per_node, assignment.num_ranks
    num_nodes = -(-num_ranks // gpus_per_node)
    node = transfers.edge_dst // gpus_per_node
    eligible = (transfers.edge_kind == TransferKind.KV) & (transfers.edge_src // gpus_per_node != node)
    group = np.full(transfers.num_edges, -1, dtype=np.int64)
    _, group[eligible] = sorted_unique((transfers.edge_block * num_nodes + node)[eligible], return_inverse=True)
    union_bytes = _group_union_tokens(transfers, group) * tiles.shape.kv_bytes_per_token
    parent, forward_group, forward_rank = node_fan_out(
        transfers.edge_block, transfers.edge_src, transfers.edge_dst, eligible, union_bytes.astype(np.float64),
        gpus_per_node, num_ranks)
    if (parent == -1).all():
        return transfers
    if forward_rank.size:
        transfers, parent = _with_forwarders(transfers, parent, forward_group, forward_rank)
    offsets, segs = _entry_segments(transfers, parent)
    return dataclasses.replace(transfers, edge_src=np.where(parent >= 0, transfers.edge_dst[np.maximum(parent, 0)],
                                                            transfers.edge_src),
                               edge_parent=parent, edge_seg_offsets=offsets, edge_segs=segs)

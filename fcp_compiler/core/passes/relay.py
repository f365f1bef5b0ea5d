"""Pass 7: relays. A rank that has received a block re-sends it to later pullers, so a hot block's senders form a
tree rather than a star, and pushes back along re-sent pulls are ordered so each relay sums its children's
gradients before its own leaves."""

from __future__ import annotations

import dataclasses

import numpy as np

from fcp_compiler.algorithms.exchange import backward_push_rounds, forward_push_rounds
from fcp_compiler.algorithms.relays import RelayEdges, RelayLinks, busiest_send_seconds, choose_relays
from fcp_compiler.core.ir import Schedule, TransferKind

# A relay receives the block at most this many stages (of either pass) before it re-sends it: each stage of gap
# keeps a block's buffer live one stage longer on the relay.
MAX_RELAY_GAP = 2
# Relays are kept only if they shorten the sum over stages of the busiest sender's link time by this fraction: each
# costs buffer time on its relay and a later backward gradient for its parent, and re-placing the pushes costs
# compile time.
MIN_GAIN = 0.02
# Segments of a block are named by bits of one int64 mask; pulls of blocks with more segments are not relayed.
MAX_MASK_SEGMENTS = 62


def _segment_masks(schedule: Schedule) -> tuple[np.ndarray, np.ndarray]:
    """Per pull, the bit mask of the segments it carries (relative to its block's first) and whether it fits."""
    transfers = schedule.rounds.transfers
    sharding = transfers.assignment.tiles.sharding
    counts = np.diff(transfers.edge_seg_offsets)
    edge_of_seg = np.repeat(np.arange(transfers.num_edges), counts)
    first_seg = sharding.block_seg_offsets[:-1][transfers.edge_block]
    relative = transfers.edge_segs - first_seg[edge_of_seg]
    fits = np.diff(sharding.block_seg_offsets)[transfers.edge_block] <= MAX_MASK_SEGMENTS
    mask = np.zeros(transfers.num_edges, dtype=np.int64)
    np.bitwise_or.at(mask, edge_of_seg, np.left_shift(np.int64(1), np.minimum(relative, MAX_MASK_SEGMENTS)))
    return mask, fits


def relay(schedule: Schedule, max_gap: int = MAX_RELAY_GAP) -> Schedule:
    """Re-source K,V pulls of busy senders from ranks that received the same block earlier, and re-place the pushes.

    Only pulls across nodes are re-sourced (and serve as parents): inside a node, fan-out already sends each block
    from one GPU, and NVLink is 9x the NIC; across nodes, a block many nodes read travels along a tree of nodes.

    A pull keeps its round in both passes, so every round stays a matching when the new sender is free in it
    (:func:`fcp_compiler.algorithms.relays.choose_relays` checks), and no tile moves. The relay must have the block
    a whole stage earlier in both passes. Partial outputs (forward) go back along Q pulls, which are never relayed;
    dK, dV of a re-sent pull go to the relay, which adds them to its own before pushing on
    (:func:`fcp_compiler.algorithms.exchange.backward_push_rounds`).

    Args:
        schedule: the coalesced schedule, without relays.
        max_gap: the most stages a relay may hold a block before re-sending it.
    Returns:
        the Schedule with relays (transfers' edge_src and edge_parent) and its pushes re-placed; the same object when
        no pull is worth relaying.
    """
    rounds = schedule.rounds
    transfers = rounds.transfers
    assignment = transfers.assignment
    tiles, profile, num_ranks = assignment.tiles, assignment.tiles.profile, assignment.num_ranks
    forward, backward = schedule.forward, schedule.backward
    if transfers.num_edges == 0:
        return schedule
    mask, fits = _segment_masks(schedule)
    edges = RelayEdges(block=transfers.edge_block, src=transfers.edge_src, dst=transfers.edge_dst,
                       colour=forward.edge_round, bwd_round=backward.edge_round, parent=transfers.edge_parent,
                       stage=forward.edge_stage, bwd_stage=backward.edge_stage,
                       nbytes=transfers.edge_bytes.astype(np.float64), seg_mask=mask,
                       relayable=(transfers.edge_kind == TransferKind.KV) & fits & (transfers.edge_link == 1))
    links = RelayLinks(node=np.arange(num_ranks) // profile.gpus_per_node, nic_bytes_per_s=profile.network_gbps * 1e9,
                       nvlink_bytes_per_s=profile.nvlink_gbps * 1e9, nvlink_lanes=rounds.nvlink_lanes)
    # Traffic under a stage's mean compute hides anyway: no relay is worth its buffer there (measured against the
    # heaviest compute, which leaves the busiest senders alone, and against none, which costs backward time).
    compute = np.bincount(forward.tile_stage * num_ranks + assignment.tile_rank, weights=tiles.tile_seconds,
                          minlength=forward.num_stages * num_ranks).reshape(-1, num_ranks)
    floor = compute.mean(axis=1)
    busiest = busiest_send_seconds(edges, transfers.edge_src, links, num_ranks)
    before = busiest.sum()
    parent = choose_relays(edges, links, num_ranks, floor, max_gap, min_gain=MIN_GAIN * before, busiest=busiest)
    if np.array_equal(parent, transfers.edge_parent):
        return schedule
    relayed_src = np.where(parent >= 0, transfers.edge_dst[np.maximum(parent, 0)], transfers.edge_src)
    after = busiest_send_seconds(edges, relayed_src, links, num_ranks).sum()
    if after > (1.0 - MIN_GAIN) * before:
        return schedule
    kv_edge, q_edge = schedule.tile_kv_edge, schedule.tile_q_edge
    relayed = dataclasses.replace(transfers, edge_src=relayed_src, edge_parent=parent)
    push_edge, push_round = forward_push_rounds(
        transfers.edge_kind == TransferKind.Q, relayed_src, transfers.edge_dst, num_ranks, forward.edge_round,
        forward.tile_stage, kv_edge, q_edge, forward.coalesce, relayed.edge_link, rounds.nvlink_lanes)
    bwd_push_edge, bwd_push_round = backward_push_rounds(
        relayed_src, transfers.edge_dst, parent, num_ranks, backward.edge_round, backward.tile_stage, kv_edge, q_edge,
        backward.coalesce, relayed.edge_link, rounds.nvlink_lanes)
    return dataclasses.replace(
        schedule, rounds=dataclasses.replace(rounds, transfers=relayed),
        forward=dataclasses.replace(forward, push_edge=push_edge, push_round=push_round),
        backward=dataclasses.replace(backward, push_edge=bwd_push_edge, push_round=bwd_push_round))

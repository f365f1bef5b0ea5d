"""The figures of a compiled plan (the --stats JSON), as docs/DESIGN.md section 5 defines them."""

from __future__ import annotations

import hashlib

import numpy as np

from fcp_compiler.algorithms.bounds import imbalance_ratio, makespan_lower_bound
from fcp_compiler.algorithms.fan_out import link_class
from fcp_compiler.core.ir import PassSchedule, Reshuffle, Schedule, TransferKind, Transfers
from fcp_compiler.core.layer_model import LSE_BYTES, LayerCosts, layer_bounds, longest_segments
from fcp_compiler.core.passes.coalesce import max_buffer_tokens
from fcp_compiler.format.models import NO_MODEL, ModelPreset


def forward_messages(final: Reshuffle) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Every forward message as (sender, receiver, bytes): pulls, and partial outputs pushed back along Q pulls."""
    transfers, shape = final.transfers, final.tiles.shape
    is_q = transfers.edge_kind == TransferKind.Q
    push_bytes = transfers.edge_tokens[is_q] * (shape.q_bytes_per_token + LSE_BYTES * shape.q_heads)
    return (np.concatenate((transfers.edge_src, transfers.edge_dst[is_q])),
            np.concatenate((transfers.edge_dst, transfers.edge_src[is_q])),
            np.concatenate((transfers.edge_bytes, push_bytes)).astype(np.float64))


def forward_comm_bytes(final: Reshuffle) -> tuple[np.ndarray, np.ndarray]:
    """Bytes each rank receives and sends in the forward pass: pulls, and partial outputs pushed back."""
    num_ranks = final.num_ranks
    sender, receiver, nbytes = forward_messages(final)
    return (np.bincount(receiver, weights=nbytes, minlength=num_ranks),
            np.bincount(sender, weights=nbytes, minlength=num_ranks))


def link_figures(final: Reshuffle) -> dict:
    """Forward traffic per link type (the NIC across nodes, NVLink inside one) and direction, and each rank's
    busiest link time against its compute time (docs/DESIGN.md section 5, exposure)."""
    assignment, num_ranks, profile = final.assignment, final.num_ranks, final.tiles.profile
    sender, receiver, nbytes = forward_messages(final)
    node = np.arange(num_ranks) // profile.gpus_per_node
    across = node[sender] != node[receiver]

    def per_rank(who: np.ndarray, mask: np.ndarray) -> np.ndarray:
        return np.bincount(who[mask], weights=nbytes[mask], minlength=num_ranks)

    nic_send, nic_recv = per_rank(sender, across), per_rank(receiver, across)
    nvlink_send, nvlink_recv = per_rank(sender, ~across), per_rank(receiver, ~across)
    link_seconds = np.maximum(np.maximum(nic_send, nic_recv) / (profile.network_gbps * 1e9),
                              np.maximum(nvlink_send, nvlink_recv) / (profile.nvlink_gbps * 1e9))
    compute = assignment.rank_seconds
    ratio = np.divide(link_seconds, compute, out=np.where(link_seconds > 0, np.inf, 0.0), where=compute > 0)
    return {"nic_bytes": int(nbytes[across].sum()), "nvlink_bytes": int(nbytes[~across].sum()),
            "max_rank_nic_send_bytes": int(nic_send.max()), "max_rank_nic_recv_bytes": int(nic_recv.max()),
            "max_link_to_compute": float(ratio.max()) if num_ranks else 0.0}


def rank_visible_pairs(final: Reshuffle) -> np.ndarray:
    """Visible (query, key) token pairs each rank computes: its compute load free of any efficiency model."""
    assignment, tiles = final.assignment, final.tiles
    pairs_per_flop = 1.0 / (4 * tiles.shape.q_heads * tiles.shape.head_dim)
    return np.bincount(assignment.tile_rank, weights=tiles.tile_flops * pairs_per_flop,
                       minlength=assignment.num_ranks)


def exchange_degree(transfers: Transfers, program: PassSchedule, nvlink_lanes: int = 1) -> int:
    """The fewest rounds one pass's messages (pulls and the pass's pushes) could take if pushes did not have to wait
    for their tiles: per link end, its NIC messages, or its NVLink messages over the lanes a round carries."""
    num_ranks = transfers.assignment.num_ranks
    senders = np.concatenate((transfers.edge_src, transfers.edge_dst[program.push_edge]))
    receivers = np.concatenate((transfers.edge_dst, transfers.edge_src[program.push_edge]))
    if senders.size == 0:
        return 0
    link = link_class(senders, receivers, transfers.assignment.tiles.profile.gpus_per_node)
    most = 0
    for who in (senders, receivers):
        counts = np.bincount(who * 2 + link, minlength=2 * num_ranks).reshape(num_ranks, 2)
        most = max(most, int(counts[:, 1].max()), int(-(-counts[:, 0].max() // nvlink_lanes)))
    return most


def pulls_read(schedule: Schedule) -> np.ndarray:
    """Per pull, whether some tile reads it (False: its receiver only forwards it)."""
    read = np.zeros(schedule.rounds.transfers.num_edges, dtype=bool)
    for edge in (schedule.tile_kv_edge, schedule.tile_q_edge):
        read[edge[edge >= 0]] = True
    return read


def plan_stats(final: Reshuffle, data: bytes, compile_seconds: float, pass_seconds: dict[str, float],
               layout: str, model: ModelPreset | None = None, max_buffer: int | None = None) -> dict:
    """Every figure of the --stats JSON for a compiled plan that needs no simulation (the CLI adds the simulated
    layer makespans and their gap to these bounds). `max_buffer`: max_buffer_tokens of the schedule, when the
    caller has it (a pass over every tile of both passes)."""
    schedule = final.schedule
    rounds = schedule.rounds
    transfers = rounds.transfers
    assignment = transfers.assignment
    tiles = assignment.tiles
    sharding = tiles.sharding
    received, sent = forward_comm_bytes(final)
    layer = layer_bounds(sharding.batch, tiles.shape, tiles.profile, model, assignment.num_ranks,
                         assignment.token_cap, longest_segments(sharding.seg_seq, sharding.seg_tokens,
                                                                sharding.batch.num_sequences))
    return {
        "num_ranks": assignment.num_ranks,
        "block_size": sharding.block_size,
        "coalesce": schedule.coalesce,
        "bwd_coalesce": schedule.backward.coalesce,
        "zigzag": sharding.zigzag,
        "layout": layout,
        "mask": sharding.batch.mask.value,
        "num_sequences": sharding.batch.num_sequences,
        "total_tokens": sharding.batch.total_tokens,
        "num_blocks": sharding.num_blocks,
        "num_tiles": tiles.num_tiles,
        "num_offloaded_tiles": assignment.num_offloaded_tiles,
        "num_relayed_transfers": rounds.transfers.num_relayed,  # re-sent by a rank that received them (fan-out too)
        "num_transfers": transfers.num_edges,
        **_exchange_figures(schedule),
        "max_buffer_tokens": max_buffer_tokens(schedule) if max_buffer is None else max_buffer,
        **_balance_figures(final, layout, model, received, sent),
        "model": model.name if model is not None else NO_MODEL,
        "layer_makespan_lower_bound_fwd_s": layer["fwd"]["bound_s"],
        "layer_makespan_lower_bound_bwd_s": layer["bwd"]["bound_s"],
        "layer_bound_binding": {"fwd": layer["fwd"]["binding"], "bwd": layer["bwd"]["binding"]},
        "total_comm_bytes": int(received.sum()),
        "max_rank_recv_bytes": int(received.max()),
        "max_rank_sent_bytes": int(sent.max()),
        **link_figures(final),
        "plan_bytes": len(data),
        "compile_seconds": compile_seconds,
        "pass_seconds": dict(pass_seconds),
        "plan_sha256": hashlib.sha256(data).hexdigest(),
    }


def _balance_figures(final: Reshuffle, layout: str, model: ModelPreset | None, received: np.ndarray,
                     sent: np.ndarray) -> dict:
    """:func:`plan_stats`' balance figures: each rank's compute, layer, pairs, tokens and traffic (`received`,
    `sent`: its forward bytes) against the mean, the tokens the reshuffle leaves where they are, and the busiest
    rank against the batch's lower bound."""
    assignment = final.schedule.rounds.transfers.assignment
    tiles = assignment.tiles
    compute = assignment.rank_seconds
    bound, bound_kind = makespan_lower_bound(float(tiles.tile_seconds.sum()), assignment.num_ranks,
                                             float(tiles.tile_seconds.max()) if tiles.num_tiles else 0.0)
    return {
        "compute_imbalance": imbalance_ratio(compute),
        # The placement's objective: each rank's forward linear layers on its plan-layout tokens (the user layout's
        # run on even chunks whatever the placement) plus its modelled tiles.
        "layer_imbalance": imbalance_ratio(compute + (assignment.rank_tokens * LayerCosts.of(
            model, tiles.profile).linear_seconds_per_token if layout == "plan" else 0.0)),
        "pair_imbalance": imbalance_ratio(rank_visible_pairs(final)),
        "token_imbalance": imbalance_ratio(assignment.rank_tokens),
        "tokens_home_fraction": float(final.run_length[final.run_user_rank == final.run_plan_rank].sum()
                                      / max(tiles.sharding.batch.total_tokens, 1)),
        "comm_imbalance": imbalance_ratio(received),
        "comm_sent_imbalance": imbalance_ratio(sent),
        "max_tokens_per_rank": int(assignment.rank_tokens.max()),
        "token_cap": assignment.token_cap,
        "makespan_lower_bound_ratio": float(compute.max() / bound) if bound > 0 else 1.0,
        "lower_bound_kind": bound_kind,
        "max_rank_compute_seconds": float(compute.max()),
    }


def _exchange_figures(schedule) -> dict:
    """The figures of a schedule's rounds and stages (the header's counts among them)."""
    rounds = schedule.rounds
    transfers = rounds.transfers
    degrees = transfers.class_degrees  # a pass over every pull
    return {
        # Delta of each link class's forward pulls as sent (fan-out and relays included), and how many NVLink
        # rounds share one; the rounds the pulls from owners were coloured into (Konig per class) and the rounds
        # the forward pulls take once fan-out waits for its entries.
        "max_degree": max(degrees),
        "nvlink_degree": degrees[0],
        "nic_degree": degrees[1],
        "nvlink_lanes": rounds.nvlink_lanes,
        "owner_rounds": rounds.num_rounds,
        "num_rounds": int(schedule.forward.edge_round.max(initial=-1)) + 1,
        # Pulls to a GPU that reads the block in no tile, only to re-send it inside its node (node fan-out), and the
        # pulls re-sent inside a node.
        "num_forwarding_transfers": int((~pulls_read(schedule)).sum()),
        "num_fanned_out_transfers": int(((transfers.edge_parent >= 0) & (transfers.edge_link == 0)).sum()),
        "num_fwd_rounds": schedule.forward.num_rounds,
        "num_bwd_rounds": schedule.backward.num_rounds,
        "fwd_exchange_degree": exchange_degree(transfers, schedule.forward, rounds.nvlink_lanes),
        "bwd_exchange_degree": exchange_degree(transfers, schedule.backward, rounds.nvlink_lanes),
        "num_fwd_stages": schedule.forward.num_stages,
        "num_bwd_stages": schedule.backward.num_stages,
    }

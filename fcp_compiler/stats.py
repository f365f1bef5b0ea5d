"""The figures of a compiled plan (the --stats JSON), as DESIGN section 5 defines them."""

from __future__ import annotations

import hashlib

import numpy as np

from fcp_compiler.algorithms.bounds import imbalance_ratio, makespan_lower_bound
from fcp_compiler.ir import PassSchedule, Reshuffle, TransferKind, Transfers
from fcp_compiler.passes.coalesce import max_buffer_tokens

LSE_BYTES = 4  # one fp32 log-sum-exp per query token and head travels with a partial output


def forward_comm_bytes(final: Reshuffle) -> tuple[np.ndarray, np.ndarray]:
    """Bytes each rank receives and sends in the forward pass: pulls, and partial outputs pushed back."""
    transfers = final.schedule.rounds.transfers
    num_ranks = transfers.assignment.num_ranks
    shape = transfers.assignment.tiles.shape
    pull_bytes = transfers.edge_bytes
    is_q = transfers.edge_kind == TransferKind.Q
    push_bytes = transfers.edge_tokens[is_q] * (shape.q_bytes_per_token + LSE_BYTES * shape.q_heads)
    received = (np.bincount(transfers.edge_dst, weights=pull_bytes, minlength=num_ranks)
                + np.bincount(transfers.edge_src[is_q], weights=push_bytes, minlength=num_ranks))
    sent = (np.bincount(transfers.edge_src, weights=pull_bytes, minlength=num_ranks)
            + np.bincount(transfers.edge_dst[is_q], weights=push_bytes, minlength=num_ranks))
    return received, sent


def exchange_degree(transfers: Transfers, program: PassSchedule) -> int:
    """Largest number of messages (pulls and the pass's pushes) any rank sends or receives in one pass: the fewest
    rounds that pass could take if pushes did not have to wait for their tiles."""
    num_ranks = transfers.assignment.num_ranks
    senders = np.concatenate((transfers.edge_src, transfers.edge_dst[program.push_edge]))
    receivers = np.concatenate((transfers.edge_dst, transfers.edge_src[program.push_edge]))
    if senders.size == 0:
        return 0
    return int(max(np.bincount(senders, minlength=num_ranks).max(), np.bincount(receivers, minlength=num_ranks).max()))


def plan_stats(final: Reshuffle, data: bytes, compile_seconds: float, pass_seconds: dict[str, float],
               layout: str) -> dict:
    """Every figure of the --stats JSON for a compiled plan."""
    schedule = final.schedule
    rounds = schedule.rounds
    transfers = rounds.transfers
    assignment = transfers.assignment
    tiles = assignment.tiles
    sharding = tiles.sharding
    compute = assignment.rank_seconds
    received, sent = forward_comm_bytes(final)
    bound, bound_kind = makespan_lower_bound(float(tiles.tile_seconds.sum()), assignment.num_ranks,
                                             float(tiles.tile_seconds.max()) if tiles.num_tiles else 0.0)
    return {
        "gpus": assignment.num_ranks,
        "block_size": sharding.block_size,
        "coalesce": schedule.coalesce,
        "zigzag": sharding.zigzag,
        "layout": layout,
        "mask": sharding.batch.mask.value,
        "num_sequences": sharding.batch.num_sequences,
        "total_tokens": sharding.batch.total_tokens,
        "num_blocks": sharding.num_blocks,
        "num_tiles": tiles.num_tiles,
        "num_offloaded_tiles": assignment.num_offloaded_tiles,
        "num_transfers": transfers.num_edges,
        "max_degree": rounds.max_degree,
        "num_rounds": rounds.num_rounds,
        "num_stages": schedule.num_comm_stages,
        "num_fwd_rounds": schedule.forward.num_rounds,
        "num_bwd_rounds": schedule.backward.num_rounds,
        "fwd_exchange_degree": exchange_degree(transfers, schedule.forward),
        "bwd_exchange_degree": exchange_degree(transfers, schedule.backward),
        "num_fwd_stages": schedule.forward.num_stages,
        "num_bwd_stages": schedule.backward.num_stages,
        "max_buffer_tokens": max_buffer_tokens(schedule),
        "compute_imbalance": imbalance_ratio(compute),
        "comm_imbalance": imbalance_ratio(received),
        "comm_sent_imbalance": imbalance_ratio(sent),
        "max_tokens_per_rank": int(assignment.rank_tokens.max()),
        "token_cap": assignment.token_cap,
        "makespan_lower_bound_ratio": float(compute.max() / bound) if bound > 0 else 1.0,
        "lower_bound_kind": bound_kind,
        "max_rank_compute_seconds": float(compute.max()),
        "total_comm_bytes": int(received.sum()),
        "max_rank_recv_bytes": int(received.max()),
        "max_rank_sent_bytes": int(sent.max()),
        "plan_bytes": len(data),
        "compile_seconds": compile_seconds,
        "pass_seconds": dict(pass_seconds),
        "plan_sha256": hashlib.sha256(data).hexdigest(),
    }

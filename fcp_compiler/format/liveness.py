"""When each received pull's buffer lives, per pass: from the stage that posts it to the end of the stage of its last
use (the runtime's liveness rule, which the memory account and the arena placement both follow)."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from fcp_compiler.algorithms.keys import lookup, stable_argsort
from fcp_compiler.format.plan_format import TransferKind
from fcp_compiler.format.stacked import StackedRanks


@dataclass(frozen=True, slots=True, kw_only=True)
class PassMessages:
    """One pass's messages on stacked ranks (:class:`StackedRanks`): per row its rank (position in the stack) and the
    stage it is posted in; per received pull the end of its buffer's life; pull rows that pushes name are rows of
    the stacked pull_send arrays."""

    pull_recv_rank: np.ndarray
    pull_recv_stage: np.ndarray
    pull_recv_last: np.ndarray
    pull_send_rank: np.ndarray
    pull_send_stage: np.ndarray
    push_recv_rank: np.ndarray
    push_recv_stage: np.ndarray
    push_recv_pull: np.ndarray
    push_send_rank: np.ndarray
    push_send_stage: np.ndarray
    push_send_pull: np.ndarray  # stacked pull_recv rows
    num_stages: int


def stacked_messages(stacked: StackedRanks, pass_name: str, last_use: bool = True,
                     tile_pulls: tuple[np.ndarray, np.ndarray] | None = None) -> PassMessages:
    """Where one pass's messages fall in its stages, on every stacked rank, and when each received pull is freed: at
    the end of the stage of its last tile, of the push back along it, of a push landing in it (a relay's), or of
    its relay's send, whichever is last (and never before it arrives). `last_use` False leaves the last out (each
    pull's pull_recv_last is then its own stage): a pass over every tile that a caller of the stages alone skips.
    `tile_pulls`: :func:`tile_pull_rows` of the stack, where the caller holds it (both passes read the same)."""
    a, header = stacked.arrays, stacked.header
    forward = pass_name == "fwd"
    coalesce = header.coalesce if forward else header.bwd_coalesce
    suffix = "round" if forward else "bwd_round"
    recv_rank, send_rank = stacked.rank_of("pull_recv_round"), stacked.rank_of("pull_send_round")
    recv_base, send_base = stacked.base("pull_recv_round"), stacked.base("pull_send_round")
    recv_stage, send_stage = a[f"pull_recv_{suffix}"] // coalesce, a[f"pull_send_{suffix}"] // coalesce
    tile_stage = a["tile_stage"] if forward else a["tile_bwd_stage"]
    push_send_stage = a[f"{pass_name}_push_send_round"] // coalesce
    push_send_pull = a[f"{pass_name}_push_send_pull"] + recv_base[stacked.rank_of(f"{pass_name}_push_send_round")]
    push_recv_rank = stacked.rank_of(f"{pass_name}_push_recv_round")
    push_recv_stage = a[f"{pass_name}_push_recv_round"] // coalesce
    push_recv_pull = a[f"{pass_name}_push_recv_pull"] + send_base[push_recv_rank]
    last = recv_stage.copy()
    if last_use:
        _last_uses(stacked, last, tile_stage, push_send_pull, push_send_stage, push_recv_pull, push_recv_stage,
                   send_stage, tile_pull_rows(stacked) if tile_pulls is None else tile_pulls)
    return PassMessages(pull_recv_rank=recv_rank, pull_recv_stage=recv_stage, pull_recv_last=last,
                        pull_send_rank=send_rank, pull_send_stage=send_stage, push_recv_rank=push_recv_rank,
                        push_recv_stage=push_recv_stage, push_recv_pull=push_recv_pull,
                        push_send_rank=stacked.rank_of(f"{pass_name}_push_send_round"),
                        push_send_stage=push_send_stage, push_send_pull=push_send_pull,
                        num_stages=header.num_fwd_stages if forward else header.num_bwd_stages)


def tile_pull_rows(stacked: StackedRanks) -> tuple[np.ndarray, np.ndarray]:
    """Per stacked tile, the stacked pull_recv row its queries and its keys arrive in (-1: the rank holds the
    block): (Q rows, K,V rows)."""
    a = stacked.arrays
    recv_rank, num_blocks = stacked.rank_of("pull_recv_round"), stacked.header.num_blocks
    # Each received pull's (rank, kind, block), sorted, to find the pull a tile reads.
    pull_key = (recv_rank * 2 + a["pull_recv_kind"]) * num_blocks + a["pull_recv_block"]
    order = stable_argsort(pull_key)
    tile_rank = stacked.rank_of("tile_stage")
    q_rows, kv_rows = (lookup(pull_key[order], order, (tile_rank * 2 + kind) * num_blocks + blocks, -1)
                       for kind, blocks in ((TransferKind.Q, a["tile_q_block"]), (TransferKind.KV, a["tile_kv_block"])))
    return q_rows, kv_rows


def _last_uses(stacked: StackedRanks, last: np.ndarray, tile_stage, push_send_pull, push_send_stage, push_recv_pull,
               push_recv_stage, send_stage, tile_pulls: tuple[np.ndarray, np.ndarray]) -> None:
    """Raise each received pull's `last` stage to its last use: a tile reading it (`tile_pulls`: each tile's pull
    rows, :func:`tile_pull_rows`), the push back along it, a push landing in it, its relay's send."""
    a = stacked.arrays
    send_rank, recv_base = stacked.rank_of("pull_send_round"), stacked.base("pull_recv_round")
    for row in tile_pulls:
        np.maximum.at(last, row[row >= 0], tile_stage[row >= 0])
    np.maximum.at(last, push_send_pull, push_send_stage)
    source = a["pull_send_source"]
    source = np.where(source >= 0, source + recv_base[send_rank], -1)  # a relay's own received row
    relayed = source[push_recv_pull]  # a relay's pushed-back gradient lands in its received buffer
    np.maximum.at(last, relayed[relayed >= 0], push_recv_stage[relayed >= 0])
    relays = np.flatnonzero(source >= 0)  # a relay keeps the block until it has sent it on
    np.maximum.at(last, source[relays], send_stage[relays])

"""The timing model's inputs from a plan: each pass's messages, tiles and data moved, as PassInput takes them.

:func:`pass_inputs` reads what the runtime reads (the plan's ranks stacked as the encoder lays them out): each
received pull and the pass's pushes back (bytes and stages), each tile at its kernel call's efficiency (kernel calls
counted as :func:`fcp_compiler.core.launches.sweep` counts them), the data the runtime moves outside the kernels
(:mod:`fcp_compiler.format.traffic`) and, in the user layout, the input and output reshuffles.
:mod:`fcp_compiler.core.simulate` runs the timing model on them.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from fcp_compiler.algorithms.keys import unique_keys
from fcp_compiler.algorithms.timeline import PassInput
from fcp_compiler.core.launches import PassLaunches, sweep
from fcp_compiler.core.layer_model import BACKWARD_WORK, LSE_BYTES
from fcp_compiler.core.plan_tiles import plan_tiles
from fcp_compiler.format.inputs import HardwareProfile, Layout
from fcp_compiler.format.memory import Sizes
from fcp_compiler.format.plan_format import TransferKind
from fcp_compiler.format.stacked import StackedRanks
from fcp_compiler.format.traffic import stacked_range_traffic


@dataclass(frozen=True, slots=True, kw_only=True)
class PassInputs:
    """Both passes' timing-model inputs (:func:`pass_inputs`)."""

    forward: PassInput
    backward: PassInput
    planned_compute: np.ndarray  # per rank, its tiles at the tile set's seconds (the compiler's balance figures)
    moved_bytes: dict  # per pass ("fwd", "bwd"), the bytes each rank moves outside the kernels


@dataclass(frozen=True, slots=True, kw_only=True)
class _PlanArrays:
    """What both passes' timing-model inputs read from a plan's stacked ranks (:func:`pass_inputs`) besides its
    tiles: the received pulls' names when recorded."""

    header: object
    stacked: StackedRanks
    pull_names: list | None

    def rounds_per_stage(self, prefix: str) -> int:
        """Pull rounds a stage of the pass."""
        return self.header.coalesce if prefix == "fwd" else self.header.bwd_coalesce

    def pushes(self, prefix: str) -> tuple[np.ndarray, np.ndarray]:
        """Each push of the pass: its stage and its pull's row among the stacked received pulls."""
        a, stacked = self.stacked.arrays, self.stacked
        push_round, sender = a[f"{prefix}_push_send_round"], stacked.rank_of(f"{prefix}_push_send_round")
        return (push_round // self.rounds_per_stage(prefix),
                a[f"{prefix}_push_send_pull"] + stacked.base("pull_recv_round")[sender])


@dataclass(frozen=True, slots=True, kw_only=True)
class _TileInputs:
    """Both passes' tiles as PassInput takes them (its tile fields), and each rank's planned compute."""

    forward: dict
    backward: dict
    planned_compute: np.ndarray


def _tile_inputs(header, stacked: StackedRanks, tiles, profile: HardwareProfile, record: bool, pairs: tuple | None,
                 kinds: tuple | None, final) -> _TileInputs:
    """Both passes' tiles as PassInput takes them (:func:`pass_inputs`), and each rank's planned compute (its tiles
    at the tile set's seconds). A pass charges each tile at its kernel call's efficiency, and counts each stage's
    calls, in one pass over the segment pairs a part at a time (:func:`launches.sweep`); its tiles are then summed a
    few ranks at a time (TileWork), one pass after the other (a column of seconds a tile: millions at small blocks),
    and only a recorded pass keeps a column per tile."""
    found = plan_tiles(stacked, tiles, final)
    if record:
        tile, rank, fwd_stage, bwd_stage, early = found.in_plan_order()
        names = [f"q{q} kv{kv}" for q, kv in zip(tiles.tile_q_block[tile].tolist(), tiles.tile_kv_block[tile].tolist())]
    fields, planned = [], None
    for launch, stage, num_stages, backward in ((found.fwd_launch(header.num_fwd_stages), found.fwd_stage,
                                                 header.num_fwd_stages, False),
                                                (found.bwd_stage, found.bwd_stage, header.num_bwd_stages, True)):
        launches = PassLaunches(rank=found.rank, launch=launch, num_launches=num_stages + 1,
                                num_ranks=header.num_ranks, split=backward)
        sweep(tiles, [launches], profile, pairs, kinds)
        scale = BACKWARD_WORK if backward else 1.0
        work, planned_compute = found.work(stage, launches.seconds, num_stages, scale, early=not backward,
                                           tile_seconds=None if backward else tiles.tile_seconds)
        planned = planned if backward else planned_compute
        # Tiles that run during the input reshuffle are not a stage's calls.
        pass_fields = {"tile_work": work, "stage_calls": launches.stage_calls()[:num_stages],
                       "tile_rank": np.zeros(0, dtype=np.int64), "tile_stage": np.zeros(0, dtype=np.int64),
                       "tile_seconds": np.zeros(0), "tile_early": np.zeros(0, dtype=bool), "tile_name": None}
        if record:
            pass_fields.update(tile_rank=rank, tile_stage=bwd_stage if backward else fwd_stage,
                               tile_seconds=launches.seconds[tile] * scale if backward else launches.seconds[tile],
                               tile_early=np.zeros(early.size, dtype=bool) if backward else early, tile_name=names)
        fields.append(pass_fields)
        del launches
    return _TileInputs(forward=fields[0], backward=fields[1], planned_compute=planned)


def pass_inputs(header, stacked: StackedRanks, tiles, profile: HardwareProfile, record: bool,
                pairs: tuple | None = None, kinds: tuple | None = None, final=None) -> PassInputs:
    """Both passes' timing-model inputs from a plan's stacked ranks.

    Args:
        header: the plan's header.
        stacked: its ranks stacked (format.stacked).
        tiles: its tile set, costed on `profile`.
        profile: the hardware the passes are timed on.
        record: name each tile and message (for the Chrome trace).
        pairs: tiles.segment_pairs(), and `kinds`: pair_kinds of them, where the caller holds them.
        final: its IR, where held: its tiles are read from it.
    Returns:
        the PassInputs: messages (pulls and the pass's pushes, in bytes and stages), tiles (seconds, stages, kernel
        calls), the data moved outside the kernels and, in the user layout, the reshuffles.
    """
    shape = header.shape
    tile_inputs = _tile_inputs(header, stacked, tiles, profile, record, pairs, kinds, final)
    fwd_tiles, bwd_tiles = tile_inputs.forward, tile_inputs.backward
    a = stacked.arrays
    r_kind, r_block = a["pull_recv_kind"], a["pull_recv_block"]
    recv_tokens = stacked.pull_tokens("recv")
    r_tokens = recv_tokens.astype(np.float64)
    kv_bytes, q_bytes, lse_bytes = shape.kv_bytes_per_token, shape.q_bytes_per_token, LSE_BYTES * shape.q_heads
    pull_names = [f"{'KV' if k == TransferKind.KV else 'Q'} b{b}" for k, b in zip(r_kind.tolist(), r_block.tolist())] \
        if record else None
    plan = _PlanArrays(header=header, stacked=stacked, pull_names=pull_names)
    traffic = stacked_range_traffic(stacked, Sizes.of(header), recv_rows=recv_tokens)
    is_kv = r_kind == TransferKind.KV
    fwd_input = _pass_input(plan, profile, "fwd", r_tokens * np.where(is_kv, kv_bytes, q_bytes),
                            r_tokens * (q_bytes + lse_bytes), fwd_tiles, (q_bytes + kv_bytes, q_bytes),
                            traffic["fwd"])
    bwd_input = _pass_input(plan, profile, "bwd", r_tokens * np.where(is_kv, kv_bytes, 3 * q_bytes + lse_bytes),
                            r_tokens * np.where(is_kv, kv_bytes, q_bytes), bwd_tiles, (q_bytes, q_bytes + kv_bytes),
                            traffic["bwd"])
    moved = {name: traffic[name].bytes.sum(axis=1) for name in ("fwd", "bwd")}
    return PassInputs(forward=fwd_input, backward=bwd_input, planned_compute=tile_inputs.planned_compute,
                      moved_bytes=moved)


def _pass_input(plan: _PlanArrays, profile: HardwareProfile, prefix: str, pull_bytes: np.ndarray,
                push_bytes: np.ndarray, tile_fields: dict, shuffle_bytes: tuple[int, int], moved) -> PassInput:
    """One pass's PassInput (:func:`pass_inputs`): `pull_bytes` of each received pull, `push_bytes` of each pull's
    push back (indexed by pull row), the tiles' fields (:func:`_tile_inputs`), the bytes a token moves in the input
    and the output reshuffle (user layout), and the pass's range traffic (`moved`)."""
    header, stacked, a = plan.header, plan.stacked, plan.stacked.arrays
    n = header.num_ranks
    num_stages = header.num_fwd_stages if prefix == "fwd" else header.num_bwd_stages
    pull_round = a["pull_recv_round"] if prefix == "fwd" else a["pull_recv_bwd_round"]
    r_me, r_peer, r_kind = stacked.rank_of("pull_recv_round"), a["pull_recv_peer"], a["pull_recv_kind"]
    rounds_per_stage = plan.rounds_per_stage(prefix)
    push_stage, push_row = plan.pushes(prefix)
    names = None
    if plan.pull_names is not None:
        r_block = a["pull_recv_block"]
        names = plan.pull_names + [f"{'dKV' if r_kind[r] == TransferKind.KV else ('O' if prefix == 'fwd' else 'dQ')} "
                                   f"b{r_block[r]}" for r in push_row.tolist()]
    no_flows = (np.zeros(0, dtype=np.int64), np.zeros(0, dtype=np.int64), np.zeros(0))
    in_user_layout = header.layout is Layout.USER
    shuffle_in, shuffle_out = shuffle_bytes
    return PassInput(
        num_ranks=n, num_stages=num_stages,
        flow_src=np.concatenate((r_peer, r_me[push_row])), flow_dst=np.concatenate((r_me, r_peer[push_row])),
        flow_bytes=np.concatenate((pull_bytes, push_bytes[push_row])),
        flow_stage=np.concatenate((pull_round // rounds_per_stage, push_stage)), flow_name=names,
        reshuffle_in=_reshuffle_flows(stacked, shuffle_in) if in_user_layout else no_flows,
        reshuffle_out=_swap(_reshuffle_flows(stacked, shuffle_out)) if in_user_layout else no_flows,
        stage_extra_s=moved.bytes.T[:num_stages] / (profile.hbm_gbps * 1e9),
        # Each pass's stage-0 K,V pulls are what a rank may post before the pass starts (K,V prefetch).
        flow_prefetch=np.concatenate(((r_kind == TransferKind.KV) & (pull_round < rounds_per_stage),
                                      np.zeros(push_row.size, dtype=bool))), **tile_fields)



def _swap(flows):
    """The output reshuffle runs the input's runs backwards: plan rank to user rank."""
    src, dst, nbytes = flows
    return dst, src, nbytes


def _reshuffle_flows(stacked: StackedRanks, bytes_per_token: float):
    """The input reshuffle's flows: per (rank, peer) pair with tokens to move, by rank then peer, the bytes."""
    a, n = stacked.arrays, stacked.num_ranks
    rank = stacked.ranks[stacked.rank_of("reshuffle_send_peer")]
    peers = a["reshuffle_send_peer"]
    remote = peers != rank
    # Sparse: the (rank, peer) pairs that exist (a dense N x N table is 134 MB at 4096 ranks).
    pairs, pair_of = unique_keys(rank[remote] * n + peers[remote], n * n, return_inverse=True)
    per_pair = np.bincount(pair_of, weights=a["reshuffle_send_length"][remote], minlength=pairs.size)
    moving = per_pair > 0
    return pairs[moving] // n, pairs[moving] % n, per_pair[moving] * bytes_per_token

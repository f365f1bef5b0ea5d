"""One rank's plan, decoded and indexed for execution: :func:`load_rank_plan`.

Reads the plan file with the format reader only (no compiler passes are imported). The plan's types are in
:mod:`fcp_runtime.rank_plan` and :mod:`fcp_runtime.kinds_plan`; the ones callers import from here are named again
below.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

from fcp_compiler.format.call_plan import tiles_during_reshuffle
from fcp_compiler.format.kinds import PlanKinds, is_kinds_file
from fcp_compiler.format.plan_format import PlanReader, RankProgram, TransferKind, expand_ranges
from fcp_compiler.format.validate import validate_plan
from fcp_compiler.format.validate_kinds import validate_kinds
from fcp_runtime.kinds_plan import KindsRankPlan, resolve_kind
from fcp_runtime.rank_plan import LAYOUTS, Message, PassProgram, Pull, RankPlan

# Named here for the callers that import them from this module: the loader, binding, stage_calls and tests.
__all__ = ["LAYOUTS", "KindsRankPlan", "RankPlan", "from_program", "load_rank_plan", "resolve_kind"]


def _splits(peers: np.ndarray, lengths: np.ndarray, num_ranks: int) -> list[int]:
    return np.bincount(peers, weights=lengths, minlength=num_ranks).astype(np.int64).tolist()


def _pass_program(name: str, a: dict[str, np.ndarray], pull_send: list[Pull], pull_recv: list[Pull],
                  tiles: list[tuple[int, int]],
                  tile_stages: np.ndarray, num_stages: int, coalesce: int, pull_round_of) -> PassProgram:
    """Group a pass's messages and tiles by stage and apply the liveness rule to its received buffers."""
    messages: list[list[Message]] = [[] for _ in range(num_stages)]
    for side, what in (("send", "pull_send"), ("recv", "pull_recv")):
        rounds = a[f"pull_{side}_{'round' if name == 'fwd' else 'bwd_round'}"].tolist()
        for row, rnd in enumerate(rounds):
            messages[rnd // coalesce].append(Message(round=rnd, what=what, pull=row))
    last_stage = [pull_round_of(pull) // coalesce for pull in pull_recv]
    by_block = {(pull.kind, pull.block): row for row, pull in enumerate(pull_recv)}
    stage_tiles: list[list[int]] = [[] for _ in range(num_stages)]
    for idx, ((q_block, kv_block), stage) in enumerate(zip(tiles, tile_stages.tolist())):
        stage_tiles[stage].append(idx)
        for key in ((TransferKind.Q, q_block), (TransferKind.KV, kv_block)):
            if key in by_block:
                last_stage[by_block[key]] = max(last_stage[by_block[key]], stage)
    for side, what in (("send", "push_send"), ("recv", "push_recv")):
        for rnd, row in zip(a[f"{name}_push_{side}_round"].tolist(), a[f"{name}_push_{side}_pull"].tolist()):
            messages[rnd // coalesce].append(Message(round=rnd, what=what, pull=row))
            if what == "push_send":
                last_stage[row] = max(last_stage[row], rnd // coalesce)
            elif pull_send[row].source >= 0:  # a gradient of a relayed pull lands in the relay's received buffer
                last_stage[pull_send[row].source] = max(last_stage[pull_send[row].source], rnd // coalesce)
    for pull in pull_send:  # a relay keeps the block it re-sends until it has sent it
        if pull.source >= 0:
            last_stage[pull.source] = max(last_stage[pull.source], pull_round_of(pull) // coalesce)
    # Both ends of a pair derive the same order from what they agree on (round; pull before push; kind and block,
    # which name one pull of a pair), not from their own row numbers: NCCL matches a pair's messages by posting
    # order, and with NVLink lanes a pair may exchange two messages in one round. A pass's stage-0 K,V pulls go
    # first, whether they were posted early (K,V prefetch) or the stage posts them, so both ends agree either way.
    def prefetched(message: Message) -> bool:
        return message.what.startswith("pull") and message.round < coalesce and \
            (pull_send if message.what == "pull_send" else pull_recv)[message.pull].kind == TransferKind.KV

    def posting_key(message: Message) -> tuple[int, int, int, int, int]:
        pull = (pull_send if message.what in ("pull_send", "push_recv") else pull_recv)[message.pull]
        return not prefetched(message), message.round, message.what.startswith("push"), pull.kind, pull.block

    for stage_messages in messages:
        stage_messages.sort(key=posting_key)
    num_prefetched = sum(map(prefetched, messages[0])) if messages else 0
    free_after: list[list[int]] = [[] for _ in range(num_stages)]
    for row, stage in enumerate(last_stage):
        free_after[stage].append(row)
    return PassProgram(name=name, num_stages=num_stages, messages=messages, tiles=stage_tiles, free_after=free_after,
                       num_prefetched=num_prefetched)


def _plan_layout_rows(program: RankProgram, block_segs: dict[int, tuple[int, ...]]):
    """Each plan-layout row's global token, position in its sequence and sequence, and each local segment's row."""
    tables = program.tables
    seq_offset = np.concatenate(([0], np.cumsum(tables.seq_lengths))).astype(np.int64)
    segs = np.asarray([seg for block in program.arrays["blocks"].tolist() for seg in block_segs[block]],
                      dtype=np.int64)
    lengths = tables.seg_end[segs] - tables.seg_start[segs]
    positions = expand_ranges(tables.seg_start[segs], lengths)
    sequences = np.repeat(tables.seg_seq[segs], lengths)
    rows = np.concatenate(([0], np.cumsum(lengths)[:-1])).astype(np.int64) if segs.size else segs
    local_seg_row = dict(zip(segs.tolist(), rows.tolist()))
    return seq_offset[sequences] + positions, positions, sequences, local_seg_row


def from_program(program: RankProgram) -> RankPlan:
    """Index a decoded rank program for execution."""
    header, tables, a = program.header, program.tables, program.arrays
    num_ranks, coalesce = header.num_ranks, header.coalesce
    seg_block, seg_start, seg_end = tables.seg_block, tables.seg_start, tables.seg_end
    ptr = np.searchsorted(seg_block, np.arange(header.num_blocks + 1))
    block_segs = {b: tuple(range(int(ptr[b]), int(ptr[b + 1]))) for b in range(header.num_blocks)}
    token_index, position_ids, sequence_ids, local_seg_row = _plan_layout_rows(program, block_segs)
    bounds = (np.arange(num_ranks + 1, dtype=np.int64) * header.total_tokens) // num_ranks

    def pulls(side: str) -> list[Pull]:
        counts = a[f"pull_{side}_seg_count"]
        offsets = np.concatenate(([0], np.cumsum(counts)))
        segs = a[f"pull_{side}_segs"]
        sources = a["pull_send_source"] if side == "send" else np.full(counts.size, -1)
        return [Pull(round=int(a[f"pull_{side}_round"][i]), bwd_round=int(a[f"pull_{side}_bwd_round"][i]),
                     kind=int(a[f"pull_{side}_kind"][i]), block=int(a[f"pull_{side}_block"][i]),
                     peer=int(a[f"pull_{side}_peer"][i]), segs=tuple(segs[offsets[i]:offsets[i + 1]].tolist()),
                     source=int(sources[i]))
                for i in range(counts.size)]

    pull_send, pull_recv = pulls("send"), pulls("recv")
    tiles = list(zip(a["tile_q_block"].tolist(), a["tile_kv_block"].tolist()))
    forward = _pass_program("fwd", a, pull_send, pull_recv, tiles, a["tile_stage"], header.num_fwd_stages, coalesce,
                            lambda pull: pull.round)
    backward = _pass_program("bwd", a, pull_send, pull_recv, tiles, a["tile_bwd_stage"], header.num_bwd_stages,
                             header.bwd_coalesce,
                             lambda pull: pull.bwd_round)
    # Runs between this rank and itself are sent and received in the same order (by global token).
    mine_send = a["reshuffle_send_peer"] == program.rank
    mine_recv = a["reshuffle_recv_peer"] == program.rank
    self_user = expand_ranges(a["reshuffle_send_offset"][mine_send], a["reshuffle_send_length"][mine_send])
    self_plan = expand_ranges(a["reshuffle_recv_offset"][mine_recv], a["reshuffle_recv_length"][mine_recv])
    early = frozenset(np.flatnonzero(tiles_during_reshuffle(program)).tolist())
    return RankPlan(
        rank=program.rank, num_ranks=num_ranks, digest=header.inputs_digest,
        seq_lengths=tables.seq_lengths, seq_window=tables.seq_window,
        layout=header.layout.value, coalesce=coalesce, bwd_coalesce=header.bwd_coalesce,
        q_heads=header.shape.q_heads, kv_heads=header.shape.kv_heads,
        head_dim=header.shape.head_dim, dtype=str(getattr(header.shape.dtype, "value", header.shape.dtype)),
        max_buffer_tokens=header.max_buffer_tokens,
        user_tokens=int(bounds[program.rank + 1] - bounds[program.rank]), plan_tokens=int(token_index.size),
        seg_seq=tables.seg_seq, seg_start=seg_start, seg_end=seg_end, block_segs=block_segs,
        local_blocks=frozenset(a["blocks"].tolist()), local_seg_row=local_seg_row,
        token_index=torch.from_numpy(token_index), position_ids=torch.from_numpy(position_ids),
        sequence_ids=torch.from_numpy(sequence_ids),
        user_gather=torch.from_numpy(expand_ranges(a["reshuffle_send_offset"], a["reshuffle_send_length"])),
        send_splits=_splits(a["reshuffle_send_peer"], a["reshuffle_send_length"], num_ranks),
        plan_scatter=torch.from_numpy(expand_ranges(a["reshuffle_recv_offset"], a["reshuffle_recv_length"])),
        recv_splits=_splits(a["reshuffle_recv_peer"], a["reshuffle_recv_length"], num_ranks),
        pull_send=pull_send, pull_recv=pull_recv, tiles=tiles, forward=forward, backward=backward,
        self_user_rows=torch.from_numpy(self_user), self_plan_rows=torch.from_numpy(self_plan), early_tiles=early,
        program=program)


def load_rank_plan(source: str | Path | bytes, rank: int, *, validate: bool = True) -> RankPlan | KindsRankPlan:
    """Read one rank's slice of a plan file (or plan bytes) and index it for execution; a plan of layer kinds (one
    plan for each kind) gives a KindsRankPlan of every kind's.

    A plan's sha256s are checksums, not a signature: a file edited and sealed again (a tile deleted, a pull sent to
    another rank) reads as intact, and would train silently wrong. So the whole plan is validated first, as
    `fcp validate` does (every query sees each of its keys exactly once, every pull received as sent, rounds
    congestion-free, live buffers and reshuffle as stated), less the memory account (the header's peak bytes are
    not recomputed: the runtime allocates what the plan needs whatever they state): 10-30 ms for a plan of 8
    ranks, 0.2 s for 256 ranks on one CPU core.

    Args:
        source: a plan file's path, or its bytes.
        rank: the rank whose slice to read.
        validate: False only for a plan this process compiled (PlanningCollate's) or one already validated.
    Returns:
        the rank's RankPlan, or a KindsRankPlan for a plan of layer kinds.
    Raises:
        fcp_compiler.PlanFormatError: unreadable plan, rank out of range, layer kinds of different layouts, or (a
            PlanInvalidError) an invariant the plan breaks, named.
    """
    if not is_kinds_file(source):
        reader = PlanReader(source)
        program = reader.rank(rank)
        if validate:
            validate_plan(reader, memory_account=False)
        return from_program(program)
    kinds = PlanKinds(source)
    programs = {kind.name: kind.reader.rank(rank) for kind in kinds.kinds}
    if validate:
        validate_kinds(kinds, memory_account=False)
    plans = {name: from_program(program) for name, program in programs.items()}
    masks = {kind.name: (kind.mask.kind.value != "full", kind.mask.window) for kind in kinds.kinds}
    return KindsRankPlan(plans, {kind.name: kind.num_layers for kind in kinds.kinds}, masks, kinds.primary.name)

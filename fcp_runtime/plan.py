"""One rank's plan, decoded and indexed for execution.

Reads the plan file with the format reader only (no compiler passes are imported).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

from fcp_compiler.plan_format import PlanReader, RankProgram, expand_ranges, tiles_during_reshuffle

KIND_KV, KIND_Q = 0, 1


@dataclass(frozen=True, slots=True, kw_only=True)
class Pull:
    """One pull row: a block's segments moving from its owner to a rank that needs them."""

    round: int
    kind: int
    block: int
    peer: int
    segs: tuple[int, ...]


@dataclass(frozen=True, slots=True, kw_only=True)
class Push:
    """A partial result returning along a pull (index into this rank's pull_recv or pull_send rows)."""

    stage: int
    pull: int


@dataclass(frozen=True, kw_only=True)
class RankPlan:
    """What one rank executes: its layout, reshuffle maps, pulls, tiles and pushes, as Python and torch objects."""

    rank: int
    num_ranks: int
    digest: str
    causal: bool
    coalesce: int
    num_fwd_stages: int
    num_bwd_stages: int
    q_heads: int
    kv_heads: int
    head_dim: int
    user_tokens: int  # rows this rank holds in the user layout
    plan_tokens: int  # rows this rank holds in the plan layout
    seg_seq: np.ndarray
    seg_start: np.ndarray
    seg_end: np.ndarray
    seg_block: np.ndarray
    block_segs: dict[int, tuple[int, ...]]
    local_blocks: frozenset[int]
    local_seg_row: dict[int, int]  # segment -> first row in the plan layout (local segments)
    user_gather: torch.Tensor  # user-layout rows, in the order the reshuffle sends them
    send_splits: list[int]
    plan_scatter: torch.Tensor  # plan-layout rows, in the order the reshuffle receives them
    recv_splits: list[int]
    pull_send: list[Pull]
    pull_recv: list[Pull]
    tiles: list[tuple[int, int, int]]  # (stage, q block, kv block) in pipeline order
    fwd_push_send: list[Push]
    fwd_push_recv: list[Push]
    bwd_push_send: list[Push]
    bwd_push_recv: list[Push]
    self_user_rows: torch.Tensor  # rows that stay on this rank through the reshuffle: user-layout index ...
    self_plan_rows: torch.Tensor  # ... and plan-layout index
    early_tiles: frozenset[int]  # stage-0 tiles whose tokens all stay on this rank (run during the reshuffle)
    _device_cache: dict = field(default_factory=dict, repr=False, compare=False)

    def seg_len(self, seg: int) -> int:
        return int(self.seg_end[seg] - self.seg_start[seg])

    def positions(self, seg: int) -> torch.Tensor:
        """Token positions of a segment inside its sequence."""
        return torch.arange(int(self.seg_start[seg]), int(self.seg_end[seg]))

    def indices_on(self, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        """The reshuffle index tensors on a device (cached)."""
        if device not in self._device_cache:
            self._device_cache[device] = (self.user_gather.to(device), self.plan_scatter.to(device))
        return self._device_cache[device]

    def self_rows_on(self, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        """The rows that stay on this rank (user-layout index, plan-layout index) on a device (cached)."""
        key = ("self", device)
        if key not in self._device_cache:
            self._device_cache[key] = (self.self_user_rows.to(device), self.self_plan_rows.to(device))
        return self._device_cache[key]


def _splits(peers: np.ndarray, lengths: np.ndarray, num_ranks: int) -> list[int]:
    return np.bincount(peers, weights=lengths, minlength=num_ranks).astype(np.int64).tolist()


def from_program(program: RankProgram) -> RankPlan:
    """Index a decoded rank program for execution."""
    header, tables, a = program.header, program.tables, program.arrays
    num_ranks = header.num_ranks
    seg_block, seg_start, seg_end = tables.seg_block, tables.seg_start, tables.seg_end
    ptr = np.searchsorted(seg_block, np.arange(header.num_blocks + 1))
    block_segs = {b: tuple(range(int(ptr[b]), int(ptr[b + 1]))) for b in range(header.num_blocks)}
    local_seg_row, row = {}, 0
    for block in a["blocks"].tolist():
        for seg in block_segs[block]:
            local_seg_row[seg] = row
            row += int(seg_end[seg] - seg_start[seg])
    bounds = (np.arange(num_ranks + 1, dtype=np.int64) * header.total_tokens) // num_ranks

    def pulls(side: str) -> list[Pull]:
        counts = a[f"pull_{side}_seg_count"]
        offsets = np.concatenate(([0], np.cumsum(counts)))
        segs = a[f"pull_{side}_segs"]
        return [Pull(round=int(a[f"pull_{side}_round"][i]), kind=int(a[f"pull_{side}_kind"][i]),
                     block=int(a[f"pull_{side}_block"][i]), peer=int(a[f"pull_{side}_peer"][i]),
                     segs=tuple(segs[offsets[i]:offsets[i + 1]].tolist())) for i in range(counts.size)]

    def pushes(name: str) -> list[Push]:
        return [Push(stage=int(s), pull=int(p)) for s, p in zip(a[f"{name}_stage"], a[f"{name}_pull"])]

    # Runs between this rank and itself are sent and received in the same order (by global token).
    mine_send = a["reshuffle_send_peer"] == program.rank
    mine_recv = a["reshuffle_recv_peer"] == program.rank
    self_user = expand_ranges(a["reshuffle_send_offset"][mine_send], a["reshuffle_send_length"][mine_send])
    self_plan = expand_ranges(a["reshuffle_recv_offset"][mine_recv], a["reshuffle_recv_length"][mine_recv])
    early = frozenset(np.flatnonzero(tiles_during_reshuffle(program)).tolist())
    return RankPlan(
        rank=program.rank, num_ranks=num_ranks, digest=header.inputs_digest, causal=header.mask.value == "causal",
        coalesce=header.coalesce, num_fwd_stages=header.num_fwd_stages, num_bwd_stages=header.num_bwd_stages,
        q_heads=header.shape.q_heads, kv_heads=header.shape.kv_heads, head_dim=header.shape.head_dim,
        user_tokens=int(bounds[program.rank + 1] - bounds[program.rank]), plan_tokens=row,
        seg_seq=tables.seg_seq, seg_start=seg_start, seg_end=seg_end, seg_block=seg_block, block_segs=block_segs,
        local_blocks=frozenset(a["blocks"].tolist()), local_seg_row=local_seg_row,
        user_gather=torch.from_numpy(expand_ranges(a["reshuffle_send_offset"], a["reshuffle_send_length"])),
        send_splits=_splits(a["reshuffle_send_peer"], a["reshuffle_send_length"], num_ranks),
        plan_scatter=torch.from_numpy(expand_ranges(a["reshuffle_recv_offset"], a["reshuffle_recv_length"])),
        recv_splits=_splits(a["reshuffle_recv_peer"], a["reshuffle_recv_length"], num_ranks),
        pull_send=pulls("send"), pull_recv=pulls("recv"),
        tiles=list(zip(a["tile_stage"].tolist(), a["tile_q_block"].tolist(), a["tile_kv_block"].tolist())),
        fwd_push_send=pushes("fwd_push_send"), fwd_push_recv=pushes("fwd_push_recv"),
        bwd_push_send=pushes("bwd_push_send"), bwd_push_recv=pushes("bwd_push_recv"),
        self_user_rows=torch.from_numpy(self_user), self_plan_rows=torch.from_numpy(self_plan), early_tiles=early)


def load_rank_plan(source: str | Path | bytes, rank: int) -> RankPlan:
    """Read one rank's slice of a plan file (or plan bytes) and index it for execution.

    Raises:
        fcp_compiler.PlanFormatError: unreadable plan or rank out of range.
    """
    return from_program(PlanReader(source).rank(rank))

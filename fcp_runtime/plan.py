"""One rank's plan, decoded and indexed for execution.

Reads the plan file with the format reader only (no compiler passes are imported).
"""

from __future__ import annotations

import itertools
import weakref
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

from fcp_compiler.format.call_plan import tiles_during_reshuffle
from fcp_compiler.format.layered import PlanKinds, is_layered
from fcp_compiler.format.plan_format import PlanReader, RankProgram, TransferKind, expand_ranges

LAYOUTS = ("plan", "user")


@dataclass(frozen=True, slots=True, kw_only=True)
class Pull:
    """One pull row: a block's segments moving from its owner to a rank that needs them, and its round in each
    pass."""

    round: int
    bwd_round: int
    kind: int
    block: int
    peer: int
    segs: tuple[int, ...]
    source: int = -1  # sent rows: -1 for this rank's own block, else the pull_recv row it relays from


@dataclass(frozen=True, slots=True, kw_only=True)
class Message:
    """One message of a pass as this rank posts it: a pull (sent or received) or a push back along a pull.

    `pull` indexes this rank's pull_send rows (a pull sent, a push received) or pull_recv rows (a pull received, a
    push sent)."""

    round: int
    what: str  # "pull_send", "pull_recv", "push_send" or "push_recv"
    pull: int


@dataclass(frozen=True, slots=True, kw_only=True)
class PassProgram:
    """What one pass does stage by stage on this rank, and when each received buffer is freed.

    The liveness rule (fcp_compiler.algorithms.liveness, which the compiler states in the header): a received pull
    is allocated when its stage posts it and freed at the end of the stage of its last tile or of the push back
    along it; a received push is allocated when posted and freed at the end of its stage, once folded in."""

    name: str
    num_stages: int
    messages: list[list[Message]]  # per stage, in the order both ends of each pair post them (_pass_program)
    tiles: list[list[int]]  # per stage, tile rows in pipeline order
    free_after: list[list[int]]  # per stage, pull_recv rows whose buffers are freed at its end
    # The first messages of stage 0, which K,V prefetch may post before the pass starts: its stage-0 K,V pulls
    # (fcp_runtime.prefetch_kv in the forward, KVPrefetch.backward_starts_at in the backward).
    num_prefetched: int = 0


# A plan's cache entry holding the posted messages of prefetches dropped unused (fcp_runtime.attention drains them).
ORPHANED_PREFETCHES = "orphaned_prefetches"


@dataclass(frozen=True, kw_only=True)
class RankPlan:
    """What one rank executes: its layout, reshuffle maps, pulls, tiles and pushes, as Python and torch objects."""

    rank: int
    num_ranks: int
    digest: str
    seq_lengths: np.ndarray  # per sequence: its tokens
    seq_window: np.ndarray  # per sequence: keys a query sees back, itself included (its length: causal; 0: full)
    layout: str  # the compiled layout: "plan" or "user"
    coalesce: int  # rounds per stage, forward
    bwd_coalesce: int  # rounds per stage, backward
    q_heads: int
    kv_heads: int
    head_dim: int
    max_buffer_tokens: int  # the header's peak live buffer tokens (any rank, either pass)
    user_tokens: int  # rows this rank holds in the user layout
    plan_tokens: int  # rows this rank holds in the plan layout
    seg_seq: np.ndarray
    seg_start: np.ndarray
    seg_end: np.ndarray
    block_segs: dict[int, tuple[int, ...]]
    local_blocks: frozenset[int]
    local_seg_row: dict[int, int]  # segment -> first row in the plan layout (local segments)
    token_index: torch.Tensor  # int64 [plan_tokens]: each plan-layout row's position in the concatenated batch
    position_ids: torch.Tensor  # int64 [plan_tokens]: its position inside its own sequence (for RoPE)
    sequence_ids: torch.Tensor  # int64 [plan_tokens]: its sequence's index in the batch
    user_gather: torch.Tensor  # user-layout rows, in the order the reshuffle sends them
    send_splits: list[int]
    plan_scatter: torch.Tensor  # plan-layout rows, in the order the reshuffle receives them
    recv_splits: list[int]
    pull_send: list[Pull]
    pull_recv: list[Pull]
    tiles: list[tuple[int, int]]  # (q block, kv block) in forward pipeline order
    forward: PassProgram
    backward: PassProgram
    self_user_rows: torch.Tensor  # rows that stay on this rank through the reshuffle: user-layout index ...
    self_plan_rows: torch.Tensor  # ... and plan-layout index
    early_tiles: frozenset[int]  # stage-0 tiles whose tokens all stay on this rank (run during the reshuffle)
    program: RankProgram  # the decoded slice (what the call plan is read from)
    _device_cache: dict = field(default_factory=dict, repr=False, compare=False)
    # int64 [1] on the host: this plan's key in this process's table of live plans, which is how a compiled graph
    # names the plan to fcp's custom op (a tensor, so a new plan each step is a new value, not a new graph).
    handle: torch.Tensor = field(init=False, repr=False, compare=False)

    def __post_init__(self):
        object.__setattr__(self, "handle", _register(self))

    def __getstate__(self) -> dict:
        """Pickled with its host caches, but not the posted messages of a dropped prefetch (this process's)."""
        state = dict(self.__dict__)
        state["_device_cache"] = {key: value for key, value in self._device_cache.items()
                                  if key != ORPHANED_PREFETCHES}
        return state

    def __setstate__(self, state: dict) -> None:
        """Unpickled (from a DataLoader worker): registered in this process, under a handle of its own."""
        self.__dict__.update(state)
        object.__setattr__(self, "handle", _register(self))

    def check_batch(self, lengths, masks=None) -> None:
        """Refuse a plan compiled for another batch or other attention: the batch's lengths and each sequence's
        window (from `masks`: one mask, or one a sequence, as a batch file gives them; default causal) must be the
        plan's. A plan file from elsewhere can be valid and still be a plan for different masks.

        Raises:
            ValueError: naming the first sequence that differs.
        """
        from fcp_compiler.format.inputs import parse_mask

        lengths = [int(length) for length in lengths]
        if len(lengths) != self.seq_lengths.size:
            raise ValueError(f"the batch has {len(lengths)} sequences; the plan was compiled for "
                             f"{self.seq_lengths.size}")
        masks = [masks] * len(lengths) if masks is None or not isinstance(masks, (list, tuple)) else list(masks)
        if len(masks) != len(lengths):
            raise ValueError(f"{len(masks)} masks for {len(lengths)} sequences; give one mask, or one a sequence")
        for seq_idx, (length, mask) in enumerate(zip(lengths, masks)):
            window = parse_mask(mask if mask is not None else "causal", "mask").window_for(length)
            if length != self.seq_lengths[seq_idx] or window != self.seq_window[seq_idx]:
                raise ValueError(f"sequence {seq_idx}: the batch has {length} tokens with window {window}; the plan "
                                 f"has {int(self.seq_lengths[seq_idx])} with window {int(self.seq_window[seq_idx])} "
                                 f"(0: full)")

    @property
    def has_windows(self) -> bool:
        """Whether a sequence has a sliding window (a window shorter than itself; 0 is a full mask)."""
        return bool(((self.seq_window > 0) & (self.seq_window < self.seq_lengths)).any())

    def seg_len(self, seg: int) -> int:
        return int(self.seg_end[seg] - self.seg_start[seg])

    def pull_tokens(self, pull: Pull) -> int:
        return sum(self.seg_len(seg) for seg in pull.segs)

    def cached(self, key, build):
        """A per-plan cache (index tensors on a device, kernel call lists) filled on first use."""
        if key not in self._device_cache:
            self._device_cache[key] = build()
        return self._device_cache[key]

    def indices_on(self, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        """The reshuffle index tensors on a device (cached)."""
        return self.cached(("reshuffle", device), lambda: (self.user_gather.to(device), self.plan_scatter.to(device)))

    def self_rows_on(self, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        """The rows that stay on this rank (user-layout index, plan-layout index) on a device (cached)."""
        return self.cached(("self", device),
                           lambda: (self.self_user_rows.to(device), self.self_plan_rows.to(device)))


_LIVE_PLANS: weakref.WeakValueDictionary = weakref.WeakValueDictionary()
_NEXT_HANDLE = itertools.count(1)


def _register(entry) -> torch.Tensor:
    """Enter a plan (or a call's binding) in the table of live ones; the entry leaves it when it is collected, so
    nothing outlives the step that holds it."""
    key = next(_NEXT_HANDLE)
    _LIVE_PLANS[key] = entry
    return torch.tensor([key], dtype=torch.int64)


def registered(handle: torch.Tensor):
    """The live plan (or binding) a handle names.

    Raises:
        ValueError: the handle names nothing alive (a plan from another process, or one already collected).
    """
    key = int(handle.reshape(-1)[0])
    entry = _LIVE_PLANS.get(key)
    if entry is None:
        raise ValueError(f"plan handle {key} names no live plan in this process: pass the RankPlan itself, from "
                         f"load_rank_plan or the collate, and keep it alive for the step")
    return entry


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
        head_dim=header.shape.head_dim, max_buffer_tokens=header.max_buffer_tokens,
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


# What every layer kind of a layered plan must share on a rank: its rows in both layouts and how they move
# between them (one dispatch for every kind).
_SHARED_LAYOUT = ("rank", "num_ranks", "layout", "user_tokens", "plan_tokens", "token_index", "user_gather",
                  "send_splits", "plan_scatter", "recv_splits")


# What a LayeredRankPlan answers for every kind: the layout, the batch, the attention shape and the inputs' digest.
_LAYOUT_ATTRIBUTES = frozenset({*_SHARED_LAYOUT, "position_ids", "sequence_ids", "seq_lengths", "self_user_rows",
                                "self_plan_rows", "digest", "q_heads", "kv_heads", "head_dim"})


class LayeredRankPlan:
    """One rank's plans for every layer kind of a layered plan (fcp_compiler.format.layered): one layout, so the
    batch is dispatched once, and a program a kind. The layout's attributes (`token_index`, `position_ids`,
    `plan_tokens`, ...) are every kind's; :meth:`kind` and :meth:`for_mask` give a kind's RankPlan, which
    ``fcp_attn_func(..., kind=NAME)`` (or its `mask`) picks.

    Raises (on construction):
        fcp_compiler.PlanFormatError: kinds whose layouts differ on this rank.
    """

    def __init__(self, kinds: dict[str, RankPlan], num_layers: dict[str, int], masks: dict[str, tuple],
                 primary: str):
        from fcp_compiler.errors import PlanFormatError

        self.kinds, self.num_layers, self.masks, self.primary = dict(kinds), dict(num_layers), dict(masks), primary
        first = self.kinds[primary]
        for name, plan in self.kinds.items():
            for attribute in _SHARED_LAYOUT:
                mine, theirs = getattr(plan, attribute), getattr(first, attribute)
                same = torch.equal(mine, theirs) if isinstance(mine, torch.Tensor) else mine == theirs
                if not same:
                    raise PlanFormatError(f"layer kind {name!r} has another {attribute} than kind {primary!r} on rank "
                                          f"{first.rank}: the kinds of a layered plan share one layout")
        self._by_mask = {mask: name for name, mask in self.masks.items()}

    def __getattr__(self, name: str):
        # The layout and batch every kind shares, read from the primary kind; a schedule's attributes are a kind's.
        if name in _LAYOUT_ATTRIBUTES:
            return getattr(self.kinds[self.primary], name)
        if name.startswith("_") or name in ("kinds", "primary", "num_layers", "masks"):
            raise AttributeError(name)
        raise AttributeError(f"{name!r} belongs to one layer kind's schedule: take plan.kind(NAME).{name} (kinds: "
                             f"{', '.join(self.kinds)})")

    @property
    def has_windows(self) -> bool:
        """Whether any kind has a sliding window (the kernels must take windows)."""
        return any(plan.has_windows for plan in self.kinds.values())

    def kind(self, name: str) -> RankPlan:
        """A kind's plan by name.

        Raises:
            ValueError: naming the kinds the plan has.
        """
        if name not in self.kinds:
            raise ValueError(f"layer kind {name!r} is not in the plan; its kinds: {', '.join(self.kinds)}")
        return self.kinds[name]

    def for_mask(self, causal: bool, window: int | None) -> RankPlan:
        """The kind whose mask is a layer's (causal or not, a sliding window of `window` keys or none).

        Raises:
            ValueError: no kind has it (the kinds' masks are named).
        """
        name = self._by_mask.get((bool(causal), window))
        if name is None:
            have = ", ".join(f"{kind} {_mask_name(*mask)}" for kind, mask in self.masks.items())
            raise ValueError(f"no layer kind of the plan has the layer's mask {_mask_name(causal, window)} (the "
                             f"plan's kinds: {have}); compile the plan with this layer's kind (--layer-masks)")
        return self.kinds[name]


def _mask_name(causal: bool, window: int | None) -> str:
    return "full" if not causal else ("causal" if window is None else f"sliding window {window}")


def resolve_kind(plan: RankPlan | LayeredRankPlan, kind: str | None = None,
                 mask: tuple[bool, int | None] | None = None) -> RankPlan:
    """The RankPlan a call runs: `plan` itself for a plan of one kind, else the kind named, or the one whose mask is
    the layer's `mask` (causal, window).

    Raises:
        ValueError: a kind named for a plan of one kind, an unknown kind, or a layered plan and neither a kind nor a
            mask to choose one by.
    """
    if isinstance(plan, LayeredRankPlan):
        if kind is not None:
            return plan.kind(kind)
        if mask is not None:
            return plan.for_mask(*mask)
        raise ValueError(f"the plan holds a schedule for each of the layer kinds {', '.join(plan.kinds)}; name the "
                         f"layer's (kind=...) or give its mask")
    if kind is not None:
        raise ValueError(f"kind={kind!r} names a layer kind, but the plan holds one schedule for every layer "
                         f"(compile it with --layer-masks for kinds)")
    return plan


def layout_plan(plan: RankPlan | LayeredRankPlan) -> RankPlan:
    """The RankPlan whose layout a dispatch reads: the plan, or a layered plan's primary kind (every kind's
    layout is one)."""
    return plan.kinds[plan.primary] if isinstance(plan, LayeredRankPlan) else plan


def load_rank_plan(source: str | Path | bytes, rank: int) -> RankPlan | LayeredRankPlan:
    """Read one rank's slice of a plan file (or plan bytes) and index it for execution; a layered plan (one plan
    for each layer kind) gives a LayeredRankPlan of every kind's.

    Raises:
        fcp_compiler.PlanFormatError: unreadable plan, rank out of range, or layer kinds of different layouts.
    """
    if not is_layered(source):
        return from_program(PlanReader(source).rank(rank))
    kinds = PlanKinds(source)
    plans = {kind.name: from_program(kind.reader.rank(rank)) for kind in kinds.kinds}
    masks = {kind.name: (kind.mask.kind.value != "full", kind.mask.window) for kind in kinds.kinds}
    return LayeredRankPlan(plans, {kind.name: kind.num_layers for kind in kinds.kinds}, masks, kinds.primary.name)

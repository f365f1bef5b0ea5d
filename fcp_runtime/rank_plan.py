"""One rank's plan as the runtime executes it: its pulls, its passes' messages, tiles and frees stage by stage, and
the table of live plans that names a plan to fcp's custom ops by a handle tensor.

:mod:`fcp_runtime.plan` builds these from a plan file; nothing here reads one.
"""

from __future__ import annotations

import itertools
import weakref
from dataclasses import dataclass, field

import numpy as np
import torch

from fcp_compiler.format.plan_format import RankProgram

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
    messages: list[list[Message]]  # per stage, in the order both ends of each pair post them (plan._pass_program)
    tiles: list[list[int]]  # per stage, tile rows in pipeline order
    free_after: list[list[int]]  # per stage, pull_recv rows whose buffers are freed at its end
    # The first messages of stage 0, which K,V prefetch may post before the pass starts: its stage-0 K,V pulls
    # (fcp_runtime.prefetch_kv in the forward, KVPrefetch.backward_starts_at in the backward).
    num_prefetched: int = 0


# A plan's cache entry holding the posted messages of prefetches dropped unused (fcp_runtime.prefetch drains them).
ORPHANED_PREFETCHES = "orphaned_prefetches"
# A plan's cache entry holding the ids of the process groups its ranks were checked against (fcp_runtime.checks):
# this process's, so not pickled.
CHECKED_GROUPS = "checked_groups"
# ... and the position tensors its rows were checked against (fcp_runtime.binding), by weak reference.
CHECKED_POSITIONS = "checked_positions"
CHECKED_VERSIONS = "checked_versions"  # ... and their version counters when checked
# A plan's cache entry holding the sha256 of the documents a collate compiled it for (fcp_runtime.loader), which
# fcp_runtime.checks compares across the group: pickled with the plan from a DataLoader worker.
BATCH_CONTENT = "batch_content"
# ... and its rows' labels (int64 [rows], in the collate's layout), which fcp_runtime.binding compares with a
# call's labels: positions alone cannot tell a step from one whose documents are a permutation of its lengths.
BATCH_LABELS = "batch_labels"
_PROCESS_LOCAL = (ORPHANED_PREFETCHES, CHECKED_GROUPS, CHECKED_POSITIONS, CHECKED_VERSIONS)


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
    dtype: str  # Q, K, V's dtype as the plan's memory figures count it: "bf16", "fp16", "fp32" or "fp64"
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
        """Pickled with its host caches, but not what belongs to this process: the posted messages of a dropped
        prefetch, the groups it was checked against."""
        state = dict(self.__dict__)
        state["_device_cache"] = {key: value for key, value in self._device_cache.items()
                                  if key not in _PROCESS_LOCAL}
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


class _Holding(np.ndarray):
    """A handle's int64 [1] array that holds the entry it names (in `entry`)."""


def pinned(handle: torch.Tensor) -> torch.Tensor:
    """A copy of a live entry's handle whose storage holds the entry alive: an autograd graph that saves it for a
    backward keeps the plan that backward runs, whatever the step dropped, and lets it go with the graph (after the
    backward, or when the graph is dropped unused). Nothing holds the copy but its holders, so no cycle forms.

    Raises:
        ValueError: as :func:`registered`.
    """
    holding = np.array([int(handle.reshape(-1)[0])], dtype=np.int64).view(_Holding)
    holding.entry = registered(handle)
    return torch.from_numpy(holding)  # the tensor's storage keeps `holding`, and so the entry, until it is freed


"""fcp_attn_func: distributed attention that replays one rank's plan, forward and backward.

One code path for every backend: torch.distributed collectives and batched point-to-point messages (gloo on CPU,
NCCL on CUDA), and the varlen kernels of :mod:`fcp_runtime.kernels`. Each stage posts its messages as one batch,
runs its tiles (which read only buffers of earlier stages), then waits; received buffers are freed by the plan's
liveness rule, and :func:`recording` logs every post, tile, wait, allocation and free.
"""

from __future__ import annotations

import contextlib
import math
import weakref
from dataclasses import dataclass, field

import numpy as np
import torch
import torch.distributed as dist

from fcp_compiler.format.plan_format import TransferKind
from fcp_runtime.kernels import default_kernels, merge_into, merge_rows
from fcp_runtime.plan import (LAYOUTS, ORPHANED_PREFETCHES, LayeredRankPlan, Message, PassProgram, RankPlan, layout_plan,
                              registered, resolve_kind)
from fcp_runtime.stage_calls import LOCAL, KernelCall, RangeCall, arenas, merge_runs, prepare_calls, stage_calls


class PlanMismatchError(RuntimeError):
    """The ranks of a group do not hold the same plan, or the group is not the plan's world."""


_CHECKED: set[tuple[int, int, str]] = set()
_EVENT_LOG: list | None = None


@contextlib.contextmanager
def recording():
    """Log what the runtime does, in order, while the block runs; yields the list of events.

    Events are tuples: ("prefetch", pass, stage, num_messages) (prefetch_kv), ("post", pass, stage, num_messages,
    pull rows whose results it pushes back), ("tile", pass,
    stage, tile rows of one kernel call, pull rows it reads),
    ("wait", pass, stage), ("alloc", pass, stage, tokens, live_tokens) and ("free", pass, stage, tokens,
    live_tokens), where live_tokens counts received buffers under the plan's liveness rule.
    """
    global _EVENT_LOG
    previous, _EVENT_LOG = _EVENT_LOG, []
    try:
        yield _EVENT_LOG
    finally:
        _EVENT_LOG = previous


def _log(*event) -> None:
    if _EVENT_LOG is not None:
        _EVENT_LOG.append(event)


def check_plan(plan: RankPlan | LayeredRankPlan, group=None) -> None:
    """Fail on every rank, before any transfer, unless all ranks hold the same plan and the group is its world.

    One all_gather_object of (digest, world size, rank) whatever the plan says, so a mismatch is an error
    everywhere, never a hang. Checked once per plan and group (a layered plan: its primary kind's digest, which
    names every kind).

    Raises:
        PlanMismatchError: naming the ranks and what differs.
    """
    plan = layout_plan(plan)
    key = (id(plan), id(group), plan.digest)
    if key in _CHECKED:
        return
    size = dist.get_world_size(group)
    mine = (plan.digest, plan.num_ranks, plan.rank)
    gathered: list = [None] * size
    dist.all_gather_object(gathered, mine, group=group)
    if size != plan.num_ranks:
        raise PlanMismatchError(f"the process group has {size} ranks but the plan was compiled for "
                                f"{plan.num_ranks}; compile it with --gpus {size}")
    wrong_world = [r for r, (_, n, _) in enumerate(gathered) if n != size]
    digests = sorted({d for d, _, _ in gathered})
    if len(digests) > 1 or wrong_world:
        groups = {d: [r for r, (dd, _, _) in enumerate(gathered) if dd == d] for d in digests}
        detail = "; ".join(f"ranks {ranks} hold plan {d[:12]}" for d, ranks in groups.items())
        raise PlanMismatchError(f"ranks hold different plans: {detail}")
    wrong_rank = [r for r, (_, _, plan_rank) in enumerate(gathered) if plan_rank != r]
    if wrong_rank:
        raise PlanMismatchError(f"ranks {wrong_rank} hold another rank's slice of the plan "
                                f"(slice {gathered[wrong_rank[0]][2]} on rank {wrong_rank[0]})")
    _CHECKED.add(key)


@dataclass
class _Store:
    """Rows of some segments: where each segment starts, and named tensors [rows, ...] (or [heads, rows]); a
    received pull on the range path has its rows in an arena, from `arena_row` on."""

    seg_row: dict[int, int]
    rows: int
    tensors: dict[str, torch.Tensor] = field(default_factory=dict)
    arena_row: int = -1


def _wait_all(requests: list) -> None:
    """Wait for every work of a batch and let them go (a backend holds the tensors a work moves until it is
    dropped)."""
    while requests:
        requests.pop().wait()


class _Executor:
    """Replays one pass of a rank's plan: messages, tiles and buffers, stage by stage."""

    def __init__(self, plan: RankPlan, group, scale: float, device: torch.device, dtype: torch.dtype,
                 head_dim: int, kernels=None):
        self.plan, self.group, self.scale, self.head_dim = plan, group, scale, head_dim
        self.device, self.dtype = device, dtype
        self.acc_dtype = torch.float32 if dtype in (torch.bfloat16, torch.float16) else dtype
        self.kernels = kernels if kernels is not None else default_kernels(device, plan.has_windows)
        if plan.has_windows and not getattr(self.kernels, "takes_windows", True):
            raise ValueError(f"the {getattr(self.kernels, 'name', 'given')} kernels have no sliding window, and the "
                             f"plan gives some documents one; run it with the exact or the flash-attn kernels")
        # A range kernel reads keys in place: pulls are received into arenas, calls are ranges over them.
        self.ranges = bool(getattr(self.kernels, "ranges", False))
        self.live_tokens = 0  # received buffers under the plan's liveness rule (logged by recording())

    # --- layout -------------------------------------------------------------------------------------------------
    def peer(self, rank: int) -> int:
        return rank if self.group is None else dist.get_global_rank(self.group, rank)

    def local_store(self, **tensors: torch.Tensor) -> _Store:
        return _Store(seg_row=self.plan.local_seg_row, rows=self.plan.plan_tokens, tensors=tensors)

    def rows(self, store: _Store, seg: int) -> slice:
        start = store.seg_row[seg]
        return slice(start, start + self.plan.seg_len(seg))

    def payload_rows(self, store: _Store, name: str, segs, heads_first: bool = False) -> torch.Tensor:
        """A message's rows of one tensor: a view where the segments are one run of rows, else one copy of the
        runs."""
        dim = 1 if heads_first else 0
        views = [store.tensors[name].narrow(dim, row, length) for row, _, length in self.runs(store, segs)]
        return (views[0] if len(views) == 1 else torch.cat(views, dim=dim)).contiguous()

    def runs(self, store: _Store, segs) -> list[tuple[int, int, int]]:
        """A message's segments as runs of consecutive store rows: (first store row, first message row, rows)."""
        pieces = ((LOCAL, store.seg_row[seg], self.plan.seg_len(seg)) for seg in segs)
        return [(row, first, length) for _, row, first, length in merge_runs(pieces)]

    def new_store(self, segs) -> _Store:
        seg_row, row = {}, 0
        for seg in segs:
            seg_row[seg] = row
            row += self.plan.seg_len(seg)
        return _Store(seg_row=seg_row, rows=row)

    def empty(self, rows: int, heads: int, dtype=None) -> torch.Tensor:
        return torch.empty((rows, heads, self.head_dim), dtype=dtype or self.dtype, device=self.device)

    # --- buffers ------------------------------------------------------------------------------------------------
    def allocate(self, name: str, stage: int, tokens: int) -> None:
        self.live_tokens += tokens
        _log("alloc", name, stage, tokens, self.live_tokens)

    def release(self, name: str, stage: int, tokens: int) -> None:
        self.live_tokens -= tokens
        _log("free", name, stage, tokens, self.live_tokens)

    # --- the stage loop, shared by both passes -----------------------------------------------------------------
    def run_stages(self, phase, program: PassProgram, local: _Store, skip: frozenset[int] = frozenset(),
                   prefetched: _Posted | None = None) -> None:
        """Replay one pass: per stage, post its messages as one batch (in round order, the order the peer posts
        them too), run its tiles, wait, make the arrived pulls usable, fold the returned pushes into this rank's
        rows, and free the buffers whose last use was this stage. Tiles whose rows are in `skip` already ran;
        stage 0's first `program.num_prefetched` messages are in flight already where `prefetched` holds them."""
        plan = self.plan
        remote: dict[int, _Store] = {}  # pull_recv row -> its store, from arrival to free
        for stage in range(program.num_stages):
            arrived, returned = [], []
            posted = prefetched.num_messages if stage == 0 and prefetched is not None else 0
            requests = self.post_batch(phase, program.name, stage, program.messages[stage][posted:], local, remote,
                                       arrived, returned)
            if posted:  # taken over from the prefetch, which then holds none of them
                requests, arrived = prefetched.requests + requests, prefetched.arrived + arrived
                prefetched.requests, prefetched.arrived = [], []
            _log("post", program.name, stage, len(program.messages[stage]),
                 tuple(m.pull for m in program.messages[stage] if m.what == "push_send"))
            tiles = [idx for idx in program.tiles[stage] if idx not in skip]
            for call in stage_calls(plan, program.name, stage, tiles, self.device, self.ranges):
                _log("tile", program.name, stage, call.tile_rows, call.pull_rows)
                phase.run_call(call, local, remote)
            # Works, arrived stores and landed pushes are let go here, by helpers: a loop variable would keep the last
            # of each (a whole batch of sent and received tensors) alive into the next stage.
            _wait_all(requests)
            _log("wait", program.name, stage)
            self.arrive(phase, arrived, remote)
            self.land_pushes(phase, program.name, stage, returned, local, remote)
            for row in program.free_after[stage]:
                del remote[row]
                self.release(program.name, stage, plan.pull_tokens(plan.pull_recv[row]))

    def arrive(self, phase, arrived: list, remote: dict[int, _Store]) -> None:
        """Make the pulls that arrived usable: their accumulators, and their stores under their pull rows."""
        for row, store in arrived:
            phase.accumulators(self.plan.pull_recv[row], store)
            remote[row] = store
        arrived.clear()

    def land_pushes(self, phase, name: str, stage: int, returned: list, local: _Store,
                    remote: dict[int, _Store]) -> None:
        """Fold the results pushed back to this rank into the rows they belong to, and free their buffers."""
        for pull, tensors in returned:
            # A relay sums the gradient of a pull it re-sent into its own partial gradient of the block.
            into = self.store_of(pull.source, local, remote)
            for row, offset, length in self.runs(into, pull.segs):
                phase.land(into, slice(row, row + length), pull.kind, tensors, slice(offset, offset + length))
            self.release(name, stage, self.plan.pull_tokens(pull))
        returned.clear()

    def post_batch(self, phase, name: str, stage: int, messages, local: _Store, remote: dict[int, _Store],
                   arrived: list, returned: list) -> list:
        """Post `messages` as one batch_isend_irecv (in the order given, the order the peer posts them too); returns
        its requests."""
        ops = []
        for message in messages:
            ops += self.post(phase, name, stage, message, local, remote, arrived, returned)
        return dist.batch_isend_irecv(ops) if ops else []

    def post(self, phase, name: str, stage: int, message: Message, local: _Store, remote: dict[int, _Store],
             arrived: list, returned: list) -> list:
        """The point-to-point ops of one message; buffers it receives into are allocated here."""
        plan = self.plan
        if message.what == "pull_send":  # from this rank's own rows, or relayed from a block it received
            pull = plan.pull_send[message.pull]
            return self.ops(dist.isend, pull.peer, pull.block, pull.kind,
                            phase.pull_payload(self.store_of(pull.source, local, remote), pull))
        if message.what == "pull_recv":
            pull = plan.pull_recv[message.pull]
            store = self.new_store(pull.segs)
            store.arena_row = phase.arena_row(message.pull)
            store.tensors = phase.pull_buffers(pull, store)
            self.allocate(name, stage, store.rows)
            arrived.append((message.pull, store))
            return self.ops(dist.irecv, pull.peer, pull.block, pull.kind, list(store.tensors.values()))
        if message.what == "push_send":  # back along a pull this rank received: its partial results
            pull = plan.pull_recv[message.pull]
            return self.ops(dist.isend, pull.peer, pull.block, 2 + pull.kind,
                            phase.push_payload(remote[message.pull], pull))
        pull = plan.pull_send[message.pull]  # push_recv: results of a pull this rank sent
        tensors = phase.push_buffers(pull, plan.pull_tokens(pull))
        self.allocate(name, stage, plan.pull_tokens(pull))
        returned.append((pull, tensors))
        return self.ops(dist.irecv, pull.peer, pull.block, 2 + pull.kind, phase.push_parts(tensors))

    def ops(self, operation, peer: int, block: int, code: int, tensors: list[torch.Tensor]) -> list:
        """One P2POp per tensor; tags (block, code, part) keep gloo's matching exact, and NCCL, which matches by
        posting order, sees the same order on both ends."""
        return [dist.P2POp(operation, t, self.peer(peer), self.group, (block * 4 + code) * 8 + i)
                for i, t in enumerate(tensors)]

    def store_of(self, source: int, local: _Store, remote: dict[int, _Store]) -> _Store:
        return local if source == LOCAL else remote[source]

    def gather(self, runs, name: str, local: _Store, remote: dict[int, _Store], heads_first: bool = False):
        """One tensor's rows of a call, packed: the rows in place when they are one run of one source (heads-first
        rows made contiguous), else one concatenation of the runs' views (one copy, one launch)."""
        dim = 1 if heads_first else 0
        views = [self.store_of(source, local, remote).tensors[name].narrow(dim, row, length)
                 for source, row, length in runs]
        if len(views) == 1:
            return views[0].contiguous() if heads_first else views[0]
        return torch.cat(views, dim=dim)

    def scatter_add(self, index, name: str, values: torch.Tensor, local: _Store, remote: dict[int, _Store],
                    dim: int = 0) -> None:
        """Add a call's packed results (rows along `dim`) into the rows they belong to: a run in place, other rows
        by index_add_ (repeated rows sum)."""
        for entry in index:
            target = self.store_of(entry.source, local, remote).tensors[name]
            if entry.span is not None:
                position, row, length = entry.span
                target.narrow(dim, row, length).add_(values.narrow(dim, position, length))
            else:
                target.index_add_(dim, entry.rows, values.index_select(dim, entry.positions).to(target.dtype))


@dataclass(kw_only=True)
class _Posted:
    """The first messages of a pass's stage 0, posted before the pass began (its stage-0 K,V pulls)."""

    num_messages: int  # program.num_prefetched
    requests: list
    arrived: list  # (pull_recv row, its store) of the pulls it receives
    arenas: _Arenas | None = None  # on the range path: the pass's arenas, its K,V pulls received into them


@dataclass(kw_only=True)
class KVPrefetch:
    """One rank's stage-0 K,V pulls of one attention call, posted early: the forward's by :func:`prefetch_kv`
    (consumed by one :func:`fcp_attn_func` call), the backward's as the layer's backward starts
    (:meth:`backward_starts_at`)."""

    plan: RankPlan
    group: object
    k: torch.Tensor
    v: torch.Tensor
    forward: _Posted
    live_tokens: int  # received buffer tokens the forward's prefetch allocated
    used: bool = False
    executor: _Executor | None = None  # the call's, once fcp_attn_func has run it
    saved_kv: tuple | None = None  # the call's K and V in the plan layout, for the backward's sends
    backward: _Posted | None = None

    def backward_starts_at(self, x: torch.Tensor) -> torch.Tensor:
        """x itself, with a hook: when its gradient is computed (give the layer's output: its backward then
        starts), the backward's stage-0 K,V pulls of this attention call are posted, so that they cross while the
        layer's MLP and O projection run backward. K and V are the forward's, so nothing they carry is computed in
        between.

        Under activation checkpointing (non-reentrant torch.utils.checkpoint, HF's gradient_checkpointing_enable)
        the layer's forward runs again inside the backward, with a new attention call whose backward would not
        know these pulls: so while saved-tensor hooks are active (a checkpointed forward, its recomputation, or
        any other such hook) no hook is added, and the backward posts its first stage with the rest. Every rank
        decides alike, so nothing is left unmatched; the forward's prefetch still works, in both runs.

        Raises:
            ValueError: before fcp_attn_func has consumed this prefetch.
        """
        if self.executor is None:
            raise ValueError("backward_starts_at: call fcp_attn_func with this prefetch first (the backward's pulls "
                             "are that call's)")
        if x.requires_grad and not _saved_tensor_hooks_active():
            x.register_hook(self._on_gradient)  # a tensor hook, not an op: x stays the same tensor
        return x

    def _on_gradient(self, grad: torch.Tensor) -> None:
        self.post_backward()

    def post_backward(self) -> None:
        """Post the backward's stage-0 K,V pulls (once)."""
        if self.backward is not None:
            return
        executor = self.executor
        k, v = self.saved_kv
        self.backward = _post_first(executor, _BackwardPass(executor, None, k.shape[1]),
                                    self.plan.backward, k, v)


def _saved_tensor_hooks_active() -> bool:
    """Whether saved-tensor hooks wrap the running forward: a checkpointed layer (first run or recomputation)."""
    return torch._C._autograd._top_saved_tensors_default_hooks(False) is not None


def _post_first(executor: _Executor, phase, program: PassProgram, k: torch.Tensor, v: torch.Tensor) -> _Posted:
    """Post a pass's stage-0 K,V pulls (program.num_prefetched first messages of its stage 0), sending from this
    rank's own K and V rows (a relay cannot send in stage 0, nothing having arrived)."""
    plan = executor.plan
    messages = program.messages[0][:program.num_prefetched] if program.num_stages else []
    if any(m.what == "pull_send" and plan.pull_send[m.pull].source != LOCAL for m in messages):
        raise PlanMismatchError(f"rank {plan.rank}'s plan relays a block in the {program.name} pass's first stage, "
                                f"before it can hold one: the plan is invalid (fcp validate)")
    local = executor.local_store(k=k.detach(), v=v.detach())
    arrived = []
    with torch.no_grad():
        requests = executor.post_batch(phase, program.name, 0, messages, local, {}, arrived, [])
    _log("prefetch", program.name, 0, len(messages))
    return _Posted(num_messages=len(messages), requests=requests, arrived=arrived, arenas=phase.arenas)


def prefetch_kv(k: torch.Tensor, v: torch.Tensor, plan: RankPlan | LayeredRankPlan, group=None, kernels=None,
                kind: str | None = None, mask: tuple[bool, int | None] | None = None) -> KVPrefetch:
    """Post this rank's part of the forward's first-stage K,V pulls (its own blocks' K,V sent, the blocks its
    first stage reads received) as soon as K and V are projected, so that they cross while Q is projected; pass
    the result to :func:`fcp_attn_func` (`prefetched=`) with the same k and v, unchanged in between, and the
    layer's output through its :meth:`KVPrefetch.backward_starts_at`, so that the backward's first-stage K,V pulls
    leave as the layer's backward starts.

    Plans compiled with kv_prefetch (the default; header.kv_prefetch) are scheduled and simulated for a runtime
    that does both. Every rank of the group should call it for the step or none (a rank that does not posts the
    same messages when its attention starts, in the same order, so results are exact either way, but its peers
    wait for it). Plan layout only: the user layout reshuffles K and V before any pull.

    Args:
        k, v: [plan tokens, kv_heads, head_dim], this rank's rows in the plan layout (rotary embedding applied).
        plan: this rank's plan; group: its process group (default: the world).
        kernels: the kernels the fcp_attn_func call will use (default: the same default): a range kernel receives
            the pulls into the pass's arena.
        kind, mask: a layered plan's layer kind, by name or by the layer's mask, as fcp_attn_func takes them (the
            call must name the same kind).
    Returns:
        the in-flight pulls, for one fcp_attn_func call.
    Raises:
        PlanMismatchError: as fcp_attn_func.
        ValueError: a user-layout plan, k, v that do not fit the plan, or a kind the plan does not hold.
    """
    plan = resolve_kind(plan, kind, mask)
    check_plan(plan, group)
    if plan.layout != "plan":
        raise ValueError(f"prefetch_kv: the plan was compiled for the {plan.layout} layout, whose attention "
                         f"reshuffles K and V first; prefetch needs a plan-layout plan (fcp compile --layout plan)")
    if k.dim() != 3 or k.shape != v.shape or k.shape[0] != plan.plan_tokens:
        raise ValueError(f"prefetch_kv: expected k, v [{plan.plan_tokens}, kv_heads, head_dim] (rank {plan.rank}'s "
                         f"plan-layout rows), got {tuple(k.shape)}, {tuple(v.shape)}")
    _drain_orphans(plan)
    executor = _Executor(plan, group, 1.0, k.device, k.dtype, k.shape[2], kernels=kernels)
    posted = _post_first(executor, _ForwardPass(executor, None, k.shape[1]), plan.forward, k, v)
    prefetched = KVPrefetch(plan=plan, group=group, k=k, v=v, forward=posted, live_tokens=executor.live_tokens)
    # A prefetch dropped unused leaves its messages posted: they are kept (a backend may abandon a dropped work's
    # buffers, and its peers' messages would then match this rank's next ones) until this plan's next call drains
    # them, so that the next call's messages match the peers' again.
    weakref.finalize(prefetched, _orphan_if_unused, posted, plan._device_cache.setdefault(ORPHANED_PREFETCHES, []))
    return prefetched


def _orphan_if_unused(posted: _Posted, orphans: list) -> None:
    """A KVPrefetch's finalizer: its posted messages, when no fcp_attn_call took them over, kept for draining."""
    if posted.requests:
        orphans.append(posted)


def _drain_orphans(plan: RankPlan) -> None:
    """Wait for the messages of every prefetch of this plan dropped unused (every rank posted its part of them when
    it prefetched, so they complete), and let them go: the call that follows posts its stage 0 afresh."""
    orphans = plan._device_cache.get(ORPHANED_PREFETCHES)
    while orphans:
        _wait_all(orphans.pop(0).requests)


# Tensors of an arena laid out [heads, rows] (LSE) or [2, rows, ...] (dK and dV as halves): their rows are dim 1.
_ROWS_DIM = {"lse": 1, "dkv": 1}


class _Arenas:
    """One pass's arenas on the range path: per kind (Q, K,V) named tensors whose rows hold the received pulls at
    the rows the compiler placed them (fcp_compiler.format.arena); each made when its kind's first pull is posted."""

    def __init__(self, offsets: list[int], make: dict):
        self.offsets, self.make, self.tensors = offsets, make, {}

    def of(self, kind: int) -> dict[str, torch.Tensor]:
        if kind not in self.tensors:
            self.tensors[kind] = self.make[kind]()
        return self.tensors[kind]

    def views(self, kind: int, row: int, rows: int, names) -> dict[str, torch.Tensor]:
        """A pull's rows of the named tensors of its kind's arena, in place."""
        tensors = self.of(kind)
        return {name: tensors[name].narrow(_ROWS_DIM.get(name, 0), row, rows) for name in names}


def _adopt(posted: _Posted | None) -> _Arenas | None:
    """The arenas a prefetch received into, handed to the pass that takes its messages over (and let go by the
    prefetch, which the caller may keep)."""
    if posted is None:
        return None
    arenas_, posted.arenas = posted.arenas, None
    return arenas_


def _arenas(executor: _Executor, pass_name: str, make: dict, adopted: _Arenas | None) -> _Arenas | None:
    """The pass's arenas on the range path (those a prefetch made, if it did), else None."""
    if not executor.ranges:
        return None
    if adopted is not None:
        adopted.make.update(make)  # the prefetch did not know the query heads
        return adopted
    return _Arenas(arenas(executor.plan)[pass_name].pull_offset.tolist(), make)


class _ForwardPass:
    """What the forward pass moves and computes: K,V or Q pulled, partial O and LSE pushed back and merged."""

    def __init__(self, executor: _Executor, q_heads: int | None, kv_heads: int, adopted: _Arenas | None = None):
        self.ex, self.hq, self.hkv = executor, q_heads, kv_heads
        ex = executor
        rows = arenas(ex.plan)["fwd"] if ex.ranges else None
        self.arenas = _arenas(ex, "fwd", {
            TransferKind.KV: lambda: {"k": ex.empty(rows.kv_rows, kv_heads), "v": ex.empty(rows.kv_rows, kv_heads)},
            TransferKind.Q: lambda: {"q": ex.empty(rows.q_rows, self.hq),
                                     "out": ex.empty(rows.q_rows, self.hq, ex.acc_dtype),
                                     "lse": torch.empty((self.hq, rows.q_rows), dtype=ex.acc_dtype, device=ex.device)},
        }, adopted)

    def arena_row(self, pull_row: int) -> int:
        return self.arenas.offsets[pull_row] if self.arenas is not None else -1

    def local_store(self, q, k, v) -> _Store:
        """The plan-layout store with empty output accumulators."""
        ex = self.ex
        return ex.local_store(q=q, k=k, v=v, out=torch.zeros(q.shape, dtype=ex.acc_dtype, device=ex.device),
                              lse=torch.full((q.shape[1], q.shape[0]), float("-inf"), dtype=ex.acc_dtype,
                                             device=ex.device))

    def pull_payload(self, local: _Store, pull) -> list[torch.Tensor]:
        names = ("k", "v") if pull.kind == TransferKind.KV else ("q",)
        return [self.ex.payload_rows(local, name, pull.segs) for name in names]

    def pull_buffers(self, pull, store: _Store) -> dict[str, torch.Tensor]:
        names = ("k", "v") if pull.kind == TransferKind.KV else ("q",)
        if self.arenas is not None:
            return self.arenas.views(pull.kind, store.arena_row, store.rows, names)
        return {name: self.ex.empty(store.rows, self.hkv if pull.kind == TransferKind.KV else self.hq)
                for name in names}

    def accumulators(self, pull, store: _Store) -> None:
        if pull.kind != TransferKind.Q:
            return
        ex = self.ex
        if self.arenas is not None:  # the slot's earlier pull left its results there
            views = self.arenas.views(pull.kind, store.arena_row, store.rows, ("out", "lse"))
            store.tensors.update(out=views["out"].zero_(), lse=views["lse"].fill_(float("-inf")))
            return
        store.tensors["out"] = torch.zeros((store.rows, self.hq, ex.head_dim), dtype=ex.acc_dtype, device=ex.device)
        store.tensors["lse"] = torch.full((self.hq, store.rows), float("-inf"), dtype=ex.acc_dtype, device=ex.device)

    def push_payload(self, store: _Store, pull) -> list[torch.Tensor]:
        return [store.tensors["out"].contiguous(), store.tensors["lse"].contiguous()]

    def push_buffers(self, pull, rows: int) -> list[torch.Tensor]:
        ex = self.ex
        return [ex.empty(rows, self.hq, ex.acc_dtype),
                torch.empty((self.hq, rows), dtype=ex.acc_dtype, device=ex.device)]

    @staticmethod
    def push_parts(tensors: list[torch.Tensor]) -> list[torch.Tensor]:
        """The tensors a push is received into, as its sender sends them."""
        return tensors

    def land(self, local: _Store, rows: slice, kind: int, tensors: list[torch.Tensor], part: slice) -> None:
        out, lse = tensors
        merge_into(local.tensors["out"][rows], local.tensors["lse"][:, rows], out[part], lse[:, part])

    def run_call(self, call, local: _Store, remote: dict[int, _Store]) -> None:
        """One kernel call: a range call merges into the accumulators in the kernel; a packed varlen call's
        entries' partial outputs merge into their query rows' accumulators here."""
        ex = self.ex
        if isinstance(call, RangeCall):
            queries = self.arenas.of(TransferKind.Q) if call.q_arena else local.tensors
            keys = self.arenas.of(TransferKind.KV) if call.kv_arena else local.tensors
            ex.kernels.forward(queries["q"], keys["k"], keys["v"], call.q_ranges.view(-1, 2),
                               call.k_ranges.view(-1, 2), call.masks.view(-1, 2), call.max_q, call.max_k, ex.scale,
                               queries["out"], queries["lse"])
            return
        out, lse = self.attend(call, local, remote)
        for entry in call.q_index:
            store = ex.store_of(entry.source, local, remote)
            if entry.span is not None:  # in place, through views
                position, row, length = entry.span
                merge_into(store.tensors["out"].narrow(0, row, length), store.tensors["lse"].narrow(1, row, length),
                           out.narrow(0, position, length), lse.narrow(1, position, length))
            else:
                merge_rows(store.tensors["out"], store.tensors["lse"], entry.rows, out.index_select(0, entry.positions),
                           lse.index_select(1, entry.positions))

    def attend(self, call: KernelCall, local: _Store, remote: dict[int, _Store]):
        """The call's kernel on its packed inputs, whose copies are freed on return, before the merges."""
        ex = self.ex
        q = ex.gather(call.q_runs, "q", local, remote)
        k = ex.gather(call.kv_runs, "k", local, remote)
        v = ex.gather(call.kv_runs, "v", local, remote)
        return ex.kernels.forward(q, k, v, call.cu_q, call.cu_k, call.max_q, call.max_k, ex.scale, call.causal,
                                  call.window)


_BACKWARD_PULLED = {TransferKind.KV: ("k", "v"), TransferKind.Q: ("q", "do", "out", "lse")}


class _BackwardPass:
    """What the backward pass moves and computes: K,V or (Q, dO, O, LSE) pulled, dK dV or dQ pushed back and
    summed; each tile recomputed from the final O and LSE."""

    def __init__(self, executor: _Executor, q_heads: int | None, kv_heads: int, adopted: _Arenas | None = None):
        self.ex, self.hq, self.hkv = executor, q_heads, kv_heads
        ex = executor
        rows = arenas(ex.plan)["bwd"] if ex.ranges else None

        def kv_arena():
            dkv = torch.empty((2, rows.kv_rows, kv_heads, ex.head_dim), dtype=ex.acc_dtype, device=ex.device)
            return {"k": ex.empty(rows.kv_rows, kv_heads), "v": ex.empty(rows.kv_rows, kv_heads), "dkv": dkv,
                    "dk": dkv[0], "dv": dkv[1]}

        def q_arena():
            return {"q": ex.empty(rows.q_rows, self.hq), "do": ex.empty(rows.q_rows, self.hq),
                    "out": ex.empty(rows.q_rows, self.hq),
                    "lse": torch.empty((self.hq, rows.q_rows), dtype=ex.acc_dtype, device=ex.device),
                    "dq": ex.empty(rows.q_rows, self.hq, ex.acc_dtype)}
        self.arenas = _arenas(ex, "bwd", {TransferKind.KV: kv_arena, TransferKind.Q: q_arena}, adopted)

    def arena_row(self, pull_row: int) -> int:
        return self.arenas.offsets[pull_row] if self.arenas is not None else -1

    def local_store(self, q, k, v, out, lse, d_out) -> _Store:
        """The plan-layout store with empty gradient accumulators."""
        zeros = dict(dtype=self.ex.acc_dtype, device=self.ex.device)
        dkv = torch.zeros((2, *k.shape), **zeros)
        return self.ex.local_store(q=q, k=k, v=v, do=d_out, out=out, lse=lse, dq=torch.zeros(q.shape, **zeros),
                                   dkv=dkv, dk=dkv[0], dv=dkv[1])

    def pull_payload(self, local: _Store, pull) -> list[torch.Tensor]:
        return [self.ex.payload_rows(local, name, pull.segs, heads_first=name == "lse")
                for name in _BACKWARD_PULLED[pull.kind]]

    def pull_buffers(self, pull, store: _Store) -> dict[str, torch.Tensor]:
        ex, rows = self.ex, store.rows
        lse = {"lse": torch.empty((self.hq, rows), dtype=ex.acc_dtype, device=ex.device)} \
            if pull.kind == TransferKind.Q else {}
        names = tuple(name for name in _BACKWARD_PULLED[pull.kind] if name != "lse")
        if self.arenas is not None:  # the LSE arrives whole and is copied into its arena rows on arrival
            return self.arenas.views(pull.kind, store.arena_row, rows, names) | lse
        heads = self.hkv if pull.kind == TransferKind.KV else self.hq
        return {name: ex.empty(rows, heads) for name in names} | lse

    def accumulators(self, pull, store: _Store) -> None:
        """dK and dV as the halves of one [2, rows, kv_heads, head_dim] tensor (one zeroing, one message back, one
        add where it lands), or dQ."""
        ex = self.ex
        if self.arenas is not None:
            if pull.kind == TransferKind.KV:
                dkv = self.arenas.views(pull.kind, store.arena_row, store.rows, ("dkv",))["dkv"].zero_()
                store.tensors.update(dkv=dkv, dk=dkv[0], dv=dkv[1])
            else:
                views = self.arenas.views(pull.kind, store.arena_row, store.rows, ("lse", "dq"))
                store.tensors.update(lse=views["lse"].copy_(store.tensors["lse"]), dq=views["dq"].zero_())
            return
        if pull.kind == TransferKind.KV:
            dkv = torch.zeros((2, store.rows, self.hkv, ex.head_dim), dtype=ex.acc_dtype, device=ex.device)
            store.tensors.update(dkv=dkv, dk=dkv[0], dv=dkv[1])
        else:
            store.tensors["dq"] = torch.zeros((store.rows, self.hq, ex.head_dim), dtype=ex.acc_dtype,
                                              device=ex.device)

    def push_payload(self, store: _Store, pull) -> list[torch.Tensor]:
        """dK and dV as two messages (each a run of rows, in an arena too), or dQ."""
        if pull.kind == TransferKind.KV:
            return [store.tensors["dk"], store.tensors["dv"]]
        return [store.tensors["dq"]]

    def push_buffers(self, pull, rows: int) -> list[torch.Tensor]:
        """One [2, rows, kv_heads, head_dim] buffer for dK and dV (one add where it lands), or dQ."""
        ex = self.ex
        if pull.kind == TransferKind.KV:
            return [torch.empty((2, rows, self.hkv, ex.head_dim), dtype=ex.acc_dtype, device=ex.device)]
        return [ex.empty(rows, self.hq, ex.acc_dtype)]

    @staticmethod
    def push_parts(tensors: list[torch.Tensor]) -> list[torch.Tensor]:
        """The tensors a push is received into, as its sender sends them: dK and dV into the halves of one buffer."""
        (buffer,) = tensors
        return [buffer[0], buffer[1]] if buffer.dim() == 4 else [buffer]

    def land(self, local: _Store, rows: slice, kind: int, tensors: list[torch.Tensor], part: slice) -> None:
        (tensor,) = tensors
        if kind == TransferKind.KV:
            local.tensors["dkv"][:, rows].add_(tensor[:, part])  # in place on the view: no write-back copy
        else:
            local.tensors["dq"][rows].add_(tensor[part])

    def run_call(self, call, local: _Store, remote: dict[int, _Store]) -> None:
        """One kernel call: a range call adds dq, dk and dv into the accumulators in the kernel; a packed varlen
        call's results add into the rows they belong to here."""
        ex = self.ex
        if isinstance(call, RangeCall):
            queries = self.arenas.of(TransferKind.Q) if call.q_arena else local.tensors
            keys = self.arenas.of(TransferKind.KV) if call.kv_arena else local.tensors
            ex.kernels.backward(queries["do"], queries["q"], keys["k"], keys["v"], queries["out"], queries["lse"],
                                call.q_ranges.view(-1, 2), call.k_ranges.view(-1, 2), call.masks.view(-1, 2),
                                call.max_q, call.max_k, ex.scale, queries["dq"], keys["dk"], keys["dv"])
            return
        dq, dkv = self.gradients(call, local, remote)
        ex.scatter_add(call.q_index, "dq", dq, local, remote)
        ex.scatter_add(call.kv_index, "dkv", dkv, local, remote, dim=1)

    def gradients(self, call: KernelCall, local: _Store, remote: dict[int, _Store]):
        """The call's kernel on its packed inputs, whose copies are freed on return, before the adds: (dq, dK and dV
        as the halves of one tensor)."""
        ex = self.ex
        q, d_out, out = (ex.gather(call.q_runs, name, local, remote) for name in ("q", "do", "out"))
        lse = ex.gather(call.q_runs, "lse", local, remote, heads_first=True)
        k = ex.gather(call.kv_runs, "k", local, remote)
        v = ex.gather(call.kv_runs, "v", local, remote)
        dq, dk, dv = ex.kernels.backward(d_out, q, k, v, out, lse, call.cu_q, call.cu_k, call.max_q, call.max_k,
                                         ex.scale, call.causal, call.window)
        return dq, _halves(dk, dv)


def _halves(dk: torch.Tensor, dv: torch.Tensor) -> torch.Tensor:
    """dk and dv as one [2, ...] tensor: the one they are the halves of when a kernel wrote them so (no copy),
    else stacked."""
    base = dk._base
    if (base is not None and base is dv._base and base.shape == (2, *dk.shape) and base.is_contiguous()
            and dk.storage_offset() == base.storage_offset()
            and dv.storage_offset() == base.storage_offset() + dk.numel()):
        return base
    return torch.stack((dk, dv))


def _reshuffle(plan: RankPlan, x: torch.Tensor, to_plan: bool, group) -> torch.Tensor:
    """Move per-token rows between the user layout and the plan layout with one all_to_all_single."""
    gather, scatter = plan.indices_on(x.device)
    # [T] (token ids, labels) as [T, 1]: flatten(1) needs a second dimension (and reshape(T, -1) a non-empty x).
    flat = x.reshape(x.shape[0], math.prod(x.shape[1:]))
    if to_plan:
        send, recv_rows, split_in, split_out, where = gather, plan.plan_tokens, plan.send_splits, \
            plan.recv_splits, scatter
    else:
        send, recv_rows, split_in, split_out, where = scatter, plan.user_tokens, plan.recv_splits, \
            plan.send_splits, gather
    out = torch.empty((sum(split_out), flat.shape[1]), dtype=flat.dtype, device=flat.device)
    dist.all_to_all_single(out, flat.index_select(0, send).contiguous(), output_split_sizes=split_out,
                           input_split_sizes=split_in, group=group)
    result = torch.empty((recv_rows, flat.shape[1]), dtype=flat.dtype, device=flat.device)
    result[where] = out
    return result.view(recv_rows, *x.shape[1:])


def _reshuffle_async(plan: RankPlan, x: torch.Tensor, group):
    """Start moving user-layout rows [T, F] to the plan layout; return the plan-layout buffer, already holding the
    rows that stay on this rank, and a function that waits for the rest and puts them in place."""
    gather, scatter = plan.indices_on(x.device)
    out = torch.empty((sum(plan.recv_splits), x.shape[1]), dtype=x.dtype, device=x.device)
    work = dist.all_to_all_single(out, x.index_select(0, gather).contiguous(), output_split_sizes=plan.recv_splits,
                                  input_split_sizes=plan.send_splits, group=group, async_op=True)
    result = torch.empty((plan.plan_tokens, x.shape[1]), dtype=x.dtype, device=x.device)
    self_user, self_plan = plan.self_rows_on(x.device)
    result[self_plan] = x[self_user]

    def finish() -> None:
        work.wait()
        result[scatter] = out
    return result, finish


def _split_heads(packed: torch.Tensor, hq: int, hkv: int, dim: int):
    return (packed[:, :hq * dim].reshape(-1, hq, dim), packed[:, hq * dim:(hq + hkv) * dim].reshape(-1, hkv, dim),
            packed[:, (hq + hkv) * dim:].reshape(-1, hkv, dim))


def _attention_forward(q, k, v, plan: RankPlan, group, scale: float, layout: str, kernels,
                       prefetched: KVPrefetch | None):
    """One attention call's forward on this rank: (out in q's layout, the plan-layout tensors the backward reads:
    (q, k, v, out, lse), the executor)."""
    _drain_orphans(plan)
    executor = _Executor(plan, group, scale, q.device, q.dtype, q.shape[2], kernels)
    if prefetched is not None:  # its received buffers are live already
        executor.live_tokens = prefetched.live_tokens
        if (prefetched.forward.arenas is not None) != executor.ranges:
            raise ValueError("prefetched: prefetch_kv was given other kernels than fcp_attn_func (a range kernel "
                             "receives into arenas, a packing one does not); pass both the same kernels")
    # Every call of both passes on the device now: the stage loops build and copy nothing.
    prepare_calls(plan, layout, q.device, executor.ranges)
    hq, hkv, dim = q.shape[1], k.shape[1], q.shape[2]
    forward = _ForwardPass(executor, hq, hkv, _adopt(prefetched.forward if prefetched is not None else None))
    skip: frozenset[int] = frozenset()
    if layout == "plan":
        q_p, k_p, v_p = q, k, v
        local = forward.local_store(q_p, k_p, v_p)
    else:
        packed, finish = _reshuffle_async(plan, torch.cat([q.flatten(1), k.flatten(1), v.flatten(1)], dim=1), group)
        q_p, k_p, v_p = _split_heads(packed, hq, hkv, dim)
        local = forward.local_store(q_p, k_p, v_p)
        # Tiles whose tokens stay on this rank run while the all-to-all is in flight.
        skip = plan.early_tiles
        for call in stage_calls(plan, "fwd", -1, sorted(skip), q.device, executor.ranges):
            _log("tile", "fwd", -1, call.tile_rows, call.pull_rows)
            forward.run_call(call, local, {})
        finish()
    executor.run_stages(forward, plan.forward, local, skip=skip,
                        prefetched=prefetched.forward if prefetched is not None else None)
    forward.arenas = None  # every pull is freed: the arenas go before the outputs are made
    out_p, lse_p = local.tensors["out"].to(q.dtype), local.tensors["lse"]
    if prefetched is not None:  # what backward_starts_at posts from
        prefetched.executor, prefetched.saved_kv = executor, (k_p.detach(), v_p.detach())
    out = out_p if layout == "plan" else _reshuffle(plan, out_p, False, group)
    return out, (q_p, k_p, v_p, out_p, lse_p), executor


def _attention_backward(executor: _Executor, saved, d_out, layout: str, prefetched: _Posted | None):
    """One attention call's backward on this rank: (dq, dk, dv) in the call's layout."""
    plan = executor.plan
    q_p, k_p, v_p, out_p, lse_p = saved
    d_out = d_out.contiguous()
    d_out_p = d_out if layout == "plan" else _reshuffle(plan, d_out, True, executor.group)
    hq, hkv, dim = q_p.shape[1], k_p.shape[1], q_p.shape[2]
    backward = _BackwardPass(executor, hq, hkv, _adopt(prefetched))
    local = backward.local_store(q_p, k_p, v_p, out_p, lse_p, d_out_p)
    executor.run_stages(backward, plan.backward, local, prefetched=prefetched)
    backward.arenas = None
    dq_p, dk_p, dv_p = (local.tensors[name].to(q_p.dtype) for name in ("dq", "dk", "dv"))
    if layout == "plan":
        return dq_p, dk_p, dv_p
    packed = _reshuffle(plan, torch.cat([dq_p.flatten(1), dk_p.flatten(1), dv_p.flatten(1)], dim=1), False,
                        executor.group)
    return _split_heads(packed, hq, hkv, dim)


class _FcpAttention(torch.autograd.Function):
    """The eager path: any kernels, K,V prefetch, either layout, and every op visible to a dispatch mode."""

    @staticmethod
    def forward(ctx, q, k, v, plan: RankPlan, group, scale: float, layout: str, kernels,
                prefetched: KVPrefetch | None):
        out, saved, executor = _attention_forward(q, k, v, plan, group, scale, layout, kernels, prefetched)
        ctx.save_for_backward(*saved)
        ctx.executor, ctx.layout, ctx.prefetched = executor, layout, prefetched
        return out

    @staticmethod
    def backward(ctx, d_out):
        prefetched = ctx.prefetched.backward if ctx.prefetched is not None else None
        grads = _attention_backward(ctx.executor, ctx.saved_tensors, d_out, ctx.layout, prefetched)
        return (*grads, None, None, None, None, None, None)


# --- the compiled path: one custom op a pass, the plan named by a tensor --------------------------------------------
# torch.compile sees fcp attention as two opaque ops with fake shapes: no graph break inside attention, and since the
# plan reaches them as its handle (a tensor whose value changes, not a Python object dynamo guards on), a new plan
# each step is no recompile. Their implementations run the same stage loops as the eager path, with the default
# kernels, in the plan layout.


def _group_name(group) -> str:
    return "" if group is None else group.group_name


def _group_of(name: str):
    return None if name == "" else dist.distributed_c10d._resolve_process_group(name)


@torch.library.custom_op("fcp::attention", mutates_args=())
def _attention_op(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, handle: torch.Tensor, group_name: str,
                  scale: float, causal: int, window: int) -> tuple[torch.Tensor, torch.Tensor]:
    plan, group = registered(handle), _group_of(group_name)
    _check_call(q, k, v, plan, group, "plan", None if causal < 0 else (bool(causal), window or None))
    out, saved, _ = _attention_forward(q, k, v, plan, group, scale, "plan", None, None)
    return out, saved[4]


@_attention_op.register_fake
def _(q, k, v, handle, group_name, scale, causal, window):
    acc = torch.float32 if q.dtype in (torch.bfloat16, torch.float16) else q.dtype
    return torch.empty_like(q), q.new_empty((q.shape[1], q.shape[0]), dtype=acc)


@torch.library.custom_op("fcp::attention_backward", mutates_args=())
def _attention_backward_op(d_out: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                           out: torch.Tensor, lse: torch.Tensor, handle: torch.Tensor, group_name: str,
                           scale: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    plan = registered(handle)
    executor = _Executor(plan, _group_of(group_name), scale, q.device, q.dtype, q.shape[2])
    dq, dk, dv = _attention_backward(executor, (q, k, v, out, lse), d_out, "plan", None)
    return dq, dk.clone(), dv.clone()  # dk and dv are halves of one buffer: an op's outputs may not alias


@_attention_backward_op.register_fake
def _(d_out, q, k, v, out, lse, handle, group_name, scale):
    return torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)


def _op_setup(ctx, inputs, output) -> None:
    q, k, v, handle, group_name, scale, _, _ = inputs
    ctx.save_for_backward(q, k, v, output[0], output[1], handle)
    ctx.group_name, ctx.scale = group_name, scale


def _op_backward(ctx, d_out, d_lse):
    q, k, v, out, lse, handle = ctx.saved_tensors
    dq, dk, dv = _attention_backward_op(d_out, q, k, v, out, lse, handle, ctx.group_name, ctx.scale)
    return dq, dk, dv, None, None, None, None, None


_attention_op.register_autograd(_op_backward, setup_context=_op_setup)


def _compiled_attention(q, k, v, plan: RankPlan, group, scale: float | None, layout: str | None, kernels,
                        prefetched, mask: tuple[bool, int | None] | None) -> torch.Tensor:
    """fcp_attn_func as torch.compile traces it: the custom op, every check inside it (at run time)."""
    if kernels is not None or prefetched is not None or layout not in (None, "plan"):
        raise ValueError("fcp_attn_func under torch.compile takes the default kernels, no prefetch and the plan "
                         "layout; call it eagerly for the others")
    causal, window = (-1, 0) if mask is None else (int(mask[0]), mask[1] or 0)
    scale = scale if scale is not None else q.shape[2] ** -0.5
    out, _ = _attention_op(q, k, v, plan.handle, _group_name(group), scale, causal, window)
    return out


def fcp_attn_func(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, plan: RankPlan | LayeredRankPlan, group=None,
                  softmax_scale: float | None = None, layout: str | None = None, kernels=None,
                  prefetched: KVPrefetch | None = None, mask: tuple[bool, int | None] | None = None,
                  kind: str | None = None) -> torch.Tensor:
    """Attention over the whole batch, replaying this rank's plan; autograd gives dq, dk, dv.

    Under torch.compile it is one custom op a pass (``fcp::attention`` and ``fcp::attention_backward``) with fake
    shapes: no graph break inside attention, and no recompile when the plan changes (the plan reaches the op as
    its handle tensor). Compiled, it takes the default kernels, no prefetch and the plan layout.

    Args:
        q: [tokens, q_heads, head_dim]; k, v: [tokens, kv_heads, head_dim]. In the plan layout (the default for
            plans compiled with --layout plan) the rows are this rank's plan-layout tokens, in the order of
            `plan.token_index` (see :func:`fcp_runtime.dispatch`): no all-to-all runs, only the plan's blocks
            move. In the user layout they are rows [floor(r*T/N), floor((r+1)*T/N)) of the concatenated batch on
            rank r, and attention reshuffles them in and the output back.
        plan: this rank's plan (:func:`fcp_runtime.load_rank_plan`); for a layered plan (one schedule for each layer
            kind), the kind named by `kind`, else the one whose mask is `mask`.
        group: the process group (default: the world); its size must be the plan's.
        softmax_scale: default head_dim ** -0.5.
        layout: "plan" or "user"; default the layout the plan was compiled for.
        kernels: the kernels, of either contract (fcp_runtime.kernels; default: default_kernels, a range kernel
            on CPU and where MagiAttention's FFA is installed, else flash-attn on CUDA).
        prefetched: what :func:`prefetch_kv` posted for this call, with these k and v (plan layout).
        mask: the calling layer's own mask, (causal, sliding window or None), checked against every document's
            mask in the plan (None: not checked). A model layer passes it so that a plan compiled for other masks
            is refused, not silently used; a layered plan's kind is picked by it unless `kind` names one.
        kind: a layered plan's layer kind by name (as compiled: --layer-masks NAME=MASK,...).
    Returns:
        out, q's shape and layout.
    Raises:
        PlanMismatchError: on every rank, when the ranks hold different plans or the group size differs.
        ValueError: shapes or dtypes that do not fit the plan, an unknown layout, a layer mask or kind the plan
            does not hold, or a prefetch for other tensors, another plan or group, or one already used.
    """
    plan = resolve_kind(plan, kind, mask)
    if torch.compiler.is_compiling():
        return _compiled_attention(q, k, v, plan, group, softmax_scale, layout, kernels, prefetched, mask)
    layout = plan.layout if layout is None else layout
    _check_call(q, k, v, plan, group, layout, mask)
    scale = softmax_scale if softmax_scale is not None else q.shape[2] ** -0.5
    if prefetched is not None:
        _check_prefetched(prefetched, k, v, plan, group, layout)
    return _FcpAttention.apply(q, k, v, plan, group, scale, layout, kernels, prefetched)


def _check_call(q, k, v, plan: RankPlan, group, layout: str, mask) -> None:
    """Refuse, before any message, a call whose ranks, shapes, dtypes or layer mask do not fit the plan."""
    check_plan(plan, group)
    if layout not in LAYOUTS:
        raise ValueError(f"layout {layout!r} must be one of {', '.join(LAYOUTS)}")
    if q.dim() != 3 or k.shape != v.shape or k.shape[0] != q.shape[0] or k.shape[2] != q.shape[2]:
        raise ValueError(f"expected q [T, Hq, D] and k, v [T, Hkv, D] with equal T and D, got {tuple(q.shape)}, "
                         f"{tuple(k.shape)}, {tuple(v.shape)}")
    if not q.dtype == k.dtype == v.dtype:
        raise ValueError(f"q, k and v must have one dtype, got {q.dtype}, {k.dtype}, {v.dtype}")
    expected = plan.plan_tokens if layout == "plan" else plan.user_tokens
    if q.shape[0] != expected:
        raise ValueError(f"rank {plan.rank} holds {q.shape[0]} tokens but the plan's {layout} layout gives it "
                         f"{expected}")
    if q.shape[1] % k.shape[1]:
        raise ValueError(f"q heads {q.shape[1]} are not a multiple of kv heads {k.shape[1]}")
    if mask is not None:
        check_layer_mask(plan, *mask)


def check_layer_mask(plan: RankPlan, causal: bool, window: int | None) -> None:
    """Refuse a plan whose documents do not all have a layer's mask: causal or not, with a sliding window of
    `window` keys (itself included) or none. Checked once per plan and mask.

    Raises:
        ValueError: naming the first document whose mask differs, and the layer's.
    """
    key = ("layer_mask", bool(causal), window)
    if plan._device_cache.get(key):
        return
    if window is not None and (not causal or window < 1):
        raise ValueError(f"a layer's sliding window must be a positive number of keys over a causal mask, got "
                         f"window {window!r} with causal={causal}")
    lengths = plan.seq_lengths.astype(np.int64)
    if not causal:
        expected = np.zeros_like(lengths)
    else:
        expected = lengths if window is None else np.minimum(lengths, window)
    got = np.where(plan.seq_window >= lengths, lengths, plan.seq_window)  # a window past the document is causal
    wrong = np.flatnonzero(got != expected)
    if wrong.size:
        seq = int(wrong[0])
        name = "full" if not causal else ("causal" if window is None else f"sliding window {window}")
        have = {0: "full"}.get(int(got[seq]), "causal" if got[seq] == lengths[seq] else f"window {int(got[seq])}")
        raise ValueError(f"the layer's mask is {name} but the plan gives document {seq} ({int(lengths[seq])} "
                         f"tokens) a {have} mask: compile the plan with the layer's mask (--mask), or run this "
                         f"layer with another attention")
    plan._device_cache[key] = True


def _check_prefetched(prefetched: KVPrefetch, k: torch.Tensor, v: torch.Tensor, plan: RankPlan, group,
                      layout: str) -> None:
    """A prefetch is for one call: the plan, group and K, V tensors it sent from, in the plan layout."""
    if prefetched.used:
        raise ValueError("prefetched: this prefetch_kv result was used by an earlier fcp_attn_func call; call "
                         "prefetch_kv once per call")
    if prefetched.plan is not plan or prefetched.group is not group or layout != "plan":
        raise ValueError(f"prefetched: it was posted for another plan or group, or the call's layout {layout!r} is "
                         f"not the plan layout it needs")
    if prefetched.k is not k or prefetched.v is not v:
        raise ValueError("prefetched: pass fcp_attn_func the same k and v tensors that prefetch_kv sent from")
    prefetched.used = True


class _Dispatch(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, plan: RankPlan, group, to_plan: bool):
        ctx.plan, ctx.group, ctx.to_plan = plan, group, to_plan
        return _reshuffle(plan, x.contiguous(), to_plan, group)

    @staticmethod
    def backward(ctx, grad):
        return _reshuffle(ctx.plan, grad.contiguous(), not ctx.to_plan, ctx.group), None, None, None


def dispatch(x: torch.Tensor, plan: RankPlan | LayeredRankPlan, group=None) -> torch.Tensor:
    """Move a per-token tensor [user_tokens, ...] from the user layout to this rank's plan layout
    [plan_tokens, ...] with one all_to_all_single (differentiable: its gradient goes back the same way). A layered
    plan's kinds share one layout: one dispatch serves every kind."""
    plan = layout_plan(plan)
    check_plan(plan, group)
    _check_rows(x, plan.user_tokens, plan, "dispatch", "user")
    return _Dispatch.apply(x, plan, group, True)


def undispatch(x: torch.Tensor, plan: RankPlan | LayeredRankPlan, group=None) -> torch.Tensor:
    """The inverse of :func:`dispatch`: plan layout [plan_tokens, ...] back to the user layout [user_tokens, ...]."""
    plan = layout_plan(plan)
    check_plan(plan, group)
    _check_rows(x, plan.plan_tokens, plan, "undispatch", "plan")
    return _Dispatch.apply(x, plan, group, False)


def _check_rows(x: torch.Tensor, expected: int, plan: RankPlan, what: str, layout: str) -> None:
    """A per-token tensor must hold exactly this rank's rows of the layout it comes from: more rows would be
    silently dropped or misplaced, fewer would fail deep inside the exchange."""
    if x.dim() == 0 or x.shape[0] != expected:
        raise ValueError(f"{what}: rank {plan.rank} holds {expected} tokens in the {layout} layout, but x has shape "
                         f"{tuple(x.shape)}; give x [{expected}, ...]")

"""K,V prefetch: a pass's first-stage K,V pulls posted before the pass starts, so that they cross while the layer
computes something else (Q's projection in the forward, the MLP and O projection in the backward)."""

from __future__ import annotations

import weakref
from dataclasses import dataclass

import torch

from fcp_runtime.checks import PlanMismatchError, check_plan, tensor_versions
from fcp_runtime.events import log_event
from fcp_runtime.executor import Executor, Posted, wait_all
from fcp_runtime.kinds_plan import KindsRankPlan, resolve_kind
from fcp_runtime.passes import BackwardPass, ForwardPass
from fcp_runtime.rank_plan import ORPHANED_PREFETCHES, PassProgram, RankPlan
from fcp_runtime.stage_calls import LOCAL


@dataclass(kw_only=True)
class KVPrefetch:
    """One rank's stage-0 K,V pulls of one attention call, posted early: the forward's by :func:`prefetch_kv`
    (consumed by one :func:`fcp_attn_func` call), the backward's as the layer's backward starts
    (:meth:`backward_starts_at`)."""

    plan: RankPlan
    group: object
    k: torch.Tensor
    v: torch.Tensor
    forward: Posted
    live_tokens: int  # received buffer tokens the forward's prefetch allocated
    kv_versions: tuple  # k's and v's in-place write counters when their rows were sent (check_prefetched)
    used: bool = False
    executor: Executor | None = None  # the call's, once fcp_attn_func has run it
    saved_kv: tuple | None = None  # the call's K and V in the plan layout, for the backward's sends
    backward: Posted | None = None

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
        self.backward = _post_first(executor, BackwardPass(executor, None, k.shape[1]),
                                    self.plan.backward, k, v)


def _saved_tensor_hooks_active() -> bool:
    """Whether saved-tensor hooks wrap the running forward: a checkpointed layer (first run or recomputation)."""
    return torch._C._autograd._top_saved_tensors_default_hooks(False) is not None


def _post_first(executor: Executor, phase, program: PassProgram, k: torch.Tensor, v: torch.Tensor) -> Posted:
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
    log_event("prefetch", program.name, 0, len(messages))
    return Posted(num_messages=len(messages), requests=requests, arrived=arrived, arenas=phase.arenas)


def prefetch_kv(k: torch.Tensor, v: torch.Tensor, plan: RankPlan | KindsRankPlan, group=None, kernels=None,
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
        kind, mask: the layer kind of a plan of layer kinds, by name or by the layer's mask, as fcp_attn_func
            takes them (the call must name the same kind).
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
                         f"reshuffles K and V first; prefetch needs a plan-layout plan (layout='plan' in Python, "
                         f"fcp compile --layout plan)")
    if k.dim() != 3 or k.shape != v.shape or k.shape[0] != plan.plan_tokens:
        raise ValueError(f"prefetch_kv: expected k, v [{plan.plan_tokens}, kv_heads, head_dim] (rank {plan.rank}'s "
                         f"plan-layout rows), got {tuple(k.shape)}, {tuple(v.shape)}")
    drain_orphans(plan)
    executor = Executor(plan, group, 1.0, k.device, k.dtype, k.shape[2], kernels=kernels)
    posted = _post_first(executor, ForwardPass(executor, None, k.shape[1]), plan.forward, k, v)
    prefetched = KVPrefetch(plan=plan, group=group, k=k, v=v, forward=posted, live_tokens=executor.live_tokens,
                            kv_versions=tensor_versions(k, v))
    # A prefetch dropped unused leaves its messages posted: they are kept (a backend may abandon a dropped work's
    # buffers, and its peers' messages would then match this rank's next ones) until this plan's next call drains
    # them, so that the next call's messages match the peers' again.
    weakref.finalize(prefetched, _orphan_if_unused, posted, plan._device_cache.setdefault(ORPHANED_PREFETCHES, []))
    return prefetched


def _orphan_if_unused(posted: Posted, orphans: list) -> None:
    """A KVPrefetch's finalizer: its posted messages, when no fcp_attn_call took them over, kept for draining."""
    if posted.requests:
        orphans.append(posted)


def drain_orphans(plan: RankPlan) -> None:
    """Wait for the messages of every prefetch of this plan dropped unused (every rank posted its part of them when
    it prefetched, so they complete), and let them go: the call that follows posts its stage 0 afresh."""
    orphans = plan._device_cache.get(ORPHANED_PREFETCHES)
    while orphans:
        wait_all(orphans.pop(0).requests)


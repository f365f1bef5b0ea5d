"""The checks that refuse a call before its first message: the ranks hold one plan and the group is its world
(:func:`check_plan`), the call's shapes, dtypes and layer mask fit the plan, a prefetch is the call's, and a
per-token tensor holds this rank's rows."""

from __future__ import annotations

import numpy as np
import torch
import torch.distributed as dist

from fcp_runtime.kinds_plan import KindsRankPlan, layout_plan
from fcp_runtime.rank_plan import BATCH_CONTENT, CHECKED_GROUPS, LAYOUTS, RankPlan


class PlanMismatchError(RuntimeError):
    """The ranks of a group do not hold the same plan, or the group is not the plan's world."""


def check_plan(plan: RankPlan | KindsRankPlan, group=None) -> None:
    """Fail on every rank, before any transfer, unless all ranks hold the same plan and the group is its world.

    One all_gather_object of (digest, world size, rank) whatever the plan says, so a mismatch is an error
    everywhere, never a hang. Checked once per plan object and group (a plan of layer kinds: its primary kind's
    digest, which names every kind). The record lives on the plan, so it dies with it: a record kept by the plan's
    id would let a new plan at a freed plan's address skip the collective on some ranks only, and hang the group.

    Raises:
        PlanMismatchError: naming the ranks and what differs.
    """
    plan = layout_plan(plan)
    checked = plan._device_cache.setdefault(CHECKED_GROUPS, set())
    if id(group) in checked:
        return
    if group is None and not dist.is_initialized():  # one process: a one-rank plan needs no process group
        if plan.num_ranks != 1:
            raise PlanMismatchError(f"the plan is for {plan.num_ranks} ranks but torch.distributed is not "
                                    f"initialized: call dist.init_process_group on each rank (only a plan for one "
                                    f"rank runs without it)")
        checked.add(id(group))
        return
    size = dist.get_world_size(group)
    mine = (plan.digest, plan.num_ranks, plan.rank, plan._device_cache.get(BATCH_CONTENT))
    gathered: list = [None] * size
    dist.all_gather_object(gathered, mine, group=group)
    if size != plan.num_ranks:
        raise PlanMismatchError(f"the process group has {size} ranks but the plan was compiled for "
                                f"{plan.num_ranks}; compile it for {size} ranks (PlanningCollate(rank, {size}, ...), "
                                f"or fcp compile --gpus {size})")
    wrong_world = [r for r, (_, n, _, _) in enumerate(gathered) if n != size]
    digests = sorted({d for d, _, _, _ in gathered})
    if len(digests) > 1 or wrong_world:
        groups = {d: [r for r, (dd, _, _, _) in enumerate(gathered) if dd == d] for d in digests}
        detail = "; ".join(f"ranks {ranks} hold plan {d[:12]}" for d, ranks in groups.items())
        raise PlanMismatchError(f"ranks hold different plans: {detail}")
    contents = sorted({str(c) for _, _, _, c in gathered})
    if len(contents) > 1:
        groups = {c: [r for r, (_, _, _, cc) in enumerate(gathered) if str(cc) == c] for c in contents}
        detail = "; ".join(f"ranks {ranks} {'documents ' + c[:12] if c != 'None' else 'a plan no collate made'}"
                           for c, ranks in groups.items())
        raise PlanMismatchError(f"the ranks hold plan {digests[0][:12]} but collated different documents ({detail}): "
                                f"every rank of a context-parallel group must collate the same step's documents "
                                f"(shard the sampler over data-parallel replicas, not over every rank)")
    wrong_rank = [r for r, (_, _, plan_rank, _) in enumerate(gathered) if plan_rank != r]
    if wrong_rank:
        raise PlanMismatchError(f"ranks {wrong_rank} hold another rank's slice of the plan "
                                f"(slice {gathered[wrong_rank[0]][2]} on rank {wrong_rank[0]})")
    checked.add(id(group))


def check_call(q, k, v, plan: RankPlan, group, layout: str, mask) -> None:
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
                         f"tokens) a {have} mask: compile the plan with the layer's mask (HFPlanningCollate."
                         f"for_model(model) reads every layer's; PlanningCollate(..., mask=...) or layer_masks=...; "
                         f"fcp compile --mask), or run this layer with another attention")
    plan._device_cache[key] = True


def check_prefetched(prefetched, k: torch.Tensor, v: torch.Tensor, plan: RankPlan, group, layout: str) -> None:
    """A prefetch (a :class:`fcp_runtime.prefetch.KVPrefetch`, which imports this module) is for one call: the
    plan, group and K, V tensors it sent from, in the plan layout."""
    if prefetched.used:
        raise ValueError("prefetched: this prefetch_kv result was used by an earlier fcp_attn_func call; call "
                         "prefetch_kv once per call")
    if prefetched.plan is not plan or prefetched.group is not group or layout != "plan":
        raise ValueError(f"prefetched: it was posted for another plan or group, or the call's layout {layout!r} is "
                         f"not the plan layout it needs")
    if prefetched.k is not k or prefetched.v is not v:
        raise ValueError("prefetched: pass fcp_attn_func the same k and v tensors that prefetch_kv sent from")
    if tensor_versions(k, v) != prefetched.kv_versions:
        raise ValueError("prefetched: k or v was written in place after prefetch_kv sent its rows (the peers would "
                         "attend to the old values): finish K and V (RoPE included) before prefetch_kv")
    prefetched.used = True


def tensor_versions(*tensors: torch.Tensor) -> tuple:
    """Each tensor's in-place write counter (None for an inference tensor, which keeps none)."""
    return tuple(None if tensor.is_inference() else tensor._version for tensor in tensors)


def check_rows(x: torch.Tensor, expected: int, plan: RankPlan, what: str, layout: str) -> None:
    """A per-token tensor must hold exactly this rank's rows of the layout it comes from: more rows would be
    silently dropped or misplaced, fewer would fail deep inside the exchange."""
    if x.dim() == 0 or x.shape[0] != expected:
        raise ValueError(f"{what}: rank {plan.rank} holds {expected} tokens in the {layout} layout, but x has shape "
                         f"{tuple(x.shape)}; give x [{expected}, ...]")

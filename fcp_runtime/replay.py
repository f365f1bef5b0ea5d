"""One attention call on this rank: its forward (the inputs reshuffled to the plan layout if they are not in it,
the forward pass, the output) and its backward, which the eager autograd function and the compiled custom ops
share."""

from __future__ import annotations

import torch

from fcp_runtime.events import log_event
from fcp_runtime.executor import Executor, Posted, adopt
from fcp_runtime.passes import BackwardPass, ForwardPass
from fcp_runtime.prefetch import KVPrefetch, drain_orphans
from fcp_runtime.rank_plan import RankPlan
from fcp_runtime.reshuffle import reshuffle, reshuffle_async, split_heads
from fcp_runtime.stage_calls import prepare_calls, stage_calls


def attention_forward(q, k, v, plan: RankPlan, group, scale: float, layout: str, kernels,
                      prefetched: KVPrefetch | None):
    """One attention call's forward on this rank: (out in q's layout, the plan-layout tensors the backward reads:
    (q, k, v, out, lse), the executor)."""
    drain_orphans(plan)
    executor = Executor(plan, group, scale, q.device, q.dtype, q.shape[2], kernels)
    if prefetched is not None:  # its received buffers are live already
        executor.live_tokens = prefetched.live_tokens
        if (prefetched.forward.arenas is not None) != executor.ranges:
            raise ValueError("prefetched: prefetch_kv was given other kernels than fcp_attn_func (a range kernel "
                             "receives into arenas, a packing one does not); pass both the same kernels")
    # Every call of both passes on the device now: the stage loops build and copy nothing.
    prepare_calls(plan, layout, q.device, executor.ranges)
    hq, hkv, dim = q.shape[1], k.shape[1], q.shape[2]
    forward = ForwardPass(executor, hq, hkv, adopt(prefetched.forward if prefetched is not None else None))
    skip: frozenset[int] = frozenset()
    if layout == "plan":
        q_p, k_p, v_p = q, k, v
        local = forward.local_store(q_p, k_p, v_p)
    else:
        packed, finish = reshuffle_async(plan, torch.cat([q.flatten(1), k.flatten(1), v.flatten(1)], dim=1), group)
        q_p, k_p, v_p = split_heads(packed, hq, hkv, dim)
        local = forward.local_store(q_p, k_p, v_p)
        # Tiles whose tokens stay on this rank run while the all-to-all is in flight.
        skip = plan.early_tiles
        for call in stage_calls(plan, "fwd", -1, sorted(skip), q.device, executor.ranges):
            log_event("tile", "fwd", -1, call.tile_rows, call.pull_rows)
            forward.run_call(call, local, {})
        finish()
    executor.run_stages(forward, plan.forward, local, skip=skip,
                        prefetched=prefetched.forward if prefetched is not None else None)
    forward.arenas = None  # every pull is freed: the arenas go before the outputs are made
    out_p, lse_p = local.tensors["out"].to(q.dtype), local.tensors["lse"]
    if prefetched is not None:  # what backward_starts_at posts from
        prefetched.executor, prefetched.saved_kv = executor, (k_p.detach(), v_p.detach())
    out = out_p if layout == "plan" else reshuffle(plan, out_p, False, group)
    return out, (q_p, k_p, v_p, out_p, lse_p), executor


def attention_backward(executor: Executor, saved, d_out, layout: str, prefetched: Posted | None):
    """One attention call's backward on this rank: (dq, dk, dv) in the call's layout."""
    plan = executor.plan
    q_p, k_p, v_p, out_p, lse_p = saved
    d_out = d_out.contiguous()
    d_out_p = d_out if layout == "plan" else reshuffle(plan, d_out, True, executor.group)
    hq, hkv, dim = q_p.shape[1], k_p.shape[1], q_p.shape[2]
    backward = BackwardPass(executor, hq, hkv, adopt(prefetched))
    local = backward.local_store(q_p, k_p, v_p, out_p, lse_p, d_out_p)
    executor.run_stages(backward, plan.backward, local, prefetched=prefetched)
    backward.arenas = None
    dq_p, dk_p, dv_p = (local.tensors[name].to(q_p.dtype) for name in ("dq", "dk", "dv"))
    if layout == "plan":
        return dq_p, dk_p, dv_p
    packed = reshuffle(plan, torch.cat([dq_p.flatten(1), dk_p.flatten(1), dv_p.flatten(1)], dim=1), False,
                       executor.group)
    return split_heads(packed, hq, hkv, dim)

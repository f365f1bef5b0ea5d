"""The compiled path: one custom op a pass, the plan named by a tensor.

torch.compile sees fcp attention as two opaque ops with fake shapes: no graph break inside attention, and since the
plan reaches them as its handle (a tensor whose value changes, not a Python object dynamo guards on), a new plan
each step is no recompile. Their implementations run the same stage loops as the eager path, with the default
kernels, in the plan layout.

The forward op also returns its handle pinned (:func:`fcp_runtime.rank_plan.pinned`), which the backward op takes:
the graph saves it for the backward, so the plan lives until its backward has run (or the graph is dropped), even
where the step lets the plan go after the forward.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from fcp_runtime.binding import check_bound
from fcp_runtime.checks import check_call
from fcp_runtime.executor import Executor
from fcp_runtime.rank_plan import RankPlan, pinned, registered
from fcp_runtime.replay import attention_backward, attention_forward


def _group_name(group) -> str:
    return "" if group is None else group.group_name


def _group_of(name: str):
    return None if name == "" else dist.distributed_c10d._resolve_process_group(name)


@torch.library.custom_op("fcp::attention", mutates_args=())
def _attention_op(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, handle: torch.Tensor, group_name: str,
                  scale: float, causal: int, window: int, position_ids: torch.Tensor | None,
                  labels: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(out, lse, the handle pinned: what the backward op takes to find the plan)."""
    plan, group = registered(handle), _group_of(group_name)
    check_call(q, k, v, plan, group, "plan", None if causal < 0 else (bool(causal), window or None))
    check_bound(position_ids, plan, group, "plan", labels)
    out, saved, _ = attention_forward(q, k, v, plan, group, scale, "plan", None, None)
    return out, saved[4], pinned(handle)


@_attention_op.register_fake
def _(q, k, v, handle, group_name, scale, causal, window, position_ids, labels):
    acc = torch.float32 if q.dtype in (torch.bfloat16, torch.float16) else q.dtype
    return torch.empty_like(q), q.new_empty((q.shape[1], q.shape[0]), dtype=acc), torch.empty_like(handle)


@torch.library.custom_op("fcp::attention_backward", mutates_args=())
def _attention_backward_op(d_out: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                           out: torch.Tensor, lse: torch.Tensor, handle: torch.Tensor, group_name: str,
                           scale: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    plan = registered(handle)
    executor = Executor(plan, _group_of(group_name), scale, q.device, q.dtype, q.shape[2])
    dq, dk, dv = attention_backward(executor, (q, k, v, out, lse), d_out, "plan", None)
    return dq, dk.clone(), dv.clone()  # dk and dv are halves of one buffer: an op's outputs may not alias


@_attention_backward_op.register_fake
def _(d_out, q, k, v, out, lse, handle, group_name, scale):
    return torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)


def _op_setup(ctx, inputs, output) -> None:
    q, k, v, _, group_name, scale, _, _, _, _ = inputs
    ctx.save_for_backward(q, k, v, *output)  # the pinned handle, not the plan's: it holds the plan for the backward
    ctx.group_name, ctx.scale = group_name, scale


def _op_backward(ctx, d_out, d_lse, d_pinned):
    q, k, v, out, lse, pinned_handle = ctx.saved_tensors
    dq, dk, dv = _attention_backward_op(d_out, q, k, v, out, lse, pinned_handle, ctx.group_name, ctx.scale)
    return dq, dk, dv, None, None, None, None, None, None, None


_attention_op.register_autograd(_op_backward, setup_context=_op_setup)


def compiled_attention(q, k, v, plan: RankPlan, group, scale: float | None, layout: str | None, kernels,
                       prefetched, mask: tuple[bool, int | None] | None,
                       position_ids: torch.Tensor | None = None, labels: torch.Tensor | None = None) -> torch.Tensor:
    """fcp_attn_func as torch.compile traces it: the custom op, every check inside it (at run time), the position
    ids' and labels' included."""
    if kernels is not None or prefetched is not None or (layout or plan.layout) != "plan":
        raise ValueError("fcp_attn_func under torch.compile takes the default kernels, no prefetch and the plan "
                         "layout (a plan compiled for it); call it eagerly for the others")
    causal, window = (-1, 0) if mask is None else (int(mask[0]), mask[1] or 0)
    scale = scale if scale is not None else q.shape[2] ** -0.5
    out, _, _ = _attention_op(q, k, v, plan.handle, _group_name(group), scale, causal, window, position_ids,
                             labels)
    return out

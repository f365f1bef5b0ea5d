"""Per-token rows between the user layout and the plan layout: one all_to_all_single each way. :func:`dispatch`
and :func:`undispatch` move a model's tensors; attention in the user layout reshuffles its inputs and outputs."""

from __future__ import annotations

import math

import torch
import torch.distributed as dist

from fcp_runtime.checks import check_plan, check_rows
from fcp_runtime.kinds_plan import KindsRankPlan, layout_plan
from fcp_runtime.rank_plan import RankPlan


class _Done:
    """The exchange of a one-rank plan: a copy, done when made."""

    def wait(self) -> None:
        pass


def _all_to_all(plan: RankPlan, out: torch.Tensor, rows: torch.Tensor, split_out, split_in, group,
                async_op: bool = False):
    """all_to_all_single of `rows` into `out`; a one-rank plan copies, so it runs with no process group."""
    if plan.num_ranks == 1:
        out.copy_(rows)
        return _Done()
    return dist.all_to_all_single(out, rows, output_split_sizes=split_out, input_split_sizes=split_in, group=group,
                                  async_op=async_op)


def reshuffle(plan: RankPlan, x: torch.Tensor, to_plan: bool, group) -> torch.Tensor:
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
    _all_to_all(plan, out, flat.index_select(0, send).contiguous(), split_out, split_in, group)
    result = torch.empty((recv_rows, flat.shape[1]), dtype=flat.dtype, device=flat.device)
    result[where] = out
    return result.view(recv_rows, *x.shape[1:])


def reshuffle_async(plan: RankPlan, x: torch.Tensor, group):
    """Start moving user-layout rows [T, F] to the plan layout; return the plan-layout buffer, already holding the
    rows that stay on this rank, and a function that waits for the rest and puts them in place."""
    gather, scatter = plan.indices_on(x.device)
    out = torch.empty((sum(plan.recv_splits), x.shape[1]), dtype=x.dtype, device=x.device)
    work = _all_to_all(plan, out, x.index_select(0, gather).contiguous(), plan.recv_splits, plan.send_splits, group,
                       async_op=True)
    result = torch.empty((plan.plan_tokens, x.shape[1]), dtype=x.dtype, device=x.device)
    self_user, self_plan = plan.self_rows_on(x.device)
    result[self_plan] = x[self_user]

    def finish() -> None:
        work.wait()
        result[scatter] = out
    return result, finish


def split_heads(packed: torch.Tensor, hq: int, hkv: int, dim: int):
    """Rows of q, k and v packed side by side [T, (hq + 2 hkv) dim] as (q [T, hq, dim], k, v [T, hkv, dim]) views."""
    return (packed[:, :hq * dim].reshape(-1, hq, dim), packed[:, hq * dim:(hq + hkv) * dim].reshape(-1, hkv, dim),
            packed[:, (hq + hkv) * dim:].reshape(-1, hkv, dim))


class _Dispatch(torch.autograd.Function):
    """One reshuffle, whose gradient is the reshuffle the other way."""

    @staticmethod
    def forward(ctx, x, plan: RankPlan, group, to_plan: bool):
        ctx.plan, ctx.group, ctx.to_plan = plan, group, to_plan
        return reshuffle(plan, x.contiguous(), to_plan, group)

    @staticmethod
    def backward(ctx, grad):
        return reshuffle(ctx.plan, grad.contiguous(), not ctx.to_plan, ctx.group), None, None, None


def dispatch(x: torch.Tensor, plan: RankPlan | KindsRankPlan, group=None) -> torch.Tensor:
    """Move a per-token tensor [user_tokens, ...] from the user layout to this rank's plan layout
    [plan_tokens, ...] with one all_to_all_single (differentiable: its gradient goes back the same way). A plan's
    layer kinds share one layout: one dispatch serves every kind."""
    plan = layout_plan(plan)
    check_plan(plan, group)
    check_rows(x, plan.user_tokens, plan, "dispatch", "user")
    return _Dispatch.apply(x, plan, group, True)


def undispatch(x: torch.Tensor, plan: RankPlan | KindsRankPlan, group=None) -> torch.Tensor:
    """The inverse of :func:`dispatch`: plan layout [plan_tokens, ...] back to the user layout [user_tokens, ...]."""
    plan = layout_plan(plan)
    check_plan(plan, group)
    check_rows(x, plan.plan_tokens, plan, "undispatch", "plan")
    return _Dispatch.apply(x, plan, group, False)

"""fcp_attn_func: distributed attention that replays one rank's plan, forward and backward.

One code path for every backend: torch.distributed collectives and batched point-to-point messages (gloo on CPU,
NCCL on CUDA), and the varlen kernels of :mod:`fcp_runtime.kernels`. Each stage posts its messages as one batch,
runs its tiles (which read only buffers of earlier stages), then waits; received buffers are freed by the plan's
liveness rule, and :func:`recording` logs every post, tile, wait, allocation and free.

This is the runtime's entry module; the parts, each read top to bottom:

- :mod:`fcp_runtime.checks`: what refuses a call before its first message (:func:`check_plan`, the call's shapes and
  layer mask, a prefetch's, a per-token tensor's rows);
- :mod:`fcp_runtime.executor`: the stage loop, its messages and received buffers;
- :mod:`fcp_runtime.passes`: what the forward and the backward pass move and compute;
- :mod:`fcp_runtime.prefetch`: K,V prefetch (:func:`prefetch_kv`);
- :mod:`fcp_runtime.reshuffle`: the user layout to the plan layout and back (:func:`dispatch`, :func:`undispatch`);
- :mod:`fcp_runtime.replay`: one call's forward and backward over the passes, in either layout;
- :mod:`fcp_runtime.compiled`: the custom ops torch.compile sees;
- :mod:`fcp_runtime.events`: the event log :func:`recording` returns.
"""

from __future__ import annotations

import torch

from fcp_runtime.binding import check_bound
from fcp_runtime.checks import PlanMismatchError, check_call, check_layer_mask, check_plan, check_prefetched
from fcp_runtime.compiled import compiled_attention
from fcp_runtime.events import recording
from fcp_runtime.kinds_plan import KindsRankPlan, resolve_kind
from fcp_runtime.prefetch import KVPrefetch, prefetch_kv
from fcp_runtime.rank_plan import RankPlan
from fcp_runtime.replay import attention_backward, attention_forward
from fcp_runtime.reshuffle import dispatch, undispatch

__all__ = ["KVPrefetch", "PlanMismatchError", "check_layer_mask", "check_plan", "dispatch", "fcp_attn_func",
           "prefetch_kv", "recording", "undispatch"]


class _FcpAttention(torch.autograd.Function):
    """The eager path: any kernels, K,V prefetch, either layout, and every op visible to a dispatch mode."""

    @staticmethod
    def forward(ctx, q, k, v, plan: RankPlan, group, scale: float, layout: str, kernels,
                prefetched: KVPrefetch | None):
        out, saved, executor = attention_forward(q, k, v, plan, group, scale, layout, kernels, prefetched)
        ctx.save_for_backward(*saved)
        ctx.executor, ctx.layout, ctx.prefetched = executor, layout, prefetched
        return out

    @staticmethod
    def backward(ctx, d_out):
        prefetched = ctx.prefetched.backward if ctx.prefetched is not None else None
        grads = attention_backward(ctx.executor, ctx.saved_tensors, d_out, ctx.layout, prefetched)
        return (*grads, None, None, None, None, None, None)


def fcp_attn_func(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, plan: RankPlan | KindsRankPlan, group=None,
                  softmax_scale: float | None = None, layout: str | None = None, kernels=None,
                  prefetched: KVPrefetch | None = None, mask: tuple[bool, int | None] | None = None,
                  kind: str | None = None, position_ids: torch.Tensor | None = None,
                  labels: torch.Tensor | None = None) -> torch.Tensor:
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
        plan: this rank's plan (:func:`fcp_runtime.load_rank_plan`); for a plan of layer kinds (one schedule for each
            kind), the kind named by `kind`, else the one whose mask is `mask`.
        group: the process group (default: the world); its size must be the plan's.
        softmax_scale: default head_dim ** -0.5.
        layout: "plan" or "user"; default the layout the plan was compiled for.
        kernels: the kernels, of either contract (fcp_runtime.kernels; default: default_kernels, a range kernel
            on CPU and where MagiAttention's FFA is installed, else flash-attn on CUDA).
        prefetched: what :func:`prefetch_kv` posted for this call, with these k and v (plan layout).
        mask: the calling layer's own mask, (causal, sliding window or None), checked against every document's
            mask in the plan (None: not checked). A model layer passes it so that a plan compiled for other masks
            is refused, not silently used; a plan of layer kinds picks its kind by it unless `kind` names one.
        kind: the layer kind by name, for a plan of layer kinds (as compiled: --layer-masks NAME=MASK,...).
        position_ids: the rows' positions inside their documents, as the model has them ([T] or [1, T]): checked
            against the plan's rows on every rank, so that a plan from another step is refused
            (:func:`fcp_runtime.binding.check_positions`: once per plan and tensor, no host read on a GPU).
            Required for a plan a collate made (it returns them beside the plan); optional for one read with
            load_rank_plan, whose caller binds it to its rows.
        labels: the rows' labels as the plan's collate returned them (its `shift_labels`, else `labels`; [T] or
            [1, T]), checked with the positions: a plan from a step whose documents are a permutation of this one's
            lengths can hold the same positions on every rank, but not the same labels. Optional.
    Returns:
        out, q's shape and layout.
    Raises:
        PlanMismatchError: on every rank, when the ranks hold different plans or the group size differs.
        ValueError: shapes or dtypes that do not fit the plan, an unknown layout, a layer mask or kind the plan
            does not hold, a prefetch for other tensors, another plan or group, or one already used, or no
            position_ids for a plan a collate made.
        BatchMismatchError: on every rank, when `position_ids` or `labels` are not the plan's rows' (a ValueError).
    """
    plan = resolve_kind(plan, kind, mask)
    if torch.compiler.is_compiling():
        return compiled_attention(q, k, v, plan, group, softmax_scale, layout, kernels, prefetched, mask,
                                  position_ids, labels)
    layout = plan.layout if layout is None else layout
    check_call(q, k, v, plan, group, layout, mask)
    check_bound(position_ids, plan, group, layout, labels)
    scale = softmax_scale if softmax_scale is not None else q.shape[2] ** -0.5
    if prefetched is not None:
        check_prefetched(prefetched, k, v, plan, group, layout)
    return _FcpAttention.apply(q, k, v, plan, group, scale, layout, kernels, prefetched)

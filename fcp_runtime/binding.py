"""A plan is bound to the batch it was compiled for: each rank's position ids (and labels, where the call gives
them) must be the plan's.

A plan from another step can hold the same number of rows on every rank and still describe other documents (a plan
for documents [96, 96] replayed on one 192-token document trains silently wrong). The rows' positions inside their
documents tell the two apart wherever the documents differ, so attention compares the positions the model was given
with the ones the plan's layout holds, on the device, before its first message. Positions alone cannot tell a step
from one whose documents are a permutation of its lengths ([64, 128, 96] and [128, 64, 96] can give every rank the
same positions): where a collate made the plan it also recorded its rows' labels, and a call that gives the labels
(HF's attention takes the batch's `shift_labels`) has them compared in the same check:

- every rank compares its own rows (one elementwise compare of T int64 values, two with labels);
- one all-reduce of one int32 over the context-parallel group makes the verdict every rank's, so all refuse
  together and none waits on a peer that stopped;
- on the CPU the verdict is read and a mismatch raises :class:`BatchMismatchError` on every rank; on a GPU it is
  never read on the host (no sync): ``torch._assert_async`` stops every rank's stream with the same message.

A step's layers share one position tensor, so the check runs once per (plan, position tensor, label tensor), and
again where either was written in place since: the first layer pays it, the rest find it done.
"""

from __future__ import annotations

import weakref

import numpy as np
import torch
import torch.distributed as dist

from fcp_runtime.checks import tensor_versions
from fcp_runtime.rank_plan import BATCH_CONTENT, BATCH_LABELS, CHECKED_POSITIONS, CHECKED_VERSIONS, RankPlan


class BatchMismatchError(ValueError):
    """The model's rows are not the ones the plan was compiled for (a plan from another step)."""


def expected_positions(plan: RankPlan, layout: str) -> torch.Tensor:
    """int64 [rows]: each of this rank's rows' position inside its own document, in `layout` ("plan": the plan's
    rows; "user": rows [floor(r*T/N), floor((r+1)*T/N)) of the concatenated batch)."""
    if layout == "plan":
        return plan.position_ids
    lengths = plan.seq_lengths.astype(np.int64)
    total = int(lengths.sum())
    lo, hi = plan.rank * total // plan.num_ranks, (plan.rank + 1) * total // plan.num_ranks
    starts = np.repeat(np.cumsum(lengths) - lengths, lengths)
    return torch.from_numpy(np.arange(lo, hi, dtype=np.int64) - starts[lo:hi])


def _mismatch_message(plan: RankPlan) -> str:
    return (f"the model's position_ids or labels are not those of the batch plan {plan.digest[:12]} was compiled "
            f"for: a plan is bound to its step's documents; give the model the fcp_plan its own batch's collate "
            f"returned")


def check_bound(position_ids: torch.Tensor | None, plan: RankPlan, group, layout: str,
                labels: torch.Tensor | None = None) -> None:
    """:func:`check_positions` where the call gives position ids; without them, refuse a plan a collate made (the
    collate returns the positions beside it, and only they bind the plan to its rows). A plan read with
    load_rank_plan is bound by its caller.

    Raises:
        ValueError: no position ids for a collate's plan.
        BatchMismatchError: as :func:`check_positions`.
    """
    if position_ids is not None:
        check_positions(position_ids, plan, group, layout, labels)
    elif BATCH_CONTENT in plan._device_cache:
        raise ValueError("this plan came from a collate with its batch's position_ids: pass them to attention "
                         "(fcp_attn_func(..., position_ids=batch['position_ids'])), so that a plan from another step, "
                         "or rows not in the plan's layout, are refused")


def check_positions(position_ids: torch.Tensor, plan: RankPlan, group, layout: str,
                    labels: torch.Tensor | None = None) -> None:
    """Refuse, on every rank of `group`, a call whose position ids, or labels, are not the plan's rows' (a plan
    from another step). Once per plan and tensors; no host sync on a GPU.

    Args:
        position_ids: the model's position ids for this rank's rows, [rows] or [1, rows].
        plan: this rank's plan (one kind's, for a plan of layer kinds: they share the layout).
        group: the context-parallel group (None: the world; no group at all: a one-rank plan).
        layout: the rows' layout, "plan" or "user".
        labels: this rank's rows' labels, [rows] or [1, rows], as the plan's collate returned them (compared
            where the collate recorded them; else not read).
    Raises:
        BatchMismatchError: on every rank, on the CPU, when any rank's positions or labels differ (on a GPU the
            device-side assertion carries the same message).
    """
    # The record lives on the plan (it dies with it) and holds the tensors weakly: id(tensor) -> (tensor, its
    # version counter), compared by identity, so a new tensor at a freed one's address is checked again, and so is
    # a tensor written in place since (a position buffer a loop refills each step).
    checked = plan._device_cache.setdefault(CHECKED_POSITIONS, weakref.WeakValueDictionary())
    versions = plan._device_cache.setdefault(CHECKED_VERSIONS, {})
    recorded_labels = plan._device_cache.get(BATCH_LABELS)
    labels = labels if recorded_labels is not None else None
    given = [tensor for tensor in (position_ids, labels) if tensor is not None]
    if all(checked.get(id(tensor)) is tensor and versions.get(id(tensor)) == tensor_versions(tensor)
           for tensor in given):
        return
    rows = position_ids.reshape(-1)
    expected = expected_positions(plan, layout)
    if rows.numel() != expected.numel():
        raise BatchMismatchError(f"rank {plan.rank}: the model's position_ids hold {rows.numel()} rows but the plan's "
                                 f"{layout} layout gives this rank {expected.numel()}")
    device_expected = plan.cached(("expected_positions", layout, rows.device),
                                  lambda: expected.to(rows.device, non_blocking=True))
    differs = (rows != device_expected).any()
    if labels is not None:
        differs = differs | _labels_differ(labels.reshape(-1), recorded_labels, plan)
    differs = differs.to(torch.int32).reshape(1)
    if plan.num_ranks > 1:
        dist.all_reduce(differs, op=dist.ReduceOp.MAX, group=group)
    if differs.device.type == "cpu":
        if int(differs[0]):
            raise BatchMismatchError(_mismatch_message(plan))
    else:
        torch._assert_async(differs[0] == 0, _mismatch_message(plan))
    for tensor in given:
        checked[id(tensor)], versions[id(tensor)] = tensor, tensor_versions(tensor)


def _labels_differ(labels: torch.Tensor, recorded: torch.Tensor, plan: RankPlan) -> torch.Tensor:
    """0-d bool on the labels' device: the call's labels are not the ones the plan's collate recorded."""
    if labels.numel() != recorded.numel():
        raise BatchMismatchError(f"rank {plan.rank}: the call's labels hold {labels.numel()} rows but the plan's "
                                 f"collate gave this rank {recorded.numel()}")
    return (labels != recorded.to(labels.device, non_blocking=True)).any()

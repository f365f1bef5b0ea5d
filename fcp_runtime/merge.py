"""Log-sum-exp merging: partial attention outputs over disjoint key sets, each with its LSE, folded into accumulator
rows in any order; the result is the attention over the union of the keys."""

from __future__ import annotations

import torch


def merge_into(out_acc: torch.Tensor, lse_acc: torch.Tensor, out: torch.Tensor, lse: torch.Tensor) -> None:
    """Merge a partial (out, lse) into accumulator rows in place, by log-sum-exp weights.

    With m = logaddexp(lse_acc, lse), the merged output is out_acc * exp(lse_acc - m) + out * exp(lse - m): two
    in-place ops on the accumulator rows (a scale, then an addcmul that reads the partial in its own dtype), so no
    full-size temporary is made; where nothing was merged yet the first weight is 0 and the result is exactly out.

    Args:
        out_acc: [l, Hq, D] accumulator rows (a view is updated in place); lse_acc: [Hq, l] (-inf where nothing has
            been merged yet).
        out, lse: the partial ([l, Hq, D], [Hq, l]).
    """
    lse = lse.to(lse_acc.dtype)
    new_lse = torch.logaddexp(lse_acc, lse)
    # Rows where both are -inf (no key seen yet, none in this partial) keep their accumulator: weights 1 and 0.
    keep = torch.exp(lse_acc - new_lse).nan_to_num_(1.0).transpose(0, 1).unsqueeze(-1).to(out_acc.dtype)
    take = torch.exp(lse - new_lse).nan_to_num_(0.0).transpose(0, 1).unsqueeze(-1).to(out_acc.dtype)
    out_acc.mul_(keep).addcmul_(out, take)
    lse_acc.copy_(new_lse)


def merge_rows(out_acc: torch.Tensor, lse_acc: torch.Tensor, rows: torch.Tensor, out: torch.Tensor,
               lse: torch.Tensor) -> None:
    """:func:`merge_into` for accumulator rows named by an index: gathered, merged, written back."""
    acc, acc_lse = out_acc.index_select(0, rows), lse_acc.index_select(1, rows)
    merge_into(acc, acc_lse, out, lse)
    out_acc.index_put_((rows,), acc)
    lse_acc[:, rows] = acc_lse

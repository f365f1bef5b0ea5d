"""Attention on one (query segment, key segment) pair, forward and backward, and log-sum-exp merging.

Two backends with one interface: an exact CPU kernel in plain torch (fp32, fp64) with the mask built from absolute
token positions, and flash-attn's varlen kernels on CUDA (bf16, fp16). Shapes: q [Lq, Hq, D], k and v [Lk, Hkv, D],
out [Lq, Hq, D], lse [Hq, Lq] (fp32 on CUDA, the input dtype on CPU).
"""

from __future__ import annotations

import torch


def _expand_kv(x: torch.Tensor, group: int) -> torch.Tensor:
    return x if group == 1 else x.repeat_interleave(group, dim=1)


def _scores(q, k, q_pos, k_pos, causal, scale):
    group = q.shape[1] // k.shape[1]
    scores = torch.einsum("qhd,khd->hqk", q, _expand_kv(k, group)) * scale
    if causal:
        visible = k_pos[None, :] <= q_pos[:, None]
        scores = scores.masked_fill(~visible[None], float("-inf"))
    return scores


def cpu_forward(q, k, v, q_pos, k_pos, causal: bool, scale: float):
    """Exact attention of one segment pair: (out, lse); rows that see no key get out 0 and lse -inf."""
    scores = _scores(q, k, q_pos, k_pos, causal, scale)
    lse = torch.logsumexp(scores, dim=-1)
    probs = torch.exp(scores - lse[..., None]).nan_to_num(0.0)
    group = q.shape[1] // k.shape[1]
    out = torch.einsum("hqk,khd->qhd", probs, _expand_kv(v, group))
    return out, lse


def cpu_backward(q, k, v, d_out, out, lse, delta, q_pos, k_pos, causal: bool, scale: float):
    """Gradients of one segment pair given the final out, lse and delta = rowsum(dO * O) of its query rows.

    Returns (dq, dk, dv) for this pair alone; the caller sums pairs.
    """
    group = q.shape[1] // k.shape[1]
    k_rep, v_rep = _expand_kv(k, group), _expand_kv(v, group)
    scores = _scores(q, k, q_pos, k_pos, causal, scale)
    probs = torch.exp(scores - lse[..., None]).nan_to_num(0.0)
    dv_rep = torch.einsum("hqk,qhd->khd", probs, d_out)
    d_probs = torch.einsum("qhd,khd->hqk", d_out, v_rep)
    d_scores = probs * (d_probs - delta[..., None])
    dq = torch.einsum("hqk,khd->qhd", d_scores, k_rep) * scale
    dk_rep = torch.einsum("hqk,qhd->khd", d_scores, q) * scale
    lk, hkv, dim = k.shape
    return dq, dk_rep.view(lk, hkv, group, dim).sum(2), dv_rep.view(lk, hkv, group, dim).sum(2)


def cuda_forward(q, k, v, q_pos, k_pos, causal: bool, scale: float):  # pragma: no cover - needs a GPU
    """flash-attn varlen on one segment pair. Segments of one sequence never overlap, so a visible pair either has
    all keys before all queries (no mask) or is the same range (causal, where top-left and bottom-right agree)."""
    from flash_attn import flash_attn_varlen_func

    same_range = bool(causal) and int(q_pos[0]) == int(k_pos[0])
    cu_q = torch.tensor([0, q.shape[0]], dtype=torch.int32, device=q.device)
    cu_k = torch.tensor([0, k.shape[0]], dtype=torch.int32, device=q.device)
    q, k, v = (x.contiguous() for x in (q, k, v))
    out, lse, _ = flash_attn_varlen_func(q, k, v, cu_q, cu_k, q.shape[0], k.shape[0], softmax_scale=scale,
                                         causal=same_range, return_attn_probs=True)
    return out, lse


def cuda_backward(q, k, v, d_out, out, lse, delta, q_pos, k_pos, causal: bool, scale: float):  # pragma: no cover
    """flash-attn varlen backward of one segment pair. Given the final out and lse of the query rows, the kernel's
    P = exp(S - lse) and D = rowsum(dO * out) are those of the whole attention, so pairs sum to the gradient."""
    from flash_attn.flash_attn_interface import _flash_attn_varlen_backward

    same_range = bool(causal) and int(q_pos[0]) == int(k_pos[0])
    q, k, v, d_out, out = (x.contiguous() for x in (q, k, v, d_out, out.to(q.dtype)))
    lse = lse.float().contiguous()
    dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
    cu_q = torch.tensor([0, q.shape[0]], dtype=torch.int32, device=q.device)
    cu_k = torch.tensor([0, k.shape[0]], dtype=torch.int32, device=q.device)
    _flash_attn_varlen_backward(d_out, q, k, v, out, lse, dq, dk, dv, cu_q, cu_k, q.shape[0], k.shape[0], 0.0,
                                scale, same_range, -1, -1, 0.0, None, False, None)
    return dq, dk, dv


def forward_pair(*args):
    """Dispatch on the device of q."""
    return (cuda_forward if args[0].is_cuda else cpu_forward)(*args)


def backward_pair(*args):
    return (cuda_backward if args[0].is_cuda else cpu_backward)(*args)


def merge(out_acc: torch.Tensor, lse_acc: torch.Tensor, rows: slice, out: torch.Tensor, lse: torch.Tensor) -> None:
    """Merge a partial (out, lse) into accumulator rows in place, by log-sum-exp weights.

    Args:
        out_acc: [L, Hq, D]; lse_acc: [Hq, L] (-inf where nothing has been merged yet).
        rows: the accumulator rows the partial covers.
        out, lse: the partial ([l, Hq, D], [Hq, l]).
    """
    old_lse = lse_acc[:, rows]
    lse = lse.to(old_lse.dtype)
    new_lse = torch.logaddexp(old_lse, lse)
    finite = torch.isfinite(new_lse)
    w_old = torch.where(finite, torch.exp(old_lse - new_lse), torch.zeros_like(new_lse)).nan_to_num(0.0)
    w_new = torch.where(finite, torch.exp(lse - new_lse), torch.zeros_like(new_lse)).nan_to_num(0.0)
    out_acc[rows] = (out_acc[rows] * w_old.transpose(0, 1)[..., None].to(out_acc.dtype)
                     + out.to(out_acc.dtype) * w_new.transpose(0, 1)[..., None].to(out_acc.dtype))
    lse_acc[:, rows] = new_lse

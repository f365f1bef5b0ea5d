"""A stand-in for flash-attn 2.8's varlen entry points, written from their documented contract, in plain torch.

It lets CI run the runtime's CUDA call sites on the CPU:

- ``flash_attn_varlen_func(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p=0.0,
  softmax_scale=None, causal=False, window_size=(-1, -1), softcap=0.0, alibi_slopes=None, deterministic=False,
  return_attn_probs=False, block_table=None)``: q [total_q, nheads, d], k and v [total_k, nheads_k, d] packed by
  cu_seqlens (int32); returns out, or (out, softmax_lse [nheads, total_q] in fp32, S_dmask) with
  return_attn_probs. Masks are aligned bottom-right: with window_size (left, right), query i of Lq sees keys
  i + Lk - Lq - left <= j <= i + Lk - Lq + right (-1: unbounded); causal sets right = 0; a row that sees no key gets
  out 0 and lse +inf.
- ``_flash_attn_varlen_backward(dout, q, k, v, out, softmax_lse, dq, dk, dv, cu_seqlens_q, cu_seqlens_k,
  max_seqlen_q, max_seqlen_k, dropout_p, softmax_scale, causal, window_size_left, window_size_right, softcap,
  alibi_slopes, deterministic, rng_state=None, zero_tensors=False)``: writes dq, dk, dv in place from the given out
  and lse (D = rowsum(dout * out)) and returns softmax_d [nheads, total_q].

One deviation, on purpose: flash-attn accepts only fp16 and bf16; the stand-in also accepts fp32 and fp64 (its lse
then has the input's dtype) so that tests can compare at 1e-10. The whole packed batch is computed as one dense,
block-diagonal masked matrix, unlike the runtime's exact kernels, which loop entry by entry.
"""

from __future__ import annotations

import torch


def _check(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p, window, softcap, alibi):
    if not (q.dtype == k.dtype == v.dtype):
        raise RuntimeError("FlashAttention: q, k, v must have the same dtype")
    if q.stride(-1) != 1 or k.stride(-1) != 1 or v.stride(-1) != 1:
        raise RuntimeError("FlashAttention: input tensor must have contiguous last dimension")
    if cu_seqlens_q.dtype != torch.int32 or cu_seqlens_k.dtype != torch.int32:
        raise RuntimeError("FlashAttention: cu_seqlens_q and cu_seqlens_k must have dtype int32")
    if q.dim() != 3 or k.shape != v.shape or k.shape[2] != q.shape[2]:
        raise RuntimeError(f"FlashAttention: expected q [total_q, nheads, d] and k, v [total_k, nheads_k, d], got "
                           f"{tuple(q.shape)}, {tuple(k.shape)}, {tuple(v.shape)}")
    if q.shape[2] % 8 or q.shape[2] > 256:
        raise RuntimeError("FlashAttention forward only supports head dimension at most 256 and a multiple of 8")
    if q.shape[1] % k.shape[1]:
        raise RuntimeError("FlashAttention: number of heads in key/value must divide number of heads in query")
    if int(cu_seqlens_q[-1]) != q.shape[0] or int(cu_seqlens_k[-1]) != k.shape[0]:
        raise RuntimeError("FlashAttention: cu_seqlens must end at the packed lengths")
    if int(torch.diff(cu_seqlens_q).max()) > max_seqlen_q or int(torch.diff(cu_seqlens_k).max()) > max_seqlen_k:
        raise RuntimeError("FlashAttention: max_seqlen smaller than a sequence")
    if len(window) != 2 or any(not isinstance(w, int) or w < -1 for w in window):
        raise RuntimeError(f"FlashAttention: window_size {tuple(window)!r} must be two integers >= -1")
    if dropout_p != 0.0 or softcap != 0.0 or alibi is not None:
        raise NotImplementedError("the stand-in implements dropout 0, no softcap, no alibi")


def _visible(cu_seqlens_q, cu_seqlens_k, causal: bool, device, window=(-1, -1)) -> torch.Tensor:
    """[total_q, total_k]: block-diagonal over entries, bottom-right causal and windowed inside each when asked."""
    cu_q, cu_k = cu_seqlens_q.long().cpu(), cu_seqlens_k.long().cpu()
    total_q, total_k = int(cu_q[-1]), int(cu_k[-1])
    entry_q = torch.repeat_interleave(torch.arange(cu_q.numel() - 1), torch.diff(cu_q))
    entry_k = torch.repeat_interleave(torch.arange(cu_k.numel() - 1), torch.diff(cu_k))
    visible = entry_q[:, None] == entry_k[None, :]
    left, right = window
    right = 0 if causal else right
    pos_q = torch.arange(total_q) - cu_q[entry_q]
    pos_k = torch.arange(total_k) - cu_k[entry_k]
    diagonal = (pos_q + (torch.diff(cu_k) - torch.diff(cu_q))[entry_q])[:, None]  # i + Lk - Lq of each query
    if right >= 0:
        visible &= pos_k[None, :] <= diagonal + right
    if left >= 0:
        visible &= pos_k[None, :] >= diagonal - left
    return visible.to(device)


def _probs(q, k, scale, visible, compute):
    group = q.shape[1] // k.shape[1]
    scores = torch.einsum("qhd,khd->hqk", q.to(compute), k.to(compute).repeat_interleave(group, dim=1)) * scale
    scores = scores.masked_fill(~visible[None], float("-inf"))
    lse = torch.logsumexp(scores, dim=-1)
    probs = torch.exp(scores - lse[..., None]).nan_to_num(0.0)
    return probs, torch.where(torch.isfinite(lse), lse, torch.full_like(lse, float("inf")))


def _compute_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float32 if dtype in (torch.float16, torch.bfloat16) else dtype


def flash_attn_varlen_func(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p=0.0,
                           softmax_scale=None, causal=False, window_size=(-1, -1), softcap=0.0, alibi_slopes=None,
                           deterministic=False, return_attn_probs=False, block_table=None):
    """Forward of packed variable-length attention (see the module docstring for the contract)."""
    _check(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p, window_size, softcap,
           alibi_slopes)
    scale = softmax_scale if softmax_scale is not None else q.shape[-1] ** -0.5
    compute = _compute_dtype(q.dtype)
    probs, lse = _probs(q, k, scale, _visible(cu_seqlens_q, cu_seqlens_k, causal, q.device, tuple(window_size)),
                        compute)
    group = q.shape[1] // k.shape[1]
    out = torch.einsum("hqk,khd->qhd", probs, v.to(compute).repeat_interleave(group, dim=1)).to(q.dtype)
    return (out, lse, None) if return_attn_probs else out


def _flash_attn_varlen_backward(dout, q, k, v, out, softmax_lse, dq, dk, dv, cu_seqlens_q, cu_seqlens_k,
                                max_seqlen_q, max_seqlen_k, dropout_p, softmax_scale, causal, window_size_left,
                                window_size_right, softcap, alibi_slopes, deterministic, rng_state=None,
                                zero_tensors=False):
    """Backward of packed variable-length attention: fills dq, dk, dv in place; returns softmax_d."""
    _check(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p,
           (window_size_left, window_size_right), softcap, alibi_slopes)
    if out.dtype != q.dtype or dout.dtype != q.dtype:
        raise RuntimeError("FlashAttention: out and dout must have the dtype of q")
    compute = _compute_dtype(q.dtype)
    visible = _visible(cu_seqlens_q, cu_seqlens_k, causal, q.device, (window_size_left, window_size_right))
    group = q.shape[1] // k.shape[1]
    qc, kc, vc, doc, oc = (x.to(compute) for x in (q, k, v, dout, out))
    k_rep, v_rep = kc.repeat_interleave(group, dim=1), vc.repeat_interleave(group, dim=1)
    scores = torch.einsum("qhd,khd->hqk", qc, k_rep) * softmax_scale
    probs = torch.exp(scores - softmax_lse.to(compute)[..., None]).masked_fill(~visible[None], 0.0)
    softmax_d = (doc * oc).sum(-1).transpose(0, 1)
    d_probs = torch.einsum("qhd,khd->hqk", doc, v_rep)
    d_scores = probs * (d_probs - softmax_d[..., None])
    total_k, heads_k, dim = k.shape
    dq.copy_(torch.einsum("hqk,khd->qhd", d_scores, k_rep) * softmax_scale)
    dk.copy_((torch.einsum("hqk,qhd->khd", d_scores, qc) * softmax_scale).view(total_k, heads_k, group, dim).sum(2))
    dv.copy_(torch.einsum("hqk,qhd->khd", probs, doc).view(total_k, heads_k, group, dim).sum(2))
    return softmax_d.to(torch.float32)

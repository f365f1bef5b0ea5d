"""Varlen attention kernels behind one contract, and log-sum-exp merging.

The contract is flash-attn 2.8's varlen interface: a batch of entries packed along the token axis, entry i pairing
query rows [cu_q[i], cu_q[i+1]) with key rows [cu_k[i], cu_k[i+1]); masks align bottom-right: with
window_size (left, right), query i sees keys i + Lk - Lq - left <= j <= i + Lk - Lq + right (-1: unbounded), and a
causal entry has right = 0; an entry may have no keys; the forward returns out [Tq, Hq, D] and lse [Hq, Tq] (a
row that sees no key: out 0, lse -inf, where flash-attn's +inf is mapped); the backward, given the
final out and lse of the query rows, returns this call's share of dq, dk, dv (D = rowsum(dO * out) is computed from
the out it is given, so calls over disjoint key sets sum to the full gradient); dk and dv may be the two halves of
one [2, Tk, Hkv, D] tensor, which the runtime then adds in one go.

Backends: :class:`ExactKernels`, an exact implementation in plain torch (any dtype, any device; the CPU path and the
tests); :class:`FlashAttnKernels`, which calls flash-attn's own functions with 2.8's argument order (CUDA, bf16
and fp16) or any module that implements the same contract; and :class:`TorchFlashKernels`, torch's own flash
attention, on CUDA when flash-attn is not installed.
"""

from __future__ import annotations

import torch


def _expand_kv(x: torch.Tensor, group: int) -> torch.Tensor:
    return x if group == 1 else x.repeat_interleave(group, dim=1)


def _entry_scores(q, k, scale: float, causal: bool, window: tuple[int, int] = (-1, -1)):
    group = q.shape[1] // k.shape[1]
    scores = torch.einsum("qhd,khd->hqk", q, _expand_kv(k, group)) * scale
    left, right = window
    right = 0 if causal else right
    if left >= 0 or right >= 0:
        lq, lk = q.shape[0], k.shape[0]
        shift = torch.arange(lk, device=q.device)[None, :] - torch.arange(lq, device=q.device)[:, None] - (lk - lq)
        visible = torch.ones(lq, lk, dtype=torch.bool, device=q.device)
        if right >= 0:
            visible &= shift <= right
        if left >= 0:
            visible &= shift >= -left
        scores = scores.masked_fill(~visible[None], float("-inf"))
    return scores


def _bounds(cu: torch.Tensor) -> list[int]:
    return cu.tolist()


class ExactKernels:
    """The varlen contract in plain torch, entry by entry: exact in fp32 and fp64."""

    name = "exact"

    def forward(self, q, k, v, cu_q, cu_k, max_q: int, max_k: int, scale: float, causal: bool,
                window: tuple[int, int] = (-1, -1)):
        """Returns (out [Tq, Hq, D] in q's dtype, lse [Hq, Tq] in q's dtype, fp32 for half types)."""
        lse_dtype = torch.float32 if q.dtype in (torch.bfloat16, torch.float16) else q.dtype
        out = torch.empty_like(q)
        lse = torch.empty((q.shape[1], q.shape[0]), dtype=lse_dtype, device=q.device)
        bq, bk = _bounds(cu_q), _bounds(cu_k)
        for i in range(len(bq) - 1):
            qs, ks, vs = q[bq[i]:bq[i + 1]], k[bk[i]:bk[i + 1]], v[bk[i]:bk[i + 1]]
            scores = _entry_scores(qs.to(lse_dtype), ks.to(lse_dtype), scale, causal, window)
            entry_lse = torch.logsumexp(scores, dim=-1)
            probs = torch.exp(scores - entry_lse[..., None])
            group = qs.shape[1] // ks.shape[1]
            out[bq[i]:bq[i + 1]] = torch.einsum("hqk,khd->qhd", probs, _expand_kv(vs.to(lse_dtype), group))
            lse[:, bq[i]:bq[i + 1]] = entry_lse
        return out, lse

    def backward(self, d_out, q, k, v, out, lse, cu_q, cu_k, max_q: int, max_k: int, scale: float, causal: bool,
                 window: tuple[int, int] = (-1, -1)):
        """Returns (dq, dk, dv) of this call, in the inputs' dtype."""
        acc = lse.dtype
        dkv = torch.zeros((2, *k.shape), dtype=k.dtype, device=k.device)  # dk, dv as halves: one tensor to add
        dq, dk, dv = torch.zeros_like(q), dkv[0], dkv[1]
        bq, bk = _bounds(cu_q), _bounds(cu_k)
        for i in range(len(bq) - 1):
            rq, rk = slice(bq[i], bq[i + 1]), slice(bk[i], bk[i + 1])
            qs, ks, vs, dos, outs = (x.to(acc) for x in (q[rq], k[rk], v[rk], d_out[rq], out[rq]))
            group = qs.shape[1] // ks.shape[1]
            probs = torch.exp(_entry_scores(qs, ks, scale, causal, window) - lse[:, rq][..., None])
            delta = (dos * outs).sum(-1).transpose(0, 1)
            d_probs = torch.einsum("qhd,khd->hqk", dos, _expand_kv(vs, group))
            d_scores = probs * (d_probs - delta[..., None])
            lk, hkv, dim = ks.shape
            dq[rq] = torch.einsum("hqk,khd->qhd", d_scores, _expand_kv(ks, group)) * scale
            dk[rk] = (torch.einsum("hqk,qhd->khd", d_scores, qs) * scale).view(lk, hkv, group, dim).sum(2)
            dv[rk] = torch.einsum("hqk,qhd->khd", probs, dos).view(lk, hkv, group, dim).sum(2)
        return dq, dk, dv


class FlashAttnKernels:
    """flash-attn's varlen forward and backward, called as flash-attn 2.8 defines them.

    Args:
        varlen_func: flash_attn.flash_attn_varlen_func (or a stand-in with its contract).
        varlen_backward: flash_attn.flash_attn_interface._flash_attn_varlen_backward (writes dq, dk, dv in place).
    """

    name = "flash"

    def __init__(self, varlen_func, varlen_backward):
        check_parameters(varlen_backward, FLASH_BACKWARD_PARAMETERS, "flash-attn's _flash_attn_varlen_backward")
        self.varlen_func, self.varlen_backward = varlen_func, varlen_backward

    @classmethod
    def installed(cls) -> "FlashAttnKernels":  # pragma: no cover - needs flash-attn
        """The installed flash-attn package's kernels (2.8 or later, its backward's arguments checked).

        Raises:
            ImportError: flash-attn is not installed.
            RuntimeError: it is older than 2.8, or its backward takes other arguments.
        """
        import flash_attn
        from flash_attn import flash_attn_varlen_func
        from flash_attn.flash_attn_interface import _flash_attn_varlen_backward

        version = tuple(int(part) for part in flash_attn.__version__.split(".")[:2])
        if version < FLASH_MIN_VERSION:
            raise RuntimeError(f"flash-attn {flash_attn.__version__} is older than the "
                               f"{'.'.join(map(str, FLASH_MIN_VERSION))} the runtime calls; upgrade it or "
                               f"uninstall it to use torch's own flash attention")
        return cls(flash_attn_varlen_func, _flash_attn_varlen_backward)

    def forward(self, q, k, v, cu_q, cu_k, max_q: int, max_k: int, scale: float, causal: bool,
                window: tuple[int, int] = (-1, -1)):
        out, lse, _ = self.varlen_func(q, k, v, cu_q, cu_k, max_q, max_k, dropout_p=0.0, softmax_scale=scale,
                                       causal=causal, window_size=window, return_attn_probs=True)
        # flash-attn gives a row that sees no key out 0 and lse +inf; the contract (and the merge) says -inf.
        return out, lse.masked_fill_(torch.isposinf(lse), float("-inf"))

    def backward(self, d_out, q, k, v, out, lse, cu_q, cu_k, max_q: int, max_k: int, scale: float, causal: bool,
                 window: tuple[int, int] = (-1, -1)):
        dkv = torch.empty((2, *k.shape), dtype=k.dtype, device=k.device)  # dk, dv as halves: one tensor to add
        dq, dk, dv = torch.empty_like(q), dkv[0], dkv[1]
        # (dout, q, k, v, out, softmax_lse, dq, dk, dv, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
        #  dropout_p, softmax_scale, causal, window_size_left, window_size_right, softcap, alibi_slopes,
        #  deterministic, rng_state)
        self.varlen_backward(d_out.contiguous(), q, k, v, out.to(q.dtype).contiguous(), lse.contiguous(), dq, dk, dv,
                             cu_q, cu_k, max_q, max_k, 0.0, scale, causal, window[0], window[1], 0.0, None, False,
                             None)
        return dq, dk, dv


class TorchFlashKernels:
    """torch's own varlen flash attention (aten::_flash_attention_forward / _backward): the CUDA path when flash-attn
    is not installed. Their schemas are checked when this is made, so a torch that changed them fails at once,
    naming the argument, instead of misreading one."""

    name = "torch-flash"

    def __init__(self):
        check_schema(torch.ops.aten._flash_attention_forward.default, TORCH_FLASH_FORWARD_ARGUMENTS)
        check_schema(torch.ops.aten._flash_attention_backward.default, TORCH_FLASH_BACKWARD_ARGUMENTS)

    def forward(self, q, k, v, cu_q, cu_k, max_q: int, max_k: int, scale: float, causal: bool,
                window: tuple[int, int] = (-1, -1)):  # pragma: no cover - needs a GPU
        out, lse, *_ = torch.ops.aten._flash_attention_forward(
            q, k, v, cu_q, cu_k, max_q, max_k, 0.0, causal, False, scale=scale, window_size_left=window[0],
            window_size_right=0 if causal else window[1])
        return out, lse.masked_fill_(torch.isposinf(lse), float("-inf"))

    def backward(self, d_out, q, k, v, out, lse, cu_q, cu_k, max_q: int, max_k: int, scale: float, causal: bool,
                 window: tuple[int, int] = (-1, -1)):  # pragma: no cover - needs a GPU
        # rng_state and unused matter only with dropout, which is 0.
        unused = torch.empty(0, dtype=torch.int64, device=q.device)
        dq, dk, dv = torch.ops.aten._flash_attention_backward(
            d_out.contiguous(), q, k, v, out.to(q.dtype).contiguous(), lse.contiguous(), cu_q, cu_k, max_q, max_k,
            0.0, causal, unused, unused, scale=scale, window_size_left=window[0],
            window_size_right=0 if causal else window[1])
        return dq, dk, dv


FLASH_MIN_VERSION = (2, 8)
# flash-attn 2.8's _flash_attn_varlen_backward, positionally as FlashAttnKernels.backward calls it.
FLASH_BACKWARD_PARAMETERS = ("dout", "q", "k", "v", "out", "softmax_lse", "dq", "dk", "dv", "cu_seqlens_q",
                             "cu_seqlens_k", "max_seqlen_q", "max_seqlen_k", "dropout_p", "softmax_scale", "causal",
                             "window_size_left", "window_size_right", "softcap", "alibi_slopes", "deterministic",
                             "rng_state")
# torch's schemas: the positional arguments in order, then the keywords TorchFlashKernels passes.
TORCH_FLASH_FORWARD_ARGUMENTS = (("query", "key", "value", "cum_seq_q", "cum_seq_k", "max_q", "max_k", "dropout_p",
                                  "is_causal", "return_debug_mask"),
                                 ("scale", "window_size_left", "window_size_right"))
TORCH_FLASH_BACKWARD_ARGUMENTS = (("grad_out", "query", "key", "value", "out", "logsumexp", "cum_seq_q", "cum_seq_k",
                                   "max_q", "max_k", "dropout_p", "is_causal", "rng_state", "unused"),
                                  ("scale", "window_size_left", "window_size_right"))


def check_parameters(function, expected: tuple[str, ...], what: str) -> None:
    """Fail unless `function` takes at least the parameters `expected`, first and in this order.

    Raises:
        RuntimeError: naming the first parameter that differs.
    """
    import inspect

    try:
        names = tuple(inspect.signature(function).parameters)
    except (TypeError, ValueError):  # a builtin without a signature: nothing to check against
        return
    for position, (got, want) in enumerate(zip(names + ("<missing>",) * len(expected), expected)):
        if got != want:
            raise RuntimeError(f"{what} takes {got!r} as argument {position}, where the runtime passes {want!r}; "
                               f"it needs flash-attn >= {'.'.join(map(str, FLASH_MIN_VERSION))}'s argument order")


def check_schema(operator, expected: tuple[tuple[str, ...], tuple[str, ...]]) -> None:
    """Fail unless a torch operator's schema has the positional arguments expected[0], in order, and the keyword
    arguments expected[1].

    Raises:
        RuntimeError: naming the operator and the argument that differs.
    """
    arguments = operator._schema.arguments
    positional = tuple(a.name for a in arguments if not a.kwarg_only)
    keywords = {a.name for a in arguments if a.kwarg_only}
    positions, names = expected
    if positional[:len(positions)] != positions:
        raise RuntimeError(f"{operator._schema.name} takes positional arguments {positional}, the runtime passes "
                           f"{positions}")
    missing = [name for name in names if name not in keywords]
    if missing:
        raise RuntimeError(f"{operator._schema.name} has no keyword argument {missing[0]!r}")


def default_kernels(device: torch.device):
    """The kernels for a device: on CUDA, flash-attn when it is installed, else torch's own flash attention (never
    the exact kernels, whose dense score matrices a CUDA batch would not fit); the exact kernels elsewhere.

    Raises:
        RuntimeError: on CUDA, an installed flash-attn older than 2.8 or with another backward, or a torch whose
            flash attention schemas differ from what the runtime passes.
    """
    if device.type == "cuda":
        try:
            return FlashAttnKernels.installed()
        except ImportError:
            return TorchFlashKernels()
    return ExactKernels()


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

"""Varlen attention kernels behind one contract (their partial outputs merge by :mod:`fcp_runtime.merge`).

The contract is flash-attn 2.8's varlen interface: a batch of entries packed along the token axis, entry i pairing
query rows [cu_q[i], cu_q[i+1]) with key rows [cu_k[i], cu_k[i+1]); masks align bottom-right: with
window_size (left, right), query i sees keys i + Lk - Lq - left <= j <= i + Lk - Lq + right (-1: unbounded), and a
causal entry has right = 0; an entry may have no keys; the forward returns out [Tq, Hq, D] and lse [Hq, Tq] (a
row that sees no key: out 0, lse -inf, where flash-attn's +inf is mapped); the backward, given the
final out and lse of the query rows, returns this call's share of dq, dk, dv (D = rowsum(dO * out) is computed from
the out it is given, so calls over disjoint key sets sum to the full gradient); dk and dv may be the two halves of
one [2, Tk, Hkv, D] tensor, which the runtime then adds in one go.

Backends: :class:`ExactKernels`, an exact implementation in plain torch (any dtype, any device; the tests of the
packing path); :class:`FlashAttnKernels`, which calls flash-attn's own functions with 2.8's argument order (CUDA, bf16
and fp16) or any module that implements the same contract; and :class:`TorchFlashKernels`, torch's own flash
attention, on CUDA when flash-attn is not installed.

A second contract, of ranges (:class:`ExactRangeKernels` states it), reads keys in place and accumulates in the
kernel; kernels that take it say so with ``ranges = True``, and the runtime then receives pulls into arenas and runs
range calls (:mod:`fcp_compiler.format.arena`). Backends: :class:`ExactRangeKernels` (plain torch; the CPU default)
and :class:`FlexFlashAttnKernels` (MagiAttention's FFA, Hopper). :func:`default_kernels` picks one.
"""

from __future__ import annotations

import torch

from fcp_runtime.merge import merge_into


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


def _entry_attention(qs, ks, vs, scale: float, causal: bool, window: tuple[int, int]):
    """One entry's (out [q, Hq, D], lse [Hq, q]) in the inputs' dtype; a row that sees no key gets out 0, lse -inf."""
    scores = _entry_scores(qs, ks, scale, causal, window)
    lse = torch.logsumexp(scores, dim=-1)
    probs = torch.exp(scores - lse[..., None]).nan_to_num_(0.0)
    return torch.einsum("hqk,khd->qhd", probs, _expand_kv(vs, qs.shape[1] // ks.shape[1])), lse


def _entry_gradients(dos, qs, ks, vs, outs, lse, scale: float, causal: bool, window: tuple[int, int]):
    """One entry's share of (dq, dk, dv), given the final out and lse of its query rows (D = rowsum(dO * out));
    a row that sees no key anywhere (lse -inf) gets no gradient, as in flash-attn."""
    group = qs.shape[1] // ks.shape[1]
    probs = torch.exp(_entry_scores(qs, ks, scale, causal, window) - lse[..., None]).nan_to_num_(0.0)
    delta = (dos * outs).sum(-1).transpose(0, 1)
    d_scores = probs * (torch.einsum("qhd,khd->hqk", dos, _expand_kv(vs, group)) - delta[..., None])
    lk, hkv, dim = ks.shape
    dq = torch.einsum("hqk,khd->qhd", d_scores, _expand_kv(ks, group)) * scale
    dk = (torch.einsum("hqk,qhd->khd", d_scores, qs) * scale).view(lk, hkv, group, dim).sum(2)
    dv = torch.einsum("hqk,qhd->khd", probs, dos).view(lk, hkv, group, dim).sum(2)
    return dq, dk, dv


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
            qs, ks, vs = (x.to(lse_dtype) for x in (q[bq[i]:bq[i + 1]], k[bk[i]:bk[i + 1]], v[bk[i]:bk[i + 1]]))
            out[bq[i]:bq[i + 1]], lse[:, bq[i]:bq[i + 1]] = _entry_attention(qs, ks, vs, scale, causal, window)
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
            dq[rq], dk[rk], dv[rk] = _entry_gradients(dos, qs, ks, vs, outs, lse[:, rq], scale, causal, window)
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


class ExactRangeKernels:
    """The range contract in plain torch, range by range, every range read and accumulated in place: exact in fp32
    and fp64. The CPU path, and the reference every other range backend is tested against.

    The range contract (FFA's, MagiAttention's flex_flash_attn): q [Tq, Hq, D], k and v [Tk, Hkv, D]; range i
    pairs query rows q_ranges[i] = (start, end) with key rows k_ranges[i], masked by masks[i] = (left, right) as
    flash-attn's window, bottom-right aligned within the pair ((-1, -1): full; (-1, 0): causal). Ranges may overlap,
    in queries and in keys. The forward merges every range's result into the accumulators out [Tq, Hq, D] and lse
    [Hq, Tq] by log-sum-exp weights (rows no range touches keep theirs); the backward, given the final out and lse,
    adds each range's share into dq, dk, dv (overlapping key ranges summed). All index tensors are int32 [n, 2].
    """

    name = "exact-ranges"
    ranges = True

    def forward(self, q, k, v, q_ranges, k_ranges, masks, max_q: int, max_k: int, scale: float, out, lse) -> None:
        """Merge each range's attention into out and lse (in place)."""
        acc = lse.dtype
        for (q0, q1), (k0, k1), window in zip(q_ranges.tolist(), k_ranges.tolist(), masks.tolist()):
            qs, ks, vs = q[q0:q1].to(acc), k[k0:k1].to(acc), v[k0:k1].to(acc)
            merge_into(out[q0:q1], lse[:, q0:q1], *_entry_attention(qs, ks, vs, scale, False, tuple(window)))

    def backward(self, d_out, q, k, v, out, lse, q_ranges, k_ranges, masks, max_q: int, max_k: int, scale: float,
                 dq, dk, dv) -> None:
        """Add each range's dq, dk, dv into the accumulators (in place)."""
        acc = dq.dtype
        for (q0, q1), (k0, k1), window in zip(q_ranges.tolist(), k_ranges.tolist(), masks.tolist()):
            qs, ks, vs, dos, outs = (x.to(acc) for x in (q[q0:q1], k[k0:k1], v[k0:k1], d_out[q0:q1], out[q0:q1]))
            dq_part, dk_part, dv_part = _entry_gradients(dos, qs, ks, vs, outs, lse[:, q0:q1].to(acc), scale, False,
                                                         tuple(window))
            dq[q0:q1] += dq_part
            dk[k0:k1] += dk_part
            dv[k0:k1] += dv_part


class FlexFlashAttnKernels:
    """MagiAttention's flex-flash-attention (FFA) behind the range contract: its forward accumulates into the out and
    lse it is given, its backward into dq, dk, dv, with atomic sums over overlapping ranges (Hopper only). Masks are
    FFA's attention types: full (0) and bottom-right causal (1); a sliding window has no type, so plans with
    windows need another backend. Read from FFA's source (its _flex_flash_attn_forward / _backward); not yet run on
    a GPU.

    Args:
        forward_func, backward_func: magi_attention.functional.flex_flash_attn's _flex_flash_attn_forward and
            _flex_flash_attn_backward (or stand-ins with their contract), checked by their parameters' names.
    """

    name = "ffa"
    ranges = True

    def __init__(self, forward_func, backward_func):
        check_parameters(forward_func, FFA_FORWARD_PARAMETERS, "FFA's _flex_flash_attn_forward",
                         "MagiAttention's FFA")
        check_parameters(backward_func, FFA_BACKWARD_PARAMETERS, "FFA's _flex_flash_attn_backward",
                         "MagiAttention's FFA")
        self.forward_func, self.backward_func = forward_func, backward_func

    @classmethod
    def installed(cls) -> "FlexFlashAttnKernels":  # pragma: no cover - needs magi_attention
        """The installed MagiAttention's FFA kernels.

        Raises:
            ImportError: magi_attention is not installed.
            RuntimeError: its functions take other arguments.
        """
        from magi_attention.functional.flex_flash_attn import _flex_flash_attn_backward, _flex_flash_attn_forward

        return cls(_flex_flash_attn_forward, _flex_flash_attn_backward)

    takes_windows = False  # FFA has attention types full and causal only; the executor refuses a windowed plan

    @staticmethod
    def attention_types(masks: torch.Tensor) -> torch.Tensor:
        """FFA's attn_type_map of the masks: 0 full, 1 causal. The masks hold no sliding window: the executor
        refuses a plan with windows for this backend before any call (on the host, from the plan), so nothing here
        reads the device tensor back."""
        return (masks[:, 1] == 0).to(torch.int32)

    def forward(self, q, k, v, q_ranges, k_ranges, masks, max_q: int, max_k: int, scale: float, out,
                lse) -> None:  # pragma: no cover - needs a GPU
        # (q, k, v, out, lse, q_ranges, k_ranges, max_seqlen_q, max_seqlen_k, attn_type_map, merge_q_ranges, qk_map,
        #  fwd_unique_count, softmax_scale, softcap, disable_fwd_atomic_reduction, out_type, deterministic, sm_margin)
        self.forward_func(q, k, v, out, lse, q_ranges, k_ranges, max_q, max_k, self.attention_types(masks), None,
                          None, None, scale, 0.0, False, out.dtype, False, 0)

    def backward(self, d_out, q, k, v, out, lse, q_ranges, k_ranges, masks, max_q: int, max_k: int, scale: float,
                 dq, dk, dv) -> None:  # pragma: no cover - needs a GPU
        self.backward_func(d_out, q, k, v, out.to(q.dtype), dq, dk, dv, lse, q_ranges, k_ranges, max_q, max_k,
                           self.attention_types(masks), None, None, None, scale, 0.0, False, dq.dtype, dk.dtype,
                           dv.dtype, False, 0)


FLASH_MIN_VERSION = (2, 8)
# flash-attn 2.8's _flash_attn_varlen_backward, positionally as FlashAttnKernels.backward calls it.
FLASH_BACKWARD_PARAMETERS = ("dout", "q", "k", "v", "out", "softmax_lse", "dq", "dk", "dv", "cu_seqlens_q",
                             "cu_seqlens_k", "max_seqlen_q", "max_seqlen_k", "dropout_p", "softmax_scale", "causal",
                             "window_size_left", "window_size_right", "softcap", "alibi_slopes", "deterministic",
                             "rng_state")
# MagiAttention's FFA functions, positionally as FlexFlashAttnKernels calls them.
FFA_FORWARD_PARAMETERS = ("q", "k", "v", "out", "lse", "q_ranges", "k_ranges", "max_seqlen_q", "max_seqlen_k",
                          "attn_type_map", "merge_q_ranges", "qk_map", "fwd_unique_count", "softmax_scale", "softcap",
                          "disable_fwd_atomic_reduction", "out_type", "deterministic", "sm_margin")
FFA_BACKWARD_PARAMETERS = ("dout", "q", "k", "v", "out", "dq", "dk", "dv", "softmax_lse", "q_ranges", "k_ranges",
                           "max_seqlen_q", "max_seqlen_k", "attn_type_map", "merge_k_ranges", "bwd_kq_map",
                           "bwd_unique_count", "softmax_scale", "softcap", "disable_bwd_dkv_atomic_reduction",
                           "dq_type", "dk_type", "dv_type", "deterministic", "sm_margin")
# torch's schemas: the positional arguments in order, then the keywords TorchFlashKernels passes.
TORCH_FLASH_FORWARD_ARGUMENTS = (("query", "key", "value", "cum_seq_q", "cum_seq_k", "max_q", "max_k", "dropout_p",
                                  "is_causal", "return_debug_mask"),
                                 ("scale", "window_size_left", "window_size_right"))
TORCH_FLASH_BACKWARD_ARGUMENTS = (("grad_out", "query", "key", "value", "out", "logsumexp", "cum_seq_q", "cum_seq_k",
                                   "max_q", "max_k", "dropout_p", "is_causal", "rng_state", "unused"),
                                  ("scale", "window_size_left", "window_size_right"))


def check_parameters(function, expected: tuple[str, ...], what: str, needs: str | None = None) -> None:
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
                               f"it needs {needs or 'flash-attn >= ' + '.'.join(map(str, FLASH_MIN_VERSION))}'s "
                               f"argument order")


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


def default_takes_ranges(device: torch.device, windows: bool = False) -> bool:
    """Whether :func:`default_kernels` gives a range kernel for this device and plan, without making it (a
    DataLoader worker builds the matching calls): on CPU always, on CUDA where MagiAttention is installed and the
    plan has no sliding window."""
    if device.type != "cuda":
        return True
    if windows:
        return False
    import importlib.util

    return importlib.util.find_spec("magi_attention") is not None


def default_kernels(device: torch.device, windows: bool = False):
    """The kernels for a device, in order of preference: on CUDA, MagiAttention's FFA when it is installed and the
    plan has no sliding window (a range kernel: keys read in place), else flash-attn, else torch's own flash
    attention (never the exact kernels, whose dense score matrices a CUDA batch would not fit); elsewhere the exact
    range kernels.

    Args:
        device: where the tensors are.
        windows: whether the plan has sliding windows.
    Raises:
        RuntimeError: on CUDA, an installed FFA or flash-attn whose functions take other arguments (or flash-attn
            older than 2.8), or a torch whose flash attention schemas differ from what the runtime passes.
    """
    if device.type == "cuda":
        if not windows:
            try:
                return FlexFlashAttnKernels.installed()
            except ImportError:
                pass
        try:
            return FlashAttnKernels.installed()
        except ImportError:
            return TorchFlashKernels()
    return ExactRangeKernels()

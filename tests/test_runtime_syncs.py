"""No host syncs in the stage loop: every GPU kernel backend replays a rank's forward and backward on the meta device,
where any data-dependent host read (.item(), .tolist(), bool() of a tensor, a copy back to the host) fails, and a
dispatch mode names the op that did it.

The backends: torch's own flash attention (its real aten ops, which have meta kernels), flash-attn and
MagiAttention's FFA through stand-ins with their parameter names (FlashAttnKernels and FlexFlashAttnKernels check
them), each writing outputs of the real shapes. The exact kernels are the CPU reference and read their ranges on the
host by design; they are not a GPU backend.
"""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from torch.utils._python_dispatch import TorchDispatchMode  # noqa: E402

import fcp_runtime.checks as checks  # noqa: E402
import fcp_runtime.executor as executor  # noqa: E402
from conftest import compile_valid  # noqa: E402
from fcp_runtime.kernels import FlashAttnKernels, FlexFlashAttnKernels, TorchFlashKernels  # noqa: E402
from meta_harness import HeldMessages, meta_replay  # noqa: E402

_HOST_READS = {"_local_scalar_dense", "item", "is_nonzero", "equal"}


class _HostReads(TorchDispatchMode):
    """Records every op that reads device data back to the host: a scalar read, or a device tensor copied into a
    host one."""

    def __init__(self):
        super().__init__()
        self.reads: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.overloadpacket.__name__
        tensors = [a for a in list(args) + list((kwargs or {}).values()) if isinstance(a, torch.Tensor)]
        if name in _HOST_READS and any(t.is_meta for t in tensors):
            self.reads.append(name)
        out = func(*args, **(kwargs or {}))
        outputs = out if isinstance(out, (tuple, list)) else [out]
        if any(t.is_meta for t in tensors) and any(isinstance(t, torch.Tensor) and t.device.type == "cpu"
                                                   for t in outputs):
            self.reads.append(f"{name} (device to host)")
        return out


# --- stand-ins with the real functions' parameter names, writing outputs of the real shapes -----------------------


def flash_attn_varlen_func(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p=0.0,
                           softmax_scale=None, causal=False, window_size=(-1, -1), softcap=0.0, alibi_slopes=None,
                           deterministic=False, return_attn_probs=False, block_table=None):
    lse = torch.empty((q.shape[1], q.shape[0]), dtype=torch.float32, device=q.device)
    return torch.empty_like(q), lse, None


def _flash_attn_varlen_backward(dout, q, k, v, out, softmax_lse, dq, dk, dv, cu_seqlens_q, cu_seqlens_k,
                                max_seqlen_q, max_seqlen_k, dropout_p, softmax_scale, causal, window_size_left,
                                window_size_right, softcap, alibi_slopes, deterministic, rng_state=None):
    return torch.empty_like(softmax_lse)


def _flex_flash_attn_forward(q, k, v, out, lse, q_ranges, k_ranges, max_seqlen_q, max_seqlen_k, attn_type_map,
                             merge_q_ranges, qk_map, fwd_unique_count, softmax_scale, softcap,
                             disable_fwd_atomic_reduction, out_type, deterministic, sm_margin):
    assert attn_type_map.shape[0] == q_ranges.shape[0] and attn_type_map.dtype == torch.int32
    return out, lse


def _flex_flash_attn_backward(dout, q, k, v, out, dq, dk, dv, softmax_lse, q_ranges, k_ranges, max_seqlen_q,
                              max_seqlen_k, attn_type_map, merge_k_ranges, bwd_kq_map, bwd_unique_count,
                              softmax_scale, softcap, disable_bwd_dkv_atomic_reduction, dq_type, dk_type, dv_type,
                              deterministic, sm_margin):
    return dq, dk, dv


BACKENDS = {
    "torch-flash": TorchFlashKernels,
    "flash-attn": lambda: FlashAttnKernels(flash_attn_varlen_func, _flash_attn_varlen_backward),
    "ffa": lambda: FlexFlashAttnKernels(_flex_flash_attn_forward, _flex_flash_attn_backward),
}


@pytest.fixture(scope="module")
def plans():
    """A plan whose ranks pull K,V and Q blocks (an offloaded tile pushes partial outputs back), and one with
    sliding windows (for the backends that have them)."""
    lengths = [9000, 3000, 2100, 400, 1500, 700, 5200]
    causal = compile_valid(lengths, 4, block_size=256, coalesce=2, model="none")
    windowed = compile_valid(lengths, 4, block_size=256, coalesce=2, model="none", mask="sliding_window:300")
    return {"causal": causal.to_bytes(), "windows": windowed.to_bytes()}


@pytest.mark.parametrize("backend", sorted(BACKENDS))
@pytest.mark.parametrize("mask", ["causal", "windows"])
def test_the_stage_loops_read_nothing_back_from_the_device(monkeypatch, plans, backend, mask):
    if backend == "ffa" and mask == "windows":
        pytest.skip("FFA has no sliding window: the executor refuses such a plan (tested below)")
    monkeypatch.setattr(executor, "dist", HeldMessages(executor.dist))  # where the stage loop posts
    monkeypatch.setattr(checks, "check_plan", lambda plan, group=None: None)  # where check_call looks
    kernels = BACKENDS[backend]()
    for rank in range(4):
        modes = meta_replay(plans[mask], rank, kernels, _HostReads)
        assert modes["fwd"].reads == [] and modes["bwd"].reads == [], (rank, modes["fwd"].reads, modes["bwd"].reads)


def test_the_audit_catches_a_host_read(monkeypatch, plans):
    """The audit's own check: a kernel that reads a device value back is caught."""

    class Reading(TorchFlashKernels):
        def forward(self, q, k, v, cu_q, *args, **kwargs):
            _ = bool(cu_q.sum())
            return super().forward(q, k, v, cu_q, *args, **kwargs)

    monkeypatch.setattr(executor, "dist", HeldMessages(executor.dist))  # where the stage loop posts
    monkeypatch.setattr(checks, "check_plan", lambda plan, group=None: None)  # where check_call looks
    with pytest.raises(RuntimeError, match="cannot be called on meta tensors"):
        meta_replay(plans["causal"], 0, Reading(), _HostReads)


def test_ffa_refuses_a_plan_with_windows_before_any_message(monkeypatch, plans):
    monkeypatch.setattr(checks, "check_plan", lambda plan, group=None: None)  # where check_call looks
    with pytest.raises(ValueError, match="the ffa kernels have no sliding window"):
        meta_replay(plans["windows"], 0, BACKENDS["ffa"](), _HostReads)

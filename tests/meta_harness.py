"""The runtime on the meta device, shared by test modules: a rank's forward and backward replayed on meta tensors
(meta_replay) with the kernels and messages stubbed (MetaKernels, MetaRangeKernels, HeldMessages), and a dispatch
mode that records the peak of the tensors ops create (Peak)."""

from __future__ import annotations

import hashlib
import weakref

import pytest

torch = pytest.importorskip("torch")

from torch.utils._python_dispatch import TorchDispatchMode  # noqa: E402

import fcp_runtime.attention as attention  # noqa: E402
from fcp_compiler.format.validate_kinds import validate_kinds  # noqa: E402
from fcp_runtime.plan import load_rank_plan  # noqa: E402


class Peak(TorchDispatchMode):
    """Live bytes of the meta tensors ops create (not views, not inputs an op returns), and their peak."""

    def __init__(self):
        super().__init__()
        self.live = self.peak = 0

    def _freed(self, nbytes: int) -> None:
        self.live -= nbytes

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if func.is_view:
            return out
        inputs = [a for a in list(args) + list((kwargs or {}).values()) if isinstance(a, torch.Tensor)]
        outputs = out if isinstance(out, (tuple, list)) else [out]
        for tensor in outputs:
            if isinstance(tensor, torch.Tensor) and tensor.is_meta and not any(tensor is i for i in inputs):
                self.live += tensor.nbytes
                self.peak = max(self.peak, self.live)
                weakref.finalize(tensor, self._freed, tensor.nbytes)
        return out


class MetaKernels:
    """The varlen contract's outputs on the meta device, laid out as flash-attn's (dK, dV halves of one tensor)."""

    def forward(self, q, k, v, *args, **kwargs):
        return torch.empty_like(q), torch.empty((q.shape[1], q.shape[0]), dtype=torch.float32, device=q.device)

    def backward(self, d_out, q, k, v, *args, **kwargs):
        dkv = torch.empty((2, *k.shape), dtype=k.dtype, device=k.device)
        return torch.empty_like(q), dkv[0], dkv[1]


class MetaRangeKernels:
    """The range contract on the meta device: it writes into the accumulators it is given, and creates nothing."""

    ranges = True

    def forward(self, *args, **kwargs):
        return None

    def backward(self, *args, **kwargs):
        return None


class Work:
    def __init__(self, tensors):
        self.tensors = tensors  # as a backend's work holds what it moves, until it is dropped

    def wait(self):
        return True


class HeldMessages:
    """torch.distributed with point-to-point messages that move nothing but hold their tensors until dropped."""

    def __init__(self, real):
        self.real = real

    def __getattr__(self, name):
        return getattr(self.real, name)

    P2POp = staticmethod(lambda operation, tensor, *args, **kwargs: tensor)
    batch_isend_irecv = staticmethod(lambda ops: [Work(ops)])
    get_global_rank = staticmethod(lambda group, rank: rank)


_VALIDATED: set[bytes] = set()  # the sha256 of each plan meta_replay has validated in this process


def meta_replay(plan_bytes: bytes, rank: int, kernels, mode) -> dict:
    """One rank's forward and backward on meta tensors (bf16, plan layout), each pass under a fresh `mode()`. The
    plan is validated once a process (callers replay every rank of one plan), not once a rank."""
    digest = hashlib.sha256(plan_bytes).digest()
    if digest not in _VALIDATED:
        validate_kinds(plan_bytes)
        _VALIDATED.add(digest)
    plan = load_rank_plan(plan_bytes, rank, validate=False)
    meta = torch.device("meta")
    q = torch.empty((plan.plan_tokens, plan.q_heads, plan.head_dim), dtype=torch.bfloat16, device=meta,
                    requires_grad=True)
    k = torch.empty((plan.plan_tokens, plan.kv_heads, plan.head_dim), dtype=torch.bfloat16, device=meta,
                    requires_grad=True)
    v = torch.empty_like(k, requires_grad=True)
    grad = torch.empty_like(q)
    with mode() as forward:
        out = attention.fcp_attn_func(q, k, v, plan, layout="plan", kernels=kernels)
    with mode() as backward:
        out.backward(grad)
    return {"fwd": forward, "bwd": backward}

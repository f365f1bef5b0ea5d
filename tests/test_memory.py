"""The memory account (fcp_compiler/format/memory.py) is the peak of what the runtime creates: a meta-device replay
of every rank's forward and backward records each tensor an op creates until Python frees it."""

from __future__ import annotations

import weakref

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from torch.utils._python_dispatch import TorchDispatchMode  # noqa: E402

import fcp_runtime.attention as attention  # noqa: E402
import fcp_runtime.checks as checks  # noqa: E402
import fcp_runtime.executor as executor  # noqa: E402
from conftest import compile_valid  # noqa: E402
from fcp_compiler.format.liveness import stacked_messages  # noqa: E402
from fcp_compiler.format.memory import rank_peak_bytes  # noqa: E402
from fcp_compiler.format.stacked import stack_programs  # noqa: E402
from fcp_compiler.format.plan_format import PlanReader  # noqa: E402
from fcp_runtime.plan import load_rank_plan  # noqa: E402


class _Peak(TorchDispatchMode):
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


class _MetaKernels:
    """The varlen contract's outputs on the meta device, laid out as flash-attn's (dK, dV halves of one tensor)."""

    def forward(self, q, k, v, *args, **kwargs):
        return torch.empty_like(q), torch.empty((q.shape[1], q.shape[0]), dtype=torch.float32, device=q.device)

    def backward(self, d_out, q, k, v, *args, **kwargs):
        dkv = torch.empty((2, *k.shape), dtype=k.dtype, device=k.device)
        return torch.empty_like(q), dkv[0], dkv[1]


class _Work:
    def __init__(self, tensors):
        self.tensors = tensors  # as a backend's work holds what it moves, until it is dropped

    def wait(self):
        return True


class _HeldMessages:
    """torch.distributed with point-to-point messages that move nothing but hold their tensors until dropped."""

    def __init__(self, real):
        self.real = real

    def __getattr__(self, name):
        return getattr(self.real, name)

    P2POp = staticmethod(lambda operation, tensor, *args, **kwargs: tensor)
    batch_isend_irecv = staticmethod(lambda ops: [_Work(ops)])
    get_global_rank = staticmethod(lambda group, rank: rank)


def meta_replay(plan_bytes: bytes, rank: int, kernels, mode) -> dict:
    """One rank's forward and backward on meta tensors (bf16, plan layout), each pass under a fresh `mode()`."""
    plan = load_rank_plan(plan_bytes, rank)
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


def _replay_peaks(plan_bytes: bytes, rank: int) -> dict[str, int]:
    return {name: mode.peak for name, mode in meta_replay(plan_bytes, rank, _MetaKernels(), _Peak).items()}


@pytest.mark.parametrize("fan_out", [False, True])
def test_the_account_is_the_peak_a_replay_of_the_runtime_records(monkeypatch, fan_out):
    monkeypatch.setattr(executor, "dist", _HeldMessages(executor.dist))  # where the stage loop posts
    monkeypatch.setattr(checks, "check_plan", lambda plan, group=None: None)  # where check_call looks
    plan = compile_valid([9000, 3000, 2100, 400, 1500, 700, 5200], 8, block_size=256, coalesce=2, gpus_per_node=4,
                         node_fan_out=fan_out)
    data = plan.to_bytes()
    reader = PlanReader(data)
    for rank in range(8):
        account = rank_peak_bytes(reader.rank(rank), layout="plan", dtype="bf16")
        replay = _replay_peaks(data, rank)
        for name in ("fwd", "bwd"):
            # The account leaves out only the merges' [heads, rows] temporaries beside a call's largest buffers.
            assert replay[name] * 0.99 <= account[name] <= replay[name] * 1.01, (rank, name, account, replay)


def test_received_buffers_live_from_their_post_to_their_last_use():
    plan = compile_valid([9000, 3000, 2100, 400, 1500], 4, block_size=256, coalesce=2)
    reader = PlanReader(plan.to_bytes())
    for rank in range(4):
        program = reader.rank(rank)
        runtime = load_rank_plan(plan.to_bytes(), rank)
        for name, executed in (("fwd", runtime.forward), ("bwd", runtime.backward)):
            messages = stacked_messages(stack_programs([program]), name)
            freed = np.full(messages.pull_recv_stage.size, -1)
            for stage, rows in enumerate(executed.free_after):
                freed[rows] = stage
            assert np.array_equal(freed, messages.pull_recv_last)
            assert (messages.pull_recv_last >= messages.pull_recv_stage).all()


def test_a_sent_pull_is_copied_exactly_when_its_rows_are_not_one_run_of_its_store():
    from fcp_compiler.format.memory import _send_copies

    plan = compile_valid([9000, 3000, 2100, 400, 1500, 700, 5200], 8, block_size=256, coalesce=2, gpus_per_node=4,
                         node_fan_out=True)
    reader = PlanReader(plan.to_bytes())
    seg_len = (reader.tables.seg_end - reader.tables.seg_start).astype(np.int64)
    checked = 0
    for rank in range(8):
        program = reader.rank(rank)
        a = dict(program.arrays)
        offsets = program.seg_offsets("send")
        segs = a["pull_send_segs"].copy()
        for row in range(offsets.size - 1):  # every other multi-segment send, its segments reversed
            if offsets[row + 1] - offsets[row] > 1 and row % 2:
                segs[offsets[row]:offsets[row + 1]] = segs[offsets[row]:offsets[row + 1]][::-1]
        a["pull_send_segs"] = segs
        changed = type(program)(rank=rank, header=program.header, tables=program.tables, arrays=a)
        local = stack_programs([program]).local_segments()[0]
        local_row = dict(zip(local.tolist(), (np.cumsum(seg_len[local]) - seg_len[local]).tolist()))
        recv = program.seg_offsets("recv")
        expected = []
        for row in range(offsets.size - 1):
            sent = segs[offsets[row]:offsets[row + 1]].tolist()
            source = int(a["pull_send_source"][row])
            if source < 0:
                store = local_row
            else:
                held = a["pull_recv_segs"][recv[source]:recv[source + 1]]
                store = dict(zip(held.tolist(), (np.cumsum(seg_len[held]) - seg_len[held]).tolist()))
            starts = [store[seg] for seg in sent]
            expected.append(any(b != a_ + seg_len[s] for a_, b, s in zip(starts, starts[1:], sent)))
        assert _send_copies(stack_programs([changed])).tolist() == expected
        checked += sum(expected)
    assert checked > 0

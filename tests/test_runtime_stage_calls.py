"""Kernel calls are built before the stage loop (fcp_runtime/stage_calls.py): a step copies its index tensors to
the device in one copy, and the stage loops issue no host-to-device copy."""

import pytest

torch = pytest.importorskip("torch")

from torch.utils._python_dispatch import TorchDispatchMode  # noqa: E402

import fcp_runtime.attention as attention  # noqa: E402
import fcp_runtime.checks as checks  # noqa: E402
import fcp_runtime.executor as executor  # noqa: E402
from conftest import compile_valid  # noqa: E402
from fcp_runtime.plan import load_rank_plan  # noqa: E402
from fcp_runtime.stage_calls import plan_requests, prepare_calls, prepare_host, stage_calls  # noqa: E402
from meta_harness import MetaRangeKernels  # noqa: E402


class _HostToDevice(TorchDispatchMode):
    """Records every op that reads a host tensor and writes a meta one (a host-to-device copy)."""

    def __init__(self):
        super().__init__()
        self.copies = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        inputs = [a for a in args if isinstance(a, torch.Tensor)]
        if any(t.device.type == "cpu" for t in inputs) and isinstance(out, torch.Tensor) and out.is_meta:
            self.copies.append((func.overloadpacket.__name__, out.dtype, out.numel()))
        return out


class _MetaKernels:
    """The varlen contract's shapes on the meta device."""

    def forward(self, q, k, v, *args, **kwargs):
        return torch.empty_like(q), torch.empty((q.shape[1], q.shape[0]), dtype=torch.float32, device=q.device)

    def backward(self, d_out, q, k, v, *args, **kwargs):
        return torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)


class _NoMessages:
    """torch.distributed with point-to-point messages that move nothing."""

    def __init__(self, real):
        self.real = real

    def __getattr__(self, name):
        return getattr(self.real, name)

    P2POp = staticmethod(lambda *args, **kwargs: None)
    batch_isend_irecv = staticmethod(lambda ops: [])
    get_global_rank = staticmethod(lambda group, rank: rank)


@pytest.fixture(scope="module")
def plan_bytes():
    return compile_valid([900, 3000, 2100, 400, 1500], 4, block_size=256, coalesce=2, model="none").to_bytes()


@pytest.fixture
def rank_plan(plan_bytes):
    return load_rank_plan(plan_bytes, 1)


@pytest.mark.parametrize("kernels", [_MetaKernels, MetaRangeKernels])
def test_a_step_copies_its_index_tensors_in_one_copy(rank_plan, monkeypatch, kernels):
    monkeypatch.setattr(executor, "dist", _NoMessages(executor.dist))  # where the stage loop posts
    monkeypatch.setattr(checks, "check_plan", lambda plan, group=None: None)  # where check_call looks
    meta = torch.device("meta")
    shape = (rank_plan.plan_tokens, rank_plan.q_heads, rank_plan.head_dim)
    q = torch.empty(shape, device=meta, requires_grad=True)
    k = torch.empty(rank_plan.plan_tokens, rank_plan.kv_heads, rank_plan.head_dim, device=meta, requires_grad=True)
    v = torch.empty_like(k, requires_grad=True)
    with _HostToDevice() as copies:
        out = attention.fcp_attn_func(q, k, v, rank_plan, layout="plan", kernels=kernels())
        out.backward(torch.empty_like(out))
    assert sum(len(program.tiles[s]) for program in (rank_plan.forward, rank_plan.backward)
               for s in range(program.num_stages)) > 0
    assert [dtype for _, dtype, _ in copies.copies] == [torch.int32], copies.copies


@pytest.mark.parametrize("layout", ["plan", "user"])
def test_prepared_calls_are_the_calls_the_stage_loop_would_build(plan_bytes, layout):
    prepared, lazy = load_rank_plan(plan_bytes, 1), load_rank_plan(plan_bytes, 1)
    prepare_host(prepared, layout)  # as a DataLoader worker does
    prepare_calls(prepared, layout, "cpu")
    requests = plan_requests(prepared, layout)
    assert requests and any(request.tiles for request in requests)
    for request in requests:
        name, stage, tiles = request.pass_name, request.stage, request.tiles
        ours = stage_calls(prepared, name, stage, list(tiles), "cpu")
        theirs = stage_calls(lazy, name, stage, list(tiles), "cpu")
        assert len(ours) == len(theirs)
        for a, b in zip(ours, theirs):
            assert (a.causal, a.window, a.max_q, a.max_k, a.tile_rows, a.pull_rows) == \
                (b.causal, b.window, b.max_q, b.max_k, b.tile_rows, b.pull_rows)
            assert torch.equal(a.cu_q, b.cu_q) and torch.equal(a.cu_k, b.cu_k)
            assert (a.q_runs, a.kv_runs) == (b.q_runs, b.kv_runs)
            for mine, other in zip(a.q_index + a.kv_index, b.q_index + b.kv_index):
                assert (mine.source, mine.span) == (other.source, other.span)
                assert torch.equal(mine.positions, other.positions) and torch.equal(mine.rows, other.rows)


@pytest.mark.parametrize("layout", ["plan", "user"])
def test_prepared_range_calls_are_the_range_calls_the_stage_loop_would_build(plan_bytes, layout):
    prepared, lazy = load_rank_plan(plan_bytes, 1), load_rank_plan(plan_bytes, 1)
    prepare_host(prepared, layout, ranges=True)
    prepare_calls(prepared, layout, "cpu", ranges=True)
    calls = 0
    for request in plan_requests(prepared, layout):
        name, stage, tiles = request.pass_name, request.stage, list(request.tiles)
        ours = stage_calls(prepared, name, stage, tiles, "cpu", ranges=True)
        theirs = stage_calls(lazy, name, stage, tiles, "cpu", ranges=True)
        assert len(ours) == len(theirs) <= 4  # one per (query tensor, key tensor)
        calls += len(ours)
        for a, b in zip(ours, theirs):
            assert (a.q_arena, a.kv_arena, a.max_q, a.max_k, a.tile_rows, a.pull_rows) == \
                (b.q_arena, b.kv_arena, b.max_q, b.max_k, b.tile_rows, b.pull_rows)
            for mine, other in ((a.q_ranges, b.q_ranges), (a.k_ranges, b.k_ranges), (a.masks, b.masks)):
                assert torch.equal(mine, other)
    assert calls > 0

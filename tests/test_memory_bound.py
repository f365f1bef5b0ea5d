"""Memory stated is memory used: the header's peak bytes per rank and pass are at or above what the runtime creates,
on either kernel path (packing: flash-attn's varlen contract; ranges: a range kernel reading K, V in place), in
either layout, dtype and mask, at small and large blocks, with as many K,V heads as query heads or fewer.

Each rank's forward and backward are replayed on the meta device (the kernels and messages stubbed, every tensor an
op creates counted from its creation until Python frees it: tests/meta_harness.py's Peak) and the replay's peak is
held against the header; each path's own account (rank_peak_bytes(path=...)) is held to the replay exactly."""

from __future__ import annotations

import sys
from typing import NamedTuple

import numpy as np
import pytest

torch = pytest.importorskip("torch")

import fcp_runtime.attention as attention  # noqa: E402
from conftest import compile_valid  # noqa: E402
from fcp_compiler.format.arena import rank_arenas  # noqa: E402
from fcp_compiler.format.inputs import AttentionShape, BatchSpec  # noqa: E402
from fcp_compiler.format.liveness import stacked_messages  # noqa: E402
from fcp_compiler.format.memory import PATHS, rank_peak_bytes, stacked_peak_bytes  # noqa: E402
from fcp_compiler.format.plan_format import PlanReader  # noqa: E402
from fcp_compiler.format.stacked import stack_programs  # noqa: E402
from fcp_runtime.plan import load_rank_plan  # noqa: E402
from meta_harness import HeldMessages, MetaKernels, MetaRangeKernels, Peak, Work  # noqa: E402

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
LENGTHS = [9000, 3000, 2100, 400, 1500, 700, 5200]
SHORT = [1500, 700, 90, 2600, 33, 260, 64]


class Case(NamedTuple):
    name: str
    lengths: list
    gpus: int
    block: int
    heads: tuple  # (q_heads, kv_heads, head_dim)
    dtype: str
    layout: str
    mask: str | None = None
    options: dict = {}


GQA, MHA = (16, 2, 64), (8, 8, 64)
CASES = [
    # F3: block 128 with node fan-out (relays), Llama-3-70B's heads: the forward's landed pushes merge in place.
    Case("f3-b128-fan-out", [3150, 1050, 735, 140, 525, 245, 1820], 8, 128, (64, 8, 128), "bf16", "plan",
         options={"gpus_per_node": 4, "node_fan_out": True}),
    # F4: as many K,V heads as query heads, on the range path: its backward's arenas outgrow the packing path's.
    Case("f4-b4096-mha", [20000, 9000, 3000, 2100, 400, 1500, 700, 5200, 12000, 7000], 8, 4096, (8, 8, 128), "bf16",
         "plan"),
    Case("b64-gqa-fp32-user-window", SHORT, 4, 64, GQA, "fp32", "user", "sliding_window:300"),
    Case("b64-mha-bf16-plan", SHORT, 4, 64, MHA, "bf16", "plan"),
    Case("b256-mha-fp32-plan-window", LENGTHS, 4, 256, MHA, "fp32", "plan", "sliding_window:1000"),
    Case("b256-gqa-bf16-user", LENGTHS, 4, 256, GQA, "bf16", "user"),
    Case("b1024-mha-bf16-user-window", LENGTHS, 4, 1024, MHA, "bf16", "user", "sliding_window:1000"),
    Case("b1024-gqa-fp32-plan", LENGTHS, 4, 1024, GQA, "fp32", "plan"),
    Case("b4096-gqa-fp16-user-window", LENGTHS, 4, 4096, GQA, "fp16", "user", "sliding_window:1000"),
    Case("b4096-mha-fp32-user", LENGTHS, 4, 4096, MHA, "fp32", "user"),
    Case("one-rank-user", SHORT, 1, 256, MHA, "bf16", "user"),
]
# Every block, heads, dtype, layout and mask together, with the long tests.
SWEEP = [Case(f"b{block}-{'mha' if heads == MHA else 'gqa'}-{dtype}-{layout}-{mask or 'causal'}", lengths, 4, block,
              heads, dtype, layout, mask)
         for block, lengths in ((64, SHORT), (128, LENGTHS), (256, LENGTHS), (4096, LENGTHS))
         for heads in (GQA, MHA) for dtype in ("bf16", "fp32") for layout in ("plan", "user")
         for mask in (None, "sliding_window:1000")]


class _Collectives(HeldMessages):
    """torch.distributed as tests/test_memory.py stubs it, with an all-to-all that moves nothing and whose work (an
    async one's) holds what it moves until it is dropped."""

    @staticmethod
    def all_to_all_single(out, rows, output_split_sizes=None, input_split_sizes=None, group=None, async_op=False):
        return Work([out, rows]) if async_op else None


@pytest.fixture
def meta_runtime(monkeypatch):
    """The runtime with its messages stubbed and no check of the process group, in every module that holds them."""
    stub = _Collectives(torch.distributed)
    for name, module in list(sys.modules.items()):
        if name.startswith("fcp_runtime") and module is not None:
            if getattr(module, "dist", None) is torch.distributed:
                monkeypatch.setattr(module, "dist", stub)
            if hasattr(module, "check_plan"):
                monkeypatch.setattr(module, "check_plan", lambda plan, group=None: None)


def _plan(case: Case):
    batch = case.lengths if case.mask is None else BatchSpec.model_validate(
        {"masks": [_mask(case.mask)] * len(case.lengths), "sequences": case.lengths})
    q_heads, kv_heads, head_dim = case.heads
    shape = AttentionShape(q_heads=q_heads, kv_heads=kv_heads, head_dim=head_dim, dtype=case.dtype)
    return compile_valid(batch, case.gpus, block_size=case.block, coalesce=2, shape=shape, layout=case.layout,
                         model="none", **case.options)


def _mask(name: str):
    kind, window = name.split(":")
    return {"kind": kind, "window": int(window)}


def _replay(data: bytes, rank: int, kernels, dtype: torch.dtype, layout: str) -> dict[str, int]:
    """One rank's forward and backward on meta tensors in `layout`, each pass under a fresh Peak: their peaks."""
    plan = load_rank_plan(data, rank)
    rows = plan.plan_tokens if layout == "plan" else plan.user_tokens
    meta = torch.device("meta")
    q = torch.empty((rows, plan.q_heads, plan.head_dim), dtype=dtype, device=meta, requires_grad=True)
    k = torch.empty((rows, plan.kv_heads, plan.head_dim), dtype=dtype, device=meta, requires_grad=True)
    v = torch.empty_like(k, requires_grad=True)
    grad = torch.empty_like(q)
    with Peak() as forward:
        out = attention.fcp_attn_func(q, k, v, plan, layout=layout, kernels=kernels)
    with Peak() as backward:
        out.backward(grad)
    return {"fwd": forward.peak, "bwd": backward.peak}


def _check(case: Case) -> None:
    plan = _plan(case)
    data = plan.to_bytes()
    reader = PlanReader(data)
    header = reader.header
    stated = np.asarray([header.max_buffer_bytes_fwd, header.max_buffer_bytes_bwd]).T
    stacked = stack_programs(reader.ranks())
    assert np.array_equal(stacked_peak_bytes(stacked), stated)
    accounts = {path: stacked_peak_bytes(stacked, path=path) for path in PATHS}
    assert np.array_equal(np.maximum(*accounts.values()), stated)
    for rank in range(case.gpus):
        for path, kernels in (("packing", MetaKernels()), ("ranges", MetaRangeKernels())):
            replayed = _replay(data, rank, kernels, DTYPES[case.dtype], case.layout)
            for column, name in enumerate(("fwd", "bwd")):
                where = (case.name, rank, path, name)
                # The header bounds every path, and each path's own account is exactly what the replay peaks at.
                assert stated[rank, column] >= replayed[name], (where, int(stated[rank, column]), replayed[name])
                assert accounts[path][rank, column] == replayed[name], (where, int(accounts[path][rank, column]),
                                                                        replayed[name])


@pytest.mark.parametrize("case", CASES, ids=[case.name for case in CASES])
def test_the_header_bounds_what_either_kernel_path_creates(meta_runtime, case):
    _check(case)


@pytest.mark.long
@pytest.mark.parametrize("case", SWEEP, ids=[case.name for case in SWEEP])
def test_the_header_bounds_every_path_over_blocks_heads_dtypes_layouts_and_masks(meta_runtime, case):
    _check(case)


def test_the_account_places_arenas_as_the_runtime_does():
    """The range path's account places every rank's arenas at once; the runtime places its own
    (format.arena.rank_arenas): the same offsets and arena rows."""
    from fcp_compiler.format.memory import _stacked_arenas

    plan = compile_valid(LENGTHS, 8, block_size=256, coalesce=2, gpus_per_node=4, node_fan_out=True, model="none")
    reader = PlanReader(plan.to_bytes())
    stacked = stack_programs(reader.ranks())
    placed = _stacked_arenas(stacked, {name: stacked_messages(stacked, name) for name in ("fwd", "bwd")})
    base, count = stacked.base("pull_recv_round"), stacked.count("pull_recv_round")
    for rank in range(8):
        runtime = rank_arenas(reader.rank(rank))
        for name in ("fwd", "bwd"):
            ours = placed[name]
            assert np.array_equal(ours.pull_offset[base[rank]:base[rank] + count[rank]], runtime[name].pull_offset)
            assert (ours.rows[1][rank], ours.rows[0][rank]) == (runtime[name].q_rows, runtime[name].kv_rows)


def test_a_ranks_account_is_the_stacked_accounts_row():
    plan = compile_valid(SHORT, 4, block_size=128, coalesce=2, layout="user", model="none")
    reader = PlanReader(plan.to_bytes())
    stacked = stack_programs(reader.ranks())
    for path in (None, *PATHS):
        peaks = stacked_peak_bytes(stacked, path=path)
        for rank in range(4):
            assert rank_peak_bytes(reader.rank(rank), path=path) == {"fwd": peaks[rank, 0], "bwd": peaks[rank, 1]}

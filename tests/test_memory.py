"""The memory account (fcp_compiler/format/memory.py) is the peak of what the runtime creates: a meta-device replay
of every rank's forward and backward records each tensor an op creates until Python frees it."""

from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")

import fcp_runtime.checks as checks  # noqa: E402
import fcp_runtime.executor as executor  # noqa: E402
from conftest import compile_valid  # noqa: E402
from fcp_compiler.format.liveness import stacked_messages  # noqa: E402
from fcp_compiler.format.memory import rank_peak_bytes  # noqa: E402
from fcp_compiler.format.stacked import stack_programs  # noqa: E402
from fcp_compiler.format.plan_format import PlanReader  # noqa: E402
from fcp_runtime.plan import load_rank_plan  # noqa: E402
from meta_harness import HeldMessages, MetaKernels, Peak, meta_replay  # noqa: E402


def _replay_peaks(plan_bytes: bytes, rank: int) -> dict[str, int]:
    return {name: mode.peak for name, mode in meta_replay(plan_bytes, rank, MetaKernels(), Peak).items()}


@pytest.mark.parametrize("fan_out", [False, True])
def test_the_account_is_the_peak_a_replay_of_the_runtime_records(monkeypatch, fan_out):
    monkeypatch.setattr(executor, "dist", HeldMessages(executor.dist))  # where the stage loop posts
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

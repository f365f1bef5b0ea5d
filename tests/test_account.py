"""The compiler's memory account of the plan it keeps (fcp_compiler/core/account.py): the figures of
core.plan_memory.plan_peak_bytes, with the tile rows read from the IR a group of ranks at a time."""

from __future__ import annotations

import numpy as np
import pytest

from conftest import compile_valid
from fcp_compiler.core import account
from fcp_compiler.core.plan_memory import plan_peak_bytes


@pytest.mark.parametrize("kwargs", [dict(block_size=128), dict(block_size=256, layout="user"),
                                    dict(block_size=128, mask="sliding_window:300"),
                                    dict(planner="magi"), dict(block_size=64, floor=False)])
def test_the_account_by_groups_of_ranks_is_the_stacked_one(monkeypatch, kwargs):
    plan = compile_valid([9000, 4096, 2100, 700, 64, 1500], 8, **kwargs)
    fields = plan.header
    expected = plan_peak_bytes(plan.ir, fields)
    assert np.array_equal(account.plan_peak_bytes(plan.ir, fields), expected)
    assert expected[:, 0].tolist() == plan.header.max_buffer_bytes_fwd
    # Groups of a few ranks, and an account that stops at the first group above a bound, in a given order.
    monkeypatch.setattr("fcp_compiler.format.memory.CHUNK_TILES", 40)
    first = expected.max(axis=1)
    stop = int(np.median(first))
    assert np.array_equal(account.plan_peak_bytes(plan.ir, fields), expected)
    assert np.array_equal(account.plan_peak_bytes(plan.ir, fields, stop_above=stop, first=first),
                          plan_peak_bytes(plan.ir, fields, stop_above=stop, first=first))

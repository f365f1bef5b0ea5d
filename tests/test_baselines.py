"""Baselines in the plan format: valid plans with the placement each strategy stands for."""

import numpy as np
import pytest

from cli import main
from conftest import compile_valid
from fcp_compiler.traces import lognormal_batch

LENGTHS = lognormal_batch(16 * 32768, 4096, 1.8, 64, 131072, seed=2)


@pytest.mark.parametrize("planner", ["ring", "bytescale", "wlbllm", "magi"])
@pytest.mark.parametrize("mask", ["causal", "full"])
def test_every_baseline_gives_a_valid_plan(planner, mask):
    plan = compile_valid(LENGTHS, 16, planner=planner, mask=mask)
    assert plan.header.planner == planner


def test_ring_puts_every_sequence_on_every_rank():
    plan = compile_valid([5000, 300, 20000], 4, planner="ring")
    tables = plan._reader.tables
    owner = np.empty(plan.header.num_blocks, dtype=int)
    for rank in range(4):
        owner[plan.rank(rank).blocks] = rank
    for seq in range(3):
        assert set(owner[tables.seg_block[tables.seg_seq == seq]]) == {0, 1, 2, 3}
    assert plan.stats["num_rounds"] == 3  # N - 1 shifts


def test_bytescale_keeps_short_sequences_whole_and_is_unbalanced_on_a_long_tail():
    plan = compile_valid(LENGTHS, 16, planner="bytescale")
    tables = plan._reader.tables
    share = -(-sum(LENGTHS) // 16)
    for seq, length in enumerate(LENGTHS):
        if length <= share:
            assert (tables.seg_seq == seq).sum() == 1
    assert plan.stats["compute_imbalance"] > 0.3


def test_fcp_balances_traffic_better_than_magi():
    fcp = compile_valid(LENGTHS, 16).stats
    magi = compile_valid(LENGTHS, 16, planner="magi").stats
    assert fcp["comm_imbalance"] < magi["comm_imbalance"]


def test_compare_and_sweep_commands(tmp_path, capsys):
    out = tmp_path / "cmp.json"
    assert main(["compare", "--trace-spec", "lognormal:4096:1.8:65536:1", "--gpus", "4,8", "--tokens-per-gpu",
                 "16384", "--json", str(out)]) == 0
    import json
    rows = json.loads(out.read_text())["results"]
    assert {(r["method"], r["gpus"]) for r in rows} == {(m, g) for m in ("fcp", "ring", "bytescale", "wlbllm", "magi")
                                                        for g in (4, 8)}
    assert all({"compute_imbalance", "comm_imbalance", "total_comm_bytes", "max_rank_comm_bytes", "num_rounds",
                "normalized_mfu_fwd", "normalized_mfu_bwd"} <= set(r) for r in rows)
    batch = tmp_path / "b.json"
    batch.write_text(json.dumps(LENGTHS))
    assert main(["sweep", str(batch), "--gpus", "16", "--block-size", "2048,4096"]) == 0
    assert main(["compare", str(batch), "--gpus", "4", "--methods", "fcp,nope"]) == 2

"""fcp_attn_func on forked gloo ranks equals dense attention over the whole batch, forward and backward, in both
layouts; the plan layout makes no all-to-all."""

import sys
from pathlib import Path

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from conftest import cases_by_layout, compile_own  # noqa: E402
from runtime_harness import compare_with_reference, run_ranks  # noqa: E402

from flash_attn_standin import _flash_attn_varlen_backward, flash_attn_varlen_func  # noqa: E402
from fcp_compiler.format.inputs import PRESET_PROFILES  # noqa: E402
from fcp_runtime import load_rank_plan  # noqa: E402
from fcp_runtime.kernels import FlashAttnKernels  # noqa: E402

CASES = [
    # (name, lengths, gpus, block, coalesce, mask, zigzag, q_heads, kv_heads, dtype[, planner])
    ("mixed-causal-fp64", [700, 90, 1500, 33, 260, 1200, 64], 4, 256, 1, "causal", "auto", 4, 2, torch.float64),
    ("mixed-full-fp64", [700, 90, 1500, 33, 260, 1200, 64], 4, 256, 3, "full", "off", 4, 2, torch.float64),
    ("plain-causal-2-ranks", [1000, 333, 77, 2100], 2, 192, 2, "causal", "off", 2, 1, torch.float64),
    ("full-fp32-2-ranks", [900, 2000, 150], 2, 320, 2, "full", "auto", 4, 1, torch.float32),
    ("zigzag-8-ranks-fp32", [2600, 1300, 100, 650, 40, 900], 8, 128, 4, "causal", "on", 4, 4, torch.float32),
    ("causal-8-ranks-fp64", [2600, 1300, 100, 650, 40, 900], 8, 128, 2, "causal", "auto", 4, 1, torch.float64),
    ("full-8-ranks-fp64", [1800, 700, 300, 64], 8, 128, 2, "full", "off", 2, 2, torch.float64),
    ("offloaded-full-fp64", [2048, 100, 60], 8, 512, 2, "full", "off", 2, 1, torch.float64),
    ("offloaded-causal-fp64", [3000, 120], 8, 256, 1, "causal", "off", 2, 2, torch.float64),
    ("causal-4-ranks-bf16", [1000, 333, 77, 2100], 4, 192, 2, "causal", "auto", 4, 2, torch.bfloat16),
]
# A network 1000x slower than H100's makes traffic, not compute, bound the stages: busy senders hand some pulls to
# relays, which the runtime must replay exactly (re-sending received K,V, summing the dK, dV pushed back to them).
SLOW_NETWORK = PRESET_PROFILES["h100"].model_copy(update={"network_gbps": 0.05, "nvlink_gbps": 0.05,
                                                          "gpus_per_node": 2})
RELAYED = [  # (name, lengths, gpus, block, coalesce, mask, zigzag, layout)
    ("relayed-6-ranks-plan", [752, 2962, 580, 999], 6, 128, 2, "causal", "auto", "plan"),
    pytest.param(("relayed-6-ranks-user", [752, 2962, 580, 999], 6, 128, 2, "causal", "auto", "user"),
                 marks=pytest.mark.long),
    ("relayed-8-ranks-plan", [563, 209, 3467, 1669, 298, 1939], 8, 128, 2, "causal", "off", "plan"),
    ("relayed-8-ranks-user", [953, 557, 554], 8, 128, 2, "causal", "off", "user"),
    pytest.param(("relayed-full-8-ranks-user", [3699, 3885], 8, 128, 2, "full", "off", "user"),
                 marks=pytest.mark.long),
]
# Each baseline's causal plan in the suite, its full-mask plan with the long tests.
BASELINES = [pytest.param((f"baseline-{planner}-{mask}", [700, 90, 1500, 33, 260, 1200, 64], 4, 256, 2, mask, "auto",
                           4, 2, torch.float64, planner), id=f"baseline-{planner}-{mask}",
                          marks=pytest.mark.long if mask == "full" else ())
             for planner in ("ring", "bytescale", "wlbllm", "magi") for mask in ("causal", "full")]


def _compile(case, layout):
    name, lengths, gpus, block, coalesce, mask, zigzag, hq, hkv, dtype, *planner = case
    own_blocks = planner and planner[0] in ("ring", "bytescale", "wlbllm")  # they size their own blocks
    # Offloading balances what whole blocks cannot; with attention alone as the objective these batches need it.
    model = "none" if name.startswith("offloaded") else "llama3-70b"
    plan = compile_own(lengths, gpus, block_size=None if own_blocks else block, coalesce=coalesce,
                         mask=mask, zigzag=zigzag, planner=planner[0] if planner else "fcp", layout=layout,
                         model=model)
    if name.startswith("offloaded"):
        assert plan.stats["num_offloaded_tiles"] > 0
    return plan


@pytest.mark.parametrize("case, layout", cases_by_layout(CASES, long={"zigzag-8-ranks-fp32-user",
                                                                     "causal-8-ranks-fp64-user"}))
def test_output_and_gradients_equal_dense_reference(case, layout):
    name, lengths, gpus, _, _, mask, _, hq, hkv, dtype, *_ = case
    plan = _compile(case, layout)
    if name == "mixed-causal-fp64" and layout == "user":  # some tiles run while the reshuffle is in flight
        assert any(load_rank_plan(plan.to_bytes(), rank).early_tiles for rank in range(gpus))
    calls = [a2a for a2a, _ in run_ranks(gpus, compare_with_reference(plan.to_bytes(), lengths, mask == "causal", hq,
                                                                       hkv, dtype, layout))]
    # Plan layout: Q, K, V were dispatched once (by the caller); attention moves only blocks. User layout: Q, K, V
    # in and O out forward, dO in and dQ, dK, dV out backward.
    assert calls == [0] * gpus if layout == "plan" else calls == [4] * gpus


@pytest.mark.parametrize("case", BASELINES)
def test_baselines_replay_exactly(case):
    _, lengths, gpus, _, _, mask, _, hq, hkv, dtype, *_ = case
    plan = _compile(case, "plan")
    run_ranks(gpus, compare_with_reference(plan.to_bytes(), lengths, mask == "causal", hq, hkv, dtype, "plan"))


def test_position_and_sequence_ids_name_each_plan_row():
    lengths = [700, 90, 1500, 33, 260, 1200, 64]
    plan = compile_own(lengths, 4, block_size=256, coalesce=2)
    starts = torch.cumsum(torch.tensor([0] + lengths), 0)
    seen = []
    for rank in range(4):
        rank_plan = load_rank_plan(plan.to_bytes(), rank)
        index, positions, sequences = rank_plan.token_index, rank_plan.position_ids, rank_plan.sequence_ids
        assert index.dtype == positions.dtype == sequences.dtype == torch.int64
        expected_sequence = torch.searchsorted(starts[1:], index, right=True)
        assert torch.equal(sequences, expected_sequence)
        assert torch.equal(positions, index - starts[expected_sequence])
        seen.append(index)
    assert torch.equal(torch.sort(torch.cat(seen)).values, torch.arange(sum(lengths)))


class _CountingFlash(FlashAttnKernels):
    """The runtime's flash-attn call sites, on the stand-in, counting the calls."""

    def __init__(self):
        super().__init__(flash_attn_varlen_func, _flash_attn_varlen_backward)
        self.num_calls = 0

    def forward(self, *args):
        self.num_calls += 1
        return super().forward(*args)

    def backward(self, *args):
        self.num_calls += 1
        return super().backward(*args)


FLASH_CASES = [case for case in CASES if case[0] in ("mixed-causal-fp64", "mixed-full-fp64", "plain-causal-2-ranks",
                                                     "full-fp32-2-ranks", "offloaded-causal-fp64",
                                                     "causal-4-ranks-bf16")]


# The user layout of every case but the one whose tiles run during the reshuffle is in the long tests, and so are
# the 2-rank cases (the exact kernel replays them in the suite).
@pytest.mark.parametrize("case, layout", cases_by_layout(FLASH_CASES, long={
    f"{c[0]}-user" for c in FLASH_CASES if c[0] != "mixed-causal-fp64"} | {
    "plain-causal-2-ranks-plan", "full-fp32-2-ranks-plan"}))
def test_flash_attn_call_sites_on_the_contract_stand_in_are_exact(case, layout):
    name, lengths, gpus, _, _, mask, _, hq, hkv, dtype, *_ = case
    plan = _compile(case, layout)
    results = run_ranks(gpus, compare_with_reference(plan.to_bytes(), lengths, mask == "causal", hq, hkv, dtype,
                                                     layout, kernels=_CountingFlash()))
    header = plan.header
    for _, num_calls in results:
        # At most two varlen calls (masked diagonal entries, unmasked ones) per stage and pass, and two more for
        # the tiles that run during the reshuffle.
        assert 0 < num_calls <= 2 * (header.num_fwd_stages + header.num_bwd_stages + 1)


@pytest.mark.parametrize("case", RELAYED, ids=[(c.values[0] if hasattr(c, "values") else c)[0] for c in RELAYED])
def test_plans_with_relays_replay_exactly(case):
    _, lengths, gpus, block, coalesce, mask, zigzag, layout = case
    plan = compile_own(lengths, gpus, block_size=block, coalesce=coalesce, mask=mask, zigzag=zigzag,
                         layout=layout, profile=SLOW_NETWORK, model="none")  # batches chosen to relay so
    assert plan.stats["num_relayed_transfers"] > 0
    assert any(pull.source >= 0 for rank in range(gpus) for pull in load_rank_plan(plan.to_bytes(), rank).pull_send)
    run_ranks(gpus, compare_with_reference(plan.to_bytes(), lengths, mask == "causal", 2, 1, torch.float64, layout))


ORDER_CASES = [CASES[1], CASES[5], ("relayed",) + RELAYED[2][1:]]


@pytest.mark.parametrize("case", [pytest.param(ORDER_CASES[0], id="mixed-full", marks=pytest.mark.long),
                                  pytest.param(ORDER_CASES[1], id="causal-8-ranks", marks=pytest.mark.long),
                                  pytest.param(ORDER_CASES[2], id="relayed-8-ranks")])
def test_replay_is_exact_when_messages_match_by_posting_order_as_in_nccl(case):
    """Every tag 0: gloo then pairs each rank pair's messages in posting order, as NCCL does, so a difference in
    the order the two ends post would mismatch sizes or data."""
    if case[0] == "relayed":
        _, lengths, gpus, block, coalesce, mask, zigzag, layout = case
        plan = compile_own(lengths, gpus, block_size=block, coalesce=coalesce, mask=mask, zigzag=zigzag,
                             layout=layout, profile=SLOW_NETWORK, model="none")
        hq, hkv, dtype = 2, 1, torch.float64
    else:
        _, lengths, gpus, block, coalesce, mask, zigzag, hq, hkv, dtype, *_ = case
        plan = _compile(case, "user")
        layout = "user"
    run_ranks(gpus, compare_with_reference(plan.to_bytes(), lengths, mask == "causal", hq, hkv, dtype, layout,
                                           order_matching=True))


@pytest.mark.parametrize("mask", ["causal", "full"])
def test_ring_costed_in_closed_form_pulls_whole_blocks_and_replays_exactly(monkeypatch, mask):
    """Past RING_CLOSED_FORM_PAIRS the ring is costed per sequence without segment pairs and pulls whole shards; forced
    here on a small batch, its tiles and FLOPs equal the pair path's and the plan replays exactly."""
    import fcp_compiler.core.passes.cost as cost

    lengths = [700, 90, 1500, 33, 260, 1200, 64]
    exact = compile_own(lengths, 4, planner="ring", mask=mask)
    monkeypatch.setattr(cost, "RING_CLOSED_FORM_PAIRS", 0)
    closed = compile_own(lengths, 4, planner="ring", mask=mask)
    tiles = [plan.ir.tiles for plan in (exact, closed)]
    assert not tiles[1].has_pairs and tiles[0].has_pairs
    assert tiles[0].tile_q_block.tolist() == tiles[1].tile_q_block.tolist()
    assert tiles[0].tile_kv_block.tolist() == tiles[1].tile_kv_block.tolist()
    torch.testing.assert_close(torch.from_numpy(tiles[1].tile_flops), torch.from_numpy(tiles[0].tile_flops))
    run_ranks(4, compare_with_reference(closed.to_bytes(), lengths, mask == "causal", 4, 2, torch.float64, "plan"))


FAN_OUT = [  # (name, lengths, gpus, block, coalesce, mask, gpus_per_node)
    ("fan-out-8-ranks-2-per-node", [3000, 1200, 700, 300, 90], 8, 128, 2, "causal", 2),
    pytest.param(("fan-out-16-ranks-4-per-node", [4100, 1900, 800, 300, 64], 16, 128, 2, "causal", 4),
                 marks=pytest.mark.long),
    ("fan-out-full-16-ranks-2-per-node", [2500, 1300, 200], 16, 128, 1, "full", 2),
]


def _fan_out_plan(case, layout):
    _, lengths, gpus, block, coalesce, mask, per_node = case
    plan = compile_own(lengths, gpus, block_size=block, coalesce=coalesce, mask=mask, layout=layout,
                         gpus_per_node=per_node)
    # Blocks crossed into a node once and were re-sent over NVLink from the entry's received buffer.
    assert plan.stats["num_fanned_out_transfers"] > 0
    return plan


# One layout of each in the suite, the other in the long tests (with the 16-rank, 4-per-node case).
@pytest.mark.parametrize("case, layout", [
    pytest.param(FAN_OUT[0], "plan", id="fan-out-8-ranks-2-per-node-plan"),
    pytest.param(FAN_OUT[0], "user", id="fan-out-8-ranks-2-per-node-user", marks=pytest.mark.long),
    *[pytest.param(FAN_OUT[1].values[0], layout, id=f"fan-out-16-ranks-4-per-node-{layout}", marks=pytest.mark.long)
      for layout in ("plan", "user")],
    pytest.param(FAN_OUT[2], "plan", id="fan-out-full-16-ranks-2-per-node-plan", marks=pytest.mark.long),
    pytest.param(FAN_OUT[2], "user", id="fan-out-full-16-ranks-2-per-node-user")])
def test_plans_with_node_fan_out_replay_exactly(case, layout):
    _, lengths, gpus, _, _, mask, _ = case
    plan = _fan_out_plan(case, layout)
    if case is FAN_OUT[0]:  # GPUs that take a block over their NIC only to re-send it to the one that reads it
        assert plan.stats["num_forwarding_transfers"] > 0
    run_ranks(gpus, compare_with_reference(plan.to_bytes(), lengths, mask == "causal", 4, 2, torch.float64, layout))


def test_node_fan_out_replays_exactly_when_messages_match_by_posting_order():
    """NVLink lanes let one rank send two messages to one peer in a round: both ends must post them in one order."""
    case = FAN_OUT[0]
    plan = _fan_out_plan(case, "plan")
    run_ranks(case[2], compare_with_reference(plan.to_bytes(), case[1], True, 4, 2, torch.float64, "plan",
                                              order_matching=True))


@pytest.mark.parametrize("layout", ["plan", "user"])
def test_each_context_parallel_group_of_its_own_replays_the_plan_exactly(layout):
    """World 6 as three CP groups of 2 (dist.new_group): messages go to the group's ranks, named by their global
    rank, and the plan check runs within the group."""
    lengths = [1000, 333, 77, 2100]
    plan = compile_own(lengths, 2, block_size=192, coalesce=2, layout=layout)
    assert plan.stats["num_transfers"] > 0
    run_ranks(6, compare_with_reference(plan.to_bytes(), lengths, True, 2, 1, torch.float64, layout, groups=3))


def test_received_pulls_listed_in_another_order_replay_exactly_when_messages_match_by_posting_order():
    """Each end of a pair posts its messages in an order derived from what both ends state (round, pull or push,
    kind, block), not from its own row numbers: with every rank's received pulls listed in reverse (the same plan,
    valid), two messages a pair exchanges in one round still match by posting order."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
    from fuzz_plans import permute_received_pulls

    from fcp_compiler.format.plan_format import PlanReader, rebuild_plan
    from fcp_compiler.format.validate import validate_plan

    case = FAN_OUT[0]
    plan = _fan_out_plan(case, "plan")
    reader = PlanReader(plan.to_bytes())
    arrays = [{name: values.copy() for name, values in program.arrays.items()} for program in reader.ranks()]
    # Some pair exchanges two messages in one round (NVLink lanes), so that the order can matter.
    pairs = [(rank, int(peer), int(rnd)) for rank, a in enumerate(arrays)
             for peer, rnd in zip(a["pull_recv_peer"], a["pull_recv_round"])]
    assert len(set(pairs)) < len(pairs)
    for a in arrays:
        permute_received_pulls(a, np.arange(a["pull_recv_round"].size)[::-1])
    reordered = rebuild_plan(reader, arrays)
    validate_plan(reordered)
    run_ranks(case[2], compare_with_reference(reordered, case[1], True, 4, 2, torch.float64, "plan",
                                              order_matching=True))


@pytest.mark.parametrize("fan_out", [False, True])
def test_plans_whose_q_pulls_go_first_replay_exactly(fan_out):
    """A helper's Q pull moved into the first stage (coalesce, where that levels the stages) comes in the same
    round as other pulls of its matching, in a plan the runtime replays exactly, with node fan-out and without;
    messages matched by posting order, as NCCL does."""
    from fcp_compiler.core.ir import TransferKind

    lengths = [57, 265, 95, 64, 68, 189, 249, 120, 197, 163, 1792]
    plan = compile_own(lengths, 8, block_size=128, coalesce=2, model="llama3-70b", node_fan_out=fan_out)
    is_q = plan.ir.transfers.edge_kind == TransferKind.Q
    assert is_q.any() and (plan.ir.schedule.forward.edge_round[is_q] < 2).all()
    run_ranks(8, compare_with_reference(plan.to_bytes(), lengths, True, 4, 2, torch.float64, "plan",
                                        order_matching=True))


PREFETCHING = {"every rank": lambda rank: True, "even ranks only": lambda rank: rank % 2 == 0}


@pytest.mark.parametrize("who", PREFETCHING, ids=list(PREFETCHING))
@pytest.mark.parametrize("fan_out", [False, True])
def test_prefetched_first_stage_kv_pulls_replay_exactly(fan_out, who):
    """prefetch_kv posts the forward's stage-0 K,V pulls before attention starts: results stay exact with node
    fan-out and without, messages matched by posting order as in NCCL, and where only some ranks prefetch (those
    that do not post the same messages first when their attention starts)."""
    lengths = [57, 265, 95, 64, 68, 189, 249, 120, 197, 163, 1792]
    plan = compile_own(lengths, 8, block_size=128, coalesce=2, model="llama3-70b", node_fan_out=fan_out)
    assert plan.header.kv_prefetch
    programs = [load_rank_plan(plan.to_bytes(), rank).forward for rank in range(8)]
    assert sum(program.num_prefetched for program in programs) > 0
    run_ranks(8, compare_with_reference(plan.to_bytes(), lengths, True, 4, 2, torch.float64, "plan",
                                        order_matching=True, prefetch=PREFETCHING[who]))

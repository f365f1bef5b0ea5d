"""The simulator: closed-form cases on plain arrays, the trace against the figures, and the seed's ablation."""

import json
from pathlib import Path

import numpy as np
import pytest

from cli import main
from conftest import compile_valid
from fcp_compiler import CompileOptions
from fcp_compiler.tools.ablation import run_ablation
from fcp_compiler.format.inputs import load_batch
from fcp_compiler.algorithms.timeline import TRACKS, LinkModel, PassInput, simulate_pass
from fcp_compiler.core.plan_memory import stack_plan
from fcp_compiler.core.simulate import HeldPlan, simulate_plan
from fcp_compiler.format.inputs import BatchSpec
from fcp_compiler.tools.report import simulation_summary

ROOT = Path(__file__).resolve().parents[1]
BW, LAT, LAUNCH = 1e9, 1e-5, 2e-6
EMPTY = (np.zeros(0, dtype=np.int64), np.zeros(0, dtype=np.int64), np.zeros(0))


def links(num_ranks, sm_fraction=0.0, gpus_per_node=1):
    return LinkModel(node_of_rank=np.arange(num_ranks) // gpus_per_node, intra_bytes_per_s=10 * BW,
                     inter_bytes_per_s=BW, latency_s=LAT, launch_s=LAUNCH, sm_fraction=sm_fraction)


def make_pass(num_ranks, num_stages, flows=(), tiles=(), shuffle_in=EMPTY):
    flows = list(flows) or [(0, 0, 0.0, 0)][:0]
    tiles = list(tiles)
    col = lambda rows, i, dtype: np.array([r[i] for r in rows], dtype=dtype)  # noqa: E731
    return PassInput(num_ranks=num_ranks, num_stages=num_stages, flow_src=col(flows, 0, np.int64),
                     flow_dst=col(flows, 1, np.int64), flow_bytes=col(flows, 2, float),
                     flow_stage=col(flows, 3, np.int64), flow_name=None, tile_rank=col(tiles, 0, np.int64),
                     tile_stage=col(tiles, 1, np.int64), tile_seconds=col(tiles, 2, float),
                     tile_early=np.zeros(len(tiles), dtype=bool), tile_name=None, reshuffle_in=shuffle_in,
                     reshuffle_out=EMPTY)


def test_one_rank_is_the_sum_of_its_tiles():
    result = simulate_pass(make_pass(1, 1, tiles=[(0, 0, 0.5), (0, 0, 0.25)]), links(1), True)
    assert result.makespan == pytest.approx(0.75 + LAUNCH)


def test_two_ranks_one_transfer_then_the_tile():
    data = make_pass(2, 2, flows=[(0, 1, 4e6, 0)], tiles=[(1, 1, 0.01)])
    result = simulate_pass(data, links(2), True)
    assert result.end[1] == pytest.approx(LAT + 4e6 / BW + 0.01 + LAUNCH)


def test_a_ring_moves_every_block_at_full_rate():
    n = 6
    data = make_pass(n, 1, flows=[(r, (r + 1) % n, 2e6, 0) for r in range(n)])
    assert simulate_pass(data, links(n), True).end == pytest.approx(np.full(n, LAT + 2e6 / BW))


def test_two_senders_into_one_receiver_halve_the_rate():
    data = make_pass(3, 1, flows=[(0, 2, 1e6, 0), (1, 2, 1e6, 0)])
    result = simulate_pass(data, links(3), True)
    assert result.end == pytest.approx([LAT + 2e6 / BW] * 3)


def test_nvlink_inside_a_node_and_the_nic_across():
    data = make_pass(4, 1, flows=[(0, 1, 1e6, 0), (2, 3, 1e6, 0)])
    result = simulate_pass(data, links(4, gpus_per_node=2), True)
    assert result.end[1] == pytest.approx(LAT + 1e6 / (10 * BW))
    data = make_pass(4, 1, flows=[(0, 2, 1e6, 0)])
    assert simulate_pass(data, links(4, gpus_per_node=2), True).end[2] == pytest.approx(LAT + 1e6 / BW)


def test_the_critical_path_goes_on_from_a_late_partner_and_adds_up_to_the_pass():
    """Rank 1 finishes its stage 0 early, then waits in stage 1 for rank 0 (0.5 s of tiles) to send it a block, then
    computes: the path is rank 0's tiles, the message, rank 1's tiles; rank 1's wait is not on it."""
    from fcp_compiler.algorithms.timeline import critical_path

    data = make_pass(2, 3, flows=[(0, 1, 1e6, 1)], tiles=[(0, 0, 0.5), (1, 0, 0.1), (1, 2, 0.2)])
    result = simulate_pass(data, links(2), True, stage_times=True)
    path = critical_path(result.stages)
    assert path["ranks"] == [1, 0]  # last first: rank 1 ends, the path goes back through rank 0's stage 0
    assert path["computing_s"] == pytest.approx(0.5 + LAUNCH + 0.2 + LAUNCH)
    assert path["messages_s"] == pytest.approx(LAT + 1e6 / BW)
    assert path["computing_s"] + path["messages_s"] == pytest.approx(result.makespan)
    # The other way round: rank 0 has nothing to compute, and both ranks end with the message; the path ends on
    # rank 0 (the first of equals), whose message waited for rank 1's tiles.
    late_receiver = simulate_pass(make_pass(2, 2, flows=[(0, 1, 1e6, 1)], tiles=[(1, 0, 0.1)]), links(2), True,
                                  stage_times=True)
    path = critical_path(late_receiver.stages)
    assert path["ranks"] == [0, 1] and path["computing_s"] == pytest.approx(0.1 + LAUNCH)


@pytest.mark.parametrize("batch", ["small_8gpu.json", "paper_lognormal_64gpu.json"])
def test_the_critical_path_of_a_plan_spans_its_attention(batch):
    """On real plans the path's computing and messages add up to the span from its first rank's start of stage 0
    to the end of the pass, and it names the rank that ends last."""
    from fcp_compiler.algorithms.timeline import critical_path

    plan = compile_valid(load_batch(ROOT / "traces" / batch), 8 if batch.startswith("small") else 64)
    simulation = simulate_plan(plan)
    for result in (simulation.layer_forward, simulation.layer_backward):
        path = critical_path(result.stages)
        first = path["ranks"][-1]
        span = float(np.maximum(result.stages.compute_end, result.stages.comm_end)[-1].max()
                     - result.stages.start[0, first])
        assert path["computing_s"] + path["messages_s"] == pytest.approx(span)
        assert path["ranks"][0] == int(np.argmax(np.maximum(result.stages.compute_end, result.stages.comm_end)[-1]))
        assert path["computing_s"] > 0


@pytest.mark.parametrize("layout", ["plan", "user"])
def test_the_layer_figures_need_no_attention_alone_pass(layout):
    """The floor scores candidates without simulating attention alone: the layer figures must be the same."""
    plan = compile_valid(load_batch(ROOT / "traces" / "small_8gpu.json"), 8, layout=layout)
    full = simulate_plan(plan).layer_figures()
    lean = simulate_plan(plan, attention_alone=False)
    assert lean.layer_figures() == full
    assert full["reshuffle_fwd_s"] > 0 if layout == "user" else full["reshuffle_fwd_s"] == 0
    # Its full figures still come, without the critical paths it kept no stage times for.
    figures = lean.figures()
    assert figures["critical_path_fwd"] is None and figures["critical_path_bwd"] is None
    assert figures["layer_makespan_fwd_s"] == full["layer_makespan_fwd_s"]
    summary = simulation_summary(figures, None)  # prints what it has, without the critical paths
    assert "layer ms" in summary and "critical path" not in summary


@pytest.mark.parametrize("mask, layout", [("causal", "plan"), ("causal", "user"), ("sliding_window:200", "plan"),
                                          ("mixed", "user")])
def test_a_plan_held_unencoded_simulates_as_its_file(mask, layout):
    """The floor simulates its candidates from their IR, stacked as the encoder lays them out (HeldPlan), and a
    CompiledPlan is simulated so too: every figure, the reshuffles and the data movement included, and the trace
    must be the file's."""
    lengths = [3000, 700, 90, 1500, 260, 1200, 5000, 64, 2100]
    if mask == "mixed":
        plan = compile_valid(BatchSpec.model_validate({**MIXED_MASKS, "sequences": lengths[:6]}), 4, block_size=256,
                             coalesce=2, layout=layout)
    else:
        plan = compile_valid(lengths, 4, block_size=256, coalesce=2, mask=mask, layout=layout)
    held = HeldPlan(stacked=stack_plan(plan.ir, plan.header), tiles=plan.ir.tiles)
    # The floor holds its tile sets' segment pairs for all its candidates: held so, the plan simulates alike.
    with_pairs = HeldPlan(stacked=held.stacked, tiles=plan.ir.tiles, pairs=plan.ir.tiles.segment_pairs())
    from_file = simulate_plan(plan.to_bytes(), record=True)
    for from_ir in (simulate_plan(held, record=True), simulate_plan(with_pairs, record=True),
                    simulate_plan(plan, record=True)):  # a CompiledPlan: its IR
        assert from_ir.figures() == from_file.figures()
        assert from_ir.chrome_trace() == from_file.chrome_trace()


def test_communication_takes_its_sm_share_from_compute():
    # 10 ms of messages beside 20 ms of tiles at 25% SMs for communication: 10 ms at 0.75 speed, then the rest.
    data = make_pass(2, 1, flows=[(0, 1, 1e7 - LAT * BW, 0)], tiles=[(0, 0, 0.02)])
    result = simulate_pass(data, links(2, sm_fraction=0.25), True)
    work = 0.02 + LAUNCH
    assert result.end[0] == pytest.approx(0.01 + (work - 0.01 * 0.75))
    assert result.busy[0] == pytest.approx(result.end[0])


@pytest.mark.parametrize("model", ["none", "llama3-8b"])
def test_trace_busy_time_matches_the_figures(tmp_path, model):
    plan = compile_valid([5000, 300, 12000, 800, 64, 9000], 4, block_size=1024, coalesce=2, model=model)
    trace = tmp_path / "trace.json"
    figures_path = tmp_path / "sim.json"
    plan.write(tmp_path / "p.fcp")
    assert main(["simulate", str(tmp_path / "p.fcp"), "--json", str(figures_path), "--trace", str(trace)]) == 0
    events = json.loads(trace.read_text())["traceEvents"]
    figures = json.loads(figures_path.read_text())
    for row in figures["per_rank"]:
        for label in ("fwd", "bwd"):
            # Each rank's compute track is its layer: attention alone without a model, linear layers around it with.
            track = TRACKS[(label, "compute")]
            busy = sum(e["dur"] for e in events
                       if e["ph"] == "X" and e.get("pid") == row["rank"] and e.get("tid") == track)
            assert busy * 1e-6 == pytest.approx(row[f"layer_busy_{label}_s"], rel=1e-9, abs=1e-12)
            if model == "none":
                assert row[f"layer_busy_{label}_s"] == pytest.approx(row[f"busy_{label}_s"], rel=1e-12)
    linear = [e for e in events if e["ph"] == "X" and e["name"].startswith(("linear", "K, V proj", "Q proj"))]
    assert bool(linear) == (model != "none")
    # With K,V prefetch (the default) the forward's projection shows K, V first, then Q.
    forward_linear = {e["name"] for e in linear if e["tid"] == TRACKS[("fwd", "compute")]}
    assert forward_linear == ({"K, V projection", "Q projection", "linear after attention"} if model != "none"
                              else set())
    names = {e["name"] for e in events if e["ph"] == "X" and e.get("tid") == TRACKS[("fwd", "compute")]}
    assert any(name.startswith("q") and "kv" in name and "stage" in name for name in names)
    assert any(e["ph"] == "X" and e["name"].startswith("KV b") for e in events)
    assert {"makespan_fwd_s", "makespan_bwd_s", "attention_mfu_fwd", "attention_mfu_bwd", "normalized_mfu_fwd",
            "normalized_mfu_bwd", "exposed_comm_fwd_s", "exposed_comm_bwd_s", "per_rank"} <= set(figures)
    assert {"rank", "busy_fwd_s", "busy_bwd_s", "eta_fwd", "eta_bwd"} <= set(figures["per_rank"][0])


def test_simulating_a_plan_is_consistent_with_its_stats():
    plan = compile_valid(load_batch(ROOT / "traces" / "paper_lognormal_64gpu.json"), 64)
    simulation = simulate_plan(plan.to_bytes())
    figures = simulation.figures()
    # No rank finishes before its own compute at the simulator's (stage-coalesced) kernel efficiency; the
    # compiler's per-tile figure uses block-sized tiles, which run less efficiently, so it is no bound.
    assert figures["makespan_fwd_s"] >= simulation.forward.compute.max() > 0
    assert 0 < figures["normalized_mfu_fwd"] <= 1 and 0 < figures["normalized_mfu_bwd"] <= 1
    assert min(row["eta_fwd"] for row in figures["per_rank"]) >= 1.0


@pytest.mark.parametrize("layout", ["plan", "user"])
def test_exposed_comm_is_what_each_passs_critical_path_waits_for(layout):
    """Not the most idle time of any rank: a lightly loaded rank waiting for the rest is idle, not exposed traffic.
    In the plan layout it is the path's message time; in the user layout the reshuffles it waits for add to it."""
    from fcp_compiler.algorithms.timeline import critical_path

    plan = compile_valid(load_batch(ROOT / "traces" / "paper_lognormal_64gpu.json"), 64, layout=layout)
    simulation = simulate_plan(plan)
    figures = simulation.figures()
    for key, result in (("fwd", simulation.forward), ("bwd", simulation.backward)):
        path = critical_path(result.stages)
        exposed = figures[f"exposed_comm_{key}_s"]
        assert exposed == pytest.approx(result.makespan - path["computing_s"], rel=1e-12, abs=1e-15)
        if layout == "plan":
            assert exposed == pytest.approx(path["messages_s"], rel=1e-9, abs=1e-12)
        else:
            assert exposed >= path["messages_s"] + 0.5 * result.reshuffle > 0
        assert figures[f"exposed_comm_share_{key}"] == pytest.approx(exposed / result.makespan)
        assert path["messages_s"] + path["computing_s"] <= result.makespan * (1 + 1e-9)
        # The old figure, under its own name.
        assert figures[f"max_rank_idle_{key}_s"] == float((result.end - result.busy).max())


@pytest.mark.long
def test_ablation_never_loses_and_ends_at_least_twice_the_base():
    steps = run_ablation(load_batch(ROOT / "traces" / "paper_lognormal_128gpu.json"), CompileOptions.of(128))
    assert [s["name"] for s in steps] == ["base", "pipeline", "solver", "coalescer", "reshuffler", "plan layout"]
    forward = [s["normalized_mfu_fwd"] for s in steps]
    assert all(b >= a - 1e-12 for a, b in zip(forward, forward[1:])), forward
    # Backward pushes share the rounds with pulls (one message per rank and round), so with one round a stage the
    # pipelined backward runs about twice the stages of the forward pass; from congestion-free rounds on every
    # technique pays again.
    backward = [s["normalized_mfu_bwd"] for s in steps]
    assert all(b >= a - 1e-12 for a, b in zip(backward[2:], backward[3:])), backward
    for values in (forward, backward):
        assert values[-1] >= 2 * values[0], values


def test_every_ablation_step_that_does_not_rise_says_why():
    """At 8 GPUs pipelining alone (block-sized launches, no matchings) is slower than the pull-all base."""
    from fcp_compiler.tools.report import ablation_table

    steps = run_ablation(load_batch(ROOT / "traces" / "small_8gpu.json"), CompileOptions.of(8, model="none"))
    assert steps[0].get("why_not_faster") is None
    for before, step in zip(steps, steps[1:]):
        falls = [key for key in ("fwd", "bwd") if step[f"normalized_mfu_{key}"] <= before[f"normalized_mfu_{key}"]]
        assert bool(falls) == bool(step["why_not_faster"]), step["name"]
        for key in falls:
            assert f"{key}: the busiest rank's kernels" in step["why_not_faster"]
    pipeline = steps[1]
    assert pipeline["normalized_mfu_fwd"] < steps[0]["normalized_mfu_fwd"]
    assert pipeline["busiest_compute_fwd_s"] > steps[0]["busiest_compute_fwd_s"]
    assert pipeline["num_launch_stages_fwd"] > steps[0]["num_launch_stages_fwd"] == 1
    assert f"pipeline is not faster than the step before: {pipeline['why_not_faster']}" in ablation_table(steps)



@pytest.mark.parametrize("gpus, gpus_per_node, mask", [(4, 8, "causal"), (8, 4, "causal"), (16, 4, "causal"),
                                                       (8, 4, "sliding_window:300"), (8, 2, "full")])
def test_the_first_stage_bound_holds_for_every_user_layout_plan(gpus, gpus_per_node, mask):
    """first_stage_bound: no rank starts the forward's stage 1 before every link end has carried its share of the
    input reshuffle and of the stage-0 messages, so the bound is at most the simulated start (and in the plan layout
    there is none)."""
    from fcp_compiler.format.inputs import load_profile
    from fcp_compiler.format.plan_format import PlanReader
    from fcp_compiler.format.stacked import stack_reader
    from fcp_compiler.tools.ablation import first_stage_bound

    lengths = [9000, 700, 90, 1500, 260, 1200, 5000, 64, 2100, 30000, 333, 4096]
    profile = load_profile("h100").model_copy(update={"gpus_per_node": gpus_per_node})
    for layout in ("user", "plan"):
        plan = compile_valid(lengths, gpus, block_size=512, coalesce=2, mask=mask, layout=layout, profile=profile)
        bound = first_stage_bound(stack_reader(PlanReader(plan.to_bytes())))
        if layout == "plan":
            assert bound is None
            continue
        assert plan.header.num_fwd_stages >= 2
        simulation = simulate_plan(plan)
        start = float(simulation.forward.stages.start[1].max())
        assert 0 < bound["bound_s"] <= start * (1 + 1e-9)
        assert bound["bound_s"] == pytest.approx(bound["reshuffle_s"] + bound["messages_s"])
        assert bound["reshuffle_s"] > 0

MIXED_MASKS = {"masks": [{"kind": "sliding_window", "window": 300}, "full", "causal",
                         {"kind": "sliding_window", "window": 1000}, {"kind": "sliding_window", "window": 40}, "full"]}


@pytest.mark.parametrize("mask,layout", [("causal", "plan"), ("causal", "user"), ("full", "plan"),
                                         ("sliding_window:200", "plan"), ("mixed", "user"), ("small calls", "plan")])
def test_simulated_kernel_launches_are_the_calls_the_runtime_makes(mask, layout, monkeypatch):
    pytest.importorskip("torch")
    if mask == "small calls":  # large packed calls cut into several (call_plan.split_calls)
        import fcp_compiler.algorithms.call_plan as call_plan

        monkeypatch.setattr(call_plan, "MAX_CALL_QUERY_ROWS", 150)
        monkeypatch.setattr(call_plan, "MAX_CALL_KEY_ROWS", 300)
        mask = "causal"
    from fcp_runtime import load_rank_plan
    from fcp_runtime.stage_calls import stage_calls

    from fcp_compiler.format.inputs import BatchSpec

    lengths = [3000, 700, 90, 1500, 260, 1200]
    if mask == "mixed":
        plan = compile_valid(BatchSpec.model_validate({**MIXED_MASKS, "sequences": lengths}), 4, block_size=256,
                             coalesce=2, layout=layout)
    else:
        plan = compile_valid(lengths, 4, block_size=256, coalesce=2, mask=mask, layout=layout)
    simulation = simulate_plan(plan)
    for rank in range(4):
        rank_plan = load_rank_plan(plan.to_bytes(), rank)
        for name, program, result in (("fwd", rank_plan.forward, simulation.forward),
                                      ("bwd", rank_plan.backward, simulation.backward)):
            skip = rank_plan.early_tiles if name == "fwd" else frozenset()
            for stage in range(program.num_stages):
                tiles = [t for t in program.tiles[stage] if t not in skip]
                assert result.calls[stage, rank] == len(stage_calls(rank_plan, name, stage, tiles, "cpu"))


def test_layer_figures_add_the_linear_layers_of_each_ranks_tokens():
    from fcp_compiler.core.layer_model import BACKWARD_LINEAR_WORK
    from fcp_compiler.format.models import MODEL_PRESETS

    lengths = [3000, 700, 90, 1500, 260, 1200]
    model = MODEL_PRESETS["llama3-8b"]
    # Q, K, V, O projections (4096 x (32 + 16) x 128 and 32 x 128 x 4096) and three 4096 x 14336 MLP matrices.
    assert model.linear_flops_per_token == 2 * (4096 * 48 * 128 + 4096 * 4096 + 3 * 4096 * 14336)
    assert model.projection_flops_per_token == 2 * 4096 * 48 * 128
    for layout in ("plan", "user"):
        plan = compile_valid(lengths, 4, block_size=256, coalesce=2, layout=layout, model="llama3-8b")
        simulation = simulate_plan(plan)
        figures = simulation.layer_figures()
        tokens = (plan.stats["max_tokens_per_rank"] if layout == "plan"
                  else -(-sum(lengths) // 4))  # the user layout's largest even chunk
        peak = plan.header.profile.peak_tflops * 1e12
        per_token = model.linear_flops_per_token / (peak * model.linear_efficiency)
        assert figures["linear_fwd_s"] == pytest.approx(tokens * per_token)
        # Each rank: its projection, then its attention (messages wait for both ends' projections), then the rest.
        projection = simulation.rank_tokens * model.projection_flops_per_token / (peak * model.linear_efficiency)
        ends = simulation.layer_forward.end + simulation.rank_tokens * per_token - projection
        assert figures["layer_makespan_fwd_s"] == pytest.approx(float(ends.max()))
        assert (simulation.layer_forward.end >= projection + simulation.layer_forward.busy - 1e-12).all()
        ends_bwd = simulation.layer_backward.end + projection * BACKWARD_LINEAR_WORK
        assert figures["layer_makespan_bwd_s"] == pytest.approx(float(ends_bwd.max()))
        # Never shorter than the slowest rank's linear layers plus the attention run alone, never longer than
        # the largest linear time plus the attention makespan with every rank waiting for the slowest projection.
        assert figures["layer_makespan_fwd_s"] >= float((simulation.rank_tokens * per_token).max()) - 1e-12
        assert figures["layer_makespan_fwd_s"] <= figures["linear_fwd_s"] + simulation.forward.makespan + 1e-9
        assert (figures["reshuffle_fwd_s"] > 0) == (layout == "user")
        assert 0 < figures["layer_mfu"] < 1 and 0 < figures["normalized_layer_mfu"] <= 1


def test_a_remote_tile_waits_for_its_senders_projection():
    # Rank 1's tile needs rank 0's block; rank 0 finishes its Q, K, V projection at 0.3 s, rank 1 at 0.1 s.
    data = make_pass(2, 2, flows=[(0, 1, 4e6, 0)], tiles=[(1, 1, 0.01), (0, 0, 0.02)])
    result = simulate_pass(data, links(2), True, rank_start=np.array([0.3, 0.1]))
    assert result.end[1] == pytest.approx(0.3 + LAT + 4e6 / BW + 0.01 + LAUNCH)
    assert result.end[0] == pytest.approx(0.3 + max(0.02 + LAUNCH, LAT + 4e6 / BW))
    # Both ends' projections: the receiver's too, when it is the later one.
    result = simulate_pass(data, links(2), True, rank_start=np.array([0.1, 0.3]))
    assert result.end[1] == pytest.approx(0.3 + LAT + 4e6 / BW + 0.01 + LAUNCH)


def test_a_prefetched_pull_leaves_once_both_ends_have_projected_k_and_v():
    # Rank 1's stage-1 tile reads rank 0's K,V, pulled in stage 0; both ranks project K,V by 0.05 s and Q by 0.3 s.
    flows = [(0, 1, 4e6, 0), (1, 0, 2e6, 0)]
    data = make_pass(2, 2, flows=flows, tiles=[(1, 1, 0.01), (0, 0, 0.02)])
    plain = simulate_pass(data, links(2), True, rank_start=np.array([0.3, 0.3]))
    assert plain.end[1] == pytest.approx(0.3 + LAT + 4e6 / BW + 0.01 + LAUNCH)
    early = PassInput(**{**{name: getattr(data, name) for name in data.__slots__},
                         "flow_prefetch": np.array([True, False])})
    result = simulate_pass(early, links(2), True, rank_start=np.array([0.3, 0.3]),
                           prefetch_start=np.array([0.05, 0.02]))
    # It leaves at 0.05 and is in by 0.05 + LAT + 4 ms, under the Q projection: the tile runs as stage 1 starts.
    assert result.end[1] == pytest.approx(0.3 + LAT + 2e6 / BW + 0.01 + LAUNCH)  # the other pull still waits
    # With comm taking half the SMs, the Q projection behind it runs at half speed from the rank's post to the
    # transfer's end (as a stage's tiles do from the stage start), so rank 1 begins later, and its pull with it.
    slowed = simulate_pass(early, links(2, sm_fraction=0.5), True, rank_start=np.array([0.3, 0.3]),
                           prefetch_start=np.array([0.05, 0.02]))
    window = 0.05 + LAT + 4e6 / BW - 0.02
    begin = 0.02 + window + (0.3 - 0.02 - window * 0.5)
    assert slowed.end[1] == pytest.approx(begin + LAT + 2e6 / BW + 0.01 + LAUNCH)


@pytest.mark.parametrize("seed", range(4))
def test_prefetching_first_stage_kv_never_slows_a_plan_where_comm_takes_no_sms(seed):
    """Posting each pass's stage-0 K,V pulls early (forward: once K and V are projected; backward: as it starts)
    moves messages earlier and nothing later: with no SM share for comm (so the linear layers beside them run at
    full speed) no rank ends either pass later, and on these batches some rank ends each earlier. In the user
    layout there is no prefetch."""
    from fcp_compiler.format.inputs import PRESET_PROFILES

    rng = np.random.default_rng(seed)
    lengths = [int(x) for x in rng.integers(64, 2500, size=int(rng.integers(4, 12)))]
    # A slow network, so that the first stage's pulls outlast its local tiles.
    profile = PRESET_PROFILES["h100"].model_copy(update={"comm_sm_fraction": 0.0, "gpus_per_node": 2,
                                                         "network_gbps": 2.0, "nvlink_gbps": 10.0})
    for layout in ("plan", "user"):
        plan = compile_valid(lengths, 8, block_size=128, coalesce=2, profile=profile, layout=layout)
        assert plan.header.kv_prefetch == (layout == "plan")
        on, off = (simulate_plan(plan, kv_prefetch=switch, attention_alone=False) for switch in (True, False))
        for on_pass, off_pass in ((on.layer_forward, off.layer_forward), (on.layer_backward, off.layer_backward)):
            assert (on_pass.end <= off_pass.end + 1e-12).all()
            assert (on_pass.end < off_pass.end - 1e-9).any() == (layout == "plan")


def test_simulate_with_a_model_prints_the_layer_and_refuses_unknown_models(tmp_path, capsys):
    plan = tmp_path / "p.fcp"
    compile_valid([3000, 700, 90, 1500], 4, block_size=256).write(plan)
    out = tmp_path / "figures.json"
    assert main(["simulate", str(plan), "--model", "llama3-70b", "--json", str(out)]) == 0
    figures = json.loads(out.read_text())
    assert {"layout", "reshuffle_fwd_s", "reshuffle_bwd_s", "linear_fwd_s", "linear_bwd_s", "layer_makespan_fwd_s",
            "layer_makespan_bwd_s", "layer_mfu", "normalized_layer_mfu", "layer_makespan_lower_bound_fwd_s",
            "layer_makespan_lower_bound_bwd_s", "layer_gap_fwd", "layer_gap_bwd"} <= set(figures)
    assert figures["model"] == "llama3-70b"
    assert "layer MFU" in capsys.readouterr().out
    assert main(["simulate", str(plan), "--model", "none", "--json", str(out)]) == 0
    alone = json.loads(out.read_text())
    assert alone["layer_makespan_fwd_s"] == pytest.approx(alone["makespan_fwd_s"]) and alone["linear_fwd_s"] == 0
    capsys.readouterr()
    assert main(["simulate", str(plan), "--model", "gpt-9"]) == 2
    assert "model 'gpt-9' must be one of gpt-oss-120b, llama3-70b, llama3-8b or none" in capsys.readouterr().err


@pytest.mark.parametrize("launch_kind", ["stages", "one launch", "reshuffle"])
def test_coalesced_seconds_charge_each_query_segments_keys_in_a_launch_as_one_call(launch_kind):
    from fcp_compiler.core.passes.cost import tile_efficiency
    from fcp_compiler.core.simulate import coalesced_seconds

    spec = BatchSpec.model_validate({"masks": ["causal", "full", {"kind": "sliding_window", "window": 300}, "causal"],
                                     "sequences": [3000, 700, 2900, 90]})
    plan = compile_valid(spec, 4, block_size=256, coalesce=2)
    tiles, assignment = plan.ir.tiles, plan.ir.assignment
    rng = np.random.default_rng(0)
    plan_tiles = rng.permutation(tiles.num_tiles)  # a plan's tiles come in any order
    rank = assignment.tile_rank[plan_tiles]
    launch = {"stages": rng.integers(0, 3, plan_tiles.size), "one launch": np.zeros(plan_tiles.size, dtype=np.int64),
              "reshuffle": rng.integers(-1, 2, plan_tiles.size)}[launch_kind]
    ours = coalesced_seconds(tiles, plan_tiles, rank, launch, tiles.profile)
    # Plainly: per (rank, launch, query segment), the query's tokens against all its keys' tokens in that launch.
    pair_tile, q_seg, kv_seg, flops = tiles.segment_pairs()
    where = {int(tile): position for position, tile in enumerate(plan_tiles)}
    seg_tokens = tiles.sharding.seg_tokens
    keys: dict = {}
    for tile, q, kv in zip(pair_tile.tolist(), q_seg.tolist(), kv_seg.tolist()):
        if tile in where:
            group = (int(rank[where[tile]]), int(launch[where[tile]]), q)
            keys[group] = keys.get(group, 0) + int(seg_tokens[kv])
    expected = np.zeros(plan_tiles.size)
    for tile, q, work in zip(pair_tile.tolist(), q_seg.tolist(), flops.tolist()):
        if tile in where:
            at = where[tile]
            size = np.sqrt(float(seg_tokens[q]) * keys[(int(rank[at]), int(launch[at]), q)])
            expected[at] += work / (tiles.profile.peak_tflops * 1e12 * float(tile_efficiency(tiles.profile, size)))
    assert len(keys) > 20
    np.testing.assert_allclose(ours, expected, rtol=1e-12)


@pytest.mark.parametrize("mask", ["causal", "sliding_window:300"])
def test_launches_read_in_parts_are_those_of_every_pair_at_once(monkeypatch, mask):
    """The segment pairs read a part at a time (TileSet.pair_parts: a query block's pairs in one part) give each
    tile's seconds and each stage's kernel calls to the last bit, whatever the parts' size, built part by part or cut
    from the pairs held whole."""
    from fcp_compiler.core import launches

    plan = compile_valid([4096, 2048 + 100, 700, 64, 1200], 4, block_size=128, mask=mask, floor=False)
    tiles = plan.ir.tiles
    pairs = tiles.segment_pairs()
    assert (tiles.dense.num_blocks.size > 1) == (mask == "causal") and tiles.listed_pair_tile.size > 0
    rng = np.random.default_rng(0)
    order, rank = rng.permutation(tiles.num_tiles), rng.integers(0, 4, tiles.num_tiles)
    launch, stage = rng.integers(-1, 3, tiles.num_tiles), rng.integers(0, 4, tiles.num_tiles)
    found = []
    for most, held in ((1 << 20, pairs), (1 << 20, None), (37, None), (1, pairs)):
        monkeypatch.setattr(launches, "PAIR_PART", most)
        parts = list(tiles.pair_parts(most, held))
        for column, cut in zip(pairs, zip(*(part for _, part, _ in parts))):
            assert np.array_equal(column, np.concatenate(cut))
        for rows, part, itself in parts:  # the dense parts' kinds in closed form are the classified ones
            if itself is not None:
                assert all(np.array_equal(a, b) for a, b in zip(launches._dense_kinds(itself),
                                                                launches.pair_kinds(tiles, part)))
        found.append([launches.coalesced_seconds(tiles, order, rank, launch, tiles.profile, held)] +
                     [launches.kernel_calls(tiles, order, rank, stage, 4, 4, held, split) for split in (False, True)])
    for other in found[1:]:
        assert all(np.array_equal(a, b) for a, b in zip(found[0], other))


def test_a_plans_tiles_are_found_in_its_tile_set_as_a_search_would_find_them():
    import dataclasses

    from fcp_compiler.core.plan_tiles import plan_tiles

    plan = compile_valid([3000, 700, 2900, 90, 1500], 4, block_size=256, coalesce=2)
    stacked, tiles = stack_plan(plan.ir, plan.header), plan.ir.tiles
    keys = tiles.tile_q_block * tiles.sharding.num_blocks + tiles.tile_kv_block
    wanted = stacked.arrays["tile_q_block"] * tiles.sharding.num_blocks + stacked.arrays["tile_kv_block"]
    found = plan_tiles(stacked, tiles)
    assert np.array_equal(found.row_tile, np.searchsorted(keys, wanted))
    # The IR's pipeline order is the plan's rows, and its tiles' ranks and stages those the rows read.
    from_ir = plan_tiles(stacked, tiles, plan.ir)
    assert np.array_equal(from_ir.row_tile, found.row_tile) and np.array_equal(from_ir.rank_rows, found.rank_rows)
    for name in ("rank", "fwd_stage", "bwd_stage"):
        assert np.array_equal(getattr(from_ir, name), getattr(found, name))
    assert not np.array_equal(wanted, np.sort(wanted))  # the plan's order is not the tile set's
    # A stack that repeats a tile is not a permutation of the tile set: searched tile by tile.
    arrays = dict(stacked.arrays, tile_kv_block=stacked.arrays["tile_kv_block"].copy())
    arrays["tile_q_block"] = arrays["tile_q_block"].copy()
    arrays["tile_q_block"][1], arrays["tile_kv_block"][1] = arrays["tile_q_block"][0], arrays["tile_kv_block"][0]
    repeated = dataclasses.replace(stacked, arrays=arrays)
    found = plan_tiles(repeated, tiles).row_tile
    assert found[1] == found[0] and np.array_equal(np.delete(found, 1), np.delete(np.searchsorted(keys, wanted), 1))


def test_last_of_most_is_the_end_of_each_groups_run_in_a_lexsort():
    from fcp_compiler.algorithms.timeline import last_of_most

    rng = np.random.default_rng(0)
    for _ in range(300):
        size = int(rng.integers(0, 60))
        groups, values = rng.integers(0, 7, size), rng.integers(0, 4, size).astype(float)  # many ties
        order = np.lexsort((values, groups))
        expected = order[np.append(groups[order][1:] != groups[order][:-1], True)] if size else order
        assert np.array_equal(last_of_most(groups, values), expected)

"""The floor (core/floor.py: its policy and compile_with_floor): FCP keeps the fastest of its candidates that fits the
memory budget, scored by the same simulation `fcp simulate` runs, and no faster-fitting candidate is passed over."""

import math

import numpy as np
import pytest

from conftest import compile_valid
from fcp_compiler import compile_plan
from fcp_compiler.core.floor import Candidate, Placement, Score, candidates, choose
from fcp_compiler.core.simulate import simulate_plan
from fcp_compiler.format.models import load_model
from fcp_compiler.tools.traces import lognormal_batch


def _score(name: str, seconds: float, buffer: int, fan_out: bool = True) -> Score:
    return Score(candidate=Candidate(placement=Placement(name), fan_out=fan_out), coalesce=16, backward_rounds=32,
                 layer_makespan_fwd_s=seconds / 3, layer_makespan_bwd_s=2 * seconds / 3, max_buffer_tokens=buffer)


def test_choose_takes_the_fastest_within_the_budget_else_the_least_memory():
    scores = [_score("layer", 3.0, 100), _score("attention", 2.0, 300), _score("greedy", 2.5, 200)]
    assert choose(scores, 250) == 2  # the fastest (attention) is over the budget
    assert choose(scores, 300) == 1
    assert choose(scores, 50) == 0  # none fits: the fewest buffer tokens
    tied = [_score("layer", 2.0, 10), _score("greedy", 2.0, 10)]
    assert choose(tied, 10) == 0  # ties go to the candidate tried first


def test_candidates_cover_every_placement_and_switch_and_respect_the_users():
    names = [candidate.name for candidate in candidates(False, None)]
    # The other token tolerances stand in for the attention placement (it won 1 of 54 matrix batches, by 0.04%).
    assert names == ["layer direct", "layer+fan-out", "layer-tokens-1% direct", "layer-tokens-10% direct",
                     "greedy direct", "magi direct"]
    assert [c.name for c in candidates(False, None, tolerances=False)] == [
        "layer direct", "layer+fan-out", "attention direct", "greedy direct", "magi direct"]
    assert [c.name for c in candidates(False, True, tolerances=False)] == ["layer+fan-out", "attention+fan-out",
                                                                          "greedy+fan-out"]
    assert [c.name for c in candidates(True, False)] == ["layer direct", "greedy direct", "magi direct"]


def test_the_fastest_direct_placement_follows_with_fan_out_only_when_fcps_own_fits_with_it():
    from fcp_compiler.core.floor import fan_out_follower

    own_direct, own_fan_out = _score("layer", 3.0, 100, fan_out=False), _score("layer", 2.9, 150)
    greedy, magi = _score("greedy", 2.0, 120, fan_out=False), _score("magi", 1.9, 120, fan_out=False)
    assert fan_out_follower([own_direct, own_fan_out, greedy], 200) == Candidate(placement=Placement.GREEDY,
                                                                                 fan_out=True)
    assert fan_out_follower([own_direct, own_fan_out, greedy, magi], 200).placement is Placement.GREEDY  # its placement
    assert fan_out_follower([own_direct, own_fan_out, greedy], 140) is None  # FCP's own was over with fan-out
    assert fan_out_follower([own_direct, own_fan_out, _score("greedy", 2.0, 300, fan_out=False)], 200) is None
    assert fan_out_follower([_score("layer", 1.0, 100, fan_out=False), own_fan_out, greedy], 200) is None


@pytest.mark.parametrize("seed, gpus", [(1, 16), (4, 32)])
def test_the_plan_is_the_fastest_fitting_candidate_and_each_score_is_what_simulate_says(seed, gpus):
    lengths = lognormal_batch(gpus * 8192, 2048, 1.8, 64, 131072, seed=seed)
    options = dict(block_size=512, coalesce=4, gpus_per_node=4)
    plan = compile_valid(lengths, gpus, **options)
    floor = plan.stats["floor"]
    rows = floor["candidates"]
    # Every candidate is scheduled, or skipped as the same placement as an earlier one, by its busy bound, or (node
    # fan-out) as out of the budget's reach; the fastest direct placement follows with fan-out when FCP's own fit
    # with it.
    followers = [row for row in rows if "+fan-out" in row["name"] and not row["name"].startswith("layer+")]
    assert len(rows) + len(floor["pruned"]) + len(floor["out_of_reach"]) == \
        len(candidates(False, None)) + len(followers)
    assert floor["memory_budget_tokens"] == 4 * 4 * 512
    own_fan_out = [row for row in rows if row["name"].startswith("layer+fan-out")]
    assert not followers or own_fan_out[0]["max_buffer_tokens"] <= floor["memory_budget_tokens"]
    best = min(row["layer_makespan_fwd_s"] + row["layer_makespan_bwd_s"] for row in rows)
    for skipped in floor["pruned"]:
        assert skipped["same_as"] is not None or skipped["busy_lower_bound_s"] >= best
    simulated = simulate_plan(plan).layer_figures()
    layer = simulated["layer_makespan_fwd_s"] + simulated["layer_makespan_bwd_s"]
    assert plan.header.max_buffer_tokens <= floor["memory_budget_tokens"] or all(
        row["max_buffer_tokens"] > floor["memory_budget_tokens"] for row in rows)
    for row in rows:
        if row["max_buffer_tokens"] <= floor["memory_budget_tokens"]:
            assert layer <= row["layer_makespan_fwd_s"] + row["layer_makespan_bwd_s"] + 1e-12, row["name"]
        else:  # over the budget (or its forward half alone was): never scored
            assert math.isinf(row["layer_makespan_fwd_s"])
    # FCP's own placement compiled alone is the floor's first candidate: scheduled as the floor scheduled it (the
    # same record), and finished no slower than it scored.
    for fan_out in (True, False):
        alone = compile_plan(lengths, gpus, floor=False, node_fan_out=fan_out, **options)
        row = next((r for r in rows if r["name"].startswith("layer+fan-out" if fan_out else "layer direct")), None)
        (own,) = alone.stats["floor"]["candidates"]
        if row is None:  # fan-out out of reach: its plan is over the budget (what compile_plan's stats say)
            assert fan_out and alone.header.max_buffer_tokens > floor["memory_budget_tokens"]
            continue
        assert {**own, "seconds": 0, "busy_lower_bound_s": None} == {**row, "seconds": 0, "busy_lower_bound_s": None}
        if row["max_buffer_tokens"] <= floor["memory_budget_tokens"]:
            figures = simulate_plan(alone).layer_figures()
            assert figures["layer_makespan_fwd_s"] + figures["layer_makespan_bwd_s"] <= \
                row["layer_makespan_fwd_s"] + row["layer_makespan_bwd_s"] + 1e-12


def test_the_winner_is_deterministic_and_the_stats_name_it():
    lengths = lognormal_batch(16 * 8192, 2048, 1.8, 64, 131072, seed=2)
    first = compile_plan(lengths, 16, block_size=512, coalesce=4, gpus_per_node=4)
    second = compile_plan(lengths, 16, block_size=512, coalesce=4, gpus_per_node=4)
    assert first.to_bytes() == second.to_bytes()
    assert first.stats["floor"]["winner"] in [row["name"] for row in first.stats["floor"]["candidates"]]
    stages = first.stats["floor"]["winner"].rsplit(" c", 1)[1]
    assert stages == f"{first.header.coalesce}/{first.header.bwd_coalesce}"


def test_progress_reports_every_scheduled_candidate_as_the_stats_record_it():
    from fcp_compiler.tools.report import floor_progress_line

    lengths = lognormal_batch(16 * 8192, 2048, 1.8, 64, 131072, seed=2)
    seen = []
    plan = compile_plan(lengths, 16, block_size=512, coalesce=4, gpus_per_node=4, progress=seen.append)
    assert seen == plan.stats["floor"]["candidates"]
    budget = plan.stats["floor"]["memory_budget_tokens"]
    for row in seen:
        line = floor_progress_line(row)
        assert line.startswith(f"  floor: {row['name']} ") and line.endswith(f"({row['seconds']:.1f} s)")
        assert ("over memory" in line) == (row["max_buffer_tokens"] > budget)
    assert "not simulated" in floor_progress_line({**seen[0], "layer_makespan_fwd_s": None,
                                                   "layer_makespan_bwd_s": None})


def test_no_floor_and_ablations_compile_one_candidate():
    lengths = np.array([8192, 4096, 300, 2000] * 4)
    for fan_out, name in ((None, "layer direct"), (True, "layer+fan-out")):  # FCP's own placement, scored alone
        alone = compile_plan(lengths, 8, block_size=1024, floor=False, node_fan_out=fan_out).stats["floor"]
        assert [row["name"].rsplit(" c", 1)[0] for row in alone["candidates"]] == [name]
        assert alone["pruned"] == [] and alone["out_of_reach"] == []
    assert "floor" not in compile_plan(lengths, 8, block_size=1024, pipelined=False).stats
    assert "floor" not in compile_plan(lengths, 8, block_size=1024, planner="magi").stats


@pytest.mark.parametrize("seed, gpus", [(1, 8), pytest.param(0, 16, marks=pytest.mark.long)])
def test_plans_with_smaller_backward_stages_validate_and_replay_exactly(seed, gpus):
    """The floor shrinks the backward's stages (fewer rounds a stage than twice the forward's) to fit the memory
    budget: such plans keep every invariant, their buffers within the header, and replay exactly."""
    torch = pytest.importorskip("torch")
    from runtime_harness import compare_with_reference, run_ranks

    lengths = lognormal_batch(gpus * 2048, 512, 1.8, 16, 16384, seed=seed)
    plan = compile_valid(lengths, gpus, block_size=128, coalesce=4, gpus_per_node=4)
    assert plan.header.bwd_coalesce < 2 * plan.header.coalesce  # the case this test is for
    assert plan.header.max_buffer_tokens <= plan.stats["floor"]["memory_budget_tokens"]
    run_ranks(gpus, compare_with_reference(plan.to_bytes(), lengths, True, 4, 2, torch.float64, "plan"))


def test_a_plan_kept_at_twice_the_rounds_a_stage_validates_and_replays_exactly():
    """schedule_search.faster_stages keeps a candidate coalesced at twice the requested rounds a stage where that fits
    and simulates faster (block 256): such a plan keeps every invariant and replays exactly in fp64."""
    torch = pytest.importorskip("torch")
    from runtime_harness import compare_with_reference, run_ranks

    total = 4 * 2048
    lengths = lognormal_batch(total, total // 64, 1.8, 16, total // 2, 0)
    plan = compile_valid(lengths, 4, block_size=256, coalesce=8)
    assert plan.header.coalesce == 16 and plan.header.bwd_coalesce == 32  # the case this test is for
    run_ranks(4, compare_with_reference(plan.to_bytes(), lengths, True, 4, 2, torch.float64, "plan"))


@pytest.mark.parametrize("layout, seed", [("plan", 0), ("user", 3), pytest.param("user", 0, marks=pytest.mark.long),
                                          pytest.param("plan", 3, marks=pytest.mark.long)])
def test_the_busy_bound_never_exceeds_the_simulated_layer_of_any_schedule_of_the_placement(layout, seed):
    """The floor skips a placement whose busiest rank alone outlasts the best plan so far: the bound must hold for
    every schedule of it, whatever the stage sizes, fan-out or model."""
    from fcp_compiler.core.simulate import busy_lower_bound

    lengths = lognormal_batch(16 * 8192, 2048, 1.8, 64, 131072, seed=seed)
    for model in ("llama3-70b", "none"):
        for fan_out in (True, False):
            for coalesce in (1, 4):
                plan = compile_plan(lengths, 16, block_size=512, coalesce=coalesce, gpus_per_node=4, layout=layout,
                                    model=model, floor=False, node_fan_out=fan_out)
                figures = simulate_plan(plan).layer_figures()
                bound = busy_lower_bound(plan.ir.assignment, plan.header.layout, load_model(model))
                simulated = figures["layer_makespan_fwd_s"] + figures["layer_makespan_bwd_s"]
                assert 0 < bound <= simulated, (model, fan_out, coalesce)


def test_the_floors_work_is_bounded_by_tiles_and_always_schedules_fcps_own_placement(monkeypatch):
    from fcp_compiler.core import floor

    assert floor.most_scheduled(75_000) >= 10 and floor.most_scheduled(1_200_000) == 1
    lengths = lognormal_batch(16 * 8192, 2048, 1.8, 64, 131072, seed=1)
    plan = compile_plan(lengths, 16, block_size=512, coalesce=4, gpus_per_node=4)
    monkeypatch.setattr(floor, "TILE_BUDGET", 2 * plan.stats["num_tiles"])
    bounded = compile_valid(lengths, 16, block_size=512, coalesce=4, gpus_per_node=4).stats["floor"]
    assert bounded["most_scheduled"] == 2
    # FCP's own placement first; its fan-out, out of the budget's reach here, keeps its place in the count without
    # being scheduled, so the floor schedules what it did before, less that candidate.
    assert [row["candidate"] for row in bounded["out_of_reach"]] == ["layer+fan-out"]
    assert [row["name"].split(" c")[0] for row in bounded["candidates"]] == ["layer direct"]
    # With one candidate there is nothing to compare: it is not simulated, and `fcp compile` simulates what it
    # prints instead.
    lengths = lognormal_batch(16 * 8192, 2048, 1.8, 64, 131072, seed=2)  # FCP's own plan fits the budget
    monkeypatch.setattr(floor, "TILE_BUDGET", 10**9)
    num_tiles = compile_plan(lengths, 16, block_size=512, coalesce=4, gpus_per_node=4).stats["num_tiles"]
    monkeypatch.setattr(floor, "TILE_BUDGET", num_tiles)
    alone = compile_valid(lengths, 16, block_size=512, coalesce=4, gpus_per_node=4)
    (row,) = alone.stats["floor"]["candidates"]
    assert row["name"].startswith("layer direct") and row["layer_makespan_fwd_s"] is None
    assert "layer_makespan_fwd_s" not in alone.stats
    from fcp_compiler.tools.report import compile_summary

    summary = compile_summary(alone.stats, "plan.fcp")
    assert "not simulated (the only candidate)" in summary and "of 1 candidate scheduled" in summary


def test_a_baseline_held_to_the_floors_memory_budget_fits_it_with_smaller_backward_stages():
    """fit_memory schedules one placement as the floor fits its candidates, so that planners compare at equal
    memory; without it the baseline keeps its system's stages and may hold more."""
    lengths = lognormal_batch(64 * 32768, 4096, 1.8, 64, 524288, seed=0)
    budget = 4 * 16 * 4096
    free = compile_valid(lengths, 64, planner="magi", node_fan_out=False)
    held = compile_valid(lengths, 64, planner="magi", node_fan_out=False, fit_memory=True)
    assert free.header.max_buffer_tokens > budget >= held.header.max_buffer_tokens
    assert held.header.coalesce == free.header.coalesce and held.header.bwd_coalesce < free.header.bwd_coalesce
    assert held.header.inputs_digest != free.header.inputs_digest  # a different plan, said so in its digest


def test_a_plan_that_deeper_levelling_lifts_over_the_budget_keeps_its_stages_with_the_backward_levelled_less():
    """Levelling holds a delayed tile's pulled block live: where the default depth (3 stages' worth) lifts the
    backward over the memory budget, schedule_search.fit_memory levels the backward again within 2 before it shrinks
    any stage, and keeps the forward as it was."""
    from fcp_compiler.core import schedule_search
    from fcp_compiler.core.memory_budget import memory_budget_tokens
    from fcp_compiler.core.options import CompileOptions
    from fcp_compiler.core.passes.coalesce import LEVELLING_STAGES, TIGHT_LEVELLING_STAGES, coalesce, pass_peaks

    # The placement at a 1% token tolerance is one whose backward deep levelling lifts over the budget.
    options = CompileOptions.of(64, model="llama3-70b", token_tolerance=0.01)
    timer, rounds = _own_rounds(options, lognormal_batch(64 * 32768, 4096, 1.8, 64, 524288, seed=0))
    budget_tokens = memory_budget_tokens(options)
    deep, shallow = (coalesce(rounds, 16, levelling_stages=depth) for depth in (LEVELLING_STAGES,
                                                                                  TIGHT_LEVELLING_STAGES))
    assert pass_peaks(deep)[1] > budget_tokens >= pass_peaks(deep)[0]  # the backward is the one over
    kept = schedule_search.fit_memory(timer, rounds, options, budget_tokens)
    fitted = kept.schedule
    # a refit, not coalesce's own schedule
    assert kept.peak_tokens == max(pass_peaks(fitted)) <= budget_tokens and not kept.plain
    assert fitted.backward.coalesce == 2 * fitted.coalesce == 32  # no stage shrunk
    assert np.array_equal(fitted.forward.tile_stage, deep.forward.tile_stage)
    assert np.array_equal(fitted.backward.tile_stage, shallow.backward.tile_stage)
    assert not np.array_equal(fitted.backward.tile_stage, deep.backward.tile_stage)


def test_a_schedule_whose_relays_would_break_the_budget_is_finished_without_them(monkeypatch):
    """A relay holds its block until it has re-sent it: where that lifts a fitting schedule over the budget, the
    floor keeps the schedule's own senders (and says so) rather than dropping the candidate."""
    import dataclasses

    from fcp_compiler.core import schedule_search

    relayed = []
    real_relay, real_peak = schedule_search.relay, schedule_search.max_buffer_tokens

    def relay_over_budget(schedule):
        relayed.append(dataclasses.replace(real_relay(schedule)))  # a new object: its peak is reported over
        return relayed[-1]

    monkeypatch.setattr(schedule_search, "relay", relay_over_budget)
    monkeypatch.setattr(schedule_search, "max_buffer_tokens",
                        lambda schedule: 10**9 if any(schedule is r for r in relayed) else real_peak(schedule))
    lengths = lognormal_batch(8 * 8192, 1024, 1.8, 64, 32768, seed=2)
    plan = compile_valid(lengths, 8, block_size=1024, coalesce=2, gpus_per_node=4)
    floor_stats = plan.stats["floor"]
    assert relayed and floor_stats["winner"].endswith("no relays")
    scored = [c for c in floor_stats["candidates"] if math.isfinite(c["layer_makespan_fwd_s"])]
    assert scored and all(c["name"].endswith("no relays") for c in scored)
    assert plan.stats["num_relayed_transfers"] == plan.stats["num_fanned_out_transfers"]  # fan-out only


def test_an_equal_chunk_placement_past_a_limit_is_skipped_with_its_reason_not_the_compile(monkeypatch):
    from fcp_compiler.core.baselines import BASELINES, Planner
    from fcp_compiler.errors import InfeasibleError

    def refused(*args):
        raise InfeasibleError("the plan would cut its sequences into 70,000,000 segment pairs")
    monkeypatch.setitem(BASELINES, Planner.MAGI, refused)
    plan = compile_valid(lognormal_batch(8 * 8192, 1024, 1.8, 64, 32768, seed=2), 8, block_size=1024, coalesce=2)
    skipped = {row["placement"]: row for row in plan.stats["floor"]["pruned"]}
    assert {"greedy", "magi"} <= set(skipped) and "segment pairs" in skipped["magi"]["refused"]
    assert not plan.stats["floor"]["winner"].startswith(("greedy", "magi"))
    with pytest.raises(InfeasibleError, match="segment pairs"):  # a baseline compiled for itself is still refused
        compile_plan([5000, 300], 8, planner="magi")


@pytest.mark.parametrize("seed, kept, pulled_back", [(3, "levelled", False), (2, "out of last stage", False),
                                                     (7, "levelled", True)])
def test_the_winners_backward_keeps_its_last_stage_to_itself_where_that_simulates_faster(seed, kept, pulled_back):
    """The floor's winner is scheduled again with the backward's pulled-K,V tiles out of its last stage, then with
    its tiles pulled back into stages with room; the plan kept is the fastest within the memory budget, its stats
    record each, and it validates (batches where each wins)."""
    lengths = lognormal_batch(16 * 8192, 2048, 1.8, 64, 131072, seed=seed)
    plan = compile_valid(lengths, 16, block_size=512, coalesce=4, gpus_per_node=4)
    floor = plan.stats["floor"]
    record = floor["backward_last_stage"]
    assert record is not None and record["out_of_last_stage_s"] is not None and record["pulled_back_s"] is not None
    simulated = simulate_plan(plan).layer_figures()
    layer = simulated["layer_makespan_fwd_s"] + simulated["layer_makespan_bwd_s"]
    winner = next(row for row in floor["candidates"] if row["name"] == floor["winner"])
    assert record["levelled_s"] == pytest.approx(winner["layer_makespan_fwd_s"] + winner["layer_makespan_bwd_s"],
                                                 rel=1e-12)
    last_stage = min(record["levelled_s"], record["out_of_last_stage_s"])
    assert layer == pytest.approx(min(last_stage, record["pulled_back_s"]), rel=1e-12)
    assert record["kept"] == kept == ("out of last stage" if record["out_of_last_stage_s"] < record["levelled_s"]
                                      else "levelled")
    assert record["pulled_back"] == pulled_back == (record["pulled_back_s"] < last_stage)
    assert plan.header.max_buffer_tokens <= floor["memory_budget_tokens"]
    backward = plan.ir.schedule.backward
    if record["kept"] == "out of last stage":  # no tile of a pulled K,V whose data came earlier is left there
        schedule = plan.ir.schedule
        last = backward.tile_stage == backward.tile_stage.max()
        assert not (last & (schedule.tile_kv_edge >= 0) & (schedule.tile_q_edge < 0)
                    & (2 * schedule.forward.edge_round[schedule.tile_kv_edge] // backward.coalesce + 1
                       < backward.tile_stage.max())).any()


def test_node_fan_out_out_of_the_budgets_reach_is_not_scheduled_and_could_not_fit():
    from fcp_compiler.core.floor import FAN_OUT_MOST_RECEIVED, fan_out_out_of_reach

    assert not fan_out_out_of_reach(FAN_OUT_MOST_RECEIVED * 1000, 1000)
    assert fan_out_out_of_reach(FAN_OUT_MOST_RECEIVED * 1000 + 1, 1000)
    lengths = lognormal_batch(16 * 8192, 2048, 1.8, 64, 131072, seed=1)
    options = dict(block_size=512, coalesce=4, gpus_per_node=4)
    floor = compile_valid(lengths, 16, **options).stats["floor"]
    budget = floor["memory_budget_tokens"]
    (skipped,) = floor["out_of_reach"]
    assert skipped["candidate"] == "layer+fan-out" and skipped["most_received_tokens"] > FAN_OUT_MOST_RECEIVED * budget
    assert not any("fan-out" in row["name"] for row in floor["candidates"])
    # The same candidate scheduled as the floor would (stages shrunk until it fits, where any size tried does) is
    # over the budget at every size.
    alone = compile_plan(lengths, 16, floor=False, node_fan_out=True, fit_memory=True, **options)
    assert alone.header.max_buffer_tokens > budget
    # Fan-out the user asked for is always scheduled; where it fits (short sequences) it is a candidate as before.
    asked = compile_plan(lengths, 16, node_fan_out=True, **options).stats["floor"]
    assert asked["out_of_reach"] == [] and all("+fan-out" in row["name"] for row in asked["candidates"])
    short = compile_valid(lognormal_batch(16 * 8192, 512, 1.2, 64, 4096, seed=0), 16, block_size=512, coalesce=16,
                          gpus_per_node=4).stats["floor"]
    assert short["out_of_reach"] == []
    (own,) = [row for row in short["candidates"] if row["name"].startswith("layer+fan-out")]
    assert own["max_buffer_tokens"] <= short["memory_budget_tokens"]


def _own_rounds(options, lengths):
    """FCP's own placement of `lengths` routed into rounds, as the floor schedules it (without fan-out); and the
    timer that timed it."""
    from fcp_compiler.core import pipeline, schedule_search
    from fcp_compiler.core.pass_timer import PassTimer
    from fcp_compiler.core.passes.assign import default_token_cap
    from fcp_compiler.core.placement import place

    batch = pipeline._to_batch(lengths, None)
    timer = PassTimer()
    token_cap = default_token_cap(batch.total_tokens, options.num_ranks, options.resolved_block_size)
    assignment = place(timer, batch, options, token_cap, Placement.LAYER)
    return timer, schedule_search.make_rounds(timer, schedule_search.route(timer, assignment, options), options,
                                              False)


def _scored_at_requested_stages(num_ranks: int, block_size: int, seed: int):
    """FCP's own placement of a small paper-like batch at the requested rounds a stage, as the floor scores it."""
    from fcp_compiler.core import schedule_search
    from fcp_compiler.core.options import CompileOptions
    from fcp_compiler.core.passes.coalesce import coalesce, max_buffer_tokens

    options = CompileOptions.of(num_ranks, block_size=block_size)
    total = 4096 * num_ranks if block_size < 4096 else 32768 * num_ranks
    timer, rounds = _own_rounds(options, lognormal_batch(total, total // 64, 1.8, 16, total // 2, seed=seed))
    schedule = coalesce(rounds, options.coalesce)
    plan = schedule_search.finish(timer, schedule, options, "0" * 64)
    arrays = schedule_search.stacked_with_columns(timer, plan)
    scored = schedule_search.ScoredSchedule(schedule=schedule, plan=plan, peak_tokens=max_buffer_tokens(schedule),
                                            arrays=arrays, figures=schedule_search.layer_figures(plan, None,
                                                                                                 arrays.stacked))
    return timer, options, scored


@pytest.mark.parametrize("seed", [0, 1, 2, 3])
def test_larger_stages_are_kept_only_where_they_fit_and_simulate_faster(seed):
    """schedule_search.faster_stages at block 512 (one tile low on the efficiency curve), with room for twice the
    pulls: the plan kept is the faster of the two schedules, its larger stages within the budget."""
    from fcp_compiler.core.schedule_search import faster_stages

    timer, options, scored = _scored_at_requested_stages(8, 512, seed)
    budget_tokens = 2 * scored.peak_tokens
    kept = faster_stages(timer, scored, options, "0" * 64, budget_tokens)
    # On each of these batches the larger stages are faster (each query segment's keys in fewer, larger calls).
    assert kept is not scored and kept.layer_seconds < scored.layer_seconds
    assert kept.schedule.coalesce == 2 * options.coalesce and kept.plan.max_buffer_tokens <= budget_tokens
    figures = kept.figures
    assert kept.layer_seconds == pytest.approx(figures["layer_makespan_fwd_s"] + figures["layer_makespan_bwd_s"])
    # Without room for twice the pulls nothing else is tried.
    assert faster_stages(timer, scored, options, "0" * 64, 2 * scored.peak_tokens - 1) is scored


def test_larger_stages_are_not_tried_where_one_tile_is_near_the_top_of_the_efficiency_curve(monkeypatch):
    """At 4096-token blocks (0.95 of the curve's top on Hopper) no second schedule is made, however much room."""
    from fcp_compiler.core import schedule_search

    timer, options, scored = _scored_at_requested_stages(4, 4096, 0)
    monkeypatch.setattr(schedule_search, "coalesce", lambda *args, **kwargs: pytest.fail("a second schedule"))
    assert schedule_search.faster_stages(timer, scored, options, "0" * 64, 10 * scored.peak_tokens) is scored


def test_a_winner_with_its_tiles_pulled_back_validates_and_replays_exactly():
    """A plan whose tiles were pulled back into stages with room (tiles run earlier than levelling put them, pushes
    placed again) keeps every invariant and replays exactly in fp64 on 8 gloo ranks."""
    torch = pytest.importorskip("torch")
    from runtime_harness import compare_with_reference, run_ranks

    lengths = lognormal_batch(8 * 2048, 512, 1.8, 16, 8 * 1024, seed=7)
    plan = compile_valid(lengths, 8, block_size=256, coalesce=16, gpus_per_node=4)
    assert plan.stats["floor"]["backward_last_stage"]["pulled_back"]  # the case this test is for
    run_ranks(8, compare_with_reference(plan.to_bytes(), lengths, True, 4, 2, torch.float64, "plan"))

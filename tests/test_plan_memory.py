"""Memory in bytes in the plan: the header states each rank's peak per pass by the memory account, the validator
holds it to that, and --memory-budget bounds the schedule (fcp_compiler/core/plan_memory.py, memory_budget.py).
"""

from __future__ import annotations

import numpy as np
import pytest

from conftest import compile_valid
from fcp_compiler import compile_plan
from fcp_compiler.core.simulate import layer_stats
from fcp_compiler.errors import InfeasibleError
from fcp_compiler.format.memory import least_peak_bytes, stacked_peak_bytes
from fcp_compiler.format.stacked import stack_programs
from fcp_compiler.format.plan_format import PlanReader, rebuild_plan
from fcp_compiler.format.validate import PlanInvalidError, validate_plan

# 8 ranks of 24K tokens, sequences up to 96K: the backward holds several pulled Q blocks at a time.
LENGTHS = [98304, 40000, 20000, 12000, 9000, 6000, 5000, 3000, 1500, 700]


def _gib(nbytes: int) -> float:
    return nbytes / 2**30


@pytest.fixture(scope="module")
def unbudgeted():
    return compile_valid(LENGTHS, 8, memory_budget_gib=float("inf"))


def test_the_header_states_each_ranks_account_and_the_validator_holds_it(unbudgeted):
    reader = PlanReader(unbudgeted.to_bytes())
    stacked = stack_programs(reader.ranks())
    peaks = stacked_peak_bytes(stacked)
    assert reader.header.max_buffer_bytes_fwd == peaks[:, 0].tolist()
    assert reader.header.max_buffer_bytes_bwd == peaks[:, 1].tolist()
    # Either kernel path's peak, the larger (tests/test_memory_bound.py holds each to a replay of the runtime).
    packing, ranges = (stacked_peak_bytes(stacked, path=path) for path in ("packing", "ranges"))
    assert np.array_equal(peaks, np.maximum(packing, ranges)) and (ranges > packing).any()
    assert reader.header.memory_budget_bytes is None
    report = validate_plan(reader)
    assert (report.max_buffer_bytes_fwd, report.max_buffer_bytes_bwd) == tuple(peaks.max(axis=0).tolist())
    for field in ("max_buffer_bytes_fwd", "max_buffer_bytes_bwd"):
        stated = list(getattr(reader.header, field))
        stated[3] -= 1
        with pytest.raises(PlanInvalidError, match=f"rank 3's .* header's {field} states") as refusal:
            validate_plan(rebuild_plan(reader, **{field: stated}))
        assert refusal.value.invariant == 4
    over_budget = rebuild_plan(reader, memory_budget_bytes=int(peaks.max()) - 1)
    with pytest.raises(PlanInvalidError, match="over the plan's memory budget"):
        validate_plan(over_budget)


def test_no_schedule_goes_below_the_least_peak(unbudgeted):
    reader = PlanReader(unbudgeted.to_bytes())
    seg_tokens = reader.tables.seg_end - reader.tables.seg_start
    block_tokens = np.bincount(reader.tables.seg_block, weights=seg_tokens)
    tokens = np.asarray([block_tokens[p.arrays["blocks"]].sum() for p in reader.ranks()])
    least = least_peak_bytes(reader.header, tokens)
    peaks = stacked_peak_bytes(stack_programs(reader.ranks()))
    assert (least <= peaks.max(axis=1)).all() and (least > 0).all()


def test_a_budget_is_met_by_smaller_stages(unbudgeted):
    header = unbudgeted.header
    peak = max(header.max_buffer_bytes_bwd + header.max_buffer_bytes_fwd)
    budget = _gib(peak) * 0.85
    plan = compile_valid(LENGTHS, 8, memory_budget_gib=budget)
    memory = plan.stats["memory"]
    assert memory["refitted"] and memory["refits"] >= 1 and memory["unbudgeted_peak_bytes"] == peak
    stated = plan.header
    assert max(stated.max_buffer_bytes_fwd + stated.max_buffer_bytes_bwd) <= budget * 2**30
    assert stated.memory_budget_bytes == int(budget * 2**30)
    # Smaller stages, not a different placement: the same blocks on the same ranks.
    assert [p.arrays["blocks"].tolist() for p in PlanReader(plan.to_bytes()).ranks()] == \
        [p.arrays["blocks"].tolist() for p in PlanReader(unbudgeted.to_bytes()).ranks()]
    assert stated.num_bwd_stages > header.num_bwd_stages


def test_a_budget_under_a_ranks_own_tokens_is_refused():
    with pytest.raises(InfeasibleError, match=r"--memory-budget 0.50 GiB cannot be met.*can go below"):
        compile_plan([65536, 65536], 2, memory_budget_gib=0.5)


def test_the_default_budget_is_kept_where_met_and_set_aside_where_no_schedule_can_meet_it(unbudgeted):
    met = compile_valid(LENGTHS, 8)
    assert met.header.memory_budget_bytes == 4 * 2**30 and met.stats["memory"]["met"]
    # 2 ranks of 160K tokens: their own accumulators and outputs alone are over 4 GiB.
    over = compile_valid([163840, 163840], 2)
    assert over.header.memory_budget_bytes is None and not over.stats["memory"]["met"]
    assert over.stats["memory"]["floor_bytes"] > 4 * 2**30 and over.stats["memory"]["unmet"] == "own tokens"
    # Attention alone and the baselines compile with no budget unless one is given.
    assert compile_valid(LENGTHS, 8, model="none").header.memory_budget_bytes is None
    assert compile_valid(LENGTHS, 8, planner="magi").header.memory_budget_bytes is None


def test_a_header_with_a_wrong_count_of_memory_figures_is_refused(unbudgeted):
    import hashlib
    import struct

    import msgpack

    from fcp_compiler.errors import PlanFormatError

    data = unbudgeted.to_bytes()
    (length,) = struct.unpack("<I", data[8:12])
    header = msgpack.unpackb(data[44:44 + length], raw=False)
    header["max_buffer_bytes_bwd"] = header["max_buffer_bytes_bwd"][:-1]
    packed = msgpack.packb(header, use_bin_type=True)
    forged = data[:8] + struct.pack("<I", len(packed)) + hashlib.sha256(packed).digest() + packed + \
        data[44 + length:]
    with pytest.raises(PlanFormatError, match="max_buffer_bytes_bwd must hold one value .* per rank \\(8\\), got 7"):
        PlanReader(forged)


def test_the_simulator_reports_the_memory_the_plan_states(unbudgeted):
    from fcp_compiler.core.simulate import simulate_plan

    figures = simulate_plan(unbudgeted).figures()
    header = unbudgeted.header
    assert figures["peak_bytes_fwd"] == max(header.max_buffer_bytes_fwd) > 0
    assert figures["peak_bytes_bwd"] == max(header.max_buffer_bytes_bwd) > 0
    assert [row["peak_bytes_bwd"] for row in figures["per_rank"]] == header.max_buffer_bytes_bwd
    assert figures["memory_budget_bytes"] is None


def test_a_faster_candidate_that_fits_at_its_own_stages_beats_the_refitted_winner(monkeypatch):
    from fcp_compiler.core import budget_refit, memory_budget
    from fcp_compiler.core.budget_refit import BudgetFit
    from fcp_compiler.core.memory_budget import Alternative
    from fcp_compiler.core.pass_timer import PassTimer
    from fcp_compiler.core.schedule_search import ScheduledPlan

    # Plans stand in as (name, peak bytes); the account reads them, and the floor gives each one's seconds.
    monkeypatch.setattr(budget_refit, "plan_peak_bytes", lambda final, fields, **_: np.array([[1, final[1]]]))
    timer = PassTimer()

    def plan(name, peak):
        return ScheduledPlan(final=(name, peak), header_fields={})

    def others(candidates):
        def listed(limit):
            return (Alternative(name=name, plan=plan(name, peak), layer_seconds=seconds, arrays=None)
                    for name, peak, seconds in candidates if seconds < limit)
        return listed

    def search():
        return budget_refit.BudgetSearch(unbudgeted_peak_bytes=120, least_peak_bytes=120)

    refit = BudgetFit(plan=plan("refit", 90), peaks=np.array([[1, 90]]), held=None, figures=None, layer_seconds=1.10)
    found, over = search(), []
    kept = memory_budget._faster_within_budget(timer, refit, others([("over", 120, 1.01), ("fits", 80, 1.05),
                                                                     ("after", 130, 1.07)]), 100, found, over=over)
    assert kept.plan.final[0] == "fits" and found.kept == "fits"
    assert [other.name for other in over] == ["over"]  # the runner-up a refit may bring under (faster than "fits")
    found = search()
    kept = memory_budget._faster_within_budget(timer, refit, others([("slower", 80, 1.2)]), 100, found)
    assert kept.plan.final[0] == "refit" and found.kept is None
    kept = memory_budget._faster_within_budget(timer, None, others([("over", 120, 1.0), ("fits", 80, 1.3)]), 100,
                                               search())
    assert kept.plan.final[0] == "fits"
    assert memory_budget._faster_within_budget(timer, None, others([("over", 120, 1.0)]), 100, search()) is None


def test_the_runner_up_over_the_budget_is_refitted_and_kept_only_where_its_refit_is_faster(monkeypatch):
    """The floor chose on the token budget: where its winner's refit is slower than another candidate that is over
    the byte budget as scheduled, that candidate is refitted too, kept where its refit is faster, and otherwise the
    record (the least peak any schedule can have, why unmet) stays the winner's."""
    from fcp_compiler.core import memory_budget
    from fcp_compiler.core.budget_refit import BudgetFit, BudgetSearch
    from fcp_compiler.core.memory_budget import Alternative
    from fcp_compiler.core.pass_timer import PassTimer
    from fcp_compiler.core.schedule_search import ScheduledPlan

    asked = []

    def refit_to(seconds):
        def refit(timer, plan, options, digest, budget_bytes, search, rounds_of, *rest, most_steps):
            assert most_steps == 4  # as many as the winner's refit tried
            asked.append((plan.final, rounds_of()))
            search.floor_bytes, search.unmet = 70, "no schedule"
            return None if seconds is None else BudgetFit(plan=ScheduledPlan(final="runner-up refitted",
                                                                             header_fields={}),
                                                          peaks=np.array([[1, 90]]), held=None, figures=None,
                                                          layer_seconds=seconds)
        return refit

    runner_up = Alternative(name="layer direct c16/32", plan=ScheduledPlan(final="runner-up", header_fields={}),
                            layer_seconds=1.0, arrays=None, rounds="its rounds")
    best = BudgetFit(plan=ScheduledPlan(final="winner refitted", header_fields={}), peaks=np.array([[1, 95]]),
                     held=None, figures=None, layer_seconds=1.1)
    timer = PassTimer()
    for seconds, kept_best, want in ((1.05, best, "runner-up refitted"), (1.15, best, "winner refitted"),
                                     (None, best, "winner refitted"), (1.3, None, "runner-up refitted"),
                                     (None, None, None)):
        monkeypatch.setattr(memory_budget, "refit_to_budget", refit_to(seconds))
        search = BudgetSearch(unbudgeted_peak_bytes=120, least_peak_bytes=120, refits=4, floor_bytes=60,
                              unmet="winner's")
        kept = memory_budget._refit_runner_up(timer, runner_up, kept_best, None, "", 100, search, None, 10, None)
        assert (kept.plan.final if kept is not None else None) == want
        assert asked.pop() == ("runner-up", "its rounds")
        if want == "runner-up refitted":
            assert search.kept == "layer direct c16/32, in smaller stages" and search.floor_bytes == 70
        else:
            assert search.kept is None and (search.floor_bytes, search.unmet) == (60, "winner's")


def test_only_a_runner_up_faster_than_the_kept_plan_by_the_margin_is_refitted(monkeypatch):
    """A refit costs a plan about RUNNER_UP_MARGIN or more: a runner-up over the budget that scored within it of the
    plan the budget would keep is not refitted (no ladder is run for it)."""
    from fcp_compiler.core import budget_refit, memory_budget
    from fcp_compiler.core.budget_refit import BudgetFit, BudgetSearch
    from fcp_compiler.core.memory_budget import RUNNER_UP_MARGIN, Alternative, KeptPlan
    from fcp_compiler.core.pass_timer import PassTimer
    from fcp_compiler.core.schedule_search import ScheduledPlan

    class Final(str):  # a plan's name standing in for its IR
        tiles = None

    refitted = []

    def refit(timer, plan, options, digest, budget_bytes, search, *rest, **steps):
        refitted.append(plan.final)
        return BudgetFit(plan=ScheduledPlan(final=f"{plan.final} refitted", header_fields={}),
                         peaks=np.array([[1, 90]]), held=None, figures=None,
                         layer_seconds=1.0 if plan.final == "winner" else 0.9)

    monkeypatch.setattr(memory_budget, "refit_to_budget", refit)
    monkeypatch.setattr(budget_refit, "plan_peak_bytes", lambda final, fields, **_: np.array([[1, 120]]))  # over
    for seconds, want in ((1.0 - 1.5 * RUNNER_UP_MARGIN, ["winner", "runner-up"]),
                          (1.0 - 0.5 * RUNNER_UP_MARGIN, ["winner"])):
        runner_up = Alternative(name="runner-up", plan=ScheduledPlan(final=Final("runner-up"), header_fields={}),
                                layer_seconds=seconds, arrays=None, rounds="its rounds")
        kept = KeptPlan(plan=ScheduledPlan(final=Final("winner"), header_fields={}), fan_out=False,
                        rounds_of=lambda: None,
                        others=lambda limit, runner_up=runner_up: iter([runner_up] if runner_up.layer_seconds < limit
                                                                       else []))
        search = BudgetSearch(unbudgeted_peak_bytes=120, least_peak_bytes=120)
        fit = memory_budget._fit_over_budget(PassTimer(), kept, None, "", 100, search, None, 10)
        assert refitted == want and fit.plan.final == f"{want[-1]} refitted"
        refitted.clear()


def test_the_step_after_the_first_that_fits_is_kept_only_where_it_is_faster_and_fits(monkeypatch):
    from fcp_compiler.core import budget_refit
    from fcp_compiler.core.budget_refit import BudgetFit
    from fcp_compiler.core.pass_timer import PassTimer
    from fcp_compiler.core.schedule_search import RankArrays, ScheduledPlan

    # Steps stand in as (name, simulated seconds, peak bytes); the account is asked only of a faster step.
    accounted = []

    def figures(plan, pairs=None, stacked=None):
        return {"layer_makespan_fwd_s": plan.final[1], "layer_makespan_bwd_s": 0.0}

    def peaks(timer, plan, stacked=None, first=None, stop_above=None):
        accounted.append(plan.final[0])
        return np.array([[1, plan.final[2]]])

    monkeypatch.setattr(budget_refit, "layer_figures", figures)
    monkeypatch.setattr(budget_refit, "peak_bytes", peaks)
    timer = PassTimer()
    fitting = BudgetFit(plan=ScheduledPlan(final=("first", 1.0, 90), header_fields={}), peaks=np.array([[1, 90]]),
                        held=None, figures=None, layer_seconds=1.0)

    def next_step(name, seconds, peak):
        search = budget_refit.BudgetSearch(unbudgeted_peak_bytes=120, least_peak_bytes=90)
        chosen = budget_refit._faster_next_step(timer, fitting, ScheduledPlan(final=(name, seconds, peak),
                                                                              header_fields={}),
                                                RankArrays(stacked=None, columns=None), 100, search)
        return chosen.kept.plan.final[0], chosen.kept.layer_seconds, search.least_peak_bytes, chosen.faster

    assert next_step("faster", 0.9, 80) == ("faster", 0.9, 80, True)
    assert next_step("faster, over", 0.9, 120) == ("first", 1.0, 90, True)
    assert next_step("as fast", 1.0, 80) == ("first", 1.0, 90, False)  # a tie goes to the first
    assert next_step("slower", 1.1, 80) == ("first", 1.0, 90, False)
    assert accounted == ["faster", "faster, over"]


def test_fcp_diff_reports_memory_and_a_rise_in_it_as_a_regression(unbudgeted):
    from fcp_compiler.tools.diff import diff_plans

    budgeted = compile_valid(LENGTHS, 8, memory_budget_gib=_gib(max(unbudgeted.header.max_buffer_bytes_bwd)) * 0.85)
    less = diff_plans(PlanReader(unbudgeted.to_bytes()), PlanReader(budgeted.to_bytes()))
    assert less["figures"]["max_buffer_bytes_bwd"]["b"] < less["figures"]["max_buffer_bytes_bwd"]["a"]
    assert "max_buffer_bytes_bwd" not in less["regressions"] and "memory_budget_bytes" in less["parameters"]
    more = diff_plans(PlanReader(budgeted.to_bytes()), PlanReader(unbudgeted.to_bytes()))
    assert "max_buffer_bytes_bwd" in more["regressions"]


def test_the_budget_ladder_from_the_plans_own_schedule_is_the_ladder_from_its_rounds():
    """The memory budget's first refit levels the backward of the plan's own schedule again (its forward is the
    same call) instead of coalescing its rounds from the start: every step must be the one coalesce makes, and the
    rounds are scheduled only when a step needs them."""
    import dataclasses

    from fcp_compiler.core import pipeline, schedule_search
    from fcp_compiler.core.budget_refit import budget_ladder
    from fcp_compiler.core.options import CompileOptions
    from fcp_compiler.core.pass_timer import PassTimer
    from fcp_compiler.core.passes.assign import default_token_cap
    from fcp_compiler.core.passes.coalesce import coalesce
    from fcp_compiler.core.placement import Placement, place

    options = CompileOptions.of(8, coalesce=8)
    batch = pipeline._to_batch(LENGTHS, None)
    timer = PassTimer()
    assignment = place(timer, batch, options, default_token_cap(batch.total_tokens, 8, 4096), Placement.LAYER)
    rounds = schedule_search.make_rounds(timer, schedule_search.route(timer, assignment, options), options, False)
    asked = []

    def rounds_of():
        asked.append(len(asked))
        return rounds

    from_rounds = list(budget_ladder(timer, lambda: rounds, options))
    ladder = budget_ladder(timer, rounds_of, options, coalesce(rounds, 8))
    for step, want in enumerate(from_rounds):
        got = next(ladder)
        assert asked == ([] if step < 2 else [0])  # c = 8 and its halved backward need no rounds
        assert (got.coalesce, got.backward.coalesce) == (want.coalesce, want.backward.coalesce)
        for part in ("forward", "backward"):
            for name in (field.name for field in dataclasses.fields(getattr(want, part))):
                assert np.array_equal(getattr(getattr(got, part), name), getattr(getattr(want, part), name)), \
                    (step, part, name)
        assert np.array_equal(got.tile_order, want.tile_order)
    assert next(ladder, None) is None and len(from_rounds) > 2


def test_a_backward_a_little_over_the_budget_is_held_in_smaller_stages_before_the_forward_shrinks(unbudgeted,
                                                                                                     monkeypatch):
    """Where the halved backward is over the budget by little while the forward fits, the budget ladder tries the
    same c with the backward in smaller stages still: the forward keeps larger stages, the plan fits and validates,
    and it simulates no slower than the ladder without those steps keeps."""
    from fcp_compiler.core import budget_refit
    from fcp_compiler.core.passes.coalesce import smaller_backward_rounds

    peak = max(max(unbudgeted.header.max_buffer_bytes_fwd), max(unbudgeted.header.max_buffer_bytes_bwd))
    budget_gib = 0.6 * peak / 2**30
    tried, real = [], budget_refit.with_backward_rounds

    def recorded(schedule, rounds, *rest):
        tried.append((schedule.coalesce, rounds))
        return real(schedule, rounds, *rest)

    monkeypatch.setattr(budget_refit, "with_backward_rounds", recorded)
    deeper = compile_valid(LENGTHS, 8, memory_budget_gib=budget_gib, floor=False)
    assert any(rounds < smaller_backward_rounds(c) for c, rounds in tried)
    monkeypatch.setattr(budget_refit, "deeper_backward_rounds", lambda c, halved: [])
    plain = compile_valid(LENGTHS, 8, memory_budget_gib=budget_gib, floor=False)
    layer = {}
    for name, plan in (("deeper", deeper), ("plain", plain)):
        header = plan.header
        assert max(max(header.max_buffer_bytes_fwd), max(header.max_buffer_bytes_bwd)) <= budget_gib * 2**30
        figures = layer_stats(plan)
        layer[name] = figures["layer_makespan_fwd_s"] + figures["layer_makespan_bwd_s"]
    assert deeper.header.num_fwd_stages < plain.header.num_fwd_stages
    assert layer["deeper"] <= layer["plain"]


@pytest.mark.long  # an 8-rank fp64 replay, 20-27 s: in the long run, which CI runs too
def test_a_plan_with_the_budgets_deeper_backward_stages_validates_and_replays_exactly():
    """A plan the budget keeps with its backward in stages of fewer rounds than the halved backward (2 rounds under
    a forward of 16) keeps every invariant, fits its budget, and replays exactly in fp64 on 8 gloo ranks."""
    torch = pytest.importorskip("torch")
    from fcp_compiler.core.passes.coalesce import smaller_backward_rounds
    from fcp_compiler.tools.traces import lognormal_batch
    from runtime_harness import compare_with_reference, run_ranks

    lengths = lognormal_batch(8 * 2048, 512, 1.8, 16, 8 * 1024, seed=5)
    options = dict(block_size=256, coalesce=16, gpus_per_node=4, floor=False)
    unbudgeted = compile_plan(lengths, 8, memory_budget_gib=float("inf"), **options).header
    budget_gib = 0.75 * max(max(unbudgeted.max_buffer_bytes_fwd), max(unbudgeted.max_buffer_bytes_bwd)) / 2**30
    plan = compile_valid(lengths, 8, memory_budget_gib=budget_gib, **options)
    header = plan.header
    assert header.bwd_coalesce < smaller_backward_rounds(header.coalesce)  # the case this test is for
    assert max(max(header.max_buffer_bytes_fwd), max(header.max_buffer_bytes_bwd)) <= budget_gib * 2**30
    run_ranks(8, compare_with_reference(plan.to_bytes(), lengths, True, 4, 2, torch.float64, "plan"))


@pytest.mark.long  # an 8-rank fp64 replay, 20-27 s: in the long run, which CI runs too
def test_a_runner_up_refitted_under_the_budget_validates_and_replays_exactly():
    """Where the floor's winner refits slower than another candidate over the budget, that candidate is refitted and
    kept: its plan (another placement than the winner's, in smaller stages) keeps every invariant, fits its budget,
    and replays exactly in fp64 on 8 gloo ranks."""
    plan = _fits_and_replays(seed=6, cut=0.7)
    kept, winner = plan.stats["memory"]["kept"], plan.stats["floor"]["winner"]
    assert kept.endswith(", in smaller stages") and not kept.startswith(("the winner", winner))  # the case


def _fits_and_replays(seed: int, cut: float):
    """A lognormal batch on 8 ranks (block 256, 16 rounds a stage, nodes of 4) under `cut` of its unbudgeted peak:
    its plan, validated, within the budget, and replayed exactly in fp64 on 8 gloo ranks."""
    torch = pytest.importorskip("torch")
    from fcp_compiler.tools.traces import lognormal_batch
    from runtime_harness import compare_with_reference, run_ranks

    lengths = lognormal_batch(8 * 2048, 512, 1.8, 16, 8 * 1024, seed=seed)
    options = dict(block_size=256, coalesce=16, gpus_per_node=4)
    unbudgeted = compile_plan(lengths, 8, memory_budget_gib=float("inf"), **options).header
    budget_gib = cut * max(max(unbudgeted.max_buffer_bytes_fwd), max(unbudgeted.max_buffer_bytes_bwd)) / 2**30
    plan = compile_valid(lengths, 8, memory_budget_gib=budget_gib, **options)
    header = plan.header
    assert max(max(header.max_buffer_bytes_fwd), max(header.max_buffer_bytes_bwd)) <= budget_gib * 2**30
    run_ranks(8, compare_with_reference(plan.to_bytes(), lengths, True, 4, 2, torch.float64, "plan"))
    return plan


def test_an_account_stopped_above_a_peak_is_the_full_accounts_first_ranks(unbudgeted, monkeypatch):
    """The budget's refits and the other candidates only ask whether a plan fits: the account may stop after the
    first group of ranks with a peak above a limit, and what it returned is then the full account of those ranks."""
    from fcp_compiler.format import memory

    monkeypatch.setattr(memory, "CHUNK_TILES", 1)  # a group a rank
    stacked = stack_programs(PlanReader(unbudgeted.to_bytes()).ranks())
    full = stacked_peak_bytes(stacked)
    assert np.array_equal(stacked_peak_bytes(stacked, stop_above=int(full.max())), full)  # none above: every rank
    rank_peak = full.max(axis=1)
    limits = sorted(set(rank_peak.tolist()))[:-1]
    assert limits
    for limit in limits:
        stopped = stacked_peak_bytes(stacked, stop_above=limit)
        assert np.array_equal(stopped, full[:int(np.argmax(rank_peak > limit)) + 1])


def test_an_account_visits_its_ranks_in_the_order_given_and_returns_them_in_rank_order(unbudgeted, monkeypatch):
    """`first` orders the groups of ranks an account visits (highest first) and changes no figure: in full the
    peaks come back in rank order; stopped, the first group visited is the highest priority's."""
    from fcp_compiler.format import memory

    monkeypatch.setattr(memory, "CHUNK_TILES", 1)  # a group a rank (STOPPING_GROUPS makes it no smaller)
    stacked = stack_programs(PlanReader(unbudgeted.to_bytes()).ranks())
    full = stacked_peak_bytes(stacked)
    priority = np.arange(stacked.num_ranks)[::-1] % 3  # ties, in rank order
    assert np.array_equal(stacked_peak_bytes(stacked, first=priority), full)
    rank_peak = full.max(axis=1)
    lowest = int(np.argmin(rank_peak))
    priority = -rank_peak
    stopped = stacked_peak_bytes(stacked, stop_above=int(rank_peak[lowest]) - 1, first=priority)
    assert np.array_equal(stopped, full[[lowest]])  # the least peak first, and it is above the limit


def test_the_least_peak_found_under_an_unmet_default_budget_is_every_refits(monkeypatch):
    """Under the default budget a refit's account stops at the first group of ranks above it; where no refit fits,
    the steps over are accounted again, so the least peak the report names is the one full accounts give."""
    from fcp_compiler.core import budget_refit
    from fcp_compiler.core import options as options_module
    from fcp_compiler.format import memory

    monkeypatch.setattr(memory, "CHUNK_TILES", 1)
    floor_bytes = 1509949440  # LENGTHS at 8 ranks: the busiest rank's own accumulators and outputs
    monkeypatch.setattr(options_module, "DEFAULT_MEMORY_BUDGET_GIB", floor_bytes * 1.005 / 2**30)
    accounted, stopped = budget_refit.stacked_peak_bytes, []

    def account(stacked, **kwargs):
        peaks = accounted(stacked, **kwargs)
        stopped.append(len(peaks) < stacked.num_ranks)
        return peaks

    monkeypatch.setattr(budget_refit, "stacked_peak_bytes", account)
    memory_record = compile_valid(LENGTHS, 8).stats["memory"]
    assert memory_record["unmet"] == "no schedule" and not memory_record["met"] and memory_record["refits"] > 2
    assert memory_record["floor_bytes"] == floor_bytes and any(stopped)
    monkeypatch.setattr(budget_refit, "stacked_peak_bytes", lambda stacked, **_: accounted(stacked))
    assert compile_valid(LENGTHS, 8).stats["memory"] == memory_record
    # The same budget given by the user is refused naming the least peak, found with every step accounted in full
    # until a rank is above the least so far.
    least = memory_record["least_peak_bytes"]
    assert least < memory_record["unbudgeted_peak_bytes"]
    with pytest.raises(InfeasibleError, match=f"the least peak found is {least / 2**30:.2f} GiB"):
        compile_plan(LENGTHS, 8, memory_budget_gib=memory_record["budget_bytes"] / 2**30)


def test_the_plan_kept_in_the_winners_place_is_finished_as_the_winner_where_that_fits_the_bytes(monkeypatch):
    """memory_budget._finished: a refit or another candidate is finished as the floor's winner is (its variants,
    each kept where faster) and kept so only where the finished plan fits the byte budget too."""
    from fcp_compiler.core import memory_budget
    from fcp_compiler.core.budget_refit import BudgetFit, BudgetSearch
    from fcp_compiler.core.pass_timer import PassTimer
    from fcp_compiler.core.schedule_search import RankArrays, ScheduledPlan
    from fcp_compiler.core.winner_schedule import LastStage

    class Final:  # the plan's IR: only its tiles are read (the segment pairs' key)
        tiles = None

    fit = BudgetFit(plan=ScheduledPlan(final=Final(), header_fields={"max_buffer_tokens": 10}),
                    peaks=np.array([[1, 90]]), held=RankArrays(stacked="refit", columns=None),
                    figures={"layer_makespan_fwd_s": 0.4, "layer_makespan_bwd_s": 0.6}, layer_seconds=1.0)
    finished = ScheduledPlan(final="finished", header_fields={})
    record = {"kept": "out of last stage", "pulled_back": True}
    for peak, variant, want in ((95, finished, "finished"), (120, finished, "refit"), (None, fit.plan, "refit")):
        seen = []

        def last_stage(timer, plan, figures, options, digest, budget_tokens, segments, held, variant=variant):
            seen.append((plan, figures, held, budget_tokens))
            moved = variant is not plan
            return LastStage(plan=variant, figures={"layer_makespan_fwd_s": 0.4, "layer_makespan_bwd_s": 0.5}
                             if moved else figures, record=record, held=RankArrays(stacked="moved", columns="its")
                             if moved else held)

        monkeypatch.setattr(memory_budget, "backward_last_stage", last_stage)
        monkeypatch.setattr(memory_budget, "memory_budget_tokens", lambda options: 8)
        monkeypatch.setattr(memory_budget, "peak_bytes", lambda timer, plan, stacked, first, stop_above:
                            np.array([[1, peak]]))
        search = BudgetSearch(unbudgeted_peak_bytes=150, least_peak_bytes=90)
        kept = memory_budget._finished(PassTimer(), fit, None, "", 100, search, np.zeros(1))
        assert seen == [(fit.plan, fit.figures, fit.held, 10)]  # from the refit's own figures and arrays
        if want == "finished":
            assert kept.plan is finished and kept.layer_seconds == pytest.approx(0.9)
            assert kept.held.columns == "its" and kept.peaks.max() == 95 and search.least_peak_bytes == 90
            assert search.finished == {**record, "within_budget_bytes": True}
        else:
            assert kept is fit
            assert search.finished == (record if peak is None else {**record, "within_budget_bytes": False})
    unheld = BudgetFit(plan=fit.plan, peaks=fit.peaks, held=None, figures=None, layer_seconds=1.0)
    search = BudgetSearch(unbudgeted_peak_bytes=150, least_peak_bytes=90)
    assert memory_budget._finished(PassTimer(), unheld, None, "", 100, search, np.zeros(1)) is unheld
    assert search.finished is None


def test_a_refit_finished_as_the_winner_validates_and_replays_exactly():
    """Where the budget keeps the winner in smaller stages and that plan is finished as the winner is (its backward's
    pulled-K,V tiles out of the last stage and its tiles pulled back, both kept), the plan keeps every invariant,
    fits its budget, simulates no slower than the refit as scheduled, and replays exactly in fp64 on 8 gloo ranks."""
    plan = _fits_and_replays(seed=11, cut=0.8)
    memory = plan.stats["memory"]
    finished = memory["backward_last_stage"]
    assert memory["kept"] == "the winner, in smaller stages" and finished["within_budget_bytes"]  # the case
    assert finished["kept"] == "out of last stage" and finished["pulled_back"]
    figures = layer_stats(plan)
    assert figures["layer_makespan_fwd_s"] + figures["layer_makespan_bwd_s"] == pytest.approx(
        finished["pulled_back_s"], rel=1e-12)
    assert finished["pulled_back_s"] < finished["out_of_last_stage_s"] < finished["levelled_s"]

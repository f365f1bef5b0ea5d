"""A plan's placement as a job shop (fcp_compiler/core/schedule_problem.py): its optimum lies between the certified
lower bound and the plan's own simulated layer time (on the profile without what the job shop leaves out), and the
job shop holds exactly the plan's work and messages."""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("ortools")

from fcp_compiler import compile_plan  # noqa: E402
from fcp_compiler.algorithms.job_shop import TIME_UNIT_S, solve_job_shop  # noqa: E402
from fcp_compiler.core.layer_model import BACKWARD_WORK  # noqa: E402
from fcp_compiler.core.schedule_problem import ideal_profile, problems_of  # noqa: E402
from fcp_compiler.core.simulate import simulate_plan  # noqa: E402
from fcp_compiler.errors import InvalidInputError  # noqa: E402
from fcp_compiler.tools.traces import lognormal_batch  # noqa: E402
from conftest import compile_valid  # noqa: E402

CASES = [(4, 512, "causal", 1), (8, 512, "sliding_window:1024", 2), (16, 1024, "causal", 3)]


def _plan(num_ranks: int, block: int, mask: str, seed: int):
    lengths = lognormal_batch(4096 * num_ranks, 4096 * num_ranks // 64, 1.8, 16, 2048 * num_ranks, seed)
    return compile_valid(lengths, num_ranks, block_size=block, mask=mask)


@pytest.mark.parametrize("num_ranks,block,mask,seed", CASES)
def test_the_optimum_lies_between_the_bound_and_the_plan(num_ranks, block, mask, seed):
    plan = _plan(num_ranks, block, mask, seed)
    figures = simulate_plan(plan, profile=ideal_profile(plan.header.profile)).layer_figures()
    for name, problem in problems_of(plan, int(plan.header.max_buffer_tokens)).items():
        result = solve_job_shop(problem, time_limit_s=60)
        assert result.optimal
        assert figures[f"layer_makespan_lower_bound_{name}_s"] <= result.makespan_s * (1 + 1e-9)
        assert result.makespan_s <= figures[f"layer_makespan_{name}_s"] * (1 + 1e-6)


def test_the_job_shop_holds_the_plans_work_and_messages():
    """Every tile's work on its rank (at one launch's efficiency: no more than the plan's staged calls charge), every
    pull once, and one push per pull the pass pushes back along."""
    plan = _plan(8, 512, "causal", 4)
    final = plan.ir
    problems = problems_of(plan)
    staged = simulate_plan(plan, profile=ideal_profile(plan.header.profile)).forward.compute
    for name, problem in problems.items():
        program = final.schedule.backward if name == "bwd" else final.schedule.forward
        assert problem.num_messages == final.transfers.num_edges + program.push_edge.size
        pulls = slice(0, final.transfers.num_edges)
        np.testing.assert_array_equal(problem.msg_src[pulls], final.transfers.edge_src)
        np.testing.assert_array_equal(problem.msg_dst[pulls], final.transfers.edge_dst)
        work = np.bincount(problem.job_rank, weights=problem.job_seconds, minlength=final.num_ranks)
        scale = BACKWARD_WORK if name == "bwd" else 1.0
        assert (work <= staged * scale * (1 + 1e-9)).all()
        assert ((work > 0) == (final.assignment.rank_seconds > 0)).all()
        assert problem.msg_awaited.sum() == program.push_edge.size


@pytest.mark.parametrize("num_ranks,block,mask,seed", CASES[:2])
def test_at_the_plans_own_calls_the_job_shop_charges_what_the_simulator_does_and_its_optimum_lies_between(
        num_ranks, block, mask, seed):
    """staged_calls: each rank's work is the plan's simulated compute to the last bit of rounding, and the optimum
    is at least the one-launch optimum (whose tiles are never dearer) and at most the plan."""
    plan = _plan(num_ranks, block, mask, seed)
    simulation = simulate_plan(plan, profile=ideal_profile(plan.header.profile))
    figures = simulation.layer_figures()
    budget_tokens = int(plan.header.max_buffer_tokens)
    one_launch = problems_of(plan, budget_tokens)
    for name, problem in problems_of(plan, budget_tokens, staged_calls=True).items():
        work = np.bincount(problem.job_rank, weights=problem.job_seconds, minlength=plan.num_ranks)
        compute = (simulation.backward if name == "bwd" else simulation.forward).compute
        np.testing.assert_allclose(work, compute, rtol=1e-9)  # (the backward's compute is at its 2.5x already)
        staged = solve_job_shop(problem, time_limit_s=60)
        cheapest = solve_job_shop(one_launch[name], time_limit_s=60)
        assert staged.optimal and cheapest.optimal
        assert cheapest.makespan_s <= staged.makespan_s * (1 + 1e-9)
        # The plan can be this optimum to the last rounding of the job shop's durations (TIME_UNIT_S each).
        rounding_s = TIME_UNIT_S * (problem.num_jobs + problem.num_messages)
        assert staged.makespan_s <= figures[f"layer_makespan_{name}_s"] + rounding_s


def test_the_user_layout_is_refused_in_one_line():
    lengths = lognormal_batch(4096 * 4, 256, 1.8, 16, 8192, 5)
    plan = compile_plan(lengths, 4, block_size=512, layout="user")
    with pytest.raises(InvalidInputError, match="layout 'user'"):
        problems_of(plan)


@pytest.mark.long
def test_the_certified_bound_is_never_above_an_exact_optimum_on_every_benchmark_instance():
    """benchmarks/schedule_optimum.py's instances (108; the paper-like distribution alone unless FCP_EVAL_DATA
    names the length files): the certified bound of each pass at most its exact optimum."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
    import schedule_optimum

    schedule_optimum._CONTEXT.update(eval_data=schedule_optimum.EVAL_DATA, time_limit=30.0, options={})
    for case in schedule_optimum.instances(schedule_optimum.EVAL_DATA, 108):
        row = schedule_optimum._measure(case)
        for name in ("fwd", "bwd"):
            assert row[f"bound_{name}_s"] <= row[f"optimum_bound_{name}_s"] * (1 + 1e-9), case

"""The floor's winner scheduled again in the variants simulated before it is kept (:func:`backward_last_stage`): its
backward's last stage kept to itself or not, then its tiles pulled back into stages with room. Each variant moves
tiles only earlier, within the memory budget, and is kept only where it simulates faster. The plan the device memory
budget keeps in the winner's place is finished the same way (:func:`fcp_compiler.core.memory_budget._finished`).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from fcp_compiler.core.ir import Schedule
from fcp_compiler.core.layer_model import BACKWARD_WORK
from fcp_compiler.core.options import CompileOptions
from fcp_compiler.core.pass_timer import PassTimer
from fcp_compiler.core.passes.coalesce import remote_tiles_out_of_last_stage, tiles_pulled_back
from fcp_compiler.core.schedule_search import (RankArrays, ScheduledPlan, Segments, finish, layer_figures,
                                               stacked_with_columns)
from fcp_compiler.core.simulate import layer_seconds


@dataclass(frozen=True, slots=True, kw_only=True)
class LastStage:
    """The floor's winner with its backward's last stage kept to itself or not, and its tiles pulled back or not
    (:func:`backward_last_stage`)."""

    plan: ScheduledPlan
    figures: dict  # its simulated layer figures
    record: dict | None  # the comparison for the floor's stats (None: no tile would move)
    held: RankArrays | None  # its stacked ranks and encoder columns, where made

    @property
    def layer_seconds(self) -> float:
        """Its simulated layer time, forward plus backward."""
        return layer_seconds(self.figures)


@dataclass(frozen=True, slots=True, kw_only=True)
class _Variant:
    """A variant of a plan, finished: its plan, and its figures and arrays where it fits the budget (else None)."""

    plan: ScheduledPlan
    figures: dict | None
    held: RankArrays | None

    @property
    def seconds(self) -> float | None:
        """Its simulated layer time, forward plus backward (None: over the budget, not simulated)."""
        return None if self.figures is None else layer_seconds(self.figures)


def _variant(timer: PassTimer, schedule: Schedule, options: CompileOptions, digest: str, budget_tokens: int,
             segments: Segments | None) -> _Variant:
    """A variant schedule of the winner finished without new relays (the winner's are in its schedule), and simulated
    where it fits `budget_tokens`."""
    plan = finish(timer, schedule, options, digest, relays=False)
    if plan.max_buffer_tokens > budget_tokens:
        return _Variant(plan=plan, figures=None, held=None)
    held = stacked_with_columns(timer, plan)
    return _Variant(plan=plan, figures=timer.run("score", layer_figures, plan, segments, held.stacked), held=held)


def backward_last_stage(timer: PassTimer, plan: ScheduledPlan, figures: dict, options: CompileOptions, digest: str,
                        budget_tokens: int, segments: Segments | None = None,
                        held: RankArrays | None = None) -> LastStage:
    """The floor's winner, or the same plan with the backward's pulled-K,V tiles that levelling put into its last
    stage back in their earliest (remote_tiles_out_of_last_stage) where that simulates faster and fits
    `budget_tokens`; then the plan kept, or the same with its tiles pulled back (:func:`_pulled_back`). `held`: the
    winner's stacked ranks and encoder columns; `figures`: its layer figures.

    Returns:
        the LastStage: the plan kept, its figures and arrays, and the comparison for the floor's stats.
    """
    last = LastStage(plan=plan, figures=figures, record=None, held=held)
    moved = timer.run("coalesce", remote_tiles_out_of_last_stage, plan.final.schedule)
    if moved is not None:
        other = _variant(timer, moved, options, digest, budget_tokens, segments)
        levelled = last.layer_seconds
        kept = other.seconds is not None and other.seconds < levelled
        record = {"kept": "out of last stage" if kept else "levelled", "levelled_s": levelled,
                  "out_of_last_stage_s": other.seconds, "max_buffer_tokens": other.plan.max_buffer_tokens}
        last = LastStage(plan=other.plan, figures=other.figures, record=record, held=other.held) if kept else \
            dataclasses.replace(last, record=record)
    return _pulled_back(timer, last, options, digest, budget_tokens, segments)


def _pulled_back(timer: PassTimer, last: LastStage, options: CompileOptions, digest: str, budget_tokens: int,
                 segments: Segments | None) -> LastStage:
    """`last`, or the same plan with its tiles pulled back into stages with room (tiles_pulled_back: a stage lasts
    as long as its busiest rank's tiles or its busiest link end's pulls, whatever its other ranks run) where that
    simulates faster and fits `budget_tokens`. Its record gains "pulled_back_s" (None: no tile moved, or over the
    budget) and "pulled_back" (whether it is kept).

    Levelling delays tiles to lower each stage's busiest rank and counts no time for messages; run earlier where a
    stage has room, they shorten later stages on some plans and lengthen others, so the winner is simulated both
    ways. Measured on the 54 batches of benchmarks/layer_objective.py's matrix: applied to every schedule (the
    refits' too), geometric mean 0.9969, 18 batches faster by up to 2.7% and 8 slower by up to 2.4%; kept only where
    the winner simulates faster, 0.9975 with none slower (10 faster by 0.5-2.7%).
    """
    moved = timer.run("coalesce", tiles_pulled_back, last.plan.final.schedule, BACKWARD_WORK)
    other = _variant(timer, moved, options, digest, budget_tokens, segments) if moved is not None else None
    seconds = other.seconds if other is not None else None
    kept = seconds is not None and seconds < last.layer_seconds
    record = {**(last.record or {}), "pulled_back_s": seconds, "pulled_back": kept}
    if kept:
        return LastStage(plan=other.plan, figures=other.figures, record=record, held=other.held)
    return dataclasses.replace(last, record=record)

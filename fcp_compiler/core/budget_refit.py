"""The memory budget's refits: a placement scheduled again, holding less step by step, until it fits a byte budget.

:func:`fcp_compiler.core.memory_budget.within_budget` decides what a compile keeps under the budget; where the plan
it keeps is over, it calls :func:`refit_to_budget` here. Each step of :func:`budget_ladder` holds less than the one
before (shallower levelling, smaller backward stages, then smaller stages in both passes); a step is finished,
accounted (:func:`fcp_compiler.core.account.plan_peak_bytes`) and simulated, and the first that fits, or a faster one
just after it, is kept (:class:`BudgetFit`). :class:`BudgetSearch` records what the steps found: how many were tried,
the least peak, the least any schedule can have, and why a budget went unmet.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import numpy as np

from fcp_compiler.core.account import plan_peak_bytes
from fcp_compiler.core.ir import Rounds, Schedule
from fcp_compiler.core.options import CompileOptions
from fcp_compiler.core.pass_timer import PassTimer
from fcp_compiler.core.passes.coalesce import (LEVELLING_STAGES, TIGHT_LEVELLING_STAGES, coalesce,
                                               deeper_backward_rounds, smaller_backward_rounds, with_backward_rounds)
from fcp_compiler.core.schedule_search import (RankArrays, ScheduledPlan, Segments, finish, layer_figures,
                                               stacked_with_columns)
from fcp_compiler.core.simulate import layer_seconds
from fcp_compiler.format.memory import least_peak_bytes, stacked_peak_bytes
from fcp_compiler.format.plan_format import PlanHeader
from fcp_compiler.format.stacked import StackedRanks

# The most a halved backward's peak may be over the byte budget for the ladder to try the same c with the backward in
# smaller stages still (budget_ladder): further over, only a smaller c brings it under.
DEEPER_WITHIN = 1.25


def most_refits(options: CompileOptions, num_tiles: int, tile_budget: int) -> float:
    """How many schedules :func:`refit_to_budget` may try for a plan of `num_tiles` tiles: any number for a budget
    the user gave (met whatever it costs), else what the floor's tile budget allows (0 past it): each refit
    schedules, encodes and accounts the whole plan, tens of seconds at thousands of ranks.

    Args:
        options: the compile options (whether the budget was given).
        num_tiles: the plan's tiles.
        tile_budget: the floor's bound on the tiles it schedules in all (floor.TILE_BUDGET).
    Returns:
        the number of schedules (math.inf: no bound).
    """
    return math.inf if options.memory_budget_is_strict else tile_budget // max(num_tiles, 1)


@dataclass(frozen=True, slots=True, kw_only=True)
class BudgetFit:
    """A plan that fits the byte budget, a refit or another floor candidate: each rank's peaks per pass by the
    account, its stacked ranks and the encoder columns the account read (None: the encoder makes them), and its
    simulated layer figures (None: not held) and seconds."""

    plan: ScheduledPlan
    peaks: np.ndarray
    held: RankArrays | None
    figures: dict | None
    layer_seconds: float


@dataclass(slots=True, kw_only=True)
class BudgetSearch:
    """What the refits and the other candidates find as they go; :func:`fcp_compiler.core.memory_budget.within_budget`
    makes its BudgetDecision of it."""

    unbudgeted_peak_bytes: int
    least_peak_bytes: int  # the least peak found (of the kept plan, then of every schedule accounted)
    refits: int = 0
    floor_bytes: int | None = None  # set where the kept plan is over the budget (:func:`_refits_allowed`)
    unmet: str | None = None
    kept: str | None = None
    finished: dict | None = None  # the plan kept, finished as the floor's winner is (memory_budget._finished)

    def found(self, peak_bytes: int) -> None:
        """A schedule accounted to `peak_bytes`."""
        self.least_peak_bytes = min(self.least_peak_bytes, peak_bytes)


def refit_to_budget(timer: PassTimer, plan: ScheduledPlan, options: CompileOptions, digest: str, budget_bytes: int,
                    search: BudgetSearch, rounds_of: Callable[[], Rounds], tile_budget: int,
                    plain: Schedule | None = None, first: np.ndarray | None = None,
                    segments: Segments | None = None, most_steps: float = math.inf) -> BudgetFit | None:
    """The plan's placement scheduled again down :func:`budget_ladder`, holding less at each step, until a step fits
    `budget_bytes`; that step, or the step after it where that one simulates faster and fits too (which of halving
    the backward's stages and shrinking both passes' costs less depends on the batch: on traces/small_8gpu.json at 8
    GPUs both passes at 12 rounds beat the backward's halved by 1%); where the first that fits is a deeper backward
    step (:func:`budget_ladder`), the fastest of it and the steps below it that simulate faster. None when no step
    fits, when a rank's own tokens' accumulators and outputs alone are over the budget, or when the default budget's
    work bound allows no step (no step is tried then). Records the steps tried, the least peak found, that floor and
    why a budget is unmet in `search`.

    Args:
        rounds_of: gives the plan's rounds before relays (called only where a step needs them).
        tile_budget: the floor's tile budget, which bounds a default budget's refits (:func:`most_refits`).
        plain: the plan's own schedule where it is coalesce's at the requested rounds a stage (:func:`budget_ladder`).
        first: the order the accounts visit ranks in (:func:`stacked_peak_bytes`), the kept plan's peaks.
        segments: its tiles' segment pairs and their kinds, where the floor holds them.
        most_steps: the most steps this call may try (besides the bound on all refits, :func:`most_refits`).
    Returns:
        the BudgetFit of the step kept, or None.
    """
    most = min(_refits_allowed(plan, options, budget_bytes, search, tile_budget), search.refits + most_steps)
    if most == 0:
        return None
    fitting, over = None, []  # fitting: the fastest step that fits so far
    # After a deeper backward step fits, the steps down the ladder are simulated while they are faster (its many
    # small backward stages can be slower than the next c's steps: Wikipedia + tail at 256 GPUs, seed 0, 527 ms at
    # 2 rounds a backward stage against 513 at the next c's halved backward); a faster one that fits is kept.
    feedback, searching = LadderFeedback(), False
    for schedule in budget_ladder(timer, rounds_of, options, plain, feedback):
        if search.refits == most:
            search.unmet = "work"
            break
        search.refits += 1
        candidate = finish(timer, schedule, options, digest)
        # The account's and the simulation's ranks, and the columns the plan is encoded from where it is kept.
        arrays = stacked_with_columns(timer, candidate, "memory")
        if fitting is not None:
            # The step after the first that fits is simulated first: where it is no faster (smaller stages seldom
            # are), its account, which where it fits visits every rank, is not needed.
            compared = _faster_next_step(timer, fitting, candidate, arrays, budget_bytes, search, first, segments)
            if searching and compared.faster and compared.kept is fitting:  # faster but over: on down the ladder
                continue
            if searching and compared.kept is not fitting:  # a faster step fits: the step after it is compared
                fitting, searching = compared.kept, False
                continue
            return compared.kept
        fit = _fitting_step(timer, candidate, arrays, options, budget_bytes, search, feedback, over, first, segments)
        if fit is not None:
            fitting, searching, feedback.fitted = fit, feedback.deeper, True
    if fitting is None:
        _least_over(timer, over, budget_bytes, search)
    return fitting


def _fitting_step(timer: PassTimer, candidate: ScheduledPlan, arrays: RankArrays, options: CompileOptions,
                  budget_bytes: int, search: BudgetSearch, feedback: LadderFeedback, over: list[StackedRanks],
                  first: np.ndarray | None, segments: Segments | None) -> BudgetFit | None:
    """One step of :func:`refit_to_budget` before any fits: its BudgetFit (accounted and simulated) where it fits
    the budget, else None, with what the ladder reads in `feedback` and, under a default budget, its stacked ranks
    appended to `over` (accounted further only where no step fits)."""
    # A rank above the budget settles whether the step fits. The least peak found is then a fitting step's, under
    # every step over; only where none fits are the steps over accounted further (_least_over: their stacks are held
    # until a step fits, as many as the floor's tile budget allows steps). A budget the user gave, whose refusal
    # names the least peak, has each step over accounted until a rank is above the least so far too (its steps are
    # not bounded by that budget, so their stacks are not held).
    strict = options.memory_budget_is_strict
    stop_above = max(budget_bytes, search.least_peak_bytes) if strict else budget_bytes
    if feedback.gauge:
        stop_above = max(stop_above, int(DEEPER_WITHIN * budget_bytes))
    peaks = peak_bytes(timer, candidate, arrays.stacked, first, stop_above=stop_above)
    if peaks.max() > budget_bytes:
        feedback.forward_over = bool(peaks[:, 0].max() > budget_bytes)
        feedback.peak_over_budget = float(peaks.max()) / budget_bytes
        if strict:
            search.found(int(peaks.max()))
        else:
            over.append(arrays.stacked)
        return None
    search.found(int(peaks.max()))
    del over[:]
    figures = timer.run("score", layer_figures, candidate, segments, arrays.stacked)
    return BudgetFit(plan=candidate, peaks=peaks, held=arrays, figures=figures,
                     layer_seconds=layer_seconds(figures))


def _refits_allowed(plan: ScheduledPlan, options: CompileOptions, budget_bytes: int, search: BudgetSearch,
                    tile_budget: int) -> float:
    """How many schedules :func:`refit_to_budget` may try for `plan` (0: none, with why in `search.unmet`: a rank's
    own tokens' accumulators and outputs alone over the budget, or the work bound); records the least peak any
    schedule can have (`floor_bytes`)."""
    final = plan.final
    rank_tokens = np.bincount(final.assignment.block_rank, weights=final.sharding.block_tokens,
                              minlength=final.num_ranks)
    floor_bytes = int(least_peak_bytes(PlanHeader.model_construct(**plan.header_fields), rank_tokens).max())
    search.floor_bytes = floor_bytes
    # The default budget's refits are work the floor's tile budget bounds, as it bounds the candidates. A given
    # budget is met whatever it costs.
    most = most_refits(options, final.tiles.num_tiles, tile_budget)
    if floor_bytes > budget_bytes or not options.pipelined or most == 0:
        search.unmet = "own tokens" if floor_bytes > budget_bytes else "work"
        return 0
    search.unmet = "no schedule"
    return most


@dataclass(frozen=True, slots=True, kw_only=True)
class _Compared:
    """:func:`_faster_next_step`'s result: the fit kept, and whether the step compared simulated faster."""

    kept: BudgetFit
    faster: bool


def _faster_next_step(timer: PassTimer, fitting: BudgetFit, candidate: ScheduledPlan, arrays: RankArrays,
                      budget_bytes: int, search: BudgetSearch, first: np.ndarray | None = None,
                      segments: Segments | None = None) -> _Compared:
    """:func:`refit_to_budget`'s choice between the fastest step that fits so far, `fitting`, and a step after it,
    `candidate` (with its stacked ranks and columns, `arrays`): the candidate where it simulates faster and fits the
    budget, else `fitting`. `segments`: as :func:`layer_figures` takes them."""
    figures = timer.run("score", layer_figures, candidate, segments, arrays.stacked)
    seconds = layer_seconds(figures)
    if seconds < fitting.layer_seconds:  # (a tie goes to the first)
        peaks = peak_bytes(timer, candidate, arrays.stacked, first, stop_above=budget_bytes)
        if peaks.max() <= budget_bytes:
            search.found(int(peaks.max()))
            return _Compared(kept=BudgetFit(plan=candidate, peaks=peaks, held=arrays, figures=figures,
                                            layer_seconds=seconds), faster=True)
        return _Compared(kept=fitting, faster=True)
    return _Compared(kept=fitting, faster=False)


def _least_over(timer: PassTimer, over: list[StackedRanks], budget_bytes: int, search: BudgetSearch) -> None:
    """Lower `search.least_peak_bytes` to the least peak of the steps `over` the budget whose accounts stopped at the
    first ranks above it: each is accounted again until a rank is above the least so far (as
    :func:`refit_to_budget` accounts the steps of a budget the user gave), so the least is every step's."""
    for stacked in over:
        peaks = timer.run("memory", stacked_peak_bytes, stacked,
                          stop_above=max(budget_bytes, search.least_peak_bytes))
        search.found(int(peaks.max()))


def peak_bytes(timer: PassTimer, plan: ScheduledPlan, stacked: StackedRanks | None = None,
               first: np.ndarray | None = None, stop_above: int | None = None) -> np.ndarray:
    """:func:`plan_peak_bytes` of a finished plan, from its stacked ranks where the caller holds them (the same
    arrays: stack_plan of the plan); `first`, `stop_above`: as :func:`stacked_peak_bytes` takes them (every rank's
    peaks, in rank order, where the account does not stop)."""
    if stacked is None:
        return timer.run("memory", plan_peak_bytes, plan.final, plan.header_fields, stop_above=stop_above,
                         first=first)
    return timer.run("memory", stacked_peak_bytes, stacked, stop_above=stop_above, first=first)


@dataclass(slots=True, kw_only=True)
class LadderFeedback:
    """What :func:`refit_to_budget` tells :func:`budget_ladder` of the steps it has accounted: whether one fits the
    budget, and whether the last one's forward is over it (on the ranks accounted; smaller backward stages cannot
    bring that step under)."""

    fitted: bool = False
    forward_over: bool = False
    peak_over_budget: float = math.inf  # the last step's peak over the budget (on the ranks accounted)
    deeper: bool = False  # set by the ladder: whether the step it gave last is one of the deeper backward steps
    # Set by the ladder: whether the step it gave last decides if deeper steps follow. Its account then stops only
    # above DEEPER_WITHIN of the budget, so that the decision is the full account's (whatever ranks an account
    # stopped above the budget visited first).
    gauge: bool = False


def budget_ladder(timer: PassTimer, rounds_of: Callable[[], Rounds], options: CompileOptions,
                  plain: Schedule | None = None, feedback: LadderFeedback | None = None) -> Iterator[Schedule]:
    """Schedules of the rounds `rounds_of()` gives that hold less and less, step by step: at the requested rounds a
    stage (c), then at about 3/4 as many each step down to one, the backward levelled within TIGHT_LEVELLING_STAGES
    (a tile levelling delays keeps its pulled block live) and then, at the same c, with its stages halved too (a
    pulled block lives until its gradient leaves two stages later). A rank receives at most a stage's rounds of
    messages at a time, so its peak falls about with the stage. `plain`: coalesce's schedule of those rounds at c,
    where the caller holds it; the first step then levels its backward again (the forward is the same call).

    With `feedback`, where the halved backward is still over the budget while its forward is not, the same c is
    tried with the backward in smaller stages still (:func:`deeper_backward_rounds`) before c shrinks: the backward
    holds about twice the forward's peak (a pulled block lives until its gradient leaves), and shrinking c for both
    passes made the forward's stages as small as the backward needs (paper trace at 64 GPUs, seed 2: 42/44 stages
    where the forward fits at 16). Those steps stop at the first that fits: the step compared with it is then the
    next c's, as without them.

    Yields:
        each step's Schedule, holding less than the one before.
    """
    per_stage, tight, rounds = options.coalesce, TIGHT_LEVELLING_STAGES, None
    while per_stage >= 1:
        if plain is not None and per_stage == options.coalesce:
            # Its forward is this step's (levelled as usual, Q pulls first where that pays): only the backward
            # changes, which with_backward_rounds levels as complete_backward would at 2c rounds a stage.
            schedule, plain = timer.run("coalesce", with_backward_rounds, plain, 2 * per_stage, tight), None
        else:
            rounds = rounds if rounds is not None else rounds_of()
            block_size = rounds.transfers.assignment.tiles.sharding.block_size
            # The forward levelled as usual (its peak is the backward's fraction); the backward within `tight`.
            schedule = timer.run("coalesce", coalesce, rounds, per_stage, options.pipelined,
                                 buffer_budget=LEVELLING_STAGES * per_stage * block_size, levelling_stages=tight)
        yield schedule
        if (halved := smaller_backward_rounds(per_stage)) is not None:
            deeper = deeper_backward_rounds(per_stage, halved) if feedback is not None else []
            if deeper:
                feedback.gauge = True
            yield timer.run("coalesce", with_backward_rounds, schedule, halved, tight)
            previous = math.inf
            for rounds_a_stage in deeper:
                # Smaller backward stages cut the peak by 5-27% a step, then no more (paper trace at 256 GPUs,
                # seed 0: 6.7, 5.4, 4.9, 5.1 GiB at 16, 8, 4 and 2 rounds): tried within DEEPER_WITHIN of the
                # budget, while the peak still falls, so that they do not spend the refits the smaller c needs.
                over_by = feedback.peak_over_budget
                if feedback.fitted or feedback.forward_over or over_by > DEEPER_WITHIN or over_by >= previous:
                    break
                previous, feedback.deeper = over_by, True
                yield timer.run("coalesce", with_backward_rounds, schedule, rounds_a_stage, tight)
                feedback.deeper = False
            if feedback is not None:
                feedback.gauge = False
        del schedule
        per_stage = per_stage * 3 // 4 if per_stage > 3 else per_stage - 1

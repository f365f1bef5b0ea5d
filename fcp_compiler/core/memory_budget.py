"""The memory budget: where a compile decides how much memory a plan may hold, and holds the plan it keeps to it.

Two budgets, each named with its unit:

- `budget_tokens` (:func:`memory_budget_tokens`): the live buffer tokens a rank may hold, MEMORY_BUDGET_STAGES
  stages' worth of pulls (4cB). The floor (:mod:`fcp_compiler.core.floor`) schedules every candidate within it, and
  so does `fit_memory` for one placement; the stage size is searched by
  :func:`fcp_compiler.core.schedule_search.fit_memory`.
- `budget_bytes` (CompileOptions.resolved_memory_budget_bytes, --memory-budget): the device memory a rank may peak
  at by the memory account (:func:`fcp_compiler.core.account.plan_peak_bytes`). :func:`within_budget` accounts the
  plan a compile keeps (:class:`KeptPlan`) and, where a rank is over, schedules its placement again holding less
  (:func:`refit_to_budget`, down :func:`budget_ladder`) or keeps a faster floor candidate that fits as scheduled.
  What it decided is a :class:`BudgetDecision` (stats["memory"]); the plan is encoded here, once its header's memory
  figures are known.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import numpy as np

from fcp_compiler.core.account import plan_peak_bytes
from fcp_compiler.core.ir import Rounds, Schedule, TileSet
from fcp_compiler.core.options import CompileOptions
from fcp_compiler.core.pass_timer import PassTimer
from fcp_compiler.core.passes.coalesce import (LEVELLING_STAGES, TIGHT_LEVELLING_STAGES, coalesce,
                                               deeper_backward_rounds, smaller_backward_rounds, with_backward_rounds)
from fcp_compiler.core.passes.encode import encode
from fcp_compiler.core.schedule_search import (RankArrays, ScheduledPlan, Segments, finish, layer_figures,
                                               stacked_with_columns)
from fcp_compiler.errors import InfeasibleError
from fcp_compiler.format.memory import least_peak_bytes, stacked_peak_bytes
from fcp_compiler.format.plan_format import PlanHeader
from fcp_compiler.format.stacked import StackedRanks

# Live buffer tokens a plan may hold on any rank, in stages' worth of pulls (coalesce x block size): what the
# runtime's memory can give. A floor candidate over it is kept only when every candidate is over it (then the one
# with the fewest); time does not buy memory.
MEMORY_BUDGET_STAGES = 4
# The most a halved backward's peak may be over the byte budget for the ladder to try the same c with the backward in
# smaller stages still (budget_ladder): further over, only a smaller c brings it under.
DEEPER_WITHIN = 1.25


def memory_budget_tokens(options: CompileOptions) -> int:
    """The live buffer tokens a plan may hold: MEMORY_BUDGET_STAGES stages' worth of pulls (4cB), what the floor
    and `fit_memory` hold every plan to.

    Args:
        options: the compile options (their rounds a stage and block size).
    Returns:
        tokens.
    """
    return MEMORY_BUDGET_STAGES * options.coalesce * options.resolved_block_size


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
class Alternative:
    """One of the floor's other candidates, as the floor scheduled and scored it."""

    name: str
    plan: ScheduledPlan
    layer_seconds: float  # its simulated layer time, forward plus backward
    arrays: RankArrays | None  # its ranks as the floor stacked them to simulate it, and their encoder columns


def _no_others(limit: float) -> Iterator[Alternative]:
    """No other candidates (a plan the floor did not choose among others)."""
    return iter(())


@dataclass(frozen=True, slots=True, kw_only=True)
class KeptPlan:
    """The plan a compile keeps before the memory budget's account (:func:`within_budget`), and what that account
    reads where the plan is over the budget: `rounds_of()` gives the plan's rounds before relays (the relay pass
    re-sources pulls in them), which the refits coalesce again; `others(seconds)` the floor's other candidates that
    simulated faster than `seconds`, fastest first; `plain`: the plan's schedule before relays where it is
    coalesce's at the requested rounds a stage (the first refit levels its backward again, :func:`budget_ladder`),
    else None; `held`: the plan's stacked ranks and encoder columns where the floor made them to simulate it, else
    None; `segments_of(tiles)`: the segment pairs and their kinds the floor holds for a tile set, which the refits'
    simulations read (None: each builds its own)."""

    plan: ScheduledPlan
    floor_stats: dict | None = None
    fan_out: bool  # whether the plan's K,V fan out inside nodes (layer kinds scheduled on its placement do too)
    rounds_of: Callable[[], Rounds]
    others: Callable[[float], Iterator[Alternative]] = _no_others
    plain: Schedule | None = None
    held: RankArrays | None = None
    segments_of: Callable[[TileSet], Segments | None] = lambda tiles: None


@dataclass(frozen=True, slots=True, kw_only=True)
class BudgetFit:
    """A plan that fits the byte budget, a refit or another floor candidate: each rank's peaks per pass by the
    account, the encoder columns the account read (None: the encoder makes them) and its simulated layer seconds."""

    plan: ScheduledPlan
    peaks: np.ndarray
    columns: dict | None
    layer_seconds: float


@dataclass(frozen=True, slots=True, kw_only=True)
class BudgetDecision:
    """What the memory budget decided for a plan: stats["memory"] (:meth:`stats`)."""

    budget_bytes: int | None  # the budget asked (None: none)
    unbudgeted_peak_bytes: int  # the kept plan's peak before any refit
    refits: int  # schedules tried
    refitted: bool  # whether the plan returned is another schedule than the one kept
    met: bool  # False: a default budget no schedule met (the header then states no budget)
    kept: str | None  # which plan fits: "the winner, in smaller stages" or another candidate's name
    peak_bytes_fwd: int
    peak_bytes_bwd: int
    # Only where a rank was over the budget: the least peak any schedule can have (a rank's own tokens'
    # accumulators and outputs), the least peak found, and why the budget was unmet where it was.
    floor_bytes: int | None = None
    least_peak_bytes: int | None = None
    unmet: str | None = None  # "own tokens", "work" (the refits' bound) or "no schedule"

    def stats(self) -> dict:
        """The record stats["memory"] gives: the over-budget figures only where a rank was over."""
        record = {"budget_bytes": self.budget_bytes, "unbudgeted_peak_bytes": self.unbudgeted_peak_bytes,
                  "refits": self.refits, "refitted": self.refitted, "met": self.met, "kept": self.kept}
        if self.floor_bytes is not None:
            record.update(floor_bytes=self.floor_bytes, least_peak_bytes=self.least_peak_bytes, unmet=self.unmet)
        return {**record, "peak_bytes_fwd": self.peak_bytes_fwd, "peak_bytes_bwd": self.peak_bytes_bwd}


@dataclass(frozen=True, slots=True, kw_only=True)
class BudgetedPlan:
    """The plan compile_plan returns, encoded: its header's fields state each rank's peaks per pass and the budget
    they meet (None where a default budget went unmet)."""

    plan: ScheduledPlan
    data: bytes
    decision: BudgetDecision


@dataclass(slots=True, kw_only=True)
class _Search:
    """What the refits and the other candidates find as they go; :func:`within_budget` makes a BudgetDecision of it."""

    unbudgeted_peak_bytes: int
    least_peak_bytes: int  # the least peak found (of the kept plan, then of every schedule accounted)
    refits: int = 0
    floor_bytes: int | None = None  # set where the kept plan is over the budget (:func:`_refits_allowed`)
    unmet: str | None = None
    kept: str | None = None

    def found(self, peak_bytes: int) -> None:
        """A schedule accounted to `peak_bytes`."""
        self.least_peak_bytes = min(self.least_peak_bytes, peak_bytes)

    def decision(self, budget_bytes: int | None, peaks: np.ndarray, refitted: bool, met: bool) -> BudgetDecision:
        """What was decided, the plan returned accounted to `peaks` (each rank's per pass)."""
        over = self.floor_bytes is not None
        return BudgetDecision(budget_bytes=budget_bytes, unbudgeted_peak_bytes=self.unbudgeted_peak_bytes,
                              refits=self.refits, refitted=refitted, met=met, kept=self.kept,
                              peak_bytes_fwd=int(peaks[:, 0].max()), peak_bytes_bwd=int(peaks[:, 1].max()),
                              floor_bytes=self.floor_bytes, least_peak_bytes=self.least_peak_bytes if over else None,
                              unmet=self.unmet if over else None)


def within_budget(timer: PassTimer, kept: KeptPlan, options: CompileOptions, digest: str,
                  tile_budget: int) -> BudgetedPlan:
    """The kept plan with each rank's memory peaks per pass in its header (:func:`plan_peak_bytes`) and, where a peak
    is over the byte budget, its placement scheduled again holding less (:func:`refit_to_budget`: shallower
    levelling, smaller stages) until every rank fits, or the fastest of the floor's other candidates that fits as
    scheduled (:func:`_faster_within_budget`); encoded. The floor's candidates are scored without the account, so
    only the plan compile_plan returns pays for it. A default budget no schedule meets leaves the plan as it was
    (its header then states no budget); a given one is refused.

    Args:
        timer: times each pass.
        kept: the plan the compile keeps, and what the refits read.
        options: the compile options (the budget in bytes, and whether the user gave it).
        digest: the inputs digest the refits' headers record.
        tile_budget: the floor's tile budget, which bounds a default budget's refits (:func:`most_refits`).
    Returns:
        the BudgetedPlan: the plan, its bytes, and what the budget decided.
    Raises:
        InfeasibleError: a budget the user gave that no schedule tried meets (naming the least peak found, and the
            least any schedule can have).
    """
    plan, budget_bytes = kept.plan, options.resolved_memory_budget_bytes
    # The encoder's columns of the plan where the floor made them (read by the account and, where the plan is kept
    # as it is, written out); else the account reads the IR a few ranks at a time, and the encoder makes them.
    if kept.held is not None:
        columns = kept.held.columns
        peaks = timer.run("memory", stacked_peak_bytes, kept.held.stacked)
    else:
        columns = None
        peaks = timer.run("memory", plan_peak_bytes, plan.final, plan.header_fields)
    search = _Search(unbudgeted_peak_bytes=int(peaks.max()), least_peak_bytes=int(peaks.max()))
    stated, refitted, met = budget_bytes, False, True  # stated: the budget the header states
    if budget_bytes is not None and peaks.max() > budget_bytes:
        found = _fit_over_budget(timer, kept, options, digest, budget_bytes, search, peaks.max(axis=1), tile_budget)
        if found is not None:
            plan, peaks, columns, refitted = found.plan, found.peaks, found.columns, True
            search.kept = search.kept or "the winner, in smaller stages"
        elif options.memory_budget_is_strict:
            raise InfeasibleError(
                f"--memory-budget {budget_bytes / 2**30:.2f} GiB cannot be met: the least peak found is "
                f"{search.least_peak_bytes / 2**30:.2f} GiB, and no schedule of this placement can go below "
                f"{search.floor_bytes / 2**30:.2f} GiB on its busiest rank (its own tokens' accumulators and "
                f"outputs); give a larger budget, more GPUs, or --memory-budget none")
        else:
            stated, met = None, False
        del found
    decision = search.decision(budget_bytes, peaks, refitted, met)
    fields = {**plan.header_fields, "max_buffer_bytes_fwd": peaks[:, 0].tolist(),
              "max_buffer_bytes_bwd": peaks[:, 1].tolist(), "memory_budget_bytes": stated}
    # The columns go to the encoder alone (not held here, nor in the timer's arguments), which drops them before it
    # joins the file's bytes: a copy of the plan's rows less at its peak.
    held = [columns]
    del columns
    final = plan.final
    data = timer.run("encode", lambda: encode(final, fields, held.pop()))
    return BudgetedPlan(plan=ScheduledPlan(final=final, header_fields=fields), data=data, decision=decision)


def _fit_over_budget(timer: PassTimer, kept: KeptPlan, options: CompileOptions, digest: str, budget_bytes: int,
                     search: _Search, first: np.ndarray, tile_budget: int) -> BudgetFit | None:
    """A plan over `budget_bytes` refitted (:func:`refit_to_budget`) or, where a faster one fits, another of the
    floor's candidates (:func:`_faster_within_budget`); None where none fits. The refits and the other candidates
    account their ranks in the order of the kept plan's peaks, `first`: a plan over the budget is most likely over
    where the kept one was, and its account stops there."""
    refit = refit_to_budget(timer, kept.plan, options, digest, budget_bytes, search, kept.rounds_of, tile_budget,
                            kept.plain, first, kept.segments_of(kept.plan.final.tiles))
    if refit is None and search.unmet != "no schedule":  # a rank's own tokens are over it, or the work bound
        return None
    return _faster_within_budget(timer, refit, kept.others, budget_bytes, search, first)


def refit_to_budget(timer: PassTimer, plan: ScheduledPlan, options: CompileOptions, digest: str, budget_bytes: int,
                    search: _Search, rounds_of: Callable[[], Rounds], tile_budget: int,
                    plain: Schedule | None = None, first: np.ndarray | None = None,
                    segments: Segments | None = None) -> BudgetFit | None:
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
    Returns:
        the BudgetFit of the step kept, or None.
    """
    most = _refits_allowed(plan, options, budget_bytes, search, tile_budget)
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
                  budget_bytes: int, search: _Search, feedback: LadderFeedback, over: list[StackedRanks],
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
    peaks = _peak_bytes(timer, candidate, arrays.stacked, first, stop_above=stop_above)
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
    return BudgetFit(plan=candidate, peaks=peaks, columns=arrays.columns,
                     layer_seconds=figures["layer_makespan_fwd_s"] + figures["layer_makespan_bwd_s"])


def _refits_allowed(plan: ScheduledPlan, options: CompileOptions, budget_bytes: int, search: _Search,
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
                      budget_bytes: int, search: _Search, first: np.ndarray | None = None,
                      segments: Segments | None = None) -> _Compared:
    """:func:`refit_to_budget`'s choice between the fastest step that fits so far, `fitting`, and a step after it,
    `candidate` (with its stacked ranks and columns, `arrays`): the candidate where it simulates faster and fits the
    budget, else `fitting`. `segments`: as :func:`layer_figures` takes them."""
    figures = timer.run("score", layer_figures, candidate, segments, arrays.stacked)
    seconds = figures["layer_makespan_fwd_s"] + figures["layer_makespan_bwd_s"]
    if seconds < fitting.layer_seconds:  # (a tie goes to the first)
        peaks = _peak_bytes(timer, candidate, arrays.stacked, first, stop_above=budget_bytes)
        if peaks.max() <= budget_bytes:
            search.found(int(peaks.max()))
            return _Compared(kept=BudgetFit(plan=candidate, peaks=peaks, columns=arrays.columns,
                                            layer_seconds=seconds), faster=True)
        return _Compared(kept=fitting, faster=True)
    return _Compared(kept=fitting, faster=False)


def _least_over(timer: PassTimer, over: list[StackedRanks], budget_bytes: int, search: _Search) -> None:
    """Lower `search.least_peak_bytes` to the least peak of the steps `over` the budget whose accounts stopped at the
    first ranks above it: each is accounted again until a rank is above the least so far (as
    :func:`refit_to_budget` accounts the steps of a budget the user gave), so the least is every step's."""
    for stacked in over:
        peaks = timer.run("memory", stacked_peak_bytes, stacked,
                          stop_above=max(budget_bytes, search.least_peak_bytes))
        search.found(int(peaks.max()))


def _faster_within_budget(timer: PassTimer, refit: BudgetFit | None, others: Callable[[float], Iterator[Alternative]],
                          budget_bytes: int, search: _Search, first: np.ndarray | None = None) -> BudgetFit | None:
    """The refitted plan, or the fastest of the floor's other candidates that fits `budget_bytes` as the floor
    scheduled it, where it simulates faster than the refit (another placement may hold less at its own stages than
    the kept plan does at smaller ones). Candidates are tried fastest first, as long as they simulated faster than
    the refit (or the first one that fits, where nothing was refitted); the one kept is named in `search.kept`.
    `first`: the order the accounts visit ranks in (the kept plan's peaks)."""
    best, limit = refit, math.inf if refit is None else refit.layer_seconds
    for other in others(limit):
        stacked = other.arrays.stacked if other.arrays is not None else None
        peaks = _peak_bytes(timer, other.plan, stacked, first, stop_above=budget_bytes)
        if peaks.max() > budget_bytes:
            continue
        if other.layer_seconds < limit:
            best = BudgetFit(plan=other.plan, peaks=peaks, columns=other.arrays.columns if other.arrays else None,
                             layer_seconds=other.layer_seconds)
            search.kept = other.name
        break
    return best


def _peak_bytes(timer: PassTimer, plan: ScheduledPlan, stacked: StackedRanks | None = None,
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

"""The floor: FCP never emits a plan slower than one of its own simpler candidates.

FCP's placement balances each rank's layer time; whether its traffic hides is known only once the plan is scheduled.
So `compile_plan` schedules a few placements (:func:`compile_with_floor`, one :class:`FloorRun`), direct and, where it
may pay, with node fan-out, scores every resulting plan by the timing model (:mod:`fcp_compiler.core.simulate`: the
forward plus backward layer makespan, exactly what `fcp simulate` reports) and keeps the fastest whose live buffers
fit the token budget (:func:`fcp_compiler.core.memory_budget.memory_budget_tokens`: MEMORY_BUDGET_STAGES x coalesce x
block size tokens). A candidate over the budget is scheduled again with smaller backward stages and then, if it is
near, smaller stages in both passes (:func:`fcp_compiler.core.schedule_search.fit_memory`); one still over it is out.
It is a floor, not the method: the candidates are the placements FCP would otherwise lose to.

- ``layer``: FCP's own placement (`assign` for each rank's layer time, under the token tolerance), and the same at
  the other tolerances of LAYER_TOLERANCES (``layer-tokens-1%``, ``layer-tokens-10%``);
- ``attention``: FCP's placement of attention alone (the joint compute/traffic search, tokens under the cap only);
- ``greedy``: a MagiAttention-like equal-chunk greedy (fixed slices of the packed batch, a min-heap on attention
  area, the same number of slices a rank), run through FCP's own transfer passes (node grouping, fan-out, relays);
- ``magi``: the same placement routed as `--planner magi` routes it (no node grouping; relays where they fit),
  direct: on the 55 matrix batches faster than node grouping on 3 (up to 1.2%), slower on 7 (up to 1.9%).

With the floor off, FCP's own placement alone is scheduled and finished here too, as the floor's first candidate.
The placements themselves (:class:`Placement`, shard, cost and assign) are :mod:`fcp_compiler.core.placement`'s.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

from fcp_compiler.core.baselines import Planner
from fcp_compiler.core.budget_refit import most_refits
from fcp_compiler.core.ir import Assignment, Batch, Rounds, Schedule, TileSet, Transfers
from fcp_compiler.core.kinds import LayerKinds
from fcp_compiler.core.kinds_schedule import kinds_seconds
from fcp_compiler.core.memory_budget import Alternative, KeptPlan, memory_budget_tokens
from fcp_compiler.core.options import CompileOptions
from fcp_compiler.core.pass_timer import PassTimer
from fcp_compiler.core.placement import EQUAL_CHUNKS, LAYER_TOLERANCES, Placement, place, same_placement, shard_and_cost
from fcp_compiler.core.schedule_search import (RankArrays, ScheduledPlan, ScoredSchedule, SegmentCache, coalesce_within,
                                               fanned_out, faster_stages, finish, fit_memory, layer_figures,
                                               make_rounds, most_received_tokens, route, stacked_with_columns)
from fcp_compiler.core.simulate import LAYER_STATS, busy_lower_bound
from fcp_compiler.core.winner_schedule import backward_last_stage
from fcp_compiler.errors import InfeasibleError
from fcp_compiler.format.inputs import Layout

# Re-exported: the placements the candidates name are the placement module's.
__all__ = ["EQUAL_CHUNKS", "FAN_OUT_MOST_RECEIVED", "LAYER_TOLERANCES", "TILE_BUDGET", "Candidate", "FloorRun",
           "Placement", "Score", "applies", "candidates", "choose", "compile_with_floor", "fan_out_follower",
           "fan_out_out_of_reach", "most_scheduled"]

# The floor's work is bounded: it schedules at most this many tiles in all (candidates x the batch's tiles), and
# always FCP's own placement. At the seed's 32K tokens a GPU that is every candidate up to about 256 GPUs (75K
# tiles), three at 1024 and one at 4096 (1.2M tiles), where a schedule takes 15-20 s on one core.
TILE_BUDGET = 1_000_000


def most_scheduled(num_tiles: int) -> int:
    """How many candidates the floor schedules for a batch of `num_tiles` tiles (at least one)."""
    return max(1, TILE_BUDGET // max(num_tiles, 1))


# Node fan-out is not scheduled (its direct twin is) where its busiest receiver would take in more than this many
# live-buffer budgets of tokens over a pass: an entry holds its block until it has re-sent it. Measured, not a bound:
# on the 54 matrix batches every fan-out candidate that fit took in at most 1.38 budgets (winners 0.78), every one
# above 1.45 was over at every stage size; leaving out those above 2 changed no plan, 6% off the 256-GPU compile.
FAN_OUT_MOST_RECEIVED = 2


def fan_out_out_of_reach(most_received_tokens: int, budget_tokens: int) -> bool:
    """Whether a node fan-out candidate whose busiest receiver takes in `most_received_tokens` over a pass is left
    unscheduled: more than FAN_OUT_MOST_RECEIVED budgets of `budget_tokens` live buffer tokens."""
    return most_received_tokens > FAN_OUT_MOST_RECEIVED * budget_tokens


@dataclass(frozen=True, slots=True, kw_only=True)
class Candidate:
    """One plan the floor compares: a placement, with or without node fan-out."""

    placement: Placement
    fan_out: bool

    @property
    def name(self) -> str:
        """How the stats name it, e.g. "layer+fan-out" or "greedy direct"."""
        return f"{self.placement.value}{'+fan-out' if self.fan_out else ' direct'}"


@dataclass(frozen=True, slots=True, kw_only=True)
class Score:
    """A scheduled candidate's figures: its simulated layer makespans and its peak live buffer tokens."""

    candidate: Candidate
    coalesce: int  # rounds a forward stage it was scheduled with (fewer than asked where memory needed)
    backward_rounds: int  # rounds a backward stage (2 x coalesce unless memory needed fewer)
    layer_makespan_fwd_s: float
    layer_makespan_bwd_s: float
    max_buffer_tokens: int
    relays: bool = True  # False: relays would have held blocks past the budget the schedule met, so none were made
    # Its placement's busiest rank's layer work (no schedule is faster); None for the only candidate (not bounded).
    busy_lower_bound_s: float | None = 0.0
    seconds: float = 0.0  # what placing (where it was the first candidate of its placement) and scheduling it took
    # With layer kinds (core.kinds): the other kinds' forward plus backward makespans on this placement, each
    # weighted by its layers per layer of the kind scheduled here, so that the floor chooses by the model's mix.
    kinds_s: float = 0.0

    @property
    def name(self) -> str:
        """The candidate's name with its stage sizes: rounds a forward stage / a backward stage."""
        return f"{self.candidate.name} c{self.coalesce}/{self.backward_rounds}{'' if self.relays else ' no relays'}"

    @property
    def record(self) -> dict:
        """The candidate in stats["floor"]["candidates"] (makespans None where not simulated: the only candidate)."""
        fwd_s, bwd_s = (None if math.isnan(s) else s for s in (self.layer_makespan_fwd_s, self.layer_makespan_bwd_s))
        return {"name": self.name, "layer_makespan_fwd_s": fwd_s, "layer_makespan_bwd_s": bwd_s,
                "max_buffer_tokens": self.max_buffer_tokens, "busy_lower_bound_s": self.busy_lower_bound_s,
                "seconds": self.seconds, **({"other_kinds_s": self.kinds_s} if self.kinds_s else {})}

    @property
    def layer_seconds(self) -> float:
        """What a training step pays for the layer: forward plus backward makespan (with layer kinds, per layer of
        this kind, the others' weighted in)."""
        return self.layer_makespan_fwd_s + self.layer_makespan_bwd_s + self.kinds_s


def candidates(attention_only: bool, fan_out: bool | None, tolerances: bool = True) -> list[Candidate]:
    """The candidates in the order they are tried (ties go to the earlier).

    When both switches are tried (`fan_out` None), only FCP's own placement is tried with node fan-out here; the
    fastest of the others follows with it (:func:`fan_out_follower`). Fan-out holds each entry's block across
    stages, so it is over the memory budget on most batches, and scheduling a plan only to find it over is the
    floor's most expensive outcome. On the 55 batches of benchmarks/layer_objective.py's matrix (before this rule),
    a fan-out candidate won 9; each was FCP's own placement or the fastest direct one, and when FCP's own was over
    the budget with fan-out the others' fan-out won none (it fit on 3 of 29).

    The attention-alone placement (its joint compute/traffic search) is tried only where the other tolerances are
    not: beside the layer placements at three tolerances it won 1 of the 54 matrix batches, by 0.04%, for 15-26% of
    the compile time (benchmarks/compile_matrix.py).

    Args:
        attention_only: no model around attention (the layer placement is then the attention placement).
        fan_out: the user's node fan-out switch; None tries both.
        tolerances: also the layer placement at the other token tolerances of LAYER_TOLERANCES (not when the user
            gave one, nor without a model or outside the plan layout, where tokens are not the linear layers' load);
            the attention placement is tried only without them.
    Returns:
        the candidates, FCP's own placement first (direct first: its fan-out holds more memory), the magi route
        last and direct only.
    """
    tolerated = [Placement.LAYER_TOKENS_1, Placement.LAYER_TOKENS_10] if tolerances and not attention_only else []
    attention = [] if attention_only or tolerated else [Placement.ATTENTION]
    placements = [Placement.LAYER] + tolerated + attention + [Placement.GREEDY]
    if fan_out is None:
        own = [Candidate(placement=Placement.LAYER, fan_out=False), Candidate(placement=Placement.LAYER, fan_out=True)]
        others = [Candidate(placement=placement, fan_out=False) for placement in placements[1:]]
    else:
        own, others = [], [Candidate(placement=placement, fan_out=fan_out) for placement in placements]
    return own + others + ([Candidate(placement=Placement.MAGI, fan_out=False)] if not fan_out else [])


def fan_out_follower(scores: list[Score], budget_tokens: int) -> Candidate | None:
    """The candidate tried after :func:`candidates` when both switches are: the fastest direct placement with node
    fan-out, when it is not FCP's own and FCP's own fit the memory budget with fan-out (the magi route's placement
    is the greedy one).

    Args:
        scores: the candidates scheduled so far.
        budget_tokens: the most live buffer tokens a rank may hold.
    Returns:
        the candidate, or None.
    """
    own = [score for score in scores if score.candidate == Candidate(placement=Placement.LAYER, fan_out=True)]
    if not own or own[0].max_buffer_tokens > budget_tokens or not math.isfinite(own[0].layer_seconds):
        return None
    direct = [score for score in scores if not score.candidate.fan_out and math.isfinite(score.layer_seconds)
              and score.max_buffer_tokens <= budget_tokens]
    if not direct:
        return None
    fastest = min(direct, key=lambda score: score.layer_seconds).candidate.placement  # the first on a tie
    fastest = Placement.GREEDY if fastest is Placement.MAGI else fastest
    return None if fastest is Placement.LAYER else Candidate(placement=fastest, fan_out=True)


def choose(scores: list[Score], budget_tokens: int) -> int:
    """Index of the winner: the least layer time among the scores within the memory budget, else the least buffer.

    Args:
        scores: the scheduled candidates, in the order tried.
        budget_tokens: the most live buffer tokens a rank may hold.
    Returns:
        the index in `scores` (the first on a tie).
    """
    assert scores
    fitting = [idx for idx, score in enumerate(scores) if score.max_buffer_tokens <= budget_tokens]
    if fitting:
        return min(fitting, key=lambda idx: (scores[idx].layer_seconds, idx))
    return min(range(len(scores)), key=lambda idx: (scores[idx].max_buffer_tokens, scores[idx].layer_seconds, idx))


def applies(options: CompileOptions, alone: bool = False) -> bool:
    """Whether compile_plan runs the floor (`alone`: or, the floor off, FCP's own candidate through it alone): it
    compares FCP's candidates; a baseline is its system's placement, and an ablation shows one technique alone."""
    return (options.floor or alone) and options.planner is Planner.FCP and options.pipelined and options.matching_rounds


def compile_with_floor(timer: PassTimer, batch: Batch, options: CompileOptions, token_cap: int, digest: str,
                       progress: Callable[[dict], None] | None = None, kinds: LayerKinds | None = None) -> KeptPlan:
    """Schedule every candidate (:func:`candidates`, then :func:`fan_out_follower`; with options.floor off, FCP's own
    placement only) within the token budget, score each that fits by the timing model and keep the winner
    (:func:`choose`), its schedule finished as :func:`backward_last_stage` says.

    Args:
        timer: times each pass.
        batch: the batch (with layer kinds, the primary kind's).
        options: the compile options.
        token_cap: the most tokens a rank may hold.
        digest: the inputs digest the plans' headers record.
        progress: called with each candidate's record (stats["floor"]["candidates"]) once it is scheduled.
        kinds: the compile's layer kinds: a candidate's score then counts every kind on its placement, weighted by
            the mix, and the memory budget's account keeps the winner's placement (the other kinds are scheduled on
            it).
    Returns:
        the KeptPlan: the winner, with the floor's stats, and what the memory budget's account may read.
    Raises:
        InfeasibleError: a token cap FCP's placement cannot meet, or a plan larger than fcp validate checks.
    """
    started = time.perf_counter()
    run = FloorRun(timer=timer, batch=batch, options=options, token_cap=token_cap, digest=digest,
                   budget_tokens=memory_budget_tokens(options), progress=progress, kinds=kinds)
    tolerances = options.token_tolerance is None and options.layout is Layout.PLAN
    tried = candidates(options.model is None, options.node_fan_out, tolerances) if options.floor else \
        [Candidate(placement=Placement.LAYER, fan_out=options.resolved_node_fan_out)]
    for candidate in tried:
        if not run.schedule(candidate):
            break
    if options.floor and options.node_fan_out is None and \
            (follower := fan_out_follower(run.scores, run.budget_tokens)) is not None:
        run.schedule(follower)
    index = choose(run.scores, run.budget_tokens)
    winner = run.winner(index)
    floor_stats = {name: winner.figures[name] for name in LAYER_STATS} if winner.figures is not None else {}
    floor_stats["floor"] = run.record(index, time.perf_counter() - started)
    floor_stats["floor"]["backward_last_stage"] = winner.last_stage
    rounds = winner.rounds
    return KeptPlan(plan=winner.plan, floor_stats=floor_stats, fan_out=run.scores[index].candidate.fan_out,
                    rounds_of=lambda: rounds, plain=winner.plain, held=winner.held, finishes=not run.alone,
                    others=lambda limit: run.others(index, limit) if kinds is None else iter(()),
                    segments_of=lambda tiles: None if run.alone else run.segments.segments_of(tiles))


@dataclass(frozen=True, slots=True, kw_only=True)
class _Pruned:
    """Why a placement was not scheduled: its busy lower bound (math.inf where refused), the earlier placement it
    places exactly as, or its refusal."""

    bound_s: float | None
    same_as: Placement | None
    refused: str | None


@dataclass(frozen=True, slots=True, kw_only=True)
class _Scored:
    """A scored candidate's plan, its simulated layer figures and its arrays (the stack its account reads too, the
    columns its file is cut from)."""

    plan: ScheduledPlan
    figures: dict
    arrays: RankArrays
    rounds: Rounds  # its rounds before relays, which the memory budget may refit ...
    plain: Schedule | None  # ... and its schedule where that refit's first step may start from it


@dataclass(frozen=True, slots=True, kw_only=True)
class _Best:
    """The fastest candidate so far that fits the budget."""

    score: Score
    plan: ScheduledPlan
    figures: dict | None  # None: not simulated (the only candidate)
    rounds: Rounds  # its rounds before relays, which the memory budget's refits schedule again
    plain: Schedule | None  # its schedule where the refits' first may start from it, else None


@dataclass(frozen=True, slots=True, kw_only=True)
class _Least:
    """The candidate over the budget with the fewest live buffer tokens so far (kept where none fits)."""

    score: Score
    transfers: Transfers  # its placement's pulls, before fan-out
    fan_out: bool
    schedule: Schedule | None  # None: not completed (its forward half was hopelessly over)


@dataclass(frozen=True, slots=True, kw_only=True)
class _Winner:
    """The winner's plan as the floor keeps it (:meth:`FloorRun.winner`)."""

    plan: ScheduledPlan
    figures: dict | None  # its simulated layer figures (None: not simulated)
    rounds: Rounds  # its rounds before relays
    plain: Schedule | None = None
    held: RankArrays | None = None
    last_stage: dict | None = None  # stats["floor"]["backward_last_stage"]


@dataclass(slots=True, kw_only=True)
class FloorRun:
    """The floor's candidates as they are scheduled: the placements made (each placed and routed once, whichever
    switches schedule it), the scores, and the plans kept: every scored candidate's plan (the memory budget may
    keep one of them, and scheduling it again costs what scoring it did), the least memory among those over the
    token budget. A candidate is scored only where the floor schedules several, so the plans kept are bounded by
    TILE_BUDGET tiles in all (about 20 MB for each of the 7 at 256 ranks); at thousands of ranks, where each IR is
    hundreds of MB, the only candidate is not scored and none is kept. :func:`choose` makes the same choice from the
    scores alone."""

    timer: PassTimer
    batch: Batch
    options: CompileOptions
    token_cap: int
    digest: str
    budget_tokens: int
    fcp_tiles: TileSet | None = None  # shared by FCP's own placements
    routed: dict[Placement, Transfers] = field(default_factory=dict)
    placed_by: dict[Placement, Assignment] = field(default_factory=dict)
    pruned: dict[Placement, _Pruned] = field(default_factory=dict)
    # fan-out candidates left unscheduled (fan_out_out_of_reach): their names and busiest receivers' tokens
    out_of_reach: list[dict] = field(default_factory=list)
    bounds: dict[Placement, float | None] = field(default_factory=dict)  # each placement's busy lower bound
    scores: list[Score] = field(default_factory=list)
    finished: dict[int, _Scored] = field(default_factory=dict)  # score index -> each scored candidate
    best: _Best | None = None
    least: _Least | None = None
    progress: Callable[[dict], None] | None = None
    kinds: LayerKinds | None = None  # the compile's layer kinds: each candidate is scored by the mix
    segments: SegmentCache = field(init=False)  # the segment pairs the candidates' tile sets share

    def __post_init__(self) -> None:
        self.segments = SegmentCache(timer=self.timer)

    @property
    def alone(self) -> bool:
        """Whether the floor's work allows one candidate only (TILE_BUDGET)."""
        return self.fcp_tiles is not None and most_scheduled(self.fcp_tiles.num_tiles) == 1

    def schedule(self, candidate: Candidate) -> bool:
        """Place (once a placement), schedule and score one candidate, unless its placement is pruned or, with node
        fan-out, it is out of the budget's reach (:func:`fan_out_out_of_reach`: recorded in `out_of_reach`, counted
        among the candidates the floor's work allows but not scheduled); False once that work is spent
        (TILE_BUDGET)."""
        started = time.perf_counter()
        if candidate.placement is Placement.MAGI and Placement.GREEDY in self.pruned:  # one placement: its bound
            self.pruned[candidate.placement] = self.pruned[Placement.GREEDY]
        if candidate.placement in self.pruned:
            return True
        # A fan-out candidate out of reach keeps its place in the count: where the tile budget binds (thousands of
        # ranks), the candidates scheduled are the ones that were, less those left out, and so is the plan.
        taken = len(self.scores) + len(self.out_of_reach)
        if self.fcp_tiles is not None and taken >= most_scheduled(self.fcp_tiles.num_tiles):
            return False
        if candidate.placement not in self.routed and not self._place(candidate.placement):
            return True
        transfers = self.routed[candidate.placement]
        fanned = fanned_out(self.timer, transfers, self.options, candidate.fan_out)
        if fanned is not transfers and self.options.node_fan_out is None:  # its direct twin is a candidate too
            received = most_received_tokens(fanned)
            if fan_out_out_of_reach(received, self.budget_tokens):
                self.out_of_reach.append({"candidate": candidate.name, "most_received_tokens": received})
                return True
        self._score(candidate, transfers, fanned, started)
        return True

    def _score(self, candidate: Candidate, transfers: Transfers, fanned: Transfers, started: float) -> None:
        """Schedule a placed candidate's pulls (`fanned`: with fan-out where it has it) within the token budget,
        finish it where it may fit, simulate it where the floor compares several, and keep its score; `started`: when
        its scheduling began."""
        timer, options, budget_tokens = self.timer, self.options, self.budget_tokens
        fitted = fit_memory(timer, make_rounds(timer, fanned, options, False), options, budget_tokens)
        schedule, peak, plan, relays = fitted.schedule, fitted.peak_tokens, None, True
        if schedule is not None and peak <= budget_tokens:  # only a plan that may fit is finished and scored
            plan = finish(timer, schedule, options, self.digest, peak_tokens=peak)
            if plan.max_buffer_tokens > budget_tokens:  # a relay holds its block longer: keep the schedule's senders
                plan, relays = finish(timer, schedule, options, self.digest, relays=False, peak_tokens=peak), False
            peak = plan.max_buffer_tokens
        fits = plan is not None and peak <= budget_tokens
        # The only candidate the floor's work allows (thousands of ranks) is not simulated: there is nothing to
        # compare it with, and `fcp compile` simulates the plan it prints (core.simulate.layer_stats).
        arrays = stacked_with_columns(timer, plan) if fits and not self.alone else None
        segments = self.segments.segments_of(plan.final.tiles) if arrays is not None else None
        figures = timer.run("score", layer_figures, plan, segments, arrays.stacked) if arrays is not None else None
        if figures and fitted.plain:  # the same pulls in larger stages where they fit and simulate faster
            kept = faster_stages(timer, ScoredSchedule(schedule=schedule, plan=plan, peak_tokens=peak, arrays=arrays,
                                                       figures=figures), options, self.digest, budget_tokens, segments)
            schedule, plan, peak, arrays = kept.schedule, kept.plan, kept.peak_tokens, kept.arrays
            figures = kept.figures
        unscored = math.nan if fits else math.inf
        score = Score(
            candidate=candidate, coalesce=schedule.coalesce if schedule else options.coalesce,
            backward_rounds=schedule.backward.coalesce if schedule else 2 * options.coalesce,
            layer_makespan_fwd_s=figures["layer_makespan_fwd_s"] if figures else unscored,
            layer_makespan_bwd_s=figures["layer_makespan_bwd_s"] if figures else unscored, max_buffer_tokens=peak,
            relays=relays, seconds=time.perf_counter() - started,  # (before the other layer kinds are scheduled)
            busy_lower_bound_s=self.bounds[candidate.placement],
            kinds_s=kinds_seconds(timer, plan, self.kinds, options, candidate.fan_out, budget_tokens)
            if figures else 0.0)
        if fits and (self.best is None or score.layer_seconds < self.best.score.layer_seconds):
            # The rounds before relays, which the memory budget's refits schedule again, and the schedule itself
            # where their first may start from it (its forward; held only where refits may run).
            refits = most_refits(options, plan.final.tiles.num_tiles, TILE_BUDGET) > 0
            self.best = _Best(score=score, plan=plan, figures=figures, rounds=schedule.rounds,
                              plain=fitted.schedule if fitted.plain and refits else None)
        if figures is not None:  # kept for others(): the memory budget may want it, and it is seconds to redo
            self.finished[len(self.scores)] = _Scored(plan=plan, figures=figures, arrays=arrays, rounds=schedule.rounds,
                                                      plain=fitted.schedule if fitted.plain else None)
        if not fits and (self.least is None or peak < self.least.score.max_buffer_tokens):
            self.least = _Least(score=score, transfers=transfers, fan_out=candidate.fan_out, schedule=schedule)
        self.scores.append(score)
        if self.progress is not None:
            self.progress(score.record)

    def others(self, winner: int, limit: float) -> Iterator[Alternative]:
        """The scored candidates but the winner that fit the token budget and simulated faster than `limit`,
        fastest first, as they were scored."""
        faster = sorted((score.layer_seconds, index) for index, score in enumerate(self.scores)
                        if index != winner and score.layer_seconds < limit and score.max_buffer_tokens
                        <= self.budget_tokens)
        for seconds, index in faster:
            scored = self.finished[index]
            yield Alternative(name=self.scores[index].name, plan=scored.plan, layer_seconds=seconds,
                              arrays=scored.arrays, figures=scored.figures, rounds=scored.rounds, plain=scored.plain)

    def winner(self, index: int) -> _Winner:
        """The plan of the winner, the score at `index`: the fastest that fit, its backward's last stage kept to
        itself where that is faster (:func:`backward_last_stage`); else (nothing fits the budget) the one with the
        fewest buffer tokens, scheduled in full."""
        timer, options = self.timer, self.options
        if self.best is not None:
            best = self.best
            assert best.score is self.scores[index]
            if self.alone:
                return _Winner(plan=best.plan, figures=best.figures, rounds=best.rounds, plain=best.plain)
            last = backward_last_stage(timer, best.plan, best.figures, options, self.digest, self.budget_tokens,
                                       self.segments.segments_of(best.plan.final.tiles), self.finished[index].arrays)
            return _Winner(plan=last.plan, figures=last.figures, rounds=best.rounds, plain=best.plain,
                           held=last.held, last_stage=last.record)
        least = self.least
        assert least.score is self.scores[index]
        rounds = least.schedule.rounds if least.schedule is not None else make_rounds(timer, least.transfers,
                                                                                      options, least.fan_out)
        schedule = least.schedule or coalesce_within(timer, rounds, options, None).schedule
        plan = finish(timer, schedule, options, self.digest)
        return _Winner(plan=plan, figures=None if self.alone else layer_figures(plan), rounds=rounds)

    def record(self, winner: int, seconds: float) -> dict:
        """stats["floor"]: the winner, every scheduled candidate's score, the placements skipped and why, and the node
        fan-out candidates out of the budget's reach; `seconds`: the floor's."""
        return {
            "winner": self.scores[winner].name, "memory_budget_tokens": self.budget_tokens, "seconds": seconds,
            "most_scheduled": most_scheduled(self.fcp_tiles.num_tiles) if self.fcp_tiles is not None else None,
            "candidates": [score.record for score in self.scores],
            "pruned": [{"placement": placement.value, "busy_lower_bound_s": pruned.bound_s,
                        "same_as": pruned.same_as.value if pruned.same_as is not None else None,
                        "refused": pruned.refused} for placement, pruned in self.pruned.items()],
            "out_of_reach": self.out_of_reach}

    def _place(self, placement: Placement) -> bool:
        """Place and route `placement`; False (and the reason in `pruned`) where it is refused, cannot win, or
        places exactly as an earlier one."""
        timer, options = self.timer, self.options
        if placement not in EQUAL_CHUNKS and self.fcp_tiles is None:
            self.fcp_tiles = shard_and_cost(timer, self.batch, options)
        try:
            assignment = self.placed_by.get(Placement.GREEDY) if placement is Placement.MAGI else None
            assignment = assignment or place(timer, self.batch, options, self.token_cap, placement, self.fcp_tiles)
        except InfeasibleError as refusal:  # MagiAttention's chunks past a limit FCP's own blocks meet
            if placement not in EQUAL_CHUNKS:
                raise
            self.pruned[placement] = _Pruned(bound_s=math.inf, same_as=None, refused=str(refusal))
            return False
        # A placement whose busiest rank alone computes longer than the best plan so far takes cannot win: its
        # schedules are skipped (the bound holds for every schedule of it; tests/test_floor.py checks it).
        fastest = self.best.score.layer_seconds if self.best is not None else math.inf
        # The only candidate the floor's work allows (or FCP's own alone) is compared with nothing, so it is not
        # bounded (it costs a pass over every segment pair: seconds at small blocks).
        compared = options.floor and not self.alone
        bound = timer.run("score", busy_lower_bound, assignment, options.layout, options.model,
                          self.segments.pairs_of(assignment.tiles)) if compared else None
        self.bounds[placement] = bound
        same = [earlier for earlier, placed in self.placed_by.items() if same_placement(placed, assignment)
                and (earlier is Placement.MAGI) == (placement is Placement.MAGI)]  # routed alike
        # Cannot win, or schedules exactly as an earlier placement does.
        if (bound is not None and bound >= fastest) or same:
            self.pruned[placement] = _Pruned(bound_s=bound, same_as=same[0] if same else None, refused=None)
            return False
        if not self.alone:  # compared with the placements after it: none where the floor schedules one candidate
            self.placed_by[placement] = assignment  # (a column a tile: millions at small blocks)
        self.routed[placement] = route(timer, assignment, options, as_its_system=placement is Placement.MAGI)
        return True


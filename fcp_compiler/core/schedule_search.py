"""Schedule search: one placement scheduled into a finished plan, and the stage size searched within a token budget.

The passes after placement, in order: plan_transfers and localize (:func:`route`), fan_out and schedule_rounds
(:func:`make_rounds`), coalesce (:func:`fit_memory`, :func:`coalesce_within`), relay and reshuffle (:func:`finish`).
A finished plan is a :class:`ScheduledPlan`, not encoded: the floor's candidates and the memory budget's refits are
simulated (:func:`layer_figures`) and accounted from their IR, and only the plan compile_plan returns is encoded.

The stage size is searched here: :func:`fit_memory` coalesces at the requested rounds a stage and, while the live
buffers exceed the caller's `budget_tokens` (:func:`fcp_compiler.core.memory_budget.memory_budget_tokens`, where the
budget is decided), tries schedules that hold less (:func:`refits`). The floor (:mod:`fcp_compiler.core.floor`)
schedules each of its candidates so.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field

import numpy as np

from fcp_compiler.core.baselines import Planner
from fcp_compiler.core.ir import Assignment, Reshuffle, Rounds, Schedule, TileSet, Transfers
from fcp_compiler.core.options import CompileOptions
from fcp_compiler.core.pass_timer import PassTimer
from fcp_compiler.core.passes.coalesce import (TIGHT_LEVELLING_STAGES, coalesce, coalesce_forward, complete_backward,
                                               forward_peak, max_buffer_tokens, pass_peaks, smaller_backward_rounds,
                                               with_backward_rounds)
from fcp_compiler.core.passes.cost import tile_efficiency
from fcp_compiler.core.passes.encode import rank_columns
from fcp_compiler.core.passes.fan_out import fan_out
from fcp_compiler.core.passes.localize import group_nodes, localize
from fcp_compiler.core.passes.relay import relay
from fcp_compiler.core.passes.reshuffle import reshuffle
from fcp_compiler.core.passes.rounds import arbitrary_rounds, schedule_rounds
from fcp_compiler.core.passes.transfers import plan_transfers
from fcp_compiler.core.plan_memory import stack_plan
from fcp_compiler.core.simulate import HeldPlan, layer_seconds, pair_kinds, simulate_plan
from fcp_compiler.format.inputs import Layout
from fcp_compiler.format.stacked import StackedRanks

# fit_memory aims this share of the token budget when it shrinks the stages of a plan over it.
FIT_MARGIN = 0.8
# faster_stages tries larger stages only where one tile (a block of queries by a block of keys) is below this share of
# the efficiency curve's top: larger stages pay mostly through larger kernel calls (on small plans call sizes are
# most of the distance to the optimum, benchmarks/schedule_optimum.py --staged-calls), and a tile near the top gains
# little from them. At 4096-token blocks (0.95 of the top on Hopper) the matrix's 54 plans changed on 2 (+0.20%,
# -0.01%) for 3.3% more compile at 64 GPUs; at 512 and 1024 (0.32, 0.56) they are most of what the small plans gain.
LARGER_STAGES_EFFICIENCY = 0.9


@dataclass(frozen=True, slots=True, kw_only=True)
class ScheduledPlan:
    """A finished plan, not encoded: its final IR and its header's fields (whose memory figures in bytes the memory
    budget's account fills in for the plan compile_plan returns, :func:`memory_budget.within_budget`)."""

    final: Reshuffle
    header_fields: dict

    @property
    def max_buffer_tokens(self) -> int:
        """The most live buffer tokens any rank holds (the header's max_buffer_tokens)."""
        return self.header_fields["max_buffer_tokens"]


@dataclass(frozen=True, slots=True, kw_only=True)
class RankArrays:
    """A finished plan's ranks stacked (what the simulation and the memory account read) and the encoder's columns
    they are stacked from (what the plan file is cut from, should the plan be the one compile_plan returns)."""

    stacked: StackedRanks
    columns: dict


# TileSet.segment_pairs(): (pair_tile, pair_q_seg, pair_kv_seg, pair_flops), the IR's columns the simulation reads.
SegmentPairs = tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]


@dataclass(frozen=True, slots=True, kw_only=True)
class Segments:
    """A tile set's segment pairs and their kernel entry kinds (simulate.pair_kinds: each pair's kind and window
    left), where the caller holds them for every plan of the tile set it simulates."""

    pairs: SegmentPairs
    kinds: tuple[np.ndarray, np.ndarray]


@dataclass(slots=True, kw_only=True)
class _HeldPairs:
    """A tile set's segment pairs, and their kinds once a simulation needs them."""

    tiles: TileSet
    pairs: SegmentPairs
    kinds: tuple[np.ndarray, np.ndarray] | None = None


@dataclass(slots=True, kw_only=True)
class SegmentCache:
    """The segment pairs of the tile sets several plans share (the floor's candidates: FCP's placements one, the
    equal-chunk ones another), each built once: every simulation and busy bound of those plans reads them."""

    timer: PassTimer
    held: dict[int, _HeldPairs] = field(default_factory=dict)  # id(tile set) -> its pairs

    def pairs_of(self, tiles: TileSet) -> SegmentPairs | None:
        """The segment pairs of a tile set, built once. None for closed-form tiles."""
        if not tiles.has_pairs:
            return None
        held = self.held.get(id(tiles))
        if held is None or held.tiles is not tiles:
            held = self.held[id(tiles)] = _HeldPairs(tiles=tiles, pairs=self.timer.run("score", tiles.segment_pairs))
        return held.pairs

    def segments_of(self, tiles: TileSet) -> Segments | None:
        """The segment pairs of a tile set (:meth:`pairs_of`) and their kernel entry kinds (simulate.pair_kinds),
        each built once: every simulation of a plan of these tiles reads both (a placement the bound prunes needs
        the pairs only). None for closed-form tiles."""
        pairs = self.pairs_of(tiles)
        if pairs is None:
            return None
        held = self.held[id(tiles)]
        if held.kinds is None:
            held.kinds = self.timer.run("score", pair_kinds, tiles, pairs)
        return Segments(pairs=pairs, kinds=held.kinds)


@dataclass(frozen=True, slots=True, kw_only=True)
class FirstSchedule:
    """coalesce at the requested rounds a stage (:func:`schedule_at`), the schedule :func:`refits` starts from."""

    schedule: Schedule | None  # None: its forward half alone was over the budget by more than half (not completed)
    forward_peak_tokens: int  # the forward's peak live buffer tokens
    peak_tokens: int  # the schedule's (both passes), before relays
    q_pulls_first: bool  # whether coalesce moved the rounds carrying Q pulls into the first stage


@dataclass(frozen=True, slots=True, kw_only=True)
class ScheduleStep:
    """One schedule :func:`fit_memory` tries: the schedule (None: not completed) and its peak live buffer tokens
    before relays."""

    schedule: Schedule | None
    peak_tokens: int


@dataclass(frozen=True, slots=True, kw_only=True)
class FittedSchedule:
    """What :func:`fit_memory` (or :func:`coalesce_within`) kept."""

    schedule: Schedule | None  # None: every forward half tried was over the budget by more than half
    peak_tokens: int | None  # its peak live buffer tokens before relays (None: not measured)
    plain: bool  # whether it is coalesce's own schedule at the requested rounds a stage (the first tried)


def route(timer: PassTimer, assignment: Assignment, options: CompileOptions, as_its_system: bool = False) -> Transfers:
    """plan_transfers and localize: FCP in the plan layout groups heavy-talking ranks into nodes after listing the
    pulls (renumbering them is cheaper than listing them again); otherwise (and for a baseline's placement routed as
    its system routes it, `as_its_system`) a block's owner goes where its tokens live, before the pulls are listed.

    Returns:
        the Transfers: every pull, on the ranks as renumbered.
    """
    if options.planner is Planner.FCP and options.layout is Layout.PLAN and not as_its_system:
        transfers = timer.run("plan_transfers", plan_transfers, assignment)
        return timer.run("localize", group_nodes, transfers)
    assignment = timer.run("localize", localize, assignment)
    return timer.run("plan_transfers", plan_transfers, assignment)


def fanned_out(timer: PassTimer, transfers: Transfers, options: CompileOptions, with_fan_out: bool) -> Transfers:
    """fan_out where asked (and rounds are matchings), else the same transfers."""
    return timer.run("fan_out", fan_out, transfers) if options.matching_rounds and with_fan_out else transfers


def most_received_tokens(transfers: Transfers) -> int:
    """The tokens the busiest receiver takes in over a pass: its pulls on both link classes."""
    received = np.bincount(transfers.edge_dst, weights=transfers.edge_tokens, minlength=transfers.assignment.num_ranks)
    return int(received.max(initial=0))


def make_rounds(timer: PassTimer, transfers: Transfers, options: CompileOptions, with_fan_out: bool) -> Rounds:
    """fan_out (when asked) and schedule_rounds (arbitrary rounds for the ablation without matchings)."""
    transfers = fanned_out(timer, transfers, options, with_fan_out)
    return timer.run("schedule_rounds", schedule_rounds if options.matching_rounds else arbitrary_rounds, transfers)


def coalesce_within(timer: PassTimer, rounds: Rounds, options: CompileOptions,
                    budget_tokens: int | None) -> FittedSchedule:
    """coalesce: within `budget_tokens` live buffer tokens where given (:func:`fit_memory`), else (or where every
    schedule tried was hopelessly over it) at the requested rounds a stage, its peak not measured.

    Returns:
        the FittedSchedule (its schedule never None).
    """
    fitted = fit_memory(timer, rounds, options, budget_tokens) if budget_tokens is not None else None
    if fitted is None or fitted.schedule is None:
        fitted = FittedSchedule(schedule=timer.run("coalesce", coalesce, rounds, options.coalesce, options.pipelined),
                                peak_tokens=None, plain=True)
    return fitted


def fit_memory(timer: PassTimer, rounds: Rounds, options: CompileOptions, budget_tokens: int) -> FittedSchedule:
    """coalesce with the requested rounds a stage and, while the live buffers exceed `budget_tokens`, again with less
    held (:func:`refits`). Where coalesce moved the Q pulls into the first stage (such a pull holds its block from
    then on) and that leaves the plan over the budget, the rounds in their plain order are refitted beside it, a step
    at a time, and the first to fit is kept, the Q pulls first on a tie (ProLong + tail at 64 GPUs, seed 1: only the
    plain order fits with the backward levelled less, and with the Q pulls first the backward's stages would halve;
    at 256 GPUs, seed 2, both need smaller stages, and the Q pulls first stay 2.7% faster).

    Args:
        timer: times each pass.
        rounds: the rounds to coalesce.
        options: the compile options (rounds a stage, pipelining).
        budget_tokens: the most live buffer tokens a rank may hold.
    Returns:
        the first schedule tried that fits, else the completed one with the fewest live buffer tokens, or None when
        every forward half tried was over by more than half; with its peak live buffer tokens before relays and
        whether it is the first one tried, coalesce's at the requested rounds a stage.
    """
    first = schedule_at(timer, rounds, options, budget_tokens, q_first=True)
    chains = [refits(timer, rounds, options, budget_tokens, first)]
    if first.q_pulls_first and first.peak_tokens > budget_tokens and options.pipelined:
        chains.append(refits(timer, rounds, options, budget_tokens,
                             schedule_at(timer, rounds, options, budget_tokens, False)))
    least = None  # only the best step over the budget is held: each is a whole schedule (GBs at thousands of ranks)
    while chains:
        for chain in list(chains):
            step = next(chain, None)
            if step is None:
                chains.remove(chain)
                continue
            if step.schedule is not None and (step.peak_tokens <= budget_tokens or not options.pipelined):
                return FittedSchedule(schedule=step.schedule, peak_tokens=step.peak_tokens,
                                      plain=step.schedule is first.schedule)
            # Completed before not, then the fewest tokens; the first of equals (the Q pulls first) stays.
            if least is None or (step.schedule is None, step.peak_tokens) < (least.schedule is None, least.peak_tokens):
                least = step
            del step  # the chain makes its next step without this one held, unless it is the least
    return FittedSchedule(schedule=least.schedule, peak_tokens=least.peak_tokens,
                          plain=least.schedule is not None and least.schedule is first.schedule)


def refits(timer: PassTimer, rounds: Rounds, options: CompileOptions, budget_tokens: int,
           first: FirstSchedule) -> Iterator[ScheduleStep]:
    """The schedules :func:`fit_memory` tries from `first`, until one fits: `first`; when the backward's peak is the
    one over, its levelling shallower (TIGHT_LEVELLING_STAGES: a tile levelling delays keeps its pulled block live,
    and its gradient lands on the block's owner later too), then its stages smaller (its pulls stay live until their
    gradients leave two stages later); then, when that leaves it over by at most half, both passes' stages (a rank
    receives at most a stage's rounds of messages at a time, so the peak falls about in proportion). Smaller still
    costs more time than it saves memory (launches, smaller kernels) and, at hundreds of ranks, seconds of
    scheduling. A forward half over the budget by more than half is not completed at all (schedule None).

    Yields:
        each ScheduleStep, `first` first; the caller stops at the first that fits.
    """
    base, forward, peak = first.schedule, first.forward_peak_tokens, first.peak_tokens
    yield ScheduleStep(schedule=base, peak_tokens=peak)
    if base is None or not options.pipelined or peak <= budget_tokens:
        return
    rounds_per_stage, tight = options.coalesce, TIGHT_LEVELLING_STAGES
    if forward <= budget_tokens:
        for backward_rounds in (2 * rounds_per_stage, smaller_backward_rounds(rounds_per_stage)):
            if backward_rounds is None:
                break
            # Each from `first`, whose forward, pulls and tile order the steps keep: the step before is not held
            # while this one is made (a column a tile: millions at small blocks).
            schedule = None
            schedule = timer.run("coalesce", with_backward_rounds, base, backward_rounds, tight)
            peak = max(forward, timer.run("score", pass_peaks, schedule)[1])
            yield ScheduleStep(schedule=schedule, peak_tokens=peak)
    if budget_tokens < peak <= budget_tokens * 3 // 2 and rounds_per_stage > 1:
        # Aim below the budget: fan-out entries hold a block across stages, so the peak falls a little slower.
        fewer = max(rounds_per_stage // 2, min(rounds_per_stage - 1, int(rounds_per_stage * budget_tokens
                                                                         * FIT_MARGIN // peak)))
        schedule = None
        schedule = timer.run("coalesce", coalesce, rounds, fewer, options.pipelined, levelling_stages=tight,
                             q_first=first.q_pulls_first)
        backward_rounds = smaller_backward_rounds(fewer)
        if max(timer.run("score", pass_peaks, schedule)) > budget_tokens and backward_rounds:
            schedule = timer.run("coalesce", with_backward_rounds, schedule, backward_rounds, tight)
        yield ScheduleStep(schedule=schedule, peak_tokens=max(timer.run("score", pass_peaks, schedule)))


def schedule_at(timer: PassTimer, rounds: Rounds, options: CompileOptions, budget_tokens: int,
                q_first: bool) -> FirstSchedule:
    """coalesce at the requested rounds a stage, its forward half first: the backward is not completed where the
    forward alone is over `budget_tokens` by more than half (no refit could bring it under).

    Returns:
        the FirstSchedule; `q_first` asks coalesce to move the rounds carrying Q pulls first where that pays.
    """
    part = timer.run("coalesce", coalesce_forward, rounds, options.coalesce, options.pipelined, q_first=q_first)
    forward, moved = timer.run("score", forward_peak, part), part.q_pulls_first
    if forward > budget_tokens * 3 // 2 and options.pipelined:
        return FirstSchedule(schedule=None, forward_peak_tokens=forward, peak_tokens=forward, q_pulls_first=moved)
    schedule = timer.run("coalesce", complete_backward, part)
    del part
    return FirstSchedule(schedule=schedule, forward_peak_tokens=forward,
                         peak_tokens=max(forward, timer.run("score", pass_peaks, schedule)[1]), q_pulls_first=moved)


def finish(timer: PassTimer, schedule: Schedule, options: CompileOptions, digest: str, relays: bool = True,
           peak_tokens: int | None = None) -> ScheduledPlan:
    """relay (FCP, unless `relays` is off) and reshuffle, and the plan's header fields.

    Args:
        timer: times each pass.
        schedule: the coalesced schedule.
        options: the compile options.
        digest: the inputs digest the header records.
        relays: False keeps the schedule's own senders (a relay holds its block until it has re-sent it).
        peak_tokens: the schedule's max_buffer_tokens where the caller has it (a pass over every buffer of both
            passes), kept where no relay changes the schedule.
    Returns:
        the ScheduledPlan (not encoded).
    """
    if relays and options.planner is Planner.FCP and options.matching_rounds:  # baselines keep their star senders
        relayed = timer.run("relay", relay, schedule)
        schedule, peak_tokens = relayed, peak_tokens if relayed is schedule else None
    final = timer.run("reshuffle", reshuffle, schedule)
    return ScheduledPlan(final=final, header_fields=_header_fields(
        final, options, schedule.rounds.transfers.assignment.token_cap, digest, peak_tokens))


def _header_fields(final: Reshuffle, options: CompileOptions, token_cap: int, digest: str,
                   peak_tokens: int | None = None) -> dict:
    """The plan header's fields of a finished plan; its memory figures in bytes are zero until the memory budget's
    account fills them in (a floor candidate is only simulated)."""
    schedule, rounds, transfers, sharding = final.schedule, final.rounds, final.transfers, final.sharding
    recv_buffer = 0
    if transfers.num_edges:
        edge_stage = schedule.forward.edge_stage
        num_stages = int(edge_stage.max()) + 1
        per_stage = np.bincount(transfers.edge_dst * num_stages + edge_stage, weights=transfers.edge_tokens)
        recv_buffer = int(per_stage.max())
    return dict(planner=options.planner.value, inputs_digest=digest, num_ranks=options.num_ranks,
                block_size=sharding.block_size,
                coalesce=schedule.coalesce, bwd_coalesce=schedule.backward.coalesce, token_cap=token_cap,
                zigzag=sharding.zigzag, mask=sharding.batch.mask,
                num_sequences=sharding.batch.num_sequences, total_tokens=sharding.batch.total_tokens,
                num_blocks=sharding.num_blocks, shape=options.shape, profile=options.profile, model=options.model_name,
                layout=options.layout, num_rounds=int(schedule.forward.edge_round.max(initial=-1)) + 1,
                **dict(zip(("nvlink_degree", "nic_degree"), transfers.class_degrees)),
                nvlink_lanes=rounds.nvlink_lanes,
                num_fwd_rounds=schedule.forward.num_rounds,
                num_bwd_rounds=schedule.backward.num_rounds, num_fwd_stages=schedule.forward.num_stages,
                num_bwd_stages=schedule.backward.num_stages, recv_buffer_tokens=recv_buffer,
                max_buffer_tokens=max_buffer_tokens(schedule) if peak_tokens is None else peak_tokens,
                pipelined=options.pipelined,
                rounds_kind="matching" if options.matching_rounds else "arbitrary",
                reshuffle_overlap=options.reshuffle_overlap, kv_prefetch=options.resolved_kv_prefetch,
                max_buffer_bytes_fwd=[0] * options.num_ranks, max_buffer_bytes_bwd=[0] * options.num_ranks,
                memory_budget_bytes=None)


@dataclass(frozen=True, slots=True, kw_only=True)
class ScoredSchedule:
    """A scheduled placement the floor has simulated: its schedule (before relays), the finished plan, its peak live
    buffer tokens, its stacked ranks and its simulated layer figures."""

    schedule: Schedule
    plan: ScheduledPlan
    peak_tokens: int
    arrays: RankArrays
    figures: dict

    @property
    def layer_seconds(self) -> float:
        """Its simulated layer time, forward plus backward."""
        return layer_seconds(self.figures)


def faster_stages(timer: PassTimer, scored: ScoredSchedule, options: CompileOptions, digest: str,
                  budget_tokens: int, segments: Segments | None = None) -> ScoredSchedule:
    """`scored`, or its pulls coalesced at twice the rounds a stage where that simulates faster. Tried only where
    the plan holds at most half `budget_tokens` live (twice the stages' pulls may still fit) and kept only where it
    fits: fewer stage ends to wait at, and each query segment's keys in fewer, larger kernel calls. On small plans
    this takes the median distance to the exact optimum of their placement from 2.3% to 1.7%
    (benchmarks/schedule_optimum.py); a plan the budget binds (most at hundreds of ranks) is never tried, nor one
    whose tiles are already near the top of the efficiency curve (LARGER_STAGES_EFFICIENCY).

    Args:
        timer: times each pass.
        scored: the plan at the requested rounds a stage.
        options: the compile options (tried for FCP, pipelined, with matching rounds).
        digest: the inputs digest the header records.
        budget_tokens: the most live buffer tokens a rank may hold.
        segments: the tiles' segment pairs and kinds, where the caller holds them.
    Returns:
        the faster ScoredSchedule.
    """
    if (options.planner is not Planner.FCP or not options.pipelined or not options.matching_rounds
            or 2 * scored.peak_tokens > budget_tokens or scored.schedule.coalesce != options.coalesce
            or not _tiles_gain_from_calls(options)):
        return scored
    larger = timer.run("coalesce", coalesce, scored.schedule.rounds, 2 * options.coalesce, options.pipelined)
    peak = max(timer.run("score", pass_peaks, larger))
    plan = finish(timer, larger, options, digest, peak_tokens=peak) if peak <= budget_tokens else None
    if plan is None or plan.max_buffer_tokens > budget_tokens:
        return scored
    arrays = stacked_with_columns(timer, plan)
    other = ScoredSchedule(schedule=larger, plan=plan, peak_tokens=plan.max_buffer_tokens, arrays=arrays,
                           figures=timer.run("score", layer_figures, plan, segments, arrays.stacked))
    return other if other.layer_seconds < scored.layer_seconds else scored


def _tiles_gain_from_calls(options: CompileOptions) -> bool:
    """Whether one tile of the block size is below LARGER_STAGES_EFFICIENCY of the efficiency curve's top."""
    profile = options.profile
    block_size = float(options.resolved_block_size)
    top = max(point.efficiency for point in profile.efficiency_curve)
    return float(tile_efficiency(profile, np.array([block_size]))[0]) < LARGER_STAGES_EFFICIENCY * top


def stacked_with_columns(timer: PassTimer, plan: ScheduledPlan, pass_name: str = "score") -> RankArrays:
    """A finished plan's stacked ranks and the encoder's columns they are stacked from, timed as `pass_name`."""
    columns = timer.run(pass_name, rank_columns, plan.final)
    return RankArrays(stacked=timer.run(pass_name, stack_plan, plan.final, plan.header_fields, columns),
                      columns=columns)


def layer_figures(plan: ScheduledPlan, segments: Segments | None = None, stacked: StackedRanks | None = None) -> dict:
    """The simulated layer figures of a finished plan, from its arrays as the encoder lays them out (nothing
    encoded); `segments`: its tiles' segment pairs and their kinds, and `stacked`: stack_plan of it, where the caller
    holds them.

    Returns:
        Simulation.layer_figures() of the plan (layer makespans, MFU, gaps to the bound).
    """
    final, fields = plan.final, plan.header_fields
    if stacked is None:  # its tiles are read from the IR, but where the user layout's reshuffle overlap reads them
        stacked = stack_plan(final, fields, rank_columns(final, tile_rows=fields["layout"] is Layout.USER))
    pairs, kinds = (segments.pairs, segments.kinds) if segments is not None else (None, None)
    return simulate_plan(HeldPlan(stacked=stacked, tiles=final.tiles, pairs=pairs, kinds=kinds, final=final),
                         attention_alone=False).layer_figures()

"""Layer kinds beyond the primary, each scheduled on the primary's placement (:mod:`fcp_compiler.core.kinds`): the
same blocks on the same ranks (one dispatch), its own mask's tiles and pulls, coalesced within the floor's token
budget (:func:`schedule_kind`), and what they add to a floor candidate's score (:func:`kinds_seconds`)."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from fcp_compiler.core.ir import Assignment, Rounds, Schedule
from fcp_compiler.core.kinds import LayerKind, LayerKinds
from fcp_compiler.core.options import CompileOptions
from fcp_compiler.core.pass_timer import PassTimer
from fcp_compiler.core.passes.cost import cost
from fcp_compiler.core.passes.transfers import plan_transfers
from fcp_compiler.core.schedule_search import ScheduledPlan, coalesce_within, finish, layer_figures, make_rounds
from fcp_compiler.core.simulate import layer_seconds


@dataclass(frozen=True, slots=True, kw_only=True)
class KindSchedule:
    """One layer kind scheduled on another kind's placement (:func:`schedule_kind`)."""

    plan: ScheduledPlan
    rounds: Rounds  # its rounds before relays (the relay pass re-sources pulls in them), which refits coalesce again
    plain: Schedule | None  # its schedule where it is coalesce's at the requested rounds a stage, else None



def schedule_kind(timer: PassTimer, placed: Assignment, kind: LayerKind, options: CompileOptions, digest: str,
                  fan_out: bool, budget_tokens: int) -> KindSchedule:
    """plan_transfers, fan_out (as the placement's own plan), schedule_rounds, coalesce within `budget_tokens`, relay
    and reshuffle for one layer kind on `placed`: it pulls only the blocks its mask reads.

    Returns:
        the KindSchedule: the finished plan, its rounds before relays and, where it is coalesce's at the requested
        rounds a stage, its schedule (what the memory budget's refits start from).
    """
    transfers = timer.run("plan_transfers", plan_transfers, _kind_assignment(timer, placed, kind, options))
    rounds = make_rounds(timer, transfers, options, fan_out)
    fitted = coalesce_within(timer, rounds, options, budget_tokens)
    plan = finish(timer, fitted.schedule, options, digest, peak_tokens=fitted.peak_tokens)
    return KindSchedule(plan=plan, rounds=rounds, plain=fitted.schedule if fitted.plain else None)


def kinds_seconds(timer: PassTimer, plan: ScheduledPlan, kinds: LayerKinds | None, options: CompileOptions,
                  fan_out: bool, budget_tokens: int) -> float:
    """The layer kinds other than the primary, scheduled on the placement of `plan` (the primary's) and simulated:
    their forward plus backward makespans weighted by layers per primary layer (0 with no kinds), what the floor adds
    to a candidate's score."""
    seconds = 0.0
    for kind in kinds.others if kinds is not None else ():
        kind_plan = schedule_kind(timer, plan.final.transfers.assignment, kind, options, "", fan_out,
                                  budget_tokens).plan
        figures = timer.run("score", layer_figures, kind_plan)
        seconds += kinds.weight(kind) * layer_seconds(figures)
    return seconds


def _kind_assignment(timer: PassTimer, placed: Assignment, kind: LayerKind, options: CompileOptions) -> Assignment:
    """A layer kind's tiles on a placement made for another kind: the same blocks on the same ranks (one layout,
    so one dispatch), its own mask's tiles (costed here), each run by its query block's owner."""
    sharding = dataclasses.replace(placed.tiles.sharding, batch=kind.batch)
    tiles = timer.run("cost", cost, sharding, options.shape, options.profile)
    return Assignment(tiles=tiles, num_ranks=placed.num_ranks, token_cap=placed.token_cap,
                      block_rank=placed.block_rank, tile_rank=placed.block_rank[tiles.tile_q_block])

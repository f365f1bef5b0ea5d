"""compile_plan: run the passes in order, time each, and wrap the result."""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from fcp_compiler.algorithms.limits import MAX_SEGMENT_PAIRS, least_segment_pairs, segment_pairs
from fcp_compiler.algorithms.pages import base_pages
from fcp_compiler.core import floor
from fcp_compiler.core.baselines import BASELINES, Planner
from fcp_compiler.core.floor import Placement
from fcp_compiler.core.ir import Assignment, Batch, Reshuffle, Rounds, Schedule, TileSet, Transfers, ZigzagMode
from fcp_compiler.core.kinds import LayerKind, LayerKinds, layer_kinds
from fcp_compiler.core.layer_model import LINEAR_WEIGHT, LayerCosts
from fcp_compiler.core.options import CompileOptions
from fcp_compiler.core.account import plan_peak_bytes
from fcp_compiler.core.plan_memory import stack_plan
from fcp_compiler.core.passes.assign import assign, default_token_cap
from fcp_compiler.core.passes.coalesce import (LEVELLING_STAGES, TIGHT_LEVELLING_STAGES, coalesce, coalesce_forward,
                                               complete_backward, forward_peak, max_buffer_tokens, pass_peaks,
                                               remote_tiles_out_of_last_stage, smaller_backward_rounds,
                                               with_backward_rounds)
from fcp_compiler.core.passes.cost import cost, ring_cost, ring_in_closed_form
from fcp_compiler.core.passes.encode import encode, rank_columns
from fcp_compiler.core.passes.fan_out import fan_out
from fcp_compiler.core.passes.localize import group_nodes, localize
from fcp_compiler.core.passes.relay import relay
from fcp_compiler.core.passes.reshuffle import reshuffle
from fcp_compiler.core.passes.rounds import arbitrary_rounds, schedule_rounds
from fcp_compiler.core.passes.shard import pairs_chunks, shard
from fcp_compiler.core.passes.transfers import plan_transfers
from fcp_compiler.core.simulate import LAYER_STATS, HeldPlan, busy_lower_bound, layer_stats, pair_kinds, simulate_plan
from fcp_compiler.core.stats import plan_stats
from fcp_compiler.errors import InfeasibleError, InvalidInputError
from fcp_compiler.format.inputs import (MAX_SEQUENCES, BatchSpec, Layout, Mask, MaskKind, parse_batch,
                                        too_many_sequences)
from fcp_compiler.format.kinds import encode_kinds
from fcp_compiler.format.memory import least_peak_bytes, stacked_peak_bytes
from fcp_compiler.format.plan_format import FORMAT_VERSION, PlanHeader, PlanReader, RankProgram
from fcp_compiler.format.safe_io import write_atomic
from fcp_compiler.format.stacked import StackedRanks

# _fit_memory aims this share of the memory budget when it shrinks the stages of a plan over it.
FIT_MARGIN = 0.8
# A rank may be 2% above the compute lower bound before tiles of heavy blocks are moved off their owner.
BALANCE_TOLERANCE = 0.02


@dataclass(frozen=True, slots=True, kw_only=True)
class CompiledPlan:
    """A compiled plan: its bytes, header, statistics and the final IR. With layer kinds, `data` is the kinds
    file (fcp_compiler.format.kinds) holding every kind's plan, `kinds` each kind's, and `ir`, `header`, `rank`
    and `stats` are the primary kind's (the one the placement was scheduled for; stats["layer_kinds"] lists all)."""

    data: bytes
    ir: Reshuffle
    stats: dict
    _reader: PlanReader
    kinds: tuple[KindPlan, ...] = ()

    def kind(self, name: str) -> KindPlan:
        """A layer kind's plan by name.

        Raises:
            KeyError: naming the kinds the plan has.
        """
        for kind in self.kinds:
            if kind.name == name:
                return kind
        raise KeyError(f"layer kind {name!r} is not in the plan; its kinds: {[k.name for k in self.kinds] or 'none'}")

    def to_bytes(self) -> bytes:
        """The plan file's bytes."""
        return self.data

    @property
    def header(self):
        return self._reader.header

    @property
    def num_ranks(self) -> int:
        return self._reader.header.num_ranks

    def rank(self, rank: int) -> RankProgram:
        """One rank's program, decoded from the bytes."""
        return self._reader.rank(rank)

    def write(self, path: str | Path) -> None:
        """Write the plan file atomically (temporary name, then rename)."""
        write_atomic(Path(path), self.data)


@dataclass(frozen=True, slots=True, kw_only=True)
class KindPlan:
    """One layer kind's plan in a compile of several (core.kinds): its name, mask, layers in the model, and its
    whole plan (bytes, IR, stats; its header's digest names the kind)."""

    name: str
    mask: Mask
    num_layers: int
    plan: CompiledPlan


def inputs_digest(batch: Batch, options: CompileOptions, token_cap: int, kinds: LayerKinds | None = None,
                  kind: LayerKind | None = None) -> str:
    """sha256 of a canonical JSON of everything the plan depends on; with layer kinds, every kind's name, mask and
    layer count and which kind's plan this is."""
    canonical = {
        "format_version": FORMAT_VERSION, "planner": options.planner.value, "lengths": batch.lengths.tolist(),
        "mask": batch.mask.value, "num_ranks": options.num_ranks, "block_size": options.resolved_block_size,
        "coalesce": options.coalesce, "token_cap": token_cap, "zigzag": options.zigzag.value,
        "layout": options.layout.value,
        "shape": options.shape.model_dump(mode="json"), "profile": options.profile.model_dump(mode="json"),
        "balance_tolerance": BALANCE_TOLERANCE, "pipelined": options.pipelined,
        "matching_rounds": options.matching_rounds, "reshuffle_overlap": options.reshuffle_overlap,
        "model": options.model_name, "node_fan_out": options.resolved_node_fan_out,
        "kv_prefetch": options.resolved_kv_prefetch, "memory_budget_bytes": options.resolved_memory_budget_bytes,
    }
    if options.planner is Planner.FCP and not _floor_applies(options):  # absent where it runs, as before it existed
        canonical["floor"] = False
    if options.fit_memory and not _floor_applies(options):  # absent unless asked (the floor always fits)
        canonical["fit_memory"] = True
    if options.resolved_token_tolerance is not None:  # absent when none applies
        canonical["token_tolerance"] = options.resolved_token_tolerance
    if batch.mask not in (MaskKind.CAUSAL, MaskKind.FULL):  # the lengths say every window of the others
        canonical["windows"] = batch.windows.tolist()
    if kinds is not None:  # absent for one kind, as before kinds existed
        canonical["layer_kinds"], canonical["kind"] = kinds.canonical(), kind.name
    return hashlib.sha256(json.dumps(canonical, sort_keys=True, separators=(",", ":")).encode()).hexdigest()


class _PassTimer:
    """Each pass's seconds, summed over the floor's candidates."""

    def __init__(self) -> None:
        self.seconds: dict[str, float] = {}

    def run(self, name: str, function, *args, **kwargs):
        start = time.perf_counter()
        result = function(*args, **kwargs)
        self.seconds[name] = self.seconds.get(name, 0.0) + time.perf_counter() - start
        return result


def _to_batch(batch: BatchSpec | Sequence[int] | np.ndarray, mask: Mask | None) -> Batch:
    """The IR batch: lengths and each sequence's window; `mask` overrides the batch's mask (or masks)."""
    if not isinstance(batch, BatchSpec):
        if len(batch) > MAX_SEQUENCES:  # before a list of them is built
            raise InvalidInputError(f"batch: {too_many_sequences(len(batch))}")
        lengths = batch.tolist() if isinstance(batch, np.ndarray) else list(batch)
        batch = parse_batch({"sequences": lengths})
    spec = batch if mask is None else BatchSpec(mask=mask, sequences=batch.sequences)
    return Batch(lengths=np.asarray(spec.sequences, dtype=np.int64), windows=np.asarray(spec.windows(),
                                                                                          dtype=np.int64))


@dataclass(frozen=True, slots=True, kw_only=True)
class _Prepared:
    """compile_plan's arguments, checked: the options, the batch the placement is scheduled for (with layer kinds,
    the primary kind's), the token cap and the layer kinds (None: one)."""

    options: CompileOptions
    batch: Batch
    cap: int
    kinds: LayerKinds | None


def _prepare(batch, num_ranks: int | None, options: CompileOptions | None, fields: dict) -> _Prepared:
    """compile_plan's arguments checked."""
    if options is None:
        if num_ranks is None:
            raise InvalidInputError("give the number of ranks (num_ranks) or a CompileOptions")
        options = CompileOptions.of(num_ranks, **fields)
    elif num_ranks is not None or fields:
        options = options.replace(**fields, **({} if num_ranks is None else {"num_ranks": num_ranks}))
    the_batch = _to_batch(batch, options.mask)
    spec = batch if isinstance(batch, BatchSpec) else None  # a list of lengths names no kinds
    kinds = layer_kinds(the_batch.lengths, spec and spec.layers, spec and spec.layer_mix, options.layer_masks,
                        options.layer_mix, options.model)
    if kinds is not None:
        if isinstance(batch, BatchSpec) and (batch.masks is not None or "mask" in batch.model_fields_set):
            raise InvalidInputError("the batch gives its own masks ('mask' or 'masks') and layer kinds are given "
                                    "(--layer-masks): give each kind's mask in the kinds only")
        if options.mask is not None:
            raise InvalidInputError(f"--mask {options.mask.kind.value} gives every layer one mask, but the batch "
                                    f"names layer kinds ({', '.join(kind.name for kind in kinds.kinds)}); give "
                                    f"either, not both")
        if options.planner is not Planner.FCP:
            raise InvalidInputError(f"--planner {options.planner.value} compiles one mask; layer kinds "
                                    f"({', '.join(kind.name for kind in kinds.kinds)}) are compiled by fcp")
        the_batch = kinds.primary.batch
    if options.validatable and options.planner is Planner.FCP:
        # Sequences of L tokens are cut into at least L / B segments each: a batch too large to validate is refused
        # from its lengths, before sharding allocates per block.
        least = least_segment_pairs(the_batch.lengths, options.resolved_block_size)
        if least > MAX_SEGMENT_PAIRS:
            raise _too_many_pairs(least, options, at_least=True)
    cap = options.token_cap if options.token_cap is not None else default_token_cap(
        the_batch.total_tokens, options.num_ranks, options.resolved_block_size)
    return _Prepared(options=options, batch=the_batch, cap=cap, kinds=kinds)


def _too_many_pairs(num_pairs: int, options: CompileOptions, at_least: bool = False) -> InfeasibleError:
    return InfeasibleError(
        f"the plan would cut its sequences into {'at least ' if at_least else ''}{num_pairs:,} segment pairs, more "
        f"than the {MAX_SEGMENT_PAIRS:,} fcp validate checks (block size {options.resolved_block_size}); use a larger "
        f"--block-size, or fewer or shorter sequences")


def _check_validatable(sharding, options: CompileOptions) -> None:
    """Refuse a sharding the validator would refuse (unless options.validatable is off)."""
    if options.validatable:
        num_pairs = segment_pairs(sharding.seg_seq, sharding.batch.num_sequences)
        if num_pairs > MAX_SEGMENT_PAIRS:
            raise _too_many_pairs(num_pairs, options)


def plan_digest(batch, num_ranks: int | None = None, *, options: CompileOptions | None = None, **fields) -> str:
    """The inputs digest compile_plan would record for these arguments, without compiling (for caches).

    Raises:
        InvalidInputError: as compile_plan.
    """
    prepared = _prepare(batch, num_ranks, options, fields)
    kinds = prepared.kinds
    return inputs_digest(prepared.batch, prepared.options, prepared.cap, kinds,
                         kinds.primary if kinds is not None else None)


@base_pages()
def compile_plan(batch: BatchSpec | Sequence[int] | np.ndarray, num_ranks: int | None = None, *,
                 options: CompileOptions | None = None, progress: Callable[[dict], None] | None = None,
                 **fields) -> CompiledPlan:
    """Compile a batch into a per-rank execution plan.

    Runs shard, cost, assign, plan_transfers, localize, fan_out, schedule_rounds, coalesce, relay, reshuffle and encode,
    timing each (stats["pass_seconds"]). Layer kinds (:mod:`fcp_compiler.core.kinds`) give one placement, chosen by
    the mix's time, and a schedule a kind: `data` is then the kinds file, `kinds` each kind's plan. For FCP the
    floor (:mod:`fcp_compiler.core.floor`) runs them for several candidate placements, direct and (:func:`floor.fan_out_follower`) with node fan-out, and keeps the plan with the
    least simulated layer time whose live buffers fit 4 x coalesce x block size tokens (stats["floor"] says which,
    and what each scored).

    Args:
        batch: a BatchSpec, or a list/array of lengths (causal unless the options' `mask` says otherwise).
        num_ranks: number of ranks N (the CLI's --gpus); or give `options`.
        options: a CompileOptions (:mod:`fcp_compiler.core.options`); `num_ranks` and `fields` override it.
        fields: CompileOptions fields by name, as :meth:`CompileOptions.of` takes them: block_size (a multiple of 64,
            default 4096; refused for the baselines that size their own blocks), coalesce (rounds a stage, 16),
            token_cap (default mean + one block), token_tolerance, zigzag ("auto", "on", "off"), layout ("plan":
            tokens dispatched once into the plan's layout; "user": attention reshuffles), shape, profile (a preset
            name or a HardwareProfile), mask, planner (fcp, or a baseline: ring, bytescale, wlbllm, magi),
            node_fan_out (None: FCP's floor tries both, each baseline as its system ships), floor (False: FCP's own
            placement only), fit_memory (one placement scheduled within the floor's live-buffer budget, for
            comparisons at equal memory), validatable (False: a plan past the validator's segment pairs is
            allowed, for scoring ring baselines), layer_masks and layer_mix (layer kinds: "NAME=MASK,..." and
            "NAME=COUNT,..." or their dicts), and the ablation switches pipelined, matching_rounds (False fails
            validation), reshuffle_overlap, kv_prefetch (False: the runtime posts the first stage's K,V pulls
            only when attention starts; the plan layout only).
        progress: called with each floor candidate's record (as stats["floor"]["candidates"] lists it) once it is
            scheduled: a compile at hundreds of ranks schedules several, for seconds.
    Returns:
        the CompiledPlan (bytes, per-rank access, stats).
    Raises:
        InvalidInputError: a bad length or parameter (named).
        InfeasibleError: a token cap no placement can meet, or a plan larger than fcp validate checks.
    """
    total_start = time.perf_counter()
    timer = _PassTimer()
    prepared = timer.run("parse", _prepare, batch, num_ranks, options, fields)
    options, the_batch, cap, kinds = prepared.options, prepared.batch, prepared.cap, prepared.kinds
    digest = inputs_digest(the_batch, options, cap, kinds, kinds.primary if kinds is not None else None)
    if _floor_applies(options):
        kept = _compile_with_floor(timer, the_batch, options, cap, digest, progress, kinds)
    else:
        kept = _compile_alone(timer, the_batch, options, cap, digest)
    (final, header_fields, data), budget_stats = _within_budget(timer, kept, options, digest)
    floor_stats, fan_out = kept.floor_stats, kept.fan_out
    del kept
    if floor_stats is not None and budget_stats["refitted"]:
        for name in LAYER_STATS:  # the floor's figures were the plan's before it was refitted
            floor_stats.pop(name, None)
    compile_seconds = time.perf_counter() - total_start
    stats = plan_stats(final, data, compile_seconds, timer.seconds, options.layout.value, options.model,
                       max_buffer=header_fields["max_buffer_tokens"])
    stats["kv_prefetch"] = header_fields["kv_prefetch"]
    stats["memory"] = budget_stats
    if floor_stats is not None:
        stats.update(floor_stats)
    plan = CompiledPlan(data=data, ir=final, stats=stats, _reader=PlanReader(data))
    return plan if kinds is None else _with_kinds(timer, plan, kinds, prepared, fan_out, total_start)


@dataclass(frozen=True, slots=True, kw_only=True)
class _Kept:
    """The plan a compile keeps before the memory budget's account (:func:`_within_budget`), and what that account
    reads where the plan is over the budget: `rounds_of()` gives the plan's rounds before relays (the relay pass
    re-sources pulls in them), which the refits coalesce again; `others(seconds)` the floor's other candidates that
    simulated faster than `seconds`, fastest first; `plain`: the plan's schedule before relays where it is
    coalesce's at the requested rounds a stage (the first refit levels its backward again, :func:`_budget_ladder`),
    else None; `held`: the plan's (stacked ranks, encoder columns) where the floor made them to simulate it, else
    None; `segments_of(tiles)`: the segment pairs and their kinds the floor holds for a tile set, which the refits'
    simulations read (None: each builds its own)."""

    plan: tuple  # (final IR, header fields, None): encoded once its memory figures are known
    floor_stats: dict | None
    fan_out: bool  # whether the plan's K,V fan out inside nodes (layer kinds scheduled on its placement do too)
    rounds_of: Callable[[], Rounds]
    others: Callable[[float], Iterator]
    plain: Schedule | None = None
    held: tuple | None = None
    segments_of: Callable[[TileSet], tuple | None] = lambda tiles: None


def _with_kinds(timer: _PassTimer, primary: CompiledPlan, kinds: LayerKinds, prepared: _Prepared, fan_out: bool,
                started: float) -> CompiledPlan:
    """The other layer kinds scheduled on the primary kind's placement (each within the memory budget, as the
    primary), and the plan of layer kinds of them all: stats["layer_kinds"] gives each kind's figures and
    stats["layer_mix_s"] the model's attention layers' simulated time, forward plus backward."""
    options = prepared.options
    plans = {kinds.primary.name: primary}
    for kind in kinds.others:
        digest = inputs_digest(kind.batch, options, prepared.cap, kinds, kind)
        plan, rounds, plain = _schedule_kind(timer, primary.ir.transfers.assignment, kind, options, digest, fan_out)
        kept = _Kept(plan=plan, floor_stats=None, fan_out=fan_out, rounds_of=lambda held=rounds: held,
                     others=lambda limit: iter(()), plain=plain)
        (final, fields, data), budget_stats = _within_budget(timer, kept, options, digest)
        stats = plan_stats(final, data, 0.0, {}, options.layout.value, options.model,
                           max_buffer=fields["max_buffer_tokens"])
        stats["kv_prefetch"], stats["memory"] = fields["kv_prefetch"], budget_stats
        plans[kind.name] = CompiledPlan(data=data, ir=final, stats=stats, _reader=PlanReader(data))
    ordered = tuple(KindPlan(name=kind.name, mask=kind.mask, num_layers=kind.num_layers, plan=plans[kind.name])
                    for kind in kinds.kinds)
    summary = [_kind_summary(timer, kind) for kind in ordered]
    data = timer.run("encode", encode_kinds, [(kind.name, kind.mask.model_dump(mode="json"), kind.num_layers,
                                                 kind.plan.data) for kind in ordered], kinds.primary.name)
    stats = {**primary.stats, "layer_kinds": summary, "primary_kind": kinds.primary.name,
             "layer_mix_s": sum(row["num_layers"] * row["layer_seconds"] for row in summary),
             "plan_bytes": len(data), "plan_sha256": hashlib.sha256(data).hexdigest(),
             "compile_seconds": time.perf_counter() - started, "pass_seconds": dict(timer.seconds)}
    return CompiledPlan(data=data, ir=primary.ir, stats=stats, _reader=primary._reader, kinds=ordered)


def _kind_summary(timer: _PassTimer, kind: KindPlan) -> dict:
    """One layer kind's row of stats["layer_kinds"]: its mask, layers, traffic and simulated layer time."""
    stats = kind.plan.stats
    figures = {name: stats[name] for name in LAYER_STATS} if "layer_makespan_fwd_s" in stats else \
        timer.run("score", layer_stats, kind.plan)
    return {"name": kind.name, "mask": kind.mask.model_dump(mode="json"), "num_layers": kind.num_layers,
            "num_tiles": stats["num_tiles"], "num_transfers": stats["num_transfers"],
            "total_comm_bytes": stats["total_comm_bytes"], "max_buffer_tokens": stats["max_buffer_tokens"],
            "peak_bytes": max(stats["memory"]["peak_bytes_fwd"], stats["memory"]["peak_bytes_bwd"]),
            "num_fwd_stages": kind.plan.header.num_fwd_stages, "num_bwd_stages": kind.plan.header.num_bwd_stages,
            **figures, "layer_seconds": figures["layer_makespan_fwd_s"] + figures["layer_makespan_bwd_s"]}


def _kind_assignment(timer: _PassTimer, placed: Assignment, kind: LayerKind, options: CompileOptions) -> Assignment:
    """A layer kind's tiles on a placement made for another kind: the same blocks on the same ranks (one layout,
    so one dispatch), its own mask's tiles (costed here), each run by its query block's owner."""
    sharding = dataclasses.replace(placed.tiles.sharding, batch=kind.batch)
    tiles = timer.run("cost", cost, sharding, options.shape, options.profile)
    return Assignment(tiles=tiles, num_ranks=placed.num_ranks, token_cap=placed.token_cap,
                      block_rank=placed.block_rank, tile_rank=placed.block_rank[tiles.tile_q_block])


def _schedule_kind(timer: _PassTimer, placed: Assignment, kind: LayerKind, options: CompileOptions, digest: str,
                   fan_out: bool) -> tuple[tuple, Rounds, Schedule | None]:
    """plan_transfers, fan_out (as the placement's own plan), schedule_rounds, coalesce within the live-buffer
    budget, relay and reshuffle for one layer kind on `placed`: it pulls only the blocks its mask reads. Returns
    (the finished plan, its rounds before relays, its schedule where it is coalesce's at the requested stages)."""
    transfers = timer.run("plan_transfers", plan_transfers, _kind_assignment(timer, placed, kind, options))
    rounds = _rounds(timer, transfers, options, fan_out)
    schedule, peak, plain = _fit_memory(timer, rounds, options, memory_budget_tokens(options))
    if schedule is None:
        schedule, peak, plain = timer.run("coalesce", coalesce, rounds, options.coalesce, options.pipelined), None, \
            True
    plan = _finish(timer, schedule, options, digest, max_buffer=peak)
    return plan, rounds, schedule if plain else None


def _kinds_seconds(timer: _PassTimer, plan: tuple, kinds: LayerKinds | None, options: CompileOptions,
                   fan_out: bool) -> float:
    """The layer kinds other than the primary, scheduled on a floor candidate's placement (`plan`, the primary's)
    and simulated: their forward plus backward makespans weighted by layers per primary layer (0 with no kinds)."""
    seconds = 0.0
    for kind in kinds.others if kinds is not None else ():
        kind_plan, _, _ = _schedule_kind(timer, plan[0].transfers.assignment, kind, options, "", fan_out)
        figures = timer.run("score", _layer_figures, kind_plan)
        seconds += kinds.weight(kind) * (figures["layer_makespan_fwd_s"] + figures["layer_makespan_bwd_s"])
    return seconds


def _compile_alone(timer: _PassTimer, batch: Batch, options: CompileOptions, cap: int, digest: str) -> _Kept:
    """FCP's own placement (or a baseline's, or an ablation step) scheduled once: within the floor's live-buffer
    budget where `fit_memory` asks, else at the requested rounds a stage."""
    assignment = _place(timer, batch, options, cap, Placement.LAYER)
    rounds = _rounds(timer, _route(timer, assignment, options), options, options.resolved_node_fan_out)
    schedule, plain, peak = None, False, None
    if options.fit_memory:  # smaller stages until it fits, as the floor does (None: hopelessly over)
        schedule, peak, plain = _fit_memory(timer, rounds, options, memory_budget_tokens(options))
    if schedule is None:
        schedule, plain, peak = timer.run("coalesce", coalesce, rounds, options.coalesce, options.pipelined), \
            True, None
    plan = _finish(timer, schedule, options, digest, max_buffer=peak)
    return _Kept(plan=plan, floor_stats=None, fan_out=options.resolved_node_fan_out, rounds_of=lambda: rounds,
                 others=lambda limit: iter(()), plain=schedule if plain else None)


def _within_budget(timer: _PassTimer, kept: _Kept, options: CompileOptions, digest: str) -> tuple[tuple, dict]:
    """The kept plan with each rank's memory peaks per pass in its header (:func:`plan_peak_bytes`) and, where a peak
    is over the memory budget, its placement scheduled again holding less (:func:`_refit_to_budget`: shallower
    levelling, smaller stages) until every rank fits, or the fastest of the floor's other candidates that fits as
    scheduled (:func:`_faster_within_budget`). The floor's candidates are scored without the account, so only the
    plan compile_plan returns pays for it. A default budget no schedule meets leaves the plan as it was (its header
    then states no budget); a given one is refused.

    Returns:
        ((final IR, header fields, bytes), the record for stats["memory"]).
    Raises:
        InfeasibleError: a budget the user gave that no schedule tried meets (naming the least peak found, and the
            least any schedule can have).
    """
    plan, held = kept.plan, kept.held
    budget = options.resolved_memory_budget_bytes
    # The encoder's columns of the plan where the floor made them (read by the account and, where the plan is kept
    # as it is, written out); else the account reads the IR a few ranks at a time, and the encoder makes them.
    if held is not None:
        stacked, columns = held
        peaks = timer.run("memory", stacked_peak_bytes, stacked)
        del stacked, held
    else:
        columns = None
        peaks = timer.run("memory", plan_peak_bytes, plan[0], plan[1])
    record = {"budget_bytes": budget, "unbudgeted_peak_bytes": int(peaks.max()), "refits": 0, "refitted": False,
              "met": True, "kept": None}
    if budget is not None and peaks.max() > budget:
        # The refits and the other candidates account their ranks in the order of the winner's peaks: a plan over
        # the budget is most likely over where the winner was, and its account stops there.
        first = peaks.max(axis=1)
        refit = _refit_to_budget(timer, plan, options, digest, budget, record, kept.rounds_of, kept.plain, first,
                                 kept.segments_of(plan[0].tiles))
        found = refit[:3] if refit is not None else None
        if refit is not None or record["unmet"] == "no schedule":  # not where a rank's own tokens are over it
            found = _faster_within_budget(timer, refit, kept.others, budget, record, first)
        if found is not None:
            (plan, peaks, columns), record["refitted"] = found, True
            record["kept"] = record["kept"] or "the winner, in smaller stages"
        elif options.memory_budget_is_strict:
            raise InfeasibleError(
                f"--memory-budget {budget / 2**30:.2f} GiB cannot be met: the least peak found is "
                f"{record['least_peak_bytes'] / 2**30:.2f} GiB, and no schedule of this placement can go below "
                f"{record['floor_bytes'] / 2**30:.2f} GiB on its busiest rank (its own tokens' accumulators and "
                f"outputs); give a larger budget, more GPUs, or --memory-budget none")
        else:
            budget, record["met"] = None, False
    memory = {"max_buffer_bytes_fwd": peaks[:, 0].tolist(), "max_buffer_bytes_bwd": peaks[:, 1].tolist(),
              "memory_budget_bytes": budget}
    record.update(peak_bytes_fwd=int(peaks[:, 0].max()), peak_bytes_bwd=int(peaks[:, 1].max()))
    fields = {**plan[1], **memory}
    # The columns go to the encoder alone (not held here, nor in the timer's arguments), which drops them before it
    # joins the file's bytes: a copy of the plan's rows less at its peak.
    held = [columns]
    del columns
    return (plan[0], fields, timer.run("encode", lambda: encode(plan[0], fields, held.pop()))), record


def _refit_to_budget(timer: _PassTimer, plan: tuple, options: CompileOptions, digest: str, budget: int,
                     record: dict, rounds_of: Callable[[], Rounds], plain: Schedule | None = None,
                     first: np.ndarray | None = None,
                     segments: tuple | None = None) -> tuple[tuple, np.ndarray, dict, float] | None:
    """The plan's placement scheduled again down :func:`_budget_ladder`, holding less at each step, until a step fits
    `budget`; that step, or the step after it where that one simulates faster and fits too (which of halving the
    backward's stages and shrinking both passes' costs less depends on the batch: on traces/small_8gpu.json at 8
    GPUs both passes at 12 rounds beat the backward's halved by 1%); with its peaks, the encoder's columns its
    account read and its simulated layer time (forward plus backward). None when no step fits, when a rank's own
    tokens' accumulators and outputs alone are over the budget, or when the default budget's work bound allows no
    step (no step is tried then). Records the steps tried, the least peak found, that floor and why a budget is
    unmet in `record`. `first`: the order the accounts visit ranks in (:func:`stacked_peak_bytes`), the winner's
    peaks; `segments`: its tiles' segment pairs and their kinds, where the floor holds them."""
    most = _refits_allowed(plan, options, budget, record)
    if most == 0:
        return None
    fitting, over = None, []  # fitting: (seconds, plan, peaks, columns) of the first step that fits
    for schedule in _budget_ladder(timer, rounds_of, options, plain):
        if record["refits"] == most:
            record["unmet"] = "work"
            break
        record["refits"] += 1
        candidate = _finish(timer, schedule, options, digest)
        # The account's and the simulation's ranks, and the columns the plan is encoded from where it is kept.
        stacked, columns = _stacked_with_columns(timer, candidate, "memory")
        if fitting is not None:
            # The step after the first that fits is simulated first: where it is no faster (smaller stages seldom
            # are), its account, which where it fits visits every rank, is not needed.
            return _faster_next_step(timer, fitting, (candidate, stacked, columns), budget, record, first, segments)
        # A rank above the budget settles whether the step fits. The least peak found is then a fitting step's,
        # under every step over; only where none fits are the steps over accounted further (_least_over: their
        # stacks are held until a step fits, as many as the floor's tile budget allows steps). A budget the user
        # gave, whose refusal names the least peak, has each step over accounted until a rank is above the least
        # so far too (its steps are not bounded by that budget, so their stacks are not held).
        strict = options.memory_budget_is_strict
        peaks = _peak_bytes(timer, candidate, stacked, first,
                            stop_above=max(budget, record["least_peak_bytes"]) if strict else budget)
        if peaks.max() > budget:
            if strict:
                record["least_peak_bytes"] = min(record["least_peak_bytes"], int(peaks.max()))
            else:
                over.append(stacked)
            continue
        record["least_peak_bytes"] = min(record["least_peak_bytes"], int(peaks.max()))
        del over[:]
        figures = timer.run("score", _layer_figures, candidate, segments, stacked)
        fitting = (figures["layer_makespan_fwd_s"] + figures["layer_makespan_bwd_s"], candidate, peaks, columns)
    if fitting is None:
        _least_over(timer, over, budget, record)
        return None
    return (*fitting[1:], fitting[0])


def _refits_allowed(plan: tuple, options: CompileOptions, budget: int, record: dict) -> float:
    """How many schedules :func:`_refit_to_budget` may try for `plan` (0: none, with why in `record["unmet"]`: a
    rank's own tokens' accumulators and outputs alone over the budget, or the work bound); records the least peak any
    schedule can have (`floor_bytes`)."""
    final, fields, _ = plan
    rank_tokens = np.bincount(final.assignment.block_rank, weights=final.sharding.block_tokens,
                              minlength=final.num_ranks)
    floor_bytes = int(least_peak_bytes(PlanHeader.model_construct(**fields), rank_tokens).max())
    record.update(floor_bytes=floor_bytes, least_peak_bytes=record["unbudgeted_peak_bytes"])
    # The default budget's refits are work the floor's tile budget bounds, as it bounds the candidates: each
    # schedules, encodes and accounts the whole plan (tens of seconds at thousands of ranks). A given budget is met
    # whatever it costs.
    most = _most_refits(options, final.tiles.num_tiles)
    if floor_bytes > budget or not options.pipelined or most == 0:
        record["unmet"] = "own tokens" if floor_bytes > budget else "work"
        return 0
    record["unmet"] = "no schedule"
    return most


def _faster_next_step(timer: _PassTimer, fitting: tuple, step: tuple, budget: int, record: dict,
                      first: np.ndarray | None = None,
                      segments: tuple | None = None) -> tuple[tuple, np.ndarray, dict, float]:
    """:func:`_refit_to_budget`'s choice between the first step that fits, `fitting` (seconds, plan, peaks, columns),
    and the step after it, `step` (plan, stacked ranks, columns): the next step where it simulates faster and fits
    the budget, else the first. `segments`: as :func:`_layer_figures` takes them. Returns (plan, peaks, columns,
    seconds)."""
    candidate, stacked, columns = step
    figures = timer.run("score", _layer_figures, candidate, segments, stacked)
    seconds = figures["layer_makespan_fwd_s"] + figures["layer_makespan_bwd_s"]
    if seconds < fitting[0]:  # (a tie goes to the first)
        peaks = _peak_bytes(timer, candidate, stacked, first, stop_above=budget)
        if peaks.max() <= budget:
            record["least_peak_bytes"] = min(record["least_peak_bytes"], int(peaks.max()))
            return candidate, peaks, columns, seconds
    return (*fitting[1:], fitting[0])


def _least_over(timer: _PassTimer, over: list[StackedRanks], budget: int, record: dict) -> None:
    """Lower `record["least_peak_bytes"]` to the least peak of the steps `over` the budget whose accounts stopped at
    the first ranks above it: each is accounted again until a rank is above the least so far (as
    :func:`_refit_to_budget` accounts the steps of a budget the user gave), so the least is every step's."""
    for stacked in over:
        peaks = timer.run("memory", stacked_peak_bytes, stacked, stop_above=max(budget, record["least_peak_bytes"]))
        record["least_peak_bytes"] = min(record["least_peak_bytes"], int(peaks.max()))


def _most_refits(options: CompileOptions, num_tiles: int) -> float:
    """How many schedules :func:`_refit_to_budget` may try for a plan of `num_tiles` tiles: any number for a budget
    the user gave, else what the floor's tile budget allows (0 past it)."""
    return math.inf if options.memory_budget_is_strict else floor.TILE_BUDGET // max(num_tiles, 1)


def _faster_within_budget(timer: _PassTimer, refit: tuple | None, others: Callable[[float], Iterator], budget: int,
                          record: dict, first: np.ndarray | None = None) -> tuple[tuple, np.ndarray, dict] | None:
    """The refitted plan, or the fastest of the floor's other candidates that fits `budget` as the floor scheduled it,
    where it simulates faster than the refit (another placement may hold less at its own stages than the winner
    does at smaller ones). Candidates are tried fastest first, as long as they simulated faster than the refit (or
    the first one that fits, where nothing was refitted): `others(limit)` gives (name, plan, its simulated layer
    seconds, its ranks as the floor stacked them to simulate it, or None, and the encoder columns they were stacked
    from, or None). `refit`: :func:`_refit_to_budget`'s (plan, peaks, columns, seconds). `first`: the order the
    accounts visit ranks in (the winner's peaks). Returns (plan, peaks, its columns or None), or None."""
    best = None if refit is None else refit[:3]
    limit = math.inf if refit is None else refit[3]
    for name, candidate, seconds, stacked, columns in others(limit):
        peaks = _peak_bytes(timer, candidate, stacked, first, stop_above=budget)
        if peaks.max() > budget:
            continue
        if seconds < limit:
            best, record["kept"] = (candidate, peaks, columns), name
        break
    return best


def _peak_bytes(timer: _PassTimer, plan: tuple, stacked: StackedRanks | None = None, first: np.ndarray | None = None,
                stop_above: int | None = None) -> np.ndarray:
    """:func:`plan_peak_bytes` of a finished plan (final IR, header fields, ...), from its stacked ranks where the
    caller holds them (the same arrays: stack_plan of the plan); `first`, `stop_above`: as
    :func:`stacked_peak_bytes` takes them (every rank's peaks, in rank order, where the account does not stop)."""
    if stacked is None:
        return timer.run("memory", plan_peak_bytes, plan[0], plan[1], stop_above=stop_above, first=first)
    return timer.run("memory", stacked_peak_bytes, stacked, stop_above=stop_above, first=first)


def _budget_ladder(timer: _PassTimer, rounds_of: Callable[[], Rounds], options: CompileOptions,
                   plain: Schedule | None = None):
    """Schedules of the rounds `rounds_of()` gives that hold less and less, step by step: at the requested rounds a
    stage (c), then at about 3/4 as many each step down to one, the backward levelled within TIGHT_LEVELLING_STAGES
    (a tile levelling delays keeps its pulled block live) and then, at the same c, with its stages halved too (a
    pulled block lives until its gradient leaves two stages later). A rank receives at most a stage's rounds of
    messages at a time, so its peak falls about with the stage. `plain`: coalesce's schedule of those rounds at c,
    where the caller holds it; the first step then levels its backward again (the forward is the same call)."""
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
            yield timer.run("coalesce", with_backward_rounds, schedule, halved, tight)
        del schedule
        per_stage = per_stage * 3 // 4 if per_stage > 3 else per_stage - 1


def memory_budget_tokens(options: CompileOptions) -> int:
    """The live buffer tokens a plan may hold: MEMORY_BUDGET_STAGES stages' worth of pulls (4cB), what the floor
    and `fit_memory` hold every plan to.

    Args:
        options: the compile options (their rounds a stage and block size).
    Returns:
        tokens.
    """
    return floor.MEMORY_BUDGET_STAGES * options.coalesce * options.resolved_block_size


def _floor_applies(options: CompileOptions) -> bool:
    """The floor compares FCP's candidates; a baseline is its system's placement, and an ablation shows one
    technique alone."""
    return options.planner is Planner.FCP and options.floor and options.pipelined and options.matching_rounds


def _compile_with_floor(timer: _PassTimer, batch: Batch, options: CompileOptions, cap: int, digest: str,
                        progress: Callable[[dict], None] | None = None, kinds: LayerKinds | None = None) -> _Kept:
    """Schedule every candidate of :mod:`fcp_compiler.core.floor` within the memory budget, score each that fits by
    the timing model and keep the winner (with the floor's stats, and what the memory budget's account may read:
    :class:`_Kept`). With layer kinds a candidate's score counts every kind on its placement, weighted by the mix,
    and the budget's account keeps the winner's placement (the other kinds are scheduled on it)."""
    started = time.perf_counter()
    run = _FloorRun(timer=timer, batch=batch, options=options, cap=cap, digest=digest,
                    budget=memory_budget_tokens(options), progress=progress, kinds=kinds)
    tolerances = options.token_tolerance is None and options.layout is Layout.PLAN
    for candidate in floor.candidates(options.model is None, options.node_fan_out, tolerances):
        if not run.schedule(candidate):
            break
    if options.node_fan_out is None and (follower := floor.fan_out_follower(run.scores, run.budget)) is not None:
        run.schedule(follower)
    scores, budget = run.scores, run.budget
    winner = floor.choose(scores, budget)
    last_stage, plain, held = None, None, None
    if run.best is not None:
        assert run.best[0] is scores[winner]
        _, plan, figures, rounds, plain = run.best
        if not run.alone:
            held = run.finished[winner][2:]
            plan, figures, last_stage, held = _backward_last_stage(timer, plan, figures, options, digest, budget,
                                                                   run.segments_of(plan[0].tiles), held)
    else:  # nothing fits the budget: the one with the fewest buffer tokens, scheduled in full
        assert run.least[0] is scores[winner]
        _, transfers, with_fan_out, schedule = run.least
        rounds = schedule.rounds if schedule is not None else _rounds(timer, transfers, options, with_fan_out)
        schedule = schedule or timer.run("coalesce", coalesce, rounds, options.coalesce, options.pipelined)
        plan = _finish(timer, schedule, options, digest)
        figures = None if run.alone else _layer_figures(plan)
    floor_stats = {name: figures[name] for name in LAYER_STATS} if figures is not None else {}
    most = floor.most_scheduled(run.fcp_tiles.num_tiles) if run.fcp_tiles is not None else None
    floor_stats["floor"] = _floor_record(scores, winner, run.pruned, budget, time.perf_counter() - started, most,
                                         run.out_of_reach)
    floor_stats["floor"]["backward_last_stage"] = last_stage
    return _Kept(plan=plan, floor_stats=floor_stats, fan_out=scores[winner].candidate.fan_out,
                 rounds_of=lambda: rounds,
                 others=lambda limit: run.others(winner, limit) if kinds is None else iter(()), plain=plain,
                 held=held, segments_of=lambda tiles: None if run.alone else run.segments_of(tiles))


def _backward_last_stage(timer: _PassTimer, plan: tuple, figures: dict, options: CompileOptions, digest: str,
                         budget: int, segments: tuple | None = None,
                         held: tuple | None = None) -> tuple[tuple, dict, dict | None, tuple | None]:
    """The winner, or the same plan with the backward's pulled-K,V tiles that levelling put into its last stage
    back in their earliest (:func:`remote_tiles_out_of_last_stage`) where that simulates faster and fits the memory
    budget. `held`: the winner's (stacked ranks, encoder columns). Returns (plan, its figures, the comparison for the
    stats: None where no tile would move, the plan's stacked ranks and columns)."""
    moved = timer.run("coalesce", remote_tiles_out_of_last_stage, plan[0].schedule)
    if moved is None:
        return plan, figures, None, held
    other = _finish(timer, moved, options, digest, relays=False)  # the winner's relays are in its schedule already
    other_held, other_figures = None, None
    if other[1]["max_buffer_tokens"] <= budget:
        other_held = _stacked_with_columns(timer, other)
        other_figures = timer.run("score", _layer_figures, other, segments, other_held[0])
    levelled = figures["layer_makespan_fwd_s"] + figures["layer_makespan_bwd_s"]
    out_of_last = other_figures["layer_makespan_fwd_s"] + other_figures["layer_makespan_bwd_s"] \
        if other_figures is not None else None
    kept = out_of_last is not None and out_of_last < levelled
    record = {"kept": "out of last stage" if kept else "levelled", "levelled_s": levelled,
              "out_of_last_stage_s": out_of_last, "max_buffer_tokens": other[1]["max_buffer_tokens"]}
    return (other, other_figures, record, other_held) if kept else (plan, figures, record, held)


def _stacked_with_columns(timer: _PassTimer, plan: tuple, pass_name: str = "score") -> tuple[StackedRanks, dict]:
    """A finished plan's stacked ranks (what the simulation and the account read) and the encoder's columns they are
    stacked from (what the plan file is cut from, should the plan be the one compile_plan returns), timed as
    `pass_name`."""
    columns = timer.run(pass_name, rank_columns, plan[0])
    return timer.run(pass_name, stack_plan, plan[0], plan[1], columns), columns


@dataclass(slots=True, kw_only=True)
class _FloorRun:
    """The floor's candidates as they are scheduled: the placements made (each placed and routed once, whichever
    switches schedule it), the scores, and the plans kept: every scored candidate's plan (the memory budget may
    keep one of them, and scheduling it again costs what scoring it did), the least memory among those over the
    live-buffer budget. A candidate is scored only where the floor schedules several, so the plans kept are bounded
    by floor.TILE_BUDGET tiles in all (about 20 MB for each of the 7 at 256 ranks); at thousands of ranks, where each
    IR is hundreds of MB, the only candidate is not scored and none is kept. floor.choose makes the same choice from
    the scores alone."""

    timer: _PassTimer
    batch: Batch
    options: CompileOptions
    cap: int
    digest: str
    budget: int
    fcp_tiles: TileSet | None = None  # shared by FCP's own placements
    routed: dict = field(default_factory=dict)
    placed_by: dict = field(default_factory=dict)
    pruned: dict = field(default_factory=dict)
    # fan-out candidates left unscheduled (floor.fan_out_out_of_reach): their names and busiest receivers' tokens
    out_of_reach: list = field(default_factory=list)
    bounds: dict = field(default_factory=dict)  # each placement's busy lower bound (simulate.busy_lower_bound)
    scores: list = field(default_factory=list)
    # score index -> (plan, figures, stacked ranks, encoder columns) of each scored candidate (the stack its account
    # reads too, the columns its file is cut from)
    finished: dict = field(default_factory=dict)
    pairs: dict = field(default_factory=dict)  # id(tile set) -> (tile set, its segment pairs, their kinds): pairs_of
    best: tuple | None = None
    least: tuple | None = None
    progress: Callable[[dict], None] | None = None
    kinds: LayerKinds | None = None  # the compile's layer kinds: each candidate is scored by the mix

    def pairs_of(self, tiles: TileSet) -> tuple | None:
        """The segment pairs of a tile set the floor's candidates share (FCP's placements one, the equal-chunk ones
        another), built once: every simulation and bound reads them. None for closed-form tiles."""
        if not tiles.has_pairs:
            return None
        held = self.pairs.get(id(tiles))
        if held is None or held[0] is not tiles:
            held = self.pairs[id(tiles)] = [tiles, self.timer.run("score", tiles.segment_pairs), None]
        return held[1]

    def segments_of(self, tiles: TileSet) -> tuple[tuple | None, tuple | None]:
        """The segment pairs of a tile set (:meth:`pairs_of`) and their kernel entry kinds (simulate.pair_kinds),
        each built once: every simulation of a plan of these tiles reads both (a placement the bound prunes needs
        the pairs only). (None, None) for closed-form tiles."""
        pairs = self.pairs_of(tiles)
        if pairs is None:
            return None, None
        held = self.pairs[id(tiles)]
        if held[2] is None:
            held[2] = self.timer.run("score", pair_kinds, tiles, pairs)
        return pairs, held[2]

    @property
    def alone(self) -> bool:
        """Whether the floor's work allows one candidate only (floor.TILE_BUDGET)."""
        return self.fcp_tiles is not None and floor.most_scheduled(self.fcp_tiles.num_tiles) == 1

    def schedule(self, candidate: floor.Candidate) -> bool:
        """Place (once a placement), schedule and score one candidate, unless its placement is pruned or, with node
        fan-out, it is out of the budget's reach (floor.fan_out_out_of_reach: recorded in `out_of_reach`, counted
        among the candidates the floor's work allows but not scheduled); False once that work is spent
        (floor.TILE_BUDGET)."""
        started = time.perf_counter()
        if candidate.placement is Placement.MAGI and Placement.GREEDY in self.pruned:  # one placement: its bound
            self.pruned[candidate.placement] = self.pruned[Placement.GREEDY]
        if candidate.placement in self.pruned:
            return True
        # A fan-out candidate out of reach keeps its place in the count: where the tile budget binds (thousands of
        # ranks), the candidates scheduled are the ones that were, less those left out, and so is the plan.
        taken = len(self.scores) + len(self.out_of_reach)
        if self.fcp_tiles is not None and taken >= floor.most_scheduled(self.fcp_tiles.num_tiles):
            return False
        if candidate.placement not in self.routed and not self._place(candidate.placement):
            return True
        timer, options, budget = self.timer, self.options, self.budget
        transfers = self.routed[candidate.placement]
        fanned = _fanned_out(timer, transfers, options, candidate.fan_out)
        if fanned is not transfers and options.node_fan_out is None:  # its direct twin is a candidate too
            received = _most_received_tokens(fanned)
            if floor.fan_out_out_of_reach(received, budget):
                self.out_of_reach.append({"candidate": candidate.name, "most_received_tokens": received})
                return True
        schedule, peak, plain = _fit_memory(timer, _rounds(timer, fanned, options, False), options, budget)
        fits, relays = schedule is not None and peak <= budget, True
        if fits:  # only a plan that may fit is finished and scored
            plan = _finish(timer, schedule, options, self.digest, max_buffer=peak)
            if plan[1]["max_buffer_tokens"] > budget:  # a relay holds its block longer: keep the schedule's senders
                plan, relays = _finish(timer, schedule, options, self.digest, relays=False, max_buffer=peak), False
            peak = plan[1]["max_buffer_tokens"]
            fits = peak <= budget
        # The only candidate the floor's work allows (thousands of ranks) is not simulated: there is nothing to
        # compare it with, and `fcp compile` simulates the plan it prints (core.simulate.layer_stats).
        stacked, columns = _stacked_with_columns(timer, plan) if fits and not self.alone else (None, None)
        figures = timer.run("score", _layer_figures, plan, self.segments_of(plan[0].tiles), stacked) \
            if stacked is not None else None
        unscored = math.nan if fits else math.inf
        score = floor.Score(
            candidate=candidate, coalesce=schedule.coalesce if schedule else options.coalesce,
            backward_rounds=schedule.backward.coalesce if schedule else 2 * options.coalesce,
            layer_makespan_fwd_s=figures["layer_makespan_fwd_s"] if figures else unscored,
            layer_makespan_bwd_s=figures["layer_makespan_bwd_s"] if figures else unscored, max_buffer_tokens=peak,
            relays=relays, seconds=time.perf_counter() - started,
            busy_lower_bound_s=self.bounds[candidate.placement],
            kinds_s=_kinds_seconds(timer, plan, self.kinds, options, candidate.fan_out) if figures else 0.0)
        if fits and (self.best is None or score.layer_seconds < self.best[0].layer_seconds):
            # The rounds before relays, which the memory budget's refits schedule again, and the schedule itself
            # where their first may start from it (its forward; held only where refits may run).
            plain = schedule if plain and _most_refits(options, plan[0].tiles.num_tiles) > 0 else None
            self.best = (score, plan, figures, schedule.rounds, plain)
        if figures is not None:  # kept for others(): the memory budget may want it, and it is seconds to redo
            self.finished[len(self.scores)] = (plan, figures, stacked, columns)
        if not fits and (self.least is None or peak < self.least[0].max_buffer_tokens):
            self.least = (score, transfers, candidate.fan_out, schedule)
        self.scores.append(score)
        if self.progress is not None:
            self.progress(_candidate_record(score))
        return True

    def others(self, winner: int, limit: float):
        """The scored candidates but the winner that fit the live-buffer budget and simulated faster than `limit`,
        fastest first, as they were scored: (its name, its plan, its layer seconds, its stacked ranks, its encoder
        columns)."""
        faster = sorted((score.layer_seconds, index) for index, score in enumerate(self.scores)
                        if index != winner and score.layer_seconds < limit and score.max_buffer_tokens <= self.budget)
        for seconds, index in faster:
            plan, _, stacked, columns = self.finished[index]
            yield self.scores[index].name, plan, seconds, stacked, columns

    def _place(self, placement: Placement) -> bool:
        """Place and route `placement`; False (and the reason in `pruned`) where it is refused, cannot win, or
        places exactly as an earlier one."""
        timer, options = self.timer, self.options
        if placement not in floor.EQUAL_CHUNKS and self.fcp_tiles is None:
            self.fcp_tiles = _fcp_tiles(timer, self.batch, options)
        try:
            assignment = self.placed_by.get(Placement.GREEDY) if placement is Placement.MAGI else None
            assignment = assignment or _place(timer, self.batch, options, self.cap, placement, self.fcp_tiles)
        except InfeasibleError as refusal:  # MagiAttention's chunks past a limit FCP's own blocks meet
            if placement not in floor.EQUAL_CHUNKS:
                raise
            self.pruned[placement] = (math.inf, None, str(refusal))
            return False
        # A placement whose busiest rank alone computes longer than the best plan so far takes cannot win: its
        # schedules are skipped (the bound holds for every schedule of it; tests/test_floor.py checks it).
        fastest = self.best[0].layer_seconds if self.best is not None else math.inf
        # The only candidate the floor's work allows is compared with nothing, so it is not bounded (it costs a
        # pass over every segment pair: seconds at small blocks).
        bound = None if self.alone else timer.run("score", busy_lower_bound, assignment, options.layout,
                                                   options.model, self.pairs_of(assignment.tiles))
        self.bounds[placement] = bound
        same = [earlier for earlier, placed in self.placed_by.items() if _same_placement(placed, assignment)
                and (earlier is Placement.MAGI) == (placement is Placement.MAGI)]  # routed alike
        # Cannot win, or schedules exactly as an earlier placement does.
        if (bound is not None and bound >= fastest) or same:
            self.pruned[placement] = (bound, same[0] if same else None, None)
            return False
        if not self.alone:  # compared with the placements after it: none where the floor schedules one candidate
            self.placed_by[placement] = assignment  # (a column a tile: millions at small blocks)
        self.routed[placement] = _route(timer, assignment, options, as_its_system=placement is Placement.MAGI)
        return True


def _floor_record(scores: list, winner: int, pruned: dict, budget: int, seconds: float,
                  most_scheduled: int | None, out_of_reach: list) -> dict:
    """stats["floor"]: the winner, every scheduled candidate's score, the placements skipped and why, and the node
    fan-out candidates out of the budget's reach."""
    return {
        "winner": scores[winner].name, "memory_budget_tokens": budget, "seconds": seconds,
        "most_scheduled": most_scheduled,
        "candidates": [_candidate_record(score) for score in scores],
        "pruned": [{"placement": placement.value, "busy_lower_bound_s": bound,
                    "same_as": same.value if same is not None else None, "refused": refused}
                   for placement, (bound, same, refused) in pruned.items()],
        "out_of_reach": out_of_reach}


def _candidate_record(score: floor.Score) -> dict:
    """One scheduled candidate in stats["floor"]["candidates"]."""
    return {"name": score.name, "layer_makespan_fwd_s": _simulated(score.layer_makespan_fwd_s),
            "layer_makespan_bwd_s": _simulated(score.layer_makespan_bwd_s),
            "max_buffer_tokens": score.max_buffer_tokens, "busy_lower_bound_s": score.busy_lower_bound_s,
            "seconds": score.seconds, **({"other_kinds_s": score.kinds_s} if score.kinds_s else {})}


def _simulated(seconds: float) -> float | None:
    """A score's makespan for the record: None where it was not simulated (the only candidate)."""
    return None if math.isnan(seconds) else seconds


def _same_placement(first: Assignment, second: Assignment) -> bool:
    """Whether two placements of one tile set put every block and every tile on the same rank."""
    return first.tiles is second.tiles and np.array_equal(first.block_rank, second.block_rank) and \
        np.array_equal(first.tile_rank, second.tile_rank)


def _layer_figures(plan: tuple, segments: tuple | None = None, stacked: StackedRanks | None = None) -> dict:
    """The simulated layer figures of a finished plan (final IR, header fields, ...), from its arrays as the
    encoder lays them out (nothing encoded); `segments`: its tiles' segment pairs and their kinds
    (_FloorRun.segments_of), and `stacked`: stack_plan of it, when the caller holds them."""
    final, fields, _ = plan
    if stacked is None:  # its tiles are read from the IR, but where the user layout's reshuffle overlap reads them
        stacked = stack_plan(final, fields, rank_columns(final, tile_rows=fields["layout"] is Layout.USER))
    pairs, kinds = segments if segments is not None else (None, None)
    return simulate_plan(HeldPlan(stacked=stacked, tiles=final.tiles, pairs=pairs, kinds=kinds, final=final),
                         attention_alone=False).layer_figures()


def _fit_memory(timer: _PassTimer, rounds: Rounds, options: CompileOptions,
                budget: int) -> tuple[Schedule | None, int, bool]:
    """coalesce with the requested rounds a stage and, while the live buffers exceed the budget, again with less
    held (:func:`_refits`). Where coalesce moved the Q pulls into the first stage (such a pull holds its block from
    then on) and that leaves the plan over the budget, the rounds in their plain order are refitted beside it, a step
    at a time, and the first to fit is kept, the Q pulls first on a tie (ProLong + tail at 64 GPUs, seed 1: only the
    plain order fits with the backward levelled less, and with the Q pulls first the backward's stages would halve;
    at 256 GPUs, seed 2, both need smaller stages, and the Q pulls first stay 2.7% faster).

    Returns:
        (the first schedule tried that fits, else the completed one with the fewest live buffer tokens, or None when
        every forward half tried was over by more than half; its peak live buffer tokens before relays; whether it
        is the first one tried, coalesce's at the requested rounds a stage).
    """
    first = _schedule_at(timer, rounds, options, budget, q_first=True)
    chains = [_refits(timer, rounds, options, budget, first)]
    if first[3] and first[2] > budget and options.pipelined:
        chains.append(_refits(timer, rounds, options, budget, _schedule_at(timer, rounds, options, budget, False)))
    least = None  # only the best step over the budget is held: each is a whole schedule (GBs at thousands of ranks)
    while chains:
        for chain in list(chains):
            step = next(chain, None)
            if step is None:
                chains.remove(chain)
                continue
            if step[0] is not None and (step[1] <= budget or not options.pipelined):
                return (*step, step[0] is first[0])
            # Completed before not, then the fewest tokens; the first of equals (the Q pulls first) stays.
            if least is None or (step[0] is None, step[1]) < (least[0] is None, least[1]):
                least = step
            del step  # the chain makes its next step without this one held, unless it is the least
    return (*least, least[0] is not None and least[0] is first[0])


def _refits(timer: _PassTimer, rounds: Rounds, options: CompileOptions, budget: int, first: tuple):
    """The schedules :func:`_fit_memory` tries from `first` (:func:`_schedule_at`'s tuple), as (schedule, peak live
    buffer tokens), until one fits: `first`; when the backward's peak is the one over, its levelling shallower
    (TIGHT_LEVELLING_STAGES: a tile levelling delays keeps its pulled block live, and its gradient lands on the
    block's owner later too), then its stages smaller (its pulls stay live until their gradients leave two stages
    later); then, when that leaves it over by at most half, both passes' stages (a rank receives at most a stage's
    rounds of messages at a time, so the peak falls about in proportion). Smaller still costs more time than it saves
    memory (launches, smaller kernels) and, at hundreds of ranks, seconds of scheduling. A forward half over the
    budget by more than half is not completed at all (schedule None)."""
    base, forward, peak, q_first = first
    yield base, peak
    if base is None or not options.pipelined or peak <= budget:
        return
    rounds_per_stage, tight = options.coalesce, TIGHT_LEVELLING_STAGES
    if forward <= budget:
        for backward_rounds in (2 * rounds_per_stage, smaller_backward_rounds(rounds_per_stage)):
            if backward_rounds is None:
                break
            # Each from `first`, whose forward, pulls and tile order the steps keep: the step before is not held
            # while this one is made (a column a tile: millions at small blocks).
            schedule = None
            schedule = timer.run("coalesce", with_backward_rounds, base, backward_rounds, tight)
            peak = max(forward, timer.run("score", pass_peaks, schedule)[1])
            yield schedule, peak
    if budget < peak <= budget * 3 // 2 and rounds_per_stage > 1:
        # Aim below the budget: fan-out entries hold a block across stages, so the peak falls a little slower.
        fewer = max(rounds_per_stage // 2, min(rounds_per_stage - 1, int(rounds_per_stage * budget * FIT_MARGIN
                                                                         // peak)))
        schedule = None
        schedule = timer.run("coalesce", coalesce, rounds, fewer, options.pipelined, levelling_stages=tight,
                             q_first=q_first)
        backward_rounds = smaller_backward_rounds(fewer)
        if max(timer.run("score", pass_peaks, schedule)) > budget and backward_rounds:
            schedule = timer.run("coalesce", with_backward_rounds, schedule, backward_rounds, tight)
        yield schedule, max(timer.run("score", pass_peaks, schedule))


def _schedule_at(timer: _PassTimer, rounds: Rounds, options: CompileOptions, budget: int,
                 q_first: bool) -> tuple[Schedule | None, int, int, bool]:
    """coalesce at the requested rounds a stage. Returns (the schedule, or None when its forward half alone was over
    the budget by more than half and so not completed; the forward's peak live buffer tokens; the schedule's; whether
    its Q pulls were moved first)."""
    part = timer.run("coalesce", coalesce_forward, rounds, options.coalesce, options.pipelined, q_first=q_first)
    forward, moved = timer.run("score", forward_peak, part), part.q_pulls_first
    if forward > budget * 3 // 2 and options.pipelined:
        return None, forward, forward, moved
    schedule = timer.run("coalesce", complete_backward, part)
    del part
    return schedule, forward, max(forward, timer.run("score", pass_peaks, schedule)[1]), moved


def _route(timer: _PassTimer, assignment: Assignment, options: CompileOptions,
           as_its_system: bool = False) -> Transfers:
    """plan_transfers and localize: FCP in the plan layout groups heavy-talking ranks into nodes after listing the
    pulls (renumbering them is cheaper than listing them again); otherwise (and for a baseline's placement routed as
    its system routes it) a block's owner goes where its tokens live, before the pulls are listed."""
    if options.planner is Planner.FCP and options.layout is Layout.PLAN and not as_its_system:
        transfers = timer.run("plan_transfers", plan_transfers, assignment)
        return timer.run("localize", group_nodes, transfers)
    assignment = timer.run("localize", localize, assignment)
    return timer.run("plan_transfers", plan_transfers, assignment)


def _fanned_out(timer: _PassTimer, transfers: Transfers, options: CompileOptions, with_fan_out: bool) -> Transfers:
    """fan_out where asked (and rounds are matchings), else the same transfers."""
    return timer.run("fan_out", fan_out, transfers) if options.matching_rounds and with_fan_out else transfers


def _most_received_tokens(transfers: Transfers) -> int:
    """The tokens the busiest receiver takes in over a pass: its pulls on both link classes."""
    received = np.bincount(transfers.edge_dst, weights=transfers.edge_tokens, minlength=transfers.assignment.num_ranks)
    return int(received.max(initial=0))


def _rounds(timer: _PassTimer, transfers: Transfers, options: CompileOptions, with_fan_out: bool) -> Rounds:
    """fan_out (when asked) and schedule_rounds."""
    transfers = _fanned_out(timer, transfers, options, with_fan_out)
    return timer.run("schedule_rounds", schedule_rounds if options.matching_rounds else arbitrary_rounds, transfers)


def _finish(timer: _PassTimer, schedule: Schedule, options: CompileOptions, digest: str,
            relays: bool = True, max_buffer: int | None = None) -> tuple:
    """relay (FCP, unless `relays` is off) and reshuffle: (final IR, header fields, None). Only the plan
    compile_plan returns is encoded (by :func:`_within_budget`, once its header's memory figures are known); the
    floor's candidates and the budget's refits are simulated and accounted from their IR. `max_buffer`: the
    schedule's max_buffer_tokens where the caller has it (a pass over every buffer of both passes), kept where no
    relay changes the schedule."""
    if relays and options.planner is Planner.FCP and options.matching_rounds:  # baselines keep their star senders
        relayed = timer.run("relay", relay, schedule)
        schedule, max_buffer = relayed, max_buffer if relayed is schedule else None
    final = timer.run("reshuffle", reshuffle, schedule)
    header_fields = _header_fields(final, options, schedule.rounds.transfers.assignment.token_cap, digest,
                                   max_buffer)
    return final, header_fields, None


def _place(timer: _PassTimer, batch: Batch, options: CompileOptions, cap: int, placement: Placement,
           tiles: TileSet | None = None) -> Assignment:
    """shard, cost and assign: FCP's placement for each rank's layer time (or attention alone) on `tiles` (default:
    FCP's own, sharded and costed here), the equal-chunk greedy of the floor, or a baseline's own sharding and
    placement (docs/DESIGN.md section 6)."""
    planner, num_ranks, block_size = options.planner, options.num_ranks, options.resolved_block_size
    if planner is Planner.FCP and placement not in floor.EQUAL_CHUNKS:
        tiles = tiles if tiles is not None else _fcp_tiles(timer, batch, options)
        # The linear layers run on a rank's blocks only in the plan layout; in the user layout they run on the even
        # user chunks whatever the placement, which then weighs attention (and its reshuffle, by home ranks) alone.
        by_layer = placement in floor.LAYER_TOLERANCES and options.model is not None and \
            options.layout is Layout.PLAN
        linear = LayerCosts.of(options.model, options.profile).linear_seconds_per_token * LINEAR_WEIGHT \
            if by_layer else 0.0
        tolerance = options.token_tolerance
        if placement in floor.LAYER_TOLERANCES:
            tolerance = floor.LAYER_TOLERANCES[placement] or options.resolved_token_tolerance
        return timer.run("assign", assign, tiles, num_ranks, cap, BALANCE_TOLERANCE, tolerance, linear)
    baseline = Planner.MAGI if placement in floor.EQUAL_CHUNKS else planner
    sharding, block_rank = timer.run("shard", BASELINES[baseline], batch, num_ranks, block_size, cap)
    _check_validatable(sharding, options)
    if baseline is Planner.RING and ring_in_closed_form(sharding):
        tiles = timer.run("cost", ring_cost, sharding, block_rank, num_ranks, options.shape, options.profile)
    else:
        tiles = timer.run("cost", cost, sharding, options.shape, options.profile)
    rank_tokens = np.bincount(block_rank, weights=sharding.block_tokens, minlength=num_ranks)
    return timer.run("assign", Assignment, tiles=tiles, num_ranks=num_ranks,
                     token_cap=max(cap, int(rank_tokens.max())), block_rank=block_rank,
                     tile_rank=block_rank[tiles.tile_q_block])


def _fcp_tiles(timer: _PassTimer, batch: Batch, options: CompileOptions) -> TileSet:
    """FCP's shard and cost (the layer and attention placements share them: one tile set, costed once)."""
    block_size = options.resolved_block_size
    # Zigzag gives every block of a sequence the same work and nearly the same traffic, which is what lets the
    # placement balance compute and traffic together (plain blocks carry about a third less traffic, but the
    # heavy last blocks of a long sequence leave it unbalanced: measured in benchmarks/balance.py).
    zigzag_on = options.zigzag is ZigzagMode.ON or (
        options.zigzag is ZigzagMode.AUTO and bool((pairs_chunks(batch) & batch.seq_causal
                                                    & (batch.lengths >= 2 * block_size)).any()))
    sharding = timer.run("shard", shard, batch, block_size, zigzag_on)
    _check_validatable(sharding, options)
    return timer.run("cost", cost, sharding, options.shape, options.profile)


def _header_fields(final: Reshuffle, options: CompileOptions, token_cap: int, digest: str,
                   max_buffer: int | None = None) -> dict:
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
                max_buffer_tokens=max_buffer_tokens(schedule) if max_buffer is None else max_buffer,
                pipelined=options.pipelined,
                rounds_kind="matching" if options.matching_rounds else "arbitrary",
                reshuffle_overlap=options.reshuffle_overlap, kv_prefetch=options.resolved_kv_prefetch,
                # Filled in by _within_budget for the plan compile_plan returns; a floor candidate is only simulated.
                max_buffer_bytes_fwd=[0] * options.num_ranks, max_buffer_bytes_bwd=[0] * options.num_ranks,
                memory_budget_bytes=None)

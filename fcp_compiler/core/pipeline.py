"""compile_plan: the paper's passes in order, then the choice between candidates (the floor), then the memory budget.

One placement through the passes (:func:`_compile_alone`): shard, cost and assign (:mod:`.placement`);
plan_transfers, localize, fan_out, schedule_rounds, coalesce, relay and reshuffle (:mod:`.schedule_search`); FCP
compares several such placements and keeps the fastest (:mod:`.floor`). The plan kept is held to the memory budget
and encoded (:mod:`.memory_budget`, where both budgets are decided), and with layer kinds every other kind is
scheduled on its placement (:func:`_with_kinds`).
"""

from __future__ import annotations

import hashlib
import json
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from fcp_compiler.algorithms.pages import base_pages
from fcp_compiler.core import floor
from fcp_compiler.core.baselines import Planner
from fcp_compiler.core.ir import Batch, Reshuffle
from fcp_compiler.core.kinds import LayerKind, LayerKinds, layer_kinds
from fcp_compiler.core.memory_budget import BudgetedPlan, KeptPlan, memory_budget_tokens, within_budget
from fcp_compiler.core.options import CompileOptions
from fcp_compiler.core.pass_timer import PassTimer
from fcp_compiler.core.passes.assign import default_token_cap
from fcp_compiler.core.placement import BALANCE_TOLERANCE, Placement, check_least_pairs, place
from fcp_compiler.core.kinds_schedule import schedule_kind
from fcp_compiler.core.schedule_search import coalesce_within, finish, make_rounds, route
from fcp_compiler.core.simulate import LAYER_STATS, layer_seconds, layer_stats
from fcp_compiler.core.stats import plan_stats
from fcp_compiler.errors import InvalidInputError
from fcp_compiler.format.inputs import MAX_SEQUENCES, BatchSpec, Mask, MaskKind, parse_batch, too_many_sequences
from fcp_compiler.format.kinds import encode_kinds
from fcp_compiler.format.plan_format import FORMAT_VERSION, PlanReader, RankProgram
from fcp_compiler.format.safe_io import write_atomic

# memory_budget_tokens is re-exported (memory_budget decides it): fcp_compiler.tools.compare reads it from here.
__all__ = ["CompiledPlan", "KindPlan", "compile_plan", "inputs_digest", "memory_budget_tokens", "plan_digest"]


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
    if options.planner is Planner.FCP and not floor.applies(options):  # absent where it runs, as before it existed
        canonical["floor"] = False
    if options.fit_memory and not floor.applies(options, alone=True):  # absent unless asked (the floor always fits)
        canonical["fit_memory"] = True
    if options.resolved_token_tolerance is not None:  # absent when none applies
        canonical["token_tolerance"] = options.resolved_token_tolerance
    if batch.mask not in (MaskKind.CAUSAL, MaskKind.FULL):  # the lengths say every window of the others
        canonical["windows"] = batch.windows.tolist()
    if kinds is not None:  # absent for one kind, as before kinds existed
        canonical["layer_kinds"], canonical["kind"] = kinds.canonical(), kind.name
    return hashlib.sha256(json.dumps(canonical, sort_keys=True, separators=(",", ":")).encode()).hexdigest()


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
    token_cap: int
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
    check_least_pairs(the_batch, options)
    token_cap = options.token_cap if options.token_cap is not None else default_token_cap(
        the_batch.total_tokens, options.num_ranks, options.resolved_block_size)
    return _Prepared(options=options, batch=the_batch, token_cap=token_cap, kinds=kinds)


def plan_digest(batch, num_ranks: int | None = None, *, options: CompileOptions | None = None, **fields) -> str:
    """The inputs digest compile_plan would record for these arguments, without compiling (for caches).

    Raises:
        InvalidInputError: as compile_plan.
    """
    prepared = _prepare(batch, num_ranks, options, fields)
    kinds = prepared.kinds
    return inputs_digest(prepared.batch, prepared.options, prepared.token_cap, kinds,
                         kinds.primary if kinds is not None else None)


@base_pages()
def compile_plan(batch: BatchSpec | Sequence[int] | np.ndarray, num_ranks: int | None = None, *,
                 options: CompileOptions | None = None, progress: Callable[[dict], None] | None = None,
                 **fields) -> CompiledPlan:
    """Compile a batch into a per-rank execution plan.

    Runs shard, cost, assign, plan_transfers, localize, fan_out, schedule_rounds, coalesce, relay, reshuffle and encode,
    timing each (stats["pass_seconds"]). Layer kinds (:mod:`fcp_compiler.core.kinds`) give one placement, chosen by
    the mix's time, and a schedule a kind: `data` is then the kinds file, `kinds` each kind's plan. For FCP the
    floor (:mod:`fcp_compiler.core.floor`) runs them for several candidate placements, direct and
    (:func:`floor.fan_out_follower`) with node fan-out, and keeps the plan with the least simulated layer time whose
    live buffers fit 4 x coalesce x block size tokens (stats["floor"] says which, and what each scored). The plan
    kept is held to the memory budget in bytes (:mod:`fcp_compiler.core.memory_budget`, stats["memory"]).

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
    timer = PassTimer()
    prepared = timer.run("parse", _prepare, batch, num_ranks, options, fields)
    options, kinds = prepared.options, prepared.kinds
    digest = inputs_digest(prepared.batch, options, prepared.token_cap, kinds,
                           kinds.primary if kinds is not None else None)
    if floor.applies(options, alone=True):  # the choice between candidates (the floor off: FCP's own only), each
        # placement through the passes, the fastest kept
        kept = floor.compile_with_floor(timer, prepared.batch, options, prepared.token_cap, digest, progress, kinds)
    else:  # a baseline's placement, or an ablation step, through the passes
        kept = _compile_alone(timer, prepared.batch, options, prepared.token_cap, digest)
    budgeted = within_budget(timer, kept, options, digest, floor.TILE_BUDGET)
    floor_stats, fan_out = kept.floor_stats, kept.fan_out
    del kept
    if floor_stats is not None and budgeted.decision.refitted:
        for name in LAYER_STATS:  # the floor's figures were the plan's before it was refitted
            floor_stats.pop(name, None)
    plan = _compiled(budgeted, options, time.perf_counter() - total_start, timer.seconds, floor_stats, timer.calls)
    return plan if kinds is None else _with_kinds(timer, plan, kinds, prepared, fan_out, total_start)


def _compile_alone(timer: PassTimer, batch: Batch, options: CompileOptions, token_cap: int, digest: str) -> KeptPlan:
    """A baseline's placement (or FCP's in an ablation step) through the passes once: within the floor's token
    budget where `fit_memory` asks, else at the requested rounds a stage."""
    assignment = place(timer, batch, options, token_cap, Placement.LAYER)  # shard, cost, assign
    transfers = route(timer, assignment, options)  # plan_transfers, localize
    rounds = make_rounds(timer, transfers, options, options.resolved_node_fan_out)  # fan_out, schedule_rounds
    # coalesce: smaller stages until it fits where asked, as the floor does (else, or hopelessly over, as asked)
    fitted = coalesce_within(timer, rounds, options, memory_budget_tokens(options) if options.fit_memory else None)
    plan = finish(timer, fitted.schedule, options, digest, peak_tokens=fitted.peak_tokens)  # relay, reshuffle
    return KeptPlan(plan=plan, fan_out=options.resolved_node_fan_out, rounds_of=lambda: rounds,
                    plain=fitted.schedule if fitted.plain else None)


def _compiled(budgeted: BudgetedPlan, options: CompileOptions, compile_seconds: float, pass_seconds: dict,
              floor_stats: dict | None = None, pass_calls: dict | None = None) -> CompiledPlan:
    """The CompiledPlan of an encoded plan: its statistics, what the memory budget decided (stats["memory"]) and
    the floor's stats where it ran."""
    final, header_fields, data = budgeted.plan.final, budgeted.plan.header_fields, budgeted.data
    stats = plan_stats(final, data, compile_seconds, pass_seconds, options.layout.value, options.model,
                       max_buffer=header_fields["max_buffer_tokens"])
    stats["kv_prefetch"] = header_fields["kv_prefetch"]
    stats["memory"] = budgeted.decision.stats()
    stats["pass_calls"] = dict(pass_calls or {})  # how often each pass ran ("reshuffle": full schedules)
    if floor_stats is not None:
        stats.update(floor_stats)
    return CompiledPlan(data=data, ir=final, stats=stats, _reader=PlanReader(data))


def _with_kinds(timer: PassTimer, primary: CompiledPlan, kinds: LayerKinds, prepared: _Prepared, fan_out: bool,
                started: float) -> CompiledPlan:
    """The other layer kinds scheduled on the primary kind's placement (each within the memory budget, as the
    primary), and the plan of layer kinds of them all: stats["layer_kinds"] gives each kind's figures and
    stats["layer_mix_s"] the model's attention layers' simulated time, forward plus backward."""
    options = prepared.options
    plans = {kinds.primary.name: primary}
    for kind in kinds.others:
        digest = inputs_digest(kind.batch, options, prepared.token_cap, kinds, kind)
        scheduled = schedule_kind(timer, primary.ir.transfers.assignment, kind, options, digest, fan_out,
                                  memory_budget_tokens(options))
        kept = KeptPlan(plan=scheduled.plan, fan_out=fan_out, rounds_of=lambda held=scheduled.rounds: held,
                        plain=scheduled.plain)
        del scheduled
        plans[kind.name] = _compiled(within_budget(timer, kept, options, digest, floor.TILE_BUDGET), options, 0.0,
                                     {})
    ordered = tuple(KindPlan(name=kind.name, mask=kind.mask, num_layers=kind.num_layers, plan=plans[kind.name])
                    for kind in kinds.kinds)
    summary = [_kind_summary(timer, kind) for kind in ordered]
    data = timer.run("encode", encode_kinds, [(kind.name, kind.mask.model_dump(mode="json"), kind.num_layers,
                                                 kind.plan.data) for kind in ordered], kinds.primary.name)
    stats = {**primary.stats, "layer_kinds": summary, "primary_kind": kinds.primary.name,
             "layer_mix_s": sum(row["num_layers"] * row["layer_seconds"] for row in summary),
             "plan_bytes": len(data), "plan_sha256": hashlib.sha256(data).hexdigest(),
             "compile_seconds": time.perf_counter() - started, "pass_seconds": dict(timer.seconds),
             "pass_calls": dict(timer.calls)}
    return CompiledPlan(data=data, ir=primary.ir, stats=stats, _reader=primary._reader, kinds=ordered)


def _kind_summary(timer: PassTimer, kind: KindPlan) -> dict:
    """One layer kind's row of stats["layer_kinds"]: its mask, layers, traffic and simulated layer time."""
    stats = kind.plan.stats
    figures = {name: stats[name] for name in LAYER_STATS} if "layer_makespan_fwd_s" in stats else \
        timer.run("score", layer_stats, kind.plan)
    return {"name": kind.name, "mask": kind.mask.model_dump(mode="json"), "num_layers": kind.num_layers,
            "num_tiles": stats["num_tiles"], "num_transfers": stats["num_transfers"],
            "total_comm_bytes": stats["total_comm_bytes"], "max_buffer_tokens": stats["max_buffer_tokens"],
            "peak_bytes": max(stats["memory"]["peak_bytes_fwd"], stats["memory"]["peak_bytes_bwd"]),
            "num_fwd_stages": kind.plan.header.num_fwd_stages, "num_bwd_stages": kind.plan.header.num_bwd_stages,
            **figures, "layer_seconds": layer_seconds(figures)}

"""compile_plan: run the passes in order, time each, and wrap the result."""

from __future__ import annotations

import hashlib
import json
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from fcp_compiler.core.baselines import BASELINES, Planner
from fcp_compiler.core.ir import Assignment, Batch, Reshuffle, ZigzagMode
from fcp_compiler.core.layer_model import LINEAR_WEIGHT, LayerCosts
from fcp_compiler.core.options import CompileOptions
from fcp_compiler.core.passes.assign import assign, default_token_cap
from fcp_compiler.core.passes.coalesce import coalesce, max_buffer_tokens
from fcp_compiler.core.passes.cost import cost, ring_cost, ring_in_closed_form
from fcp_compiler.core.passes.encode import encode
from fcp_compiler.core.passes.fan_out import fan_out
from fcp_compiler.core.passes.localize import group_nodes, localize
from fcp_compiler.core.passes.relay import relay
from fcp_compiler.core.passes.reshuffle import reshuffle
from fcp_compiler.core.passes.rounds import arbitrary_rounds, schedule_rounds
from fcp_compiler.core.passes.shard import pairs_chunks, shard
from fcp_compiler.core.passes.transfers import plan_transfers
from fcp_compiler.core.stats import plan_stats
from fcp_compiler.errors import InvalidInputError
from fcp_compiler.format.inputs import BatchSpec, Layout, Mask, MaskKind, parse_batch
from fcp_compiler.format.plan_format import FORMAT_VERSION, PlanReader, RankProgram
from fcp_compiler.format.safe_io import write_atomic

# A rank may be 2% above the compute lower bound before tiles of heavy blocks are moved off their owner.
BALANCE_TOLERANCE = 0.02


@dataclass(frozen=True, slots=True, kw_only=True)
class CompiledPlan:
    """A compiled plan: its bytes, header, statistics and the final IR."""

    data: bytes
    ir: Reshuffle
    stats: dict
    _reader: PlanReader

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


def inputs_digest(batch: Batch, options: CompileOptions, token_cap: int) -> str:
    """sha256 of a canonical JSON of everything the plan depends on."""
    canonical = {
        "format_version": FORMAT_VERSION, "planner": options.planner.value, "lengths": batch.lengths.tolist(),
        "mask": batch.mask.value, "num_ranks": options.num_ranks, "block_size": options.resolved_block_size,
        "coalesce": options.coalesce, "token_cap": token_cap, "zigzag": options.zigzag.value,
        "layout": options.layout.value,
        "shape": options.shape.model_dump(mode="json"), "profile": options.profile.model_dump(mode="json"),
        "balance_tolerance": BALANCE_TOLERANCE, "pipelined": options.pipelined,
        "matching_rounds": options.matching_rounds, "reshuffle_overlap": options.reshuffle_overlap,
        "model": options.model_name, "node_fan_out": options.resolved_node_fan_out,
    }
    if options.resolved_token_tolerance is not None:  # absent when none applies
        canonical["token_tolerance"] = options.resolved_token_tolerance
    if batch.mask not in (MaskKind.CAUSAL, MaskKind.FULL):  # the lengths say every window of the others
        canonical["windows"] = batch.windows.tolist()
    return hashlib.sha256(json.dumps(canonical, sort_keys=True, separators=(",", ":")).encode()).hexdigest()


class _PassTimer:
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
        lengths = batch.tolist() if isinstance(batch, np.ndarray) else list(batch)
        batch = parse_batch({"sequences": lengths})
    spec = batch if mask is None else BatchSpec(mask=mask, sequences=batch.sequences)
    return Batch(lengths=np.asarray(spec.sequences, dtype=np.int64), windows=np.asarray(spec.windows(),
                                                                                          dtype=np.int64))


def _prepare(batch, num_ranks: int | None, options: CompileOptions | None, fields: dict):
    """compile_plan's arguments checked into (options, batch, token cap)."""
    if options is None:
        if num_ranks is None:
            raise InvalidInputError("give the number of ranks (num_ranks) or a CompileOptions")
        options = CompileOptions.of(num_ranks, **fields)
    elif num_ranks is not None or fields:
        options = options.replace(**fields, **({} if num_ranks is None else {"num_ranks": num_ranks}))
    the_batch = _to_batch(batch, options.mask)
    cap = options.token_cap if options.token_cap is not None else default_token_cap(
        the_batch.total_tokens, options.num_ranks, options.resolved_block_size)
    return options, the_batch, cap


def plan_digest(batch, num_ranks: int | None = None, *, options: CompileOptions | None = None, **fields) -> str:
    """The inputs digest compile_plan would record for these arguments, without compiling (for caches).

    Raises:
        InvalidInputError: as compile_plan.
    """
    options, the_batch, cap = _prepare(batch, num_ranks, options, fields)
    return inputs_digest(the_batch, options, cap)


def compile_plan(batch: BatchSpec | Sequence[int] | np.ndarray, num_ranks: int | None = None, *,
                 options: CompileOptions | None = None, **fields) -> CompiledPlan:
    """Compile a batch into a per-rank execution plan.

    Runs shard, cost, assign, plan_transfers, localize, fan_out, schedule_rounds, coalesce, relay, reshuffle and encode,
    timing each (stats["pass_seconds"]).

    Args:
        batch: a BatchSpec, or a list/array of lengths (causal unless the options' `mask` says otherwise).
        num_ranks: number of ranks N (the CLI's --gpus); or give `options`.
        options: a CompileOptions (:mod:`fcp_compiler.core.options`); `num_ranks` and `fields` override it.
        fields: CompileOptions fields by name, as :meth:`CompileOptions.of` takes them: block_size (a multiple of 64,
            default 4096; refused for the baselines that size their own blocks), coalesce (rounds a stage, 16),
            token_cap (default mean + one block), token_tolerance, zigzag ("auto", "on", "off"), layout ("plan":
            tokens dispatched once into the plan's layout; "user": attention reshuffles), shape, profile (a preset
            name or a HardwareProfile), mask, planner (fcp, or a baseline: ring, bytescale, wlbllm, magi), and the
            ablation switches pipelined, matching_rounds (False fails validation), reshuffle_overlap.
    Returns:
        the CompiledPlan (bytes, per-rank access, stats).
    Raises:
        InvalidInputError: a bad length or parameter (named).
        InfeasibleError: a token cap no placement can meet.
    """
    total_start = time.perf_counter()
    timer = _PassTimer()
    options, the_batch, cap = timer.run("parse", _prepare, batch, num_ranks, options, fields)
    planner = options.planner
    assignment = _place(timer, the_batch, options, cap)
    if planner is Planner.FCP and options.layout is Layout.PLAN:
        # Grouping ranks into nodes needs the traffic, and renumbering the pulls is cheaper than listing them again.
        transfers = timer.run("plan_transfers", plan_transfers, assignment)
        transfers = timer.run("localize", group_nodes, transfers)
        assignment = transfers.assignment
    else:
        assignment = timer.run("localize", localize, assignment)
        transfers = timer.run("plan_transfers", plan_transfers, assignment)
    if options.matching_rounds and options.resolved_node_fan_out:
        transfers = timer.run("fan_out", fan_out, transfers)
    rounds = timer.run("schedule_rounds", schedule_rounds if options.matching_rounds else arbitrary_rounds,
                       transfers)
    schedule = timer.run("coalesce", coalesce, rounds, options.coalesce, options.pipelined)
    if planner is Planner.FCP and options.matching_rounds:  # baselines keep their systems' star-shaped senders
        schedule = timer.run("relay", relay, schedule)
    final = timer.run("reshuffle", reshuffle, schedule)
    header_fields = _header_fields(final, options, assignment.token_cap, inputs_digest(the_batch, options, cap))
    data = timer.run("encode", encode, final, header_fields)
    compile_seconds = time.perf_counter() - total_start
    stats = plan_stats(final, data, compile_seconds, timer.seconds, options.layout.value, options.model,
                       max_buffer=header_fields["max_buffer_tokens"])
    return CompiledPlan(data=data, ir=final, stats=stats, _reader=PlanReader(data))


def _place(timer: _PassTimer, batch: Batch, options: CompileOptions, cap: int) -> Assignment:
    """shard, cost and assign for FCP; a baseline's own sharding and placement (DESIGN section 6) otherwise."""
    planner, num_ranks, block_size = options.planner, options.num_ranks, options.resolved_block_size
    if planner is Planner.FCP:
        # Zigzag gives every block of a sequence the same work and nearly the same traffic, which is what lets the
        # placement balance compute and traffic together (plain blocks carry about a third less traffic, but the
        # heavy last blocks of a long sequence leave it unbalanced: measured in benchmarks/balance.py).
        zigzag_on = options.zigzag is ZigzagMode.ON or (
            options.zigzag is ZigzagMode.AUTO and bool((pairs_chunks(batch) & batch.seq_causal
                                                        & (batch.lengths >= 2 * block_size)).any()))
        sharding = timer.run("shard", shard, batch, block_size, zigzag_on)
        tiles = timer.run("cost", cost, sharding, options.shape, options.profile)
        # The linear layers run on a rank's blocks only in the plan layout; in the user layout they run on the even
        # user chunks whatever the placement, which then weighs attention (and its reshuffle, by home ranks) alone.
        linear = LayerCosts.of(options.model, options.profile).linear_seconds_per_token * LINEAR_WEIGHT \
            if options.layout is Layout.PLAN else 0.0
        return timer.run("assign", assign, tiles, num_ranks, cap, BALANCE_TOLERANCE,
                         options.resolved_token_tolerance, linear)
    sharding, block_rank = timer.run("shard", BASELINES[planner], batch, num_ranks, block_size, cap)
    if planner is Planner.RING and ring_in_closed_form(sharding):
        tiles = timer.run("cost", ring_cost, sharding, block_rank, num_ranks, options.shape, options.profile)
    else:
        tiles = timer.run("cost", cost, sharding, options.shape, options.profile)
    rank_tokens = np.bincount(block_rank, weights=sharding.block_tokens, minlength=num_ranks)
    return timer.run("assign", Assignment, tiles=tiles, num_ranks=num_ranks,
                     token_cap=max(cap, int(rank_tokens.max())), block_rank=block_rank,
                     tile_rank=block_rank[tiles.tile_q_block])


def _header_fields(final: Reshuffle, options: CompileOptions, token_cap: int, digest: str) -> dict:
    schedule, rounds, transfers, sharding = final.schedule, final.rounds, final.transfers, final.sharding
    recv_buffer = 0
    if transfers.num_edges:
        edge_stage = schedule.forward.edge_stage
        num_stages = int(edge_stage.max()) + 1
        per_stage = np.bincount(transfers.edge_dst * num_stages + edge_stage, weights=transfers.edge_tokens)
        recv_buffer = int(per_stage.max())
    return dict(planner=options.planner.value, inputs_digest=digest, num_ranks=options.num_ranks,
                block_size=sharding.block_size,
                coalesce=options.coalesce, bwd_coalesce=schedule.backward.coalesce, token_cap=token_cap,
                zigzag=sharding.zigzag, mask=sharding.batch.mask,
                num_sequences=sharding.batch.num_sequences, total_tokens=sharding.batch.total_tokens,
                num_blocks=sharding.num_blocks, shape=options.shape, profile=options.profile, model=options.model_name,
                layout=options.layout, num_rounds=int(schedule.forward.edge_round.max(initial=-1)) + 1,
                **dict(zip(("nvlink_degree", "nic_degree"), transfers.class_degrees)),
                nvlink_lanes=rounds.nvlink_lanes,
                num_fwd_rounds=schedule.forward.num_rounds,
                num_bwd_rounds=schedule.backward.num_rounds, num_fwd_stages=schedule.forward.num_stages,
                num_bwd_stages=schedule.backward.num_stages, recv_buffer_tokens=recv_buffer,
                max_buffer_tokens=max_buffer_tokens(schedule), pipelined=options.pipelined,
                rounds_kind="matching" if options.matching_rounds else "arbitrary",
                reshuffle_overlap=options.reshuffle_overlap)

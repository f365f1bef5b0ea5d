"""compile_plan: run the passes in order, time each, and wrap the result."""

from __future__ import annotations

import hashlib
import json
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from fcp_compiler.errors import InvalidInputError
from fcp_compiler.format.safe_io import write_atomic
from fcp_compiler.format.inputs import (MAX_BATCH_TOKENS, PRESET_PROFILES, AttentionShape, BatchSpec, HardwareProfile,
                                 Layout, MaskKind, parse_batch)
from fcp_compiler.core.baselines import BASELINES, OWN_BLOCK_SIZE, Planner
from fcp_compiler.core.ir import Assignment, Batch, Reshuffle, ZigzagMode
from fcp_compiler.core.passes.assign import assign, default_token_cap
from fcp_compiler.core.passes.coalesce import coalesce, max_buffer_tokens
from fcp_compiler.core.passes.cost import RING_CLOSED_FORM_PAIRS, cost, count_segment_pairs, ring_cost
from fcp_compiler.core.passes.encode import encode
from fcp_compiler.core.passes.localize import group_nodes, localize
from fcp_compiler.core.passes.relay import relay
from fcp_compiler.core.passes.reshuffle import reshuffle
from fcp_compiler.core.passes.rounds import arbitrary_rounds, schedule_rounds
from fcp_compiler.core.passes.shard import shard
from fcp_compiler.core.passes.transfers import plan_transfers
from fcp_compiler.format.plan_format import FORMAT_VERSION, MAX_BLOCK_SIZE, MAX_RANKS, PlanReader, RankProgram
from fcp_compiler.core.stats import plan_stats

MAX_COALESCE = 2**16  # rounds per stage
# A rank may be 2% above the compute lower bound before tiles of heavy blocks are moved off their owner.
BALANCE_TOLERANCE = 0.02


@dataclass(frozen=True, slots=True, kw_only=True)
class CompileOptions:
    """Every parameter of a compile besides the batch. Defaults are the seed's setting."""

    num_ranks: int
    block_size: int = 4096
    coalesce: int = 16
    token_cap: int | None = None  # None: mean tokens per rank + one block
    # Relative excess over the mean tokens a rank may hold, where whole blocks allow (None: the cap alone). In the
    # plan layout every other layer works on a rank's own tokens; tighter token balance costs attention traffic.
    token_tolerance: float | None = None
    zigzag: ZigzagMode = ZigzagMode.AUTO
    layout: Layout = Layout.PLAN
    shape: AttentionShape = field(default_factory=AttentionShape)
    profile: HardwareProfile = field(default_factory=lambda: PRESET_PROFILES["h100"])
    # Ablations of the seed's techniques (DESIGN section 7); the defaults are the full system.
    pipelined: bool = True
    matching_rounds: bool = True
    reshuffle_overlap: bool = True

    def check(self) -> None:
        """Raise InvalidInputError naming the first parameter out of range."""
        if isinstance(self.num_ranks, bool) or not isinstance(self.num_ranks, int) or \
                not 1 <= self.num_ranks <= MAX_RANKS:
            raise InvalidInputError(f"--gpus {self.num_ranks!r} must be an integer from 1 to {MAX_RANKS}")
        if not isinstance(self.block_size, int) or not 64 <= self.block_size <= MAX_BLOCK_SIZE or self.block_size % 64:
            raise InvalidInputError(f"--block-size {self.block_size!r} must be a multiple of 64 from 64 to "
                                    f"{MAX_BLOCK_SIZE} (e.g. 1024, 2048, 4096)")
        if not isinstance(self.coalesce, int) or not 1 <= self.coalesce <= MAX_COALESCE:
            raise InvalidInputError(f"--coalesce {self.coalesce!r} must be an integer from 1 to {MAX_COALESCE}")
        if self.token_cap is not None and (not isinstance(self.token_cap, int) or
                                           not 1 <= self.token_cap <= MAX_BATCH_TOKENS):
            raise InvalidInputError(f"--token-cap {self.token_cap!r} must be an integer from 1 to "
                                    f"{MAX_BATCH_TOKENS}")
        if self.token_tolerance is not None and (
                isinstance(self.token_tolerance, bool) or not isinstance(self.token_tolerance, (int, float))
                or not 0.0 < self.token_tolerance < 1.0):
            raise InvalidInputError(f"--token-tolerance {self.token_tolerance!r} must be a number in (0, 1), "
                                    f"e.g. 0.02")


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


def inputs_digest(batch: Batch, options: CompileOptions, token_cap: int, planner: str) -> str:
    """sha256 of a canonical JSON of everything the plan depends on."""
    canonical = {
        "format_version": FORMAT_VERSION, "planner": planner, "lengths": batch.lengths.tolist(),
        "mask": batch.mask.value, "num_ranks": options.num_ranks, "block_size": options.block_size,
        "coalesce": options.coalesce, "token_cap": token_cap, "zigzag": options.zigzag.value,
        "layout": options.layout.value,
        "shape": options.shape.model_dump(mode="json"), "profile": options.profile.model_dump(mode="json"),
        "balance_tolerance": BALANCE_TOLERANCE, "pipelined": options.pipelined,
        "matching_rounds": options.matching_rounds, "reshuffle_overlap": options.reshuffle_overlap,
    }
    if options.token_tolerance is not None:  # absent by default, so earlier plans keep their digest
        canonical["token_tolerance"] = options.token_tolerance
    return hashlib.sha256(json.dumps(canonical, sort_keys=True, separators=(",", ":")).encode()).hexdigest()


class _PassTimer:
    def __init__(self) -> None:
        self.seconds: dict[str, float] = {}

    def run(self, name: str, function, *args, **kwargs):
        start = time.perf_counter()
        result = function(*args, **kwargs)
        self.seconds[name] = self.seconds.get(name, 0.0) + time.perf_counter() - start
        return result


def _to_batch(batch: BatchSpec | Sequence[int] | np.ndarray, mask: MaskKind | str | None) -> Batch:
    if isinstance(batch, BatchSpec):
        spec = batch if mask is None else BatchSpec(mask=MaskKind(mask), sequences=batch.sequences)
    else:
        lengths = batch.tolist() if isinstance(batch, np.ndarray) else list(batch)
        spec = parse_batch({"mask": MaskKind(mask or "causal").value, "sequences": lengths})
    return Batch(lengths=np.asarray(spec.sequences, dtype=np.int64), mask=spec.mask)


def _prepare(batch, gpus: int, *, block_size: int | None = None, coalesce_degree: int = 16,
             token_cap: int | None = None,
             token_tolerance: float | None = None, zigzag: ZigzagMode | str = "auto", layout: Layout | str = "plan",
             shape: AttentionShape | None = None, profile: HardwareProfile | str = "h100",
             mask: MaskKind | str | None = None, pipelined: bool = True, matching_rounds: bool = True,
             reshuffle_overlap: bool = True, planner: Planner | str = "fcp"):
    """Check and normalise compile_plan's arguments: (options, planner, batch, token cap)."""
    if isinstance(profile, str):
        from fcp_compiler.format.inputs import load_profile
        profile = load_profile(profile)
    try:
        zigzag_mode = ZigzagMode(zigzag)
    except ValueError:
        raise InvalidInputError(f"zigzag {zigzag!r} must be one of auto, on, off") from None
    try:
        the_layout = Layout(layout)
    except ValueError:
        raise InvalidInputError(f"layout {layout!r} must be one of plan, user") from None
    try:
        planner = Planner(planner)
    except ValueError:
        raise InvalidInputError(f"planner {planner!r} must be one of {', '.join(p.value for p in Planner)}") from None
    if block_size is not None and planner in OWN_BLOCK_SIZE:
        raise InvalidInputError(f"--block-size {block_size!r} does not apply to --planner {planner.value}: it shards "
                                f"each sequence over ranks and sizes its blocks itself; leave --block-size out")
    block_size = 4096 if block_size is None else block_size
    options = CompileOptions(num_ranks=gpus, block_size=block_size, coalesce=coalesce_degree, token_cap=token_cap,
                             token_tolerance=token_tolerance, zigzag=zigzag_mode, layout=the_layout,
                             shape=shape or AttentionShape(), profile=profile,
                             pipelined=pipelined, matching_rounds=matching_rounds,
                             reshuffle_overlap=reshuffle_overlap)
    options.check()
    the_batch = _to_batch(batch, mask)
    cap = token_cap if token_cap is not None else default_token_cap(the_batch.total_tokens, gpus, block_size)
    return options, planner, the_batch, cap


def plan_digest(batch, gpus: int, **compile_options) -> str:
    """The inputs digest compile_plan would record for these arguments, without compiling (for caches).

    Raises:
        InvalidInputError: as compile_plan.
    """
    options, planner, the_batch, cap = _prepare(batch, gpus, **compile_options)
    return inputs_digest(the_batch, options, cap, planner.value)


def compile_plan(batch: BatchSpec | Sequence[int] | np.ndarray, gpus: int, *, block_size: int | None = None,
                 coalesce_degree: int = 16, token_cap: int | None = None,
                 token_tolerance: float | None = None, zigzag: ZigzagMode | str = "auto",
                 layout: Layout | str = "plan", shape: AttentionShape | None = None,
                 profile: HardwareProfile | str = "h100",
                 mask: MaskKind | str | None = None, pipelined: bool = True, matching_rounds: bool = True,
                 reshuffle_overlap: bool = True, planner: Planner | str = "fcp") -> CompiledPlan:
    """Compile a batch into a per-rank execution plan.

    Runs shard, cost, assign, plan_transfers, schedule_rounds, coalesce, reshuffle and encode, timing each.

    Args:
        batch: a BatchSpec, or a list/array of lengths (causal unless `mask` says otherwise).
        gpus: number of ranks N.
        block_size: tokens per block, a positive multiple of 64 (default 4096); refused for the baselines that
            size their own blocks (ring, bytescale, wlbllm).
        coalesce_degree: rounds per stage.
        token_cap: most tokens per rank (default: mean + one block).
        token_tolerance: keep every rank within (1 + token_tolerance) x the mean tokens where whole blocks allow
            (default: only the cap); for the plan layout's linear layers, at some cost in attention traffic.
        zigzag: "auto" (on for causal batches with a sequence of two blocks or more), "on" or "off".
        layout: "plan" (the default: tokens are dispatched once into the plan's layout and every layer works there)
            or "user" (attention reshuffles from and to contiguous user-layout chunks); recorded in the header.
        shape: attention shape (default: 64 query heads, 8 KV heads, head_dim 128, bf16).
        profile: a preset name or a HardwareProfile.
        mask: override of the batch's mask kind.
        pipelined, matching_rounds, reshuffle_overlap: switch off block-level pipelining, congestion-free rounds
            (pulls in edge order instead; the plan then fails validation) or the overlap of the reshuffle with
            local tiles, to measure what each is worth (fcp ablate).
        planner: fcp, or a baseline in the same format: ring, bytescale, wlbllm, magi (DESIGN section 6).
    Returns:
        the CompiledPlan (bytes, per-rank access, stats).
    Raises:
        InvalidInputError: a bad length or parameter (named).
        InfeasibleError: a token cap no placement can meet.
    """
    total_start = time.perf_counter()
    timer = _PassTimer()
    options, planner, the_batch, cap = timer.run(
        "parse", _prepare, batch, gpus, block_size=block_size, coalesce_degree=coalesce_degree, token_cap=token_cap,
        token_tolerance=token_tolerance,
        zigzag=zigzag, layout=layout, shape=shape, profile=profile, mask=mask, pipelined=pipelined,
        matching_rounds=matching_rounds, reshuffle_overlap=reshuffle_overlap, planner=planner)
    assignment = _place(timer, planner, the_batch, options, cap)
    if planner is Planner.FCP and options.layout is Layout.PLAN:
        # Grouping ranks into nodes needs the traffic, and renumbering the pulls is cheaper than listing them again.
        transfers = timer.run("plan_transfers", plan_transfers, assignment)
        transfers = timer.run("localize", group_nodes, transfers)
        assignment = transfers.assignment
    else:
        assignment = timer.run("localize", localize, assignment)
        transfers = timer.run("plan_transfers", plan_transfers, assignment)
    rounds = timer.run("schedule_rounds", schedule_rounds if matching_rounds else arbitrary_rounds, transfers)
    schedule = timer.run("coalesce", coalesce, rounds, coalesce_degree, pipelined)
    if planner is Planner.FCP and matching_rounds:  # baselines keep their systems' star-shaped senders
        schedule = timer.run("relay", relay, schedule)
    final = timer.run("reshuffle", reshuffle, schedule)
    header_fields = _header_fields(final, options, assignment.token_cap,
                                   inputs_digest(the_batch, options, cap, planner.value), planner.value)
    data = timer.run("encode", encode, final, header_fields)
    compile_seconds = time.perf_counter() - total_start
    stats = plan_stats(final, data, compile_seconds, timer.seconds, options.layout.value)
    return CompiledPlan(data=data, ir=final, stats=stats, _reader=PlanReader(data))


def _place(timer: _PassTimer, planner: Planner, batch: Batch, options: CompileOptions, cap: int) -> Assignment:
    """shard, cost and assign for FCP; a baseline's own sharding and placement (DESIGN section 6) otherwise."""
    num_ranks, block_size = options.num_ranks, options.block_size
    if planner is Planner.FCP:
        # Zigzag gives every block of a sequence the same work and nearly the same traffic, which is what lets the
        # placement balance compute and traffic together (plain blocks carry about a third less traffic, but the
        # heavy last blocks of a long sequence leave it unbalanced: measured in benchmarks/balance.py).
        zigzag_on = options.zigzag is ZigzagMode.ON or (
            options.zigzag is ZigzagMode.AUTO and batch.causal and bool((batch.lengths >= 2 * block_size).any()))
        sharding = timer.run("shard", shard, batch, block_size, zigzag_on)
        tiles = timer.run("cost", cost, sharding, options.shape, options.profile)
        return timer.run("assign", assign, tiles, num_ranks, cap, BALANCE_TOLERANCE, options.token_tolerance)
    sharding, block_rank = timer.run("shard", BASELINES[planner], batch, num_ranks, block_size, cap)
    if planner is Planner.RING and count_segment_pairs(sharding) > RING_CLOSED_FORM_PAIRS:
        tiles = timer.run("cost", ring_cost, sharding, block_rank, num_ranks, options.shape, options.profile)
    else:
        tiles = timer.run("cost", cost, sharding, options.shape, options.profile)
    rank_tokens = np.bincount(block_rank, weights=sharding.block_tokens, minlength=num_ranks)
    return timer.run("assign", Assignment, tiles=tiles, num_ranks=num_ranks,
                     token_cap=max(cap, int(rank_tokens.max())), block_rank=block_rank,
                     tile_rank=block_rank[tiles.tile_q_block])


def _header_fields(final: Reshuffle, options: CompileOptions, token_cap: int, digest: str, planner: str) -> dict:
    schedule, rounds, transfers, sharding = final.schedule, final.rounds, final.transfers, final.sharding
    recv_buffer = 0
    if transfers.num_edges:
        edge_stage = schedule.forward.edge_stage
        num_stages = int(edge_stage.max()) + 1
        per_stage = np.bincount(transfers.edge_dst * num_stages + edge_stage, weights=transfers.edge_tokens)
        recv_buffer = int(per_stage.max())
    return dict(planner=planner, inputs_digest=digest, num_ranks=options.num_ranks, block_size=sharding.block_size,
                coalesce=options.coalesce, bwd_coalesce=schedule.backward.coalesce, token_cap=token_cap,
                zigzag=sharding.zigzag, mask=sharding.batch.mask,
                num_sequences=sharding.batch.num_sequences, total_tokens=sharding.batch.total_tokens,
                num_blocks=sharding.num_blocks, shape=options.shape, profile=options.profile,
                layout=options.layout, num_rounds=rounds.num_rounds, num_fwd_rounds=schedule.forward.num_rounds,
                num_bwd_rounds=schedule.backward.num_rounds, num_fwd_stages=schedule.forward.num_stages,
                num_bwd_stages=schedule.backward.num_stages, recv_buffer_tokens=recv_buffer,
                max_buffer_tokens=max_buffer_tokens(schedule), pipelined=options.pipelined,
                rounds_kind="matching" if options.matching_rounds else "arbitrary",
                reshuffle_overlap=options.reshuffle_overlap)

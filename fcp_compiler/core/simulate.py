"""Simulation of a compiled plan: each rank's layer (linear layers around attention) forward and backward, on the
timing model of :mod:`fcp_compiler.algorithms.timeline`, beside the certified lower bound; figures and Chrome traces.

It reads what the runtime reads (the plan file) and charges what the runtime runs: one launch per kernel call, as
:func:`kernel_calls` counts them, and the data the runtime moves outside the kernels on the range path
(:mod:`fcp_compiler.format.traffic`: packed sends, accumulators zeroed, pushes landed) at the profile's HBM bandwidth,
on the compute stream of the stage that moves it (each pass's inputs to the timing model are built in
:mod:`fcp_compiler.core.pass_inputs`). The compiler's floor (:mod:`fcp_compiler.core.floor`) scores its candidates
with it.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

import numpy as np

from fcp_compiler.format.inputs import HardwareProfile, Layout
from fcp_compiler.format.models import NO_MODEL, ModelPreset, load_model
from fcp_compiler.core.ir import Batch, Reshuffle, Sharding, TileSet
from fcp_compiler.core.launches import busy_lower_bound, coalesced_seconds, kernel_calls, pair_kinds
from fcp_compiler.core.pass_inputs import pass_inputs
from fcp_compiler.core.passes.encode import rank_columns
from fcp_compiler.core.plan_memory import stack_plan
from fcp_compiler.algorithms.pages import base_pages
from fcp_compiler.algorithms.timeline import TRACKS, LinkModel, PassInput, PassResult, critical_path, simulate_pass
from fcp_compiler.algorithms.visibility import visible_pairs
from fcp_compiler.core.passes.cost import cost, ring_cost, ring_in_closed_form, tile_efficiency
from fcp_compiler.format.plan_format import PlanReader
from fcp_compiler.format.stacked import StackedRanks, stack_reader
from fcp_compiler.core.layer_model import (BACKWARD_LINEAR_WORK, BACKWARD_WORK, LayerCosts, layer_bounds,
                                          longest_segments)

# Re-exported: the figures' kernel launches (core.launches) are read from here by the benchmarks and the floor.
__all__ = ["HeldPlan", "LAYER_STATS", "Simulation", "busy_lower_bound", "coalesced_seconds", "kernel_calls",
           "layer_stats", "link_model", "pair_kinds", "simulate_plan", "write_trace"]


def link_model(profile: HardwareProfile, num_ranks: int) -> LinkModel:
    """The timing model's links for `num_ranks` GPUs of `profile`."""
    return LinkModel(node_of_rank=np.arange(num_ranks) // profile.gpus_per_node,
                     intra_bytes_per_s=profile.nvlink_gbps * 1e9, inter_bytes_per_s=profile.network_gbps * 1e9,
                     latency_s=profile.latency_us * 1e-6, launch_s=profile.launch_us * 1e-6,
                     sm_fraction=profile.comm_sm_fraction)


@dataclass(frozen=True, slots=True, kw_only=True)
class Simulation:
    """Figures of a simulated plan (docs/DESIGN.md section 5) and, when recorded, its Chrome trace events.

    forward and backward are attention alone, from time 0 on every rank. layer_forward and layer_backward are each
    rank's own layer (:mod:`fcp_compiler.core.layer_model`): its linear layers before attention, its attention
    (whose messages wait for both ends' linear layers), then its linear layers after; without a model they are the
    attention passes.
    """

    forward: PassResult
    backward: PassResult
    layer_forward: PassResult
    layer_backward: PassResult
    phases: dict  # per rank, linear seconds before and after attention in each pass (LayerCosts.phases)
    bounds: dict  # {"fwd": ..., "bwd": ...}: the certified lower bounds on each pass's layer makespan
    model: ModelPreset | None
    flops_fwd: float
    single_gpu_efficiency: float
    peak_flops: float
    num_ranks: int
    planned_compute: np.ndarray  # per rank, the compiler's tile-by-tile cost (what its balance figures use)
    layout: str = "plan"
    rank_tokens: np.ndarray | None = None  # tokens each rank's linear layers see in the plan's layout
    kv_prefetch: bool = False  # each pass's stage-0 K,V pulls left early (forward: K, V projected before Q)
    # Per rank, the device memory each pass peaks at (the plan header's, by the memory account), and its budget.
    peak_bytes: dict | None = None
    memory_budget_bytes: int | None = None
    # Per pass, the bytes each rank's runtime moves outside the kernels (fcp_compiler.format.traffic; charged on its
    # compute stream at hbm_bytes_per_s).
    moved_bytes: dict | None = None
    hbm_bytes_per_s: float = 0.0

    @property
    def layer_end_fwd(self) -> np.ndarray:
        """When each rank finishes its forward layer."""
        return self.layer_forward.end + self.phases["fwd_after"]

    @property
    def layer_end_bwd(self) -> np.ndarray:
        """When each rank finishes its backward layer (from the start of the backward)."""
        return self.layer_backward.end + self.phases["bwd_after"]

    def layer_figures(self) -> dict:
        """One transformer layer of the model around this attention, rank by rank: makespans, MFU (and normalised
        by what one GPU reaches on the same work with one sequence per GPU), the lower bound and the gap to it."""
        layer_fwd, layer_bwd = float(self.layer_end_fwd.max()), float(self.layer_end_bwd.max())
        linear_fwd = self.phases["fwd_before"] + self.phases["fwd_after"]
        linear_flops = (float(self.rank_tokens.sum()) * self.model.linear_flops_per_token if self.model else 0.0)
        useful = linear_flops * (1 + BACKWARD_LINEAR_WORK) + self.flops_fwd * (1 + BACKWARD_WORK)
        one_gpu_seconds = (float(linear_fwd.sum()) * (1 + BACKWARD_LINEAR_WORK) + self.flops_fwd * (1 + BACKWARD_WORK)
                           / (self.peak_flops * self.single_gpu_efficiency))
        total = layer_fwd + layer_bwd
        layer_mfu = useful / (self.num_ranks * self.peak_flops * total) if total > 0 else 0.0
        one_gpu_efficiency = useful / (self.peak_flops * one_gpu_seconds) if one_gpu_seconds > 0 else 1.0
        bound_fwd, bound_bwd = self.bounds["fwd"]["bound_s"], self.bounds["bwd"]["bound_s"]
        return {"model": self.model.name if self.model else NO_MODEL, "layout": self.layout,
                "kv_prefetch": self.kv_prefetch,
                "reshuffle_fwd_s": self.forward.reshuffle, "reshuffle_bwd_s": self.backward.reshuffle,
                "linear_fwd_s": float(linear_fwd.max()),
                "linear_bwd_s": float(linear_fwd.max()) * BACKWARD_LINEAR_WORK,
                "layer_makespan_fwd_s": layer_fwd, "layer_makespan_bwd_s": layer_bwd, "layer_mfu": layer_mfu,
                "normalized_layer_mfu": layer_mfu / one_gpu_efficiency,
                "layer_makespan_lower_bound_fwd_s": bound_fwd, "layer_makespan_lower_bound_bwd_s": bound_bwd,
                "layer_gap_fwd": layer_fwd / bound_fwd if bound_fwd > 0 else 1.0,
                "layer_gap_bwd": layer_bwd / bound_bwd if bound_bwd > 0 else 1.0,
                "layer_bound_terms": self.bounds}

    def figures(self) -> dict:
        """The --json of fcp simulate. The critical paths are None where the stage times were not kept
        (simulate_plan(attention_alone=False), the floor's scoring)."""
        fwd, bwd = self.forward.makespan, self.backward.makespan
        mfu_fwd = self.flops_fwd / (self.num_ranks * self.peak_flops * fwd) if fwd > 0 else 0.0
        mfu_bwd = BACKWARD_WORK * self.flops_fwd / (self.num_ranks * self.peak_flops * bwd) if bwd > 0 else 0.0
        layer_fwd, layer_bwd = self.layer_end_fwd, self.layer_end_bwd
        # A rank's compute stream in its layer: its linear layers and its attention (what its trace track shows).
        layer_busy = {key: getattr(self, f"layer_{name}").busy + self.phases[f"{key}_before"]
                      + self.phases[f"{key}_after"] for key, name in (("fwd", "forward"), ("bwd", "backward"))}
        per_rank = [{"rank": r, "tokens": int(self.rank_tokens[r]), "layer_end_fwd_s": float(layer_fwd[r]),
                     "layer_end_bwd_s": float(layer_bwd[r]), "layer_busy_fwd_s": float(layer_busy["fwd"][r]),
                     "layer_busy_bwd_s": float(layer_busy["bwd"][r]),
                     "busy_fwd_s": float(self.forward.busy[r]), "busy_bwd_s": float(self.backward.busy[r]),
                     "eta_fwd": float(self.forward.end[r] / self.forward.compute[r]) if self.forward.compute[r]
                     else 0.0,
                     "eta_bwd": float(self.backward.end[r] / self.backward.compute[r]) if self.backward.compute[r]
                     else 0.0,
                     **({f"peak_bytes_{key}": int(self.peak_bytes[key][r]) for key in ("fwd", "bwd")}
                        if self.peak_bytes else {}),
                     **({f"moved_bytes_{key}": float(self.moved_bytes[key][r]) for key in ("fwd", "bwd")}
                        if self.moved_bytes else {})} for r in range(self.num_ranks)]
        memory = {f"peak_bytes_{key}": int(max(self.peak_bytes[key])) for key in ("fwd", "bwd")} \
            if self.peak_bytes else {}
        if self.moved_bytes:  # the busiest rank's data movement outside the kernels, and what it is charged
            memory |= {f"moved_bytes_{key}": float(self.moved_bytes[key].max(initial=0.0)) for key in ("fwd", "bwd")}
            memory["hbm_bytes_per_s"] = self.hbm_bytes_per_s
        return {
            "makespan_fwd_s": fwd, "makespan_bwd_s": bwd,
            "attention_mfu_fwd": mfu_fwd, "attention_mfu_bwd": mfu_bwd,
            "normalized_mfu_fwd": mfu_fwd / self.single_gpu_efficiency,
            "normalized_mfu_bwd": mfu_bwd / self.single_gpu_efficiency,
            "single_gpu_efficiency": self.single_gpu_efficiency,
            **self._exposure(),
            "compute_lower_bound_fwd_s": float(self.forward.compute.sum() / self.num_ranks),
            **memory, "memory_budget_bytes": self.memory_budget_bytes,
            **self.layer_figures(),
            # Why the layer's attention ends when it does: the path through the stages (timeline.critical_path).
            **{f"critical_path_{key}": critical_path(result.stages) if result.stages is not None else None
               for key, result in (("fwd", self.layer_forward), ("bwd", self.layer_backward))},
            "per_rank": per_rank,
        }

    def _exposure(self) -> dict:
        """Each attention pass's communication not hidden under compute (docs/DESIGN.md section 5): its makespan less
        the computing on its critical path, i.e. the path's message time plus, in the user layout, the reshuffles
        it waits for (exposed_comm_*_s, None where stage times were not kept), and its share of the makespan; beside
        it the most time any one rank is idle in the pass (max_rank_idle_*_s), which also counts a lightly loaded
        rank waiting for the rest."""
        figures = {}
        for key, result in (("fwd", self.forward), ("bwd", self.backward)):
            exposed = max(result.makespan - critical_path(result.stages)["computing_s"], 0.0) \
                if result.stages is not None else None
            figures[f"exposed_comm_{key}_s"] = exposed
            figures[f"exposed_comm_share_{key}"] = exposed / result.makespan if exposed is not None and \
                result.makespan > 0 else None
            figures[f"max_rank_idle_{key}_s"] = float(np.max(result.end - result.busy))
        return figures

    def chrome_trace(self) -> dict:
        """Chrome trace events (Perfetto opens them): a process per rank; compute, send and receive tracks."""
        meta = []
        for rank in range(self.num_ranks):
            meta.append({"name": "process_name", "ph": "M", "pid": rank, "args": {"name": f"rank {rank}"}})
            for (label, track), tid in TRACKS.items():
                meta.append({"name": "thread_name", "ph": "M", "pid": rank, "tid": tid,
                             "args": {"name": f"{label} {track}"}})
        events = self.layer_forward.events + self.layer_backward.events
        return {"traceEvents": meta + events, "displayTimeUnit": "ms"}


@base_pages()
def simulate_plan(source, profile: HardwareProfile | None = None, record: bool = False,
                  model: str | None = None, attention_alone: bool = True,
                  kv_prefetch: bool | None = None) -> Simulation:
    """Simulate a plan on a hardware profile (default: the one it was compiled for).

    Args:
        source: plan file, bytes, reader, or a CompiledPlan (whose tile costs are reused when the profile is the
            one it was compiled for).
        profile: hardware to simulate on.
        record: keep Chrome trace events (tiles named by block and stage, messages by kind and block, each rank's
            linear layers).
        model: the layer around attention, a preset name or "none" (default: the one the plan was compiled for).
        attention_alone: also simulate each pass's attention alone, from time 0 on every rank (what
            Simulation.figures reports beside the layer, with each pass's critical path). False, for callers that
            read only layer_figures (the floor scores every candidate by them): forward and backward are then the
            layer passes, whose reshuffle times (all layer_figures reads of them) are the same, and no stage times
            are kept.
        kv_prefetch: whether the runtime posts each pass's stage-0 K,V pulls early, the forward's once K and V are
            projected, before Q, the backward's as the layer's backward starts (fcp_runtime.prefetch_kv; the plan
            layout, with a model, only); default: what the plan was compiled for (header.kv_prefetch).
    Returns:
        the Simulation.
    Raises:
        InvalidInputError: an unknown model name.
    """
    read = _read_with_costs(source, profile)
    header, tables, stacked, profile, tiles, final = (read.header, read.tables, read.stacked, read.profile, read.tiles,
                                                      read.final)
    n = header.num_ranks
    held = isinstance(source, HeldPlan) and tiles is source.tiles
    inputs = pass_inputs(header, stacked, tiles, profile, record, source.pairs if held else None,
                         source.kinds if held else None, final)
    fwd_input, bwd_input = inputs.forward, inputs.backward
    links = link_model(profile, n)
    layer_model = load_model(header.model if model is None else model)
    rank_tokens = _layer_tokens(header, tables, stacked)
    phases = LayerCosts.of(layer_model, profile).phases(rank_tokens)
    prefetch = header.kv_prefetch if kv_prefetch is None else kv_prefetch
    # Attention alone has no projection to overlap.
    kv_ready = phases["fwd_kv"] if prefetch and header.layout is Layout.PLAN and layer_model is not None else None
    (forward, backward), (layer_forward, layer_backward) = _simulate_passes(
        fwd_input, bwd_input, links, header.reshuffle_overlap, phases, record, layer_model, attention_alone, kv_ready)
    batch = Batch(lengths=tables.seq_lengths, windows=tables.seq_window)
    return Simulation(forward=forward, backward=backward, layer_forward=layer_forward,
                      layer_backward=layer_backward, phases=phases, model=layer_model,
                      bounds=layer_bounds(batch, header.shape, profile, layer_model, n, header.token_cap,
                                         longest_segments(tables.seg_seq, tables.seg_end - tables.seg_start,
                                                          tables.seq_lengths.size)),
                      flops_fwd=float(tiles.tile_flops.sum()),
                      single_gpu_efficiency=_single_gpu_efficiency(tables.seq_lengths, tables.seq_window, profile),
                      peak_flops=profile.peak_tflops * 1e12, num_ranks=n, planned_compute=inputs.planned_compute,
                      layout=header.layout.value, rank_tokens=rank_tokens,
                      kv_prefetch=kv_ready is not None,
                      peak_bytes={"fwd": header.max_buffer_bytes_fwd, "bwd": header.max_buffer_bytes_bwd},
                      memory_budget_bytes=header.memory_budget_bytes, moved_bytes=inputs.moved_bytes,
                      hbm_bytes_per_s=profile.hbm_gbps * 1e9)


def _simulate_passes(fwd_input: PassInput, bwd_input: PassInput, links: LinkModel, overlap: bool, phases: dict,
                     record: bool, layer_model: ModelPreset | None, attention_alone: bool,
                     kv_ready: np.ndarray | None) -> tuple[tuple[PassResult, PassResult], tuple[PassResult, PassResult]]:
    """The attention passes and the layer passes of :func:`simulate_plan`: ((forward, backward), (layer forward,
    layer backward)); without `attention_alone` (and with a model) the attention passes are the layer's."""
    # Attention alone is recorded only when there is no layer around it to record.
    attention_record = record and layer_model is None
    # The layer passes keep their stage times for the critical path (Simulation.figures) in a full simulation.
    if layer_model is not None and not attention_alone:
        layer = _layer_passes(fwd_input, bwd_input, links, overlap, phases, record, stage_times=False,
                              kv_ready=kv_ready)
        return layer, layer
    # Stage times kept for each pass's critical path: the makespan less its computing is the exposed communication.
    forward = simulate_pass(fwd_input, links, overlap, attention_record, 0.0, "fwd", stage_times=True)
    backward = simulate_pass(bwd_input, links, overlap, attention_record, forward.makespan, "bwd", stage_times=True)
    if layer_model is None:  # attention alone is then the layer
        return (forward, backward), (forward, backward)
    return (forward, backward), _layer_passes(fwd_input, bwd_input, links, overlap, phases, record,
                                              stage_times=True, kv_ready=kv_ready)


def _layer_passes(fwd_input: PassInput, bwd_input: PassInput, links: LinkModel, overlap: bool, phases: dict,
                  record: bool, stage_times: bool,
                  kv_ready: np.ndarray | None = None) -> tuple[PassResult, PassResult]:
    """Each pass again with every rank starting when its linear layers before attention end (its messages waiting
    for both ends'); the backward starts when the last rank has finished its forward layer. Where `kv_ready` is
    given (K,V prefetch: when each rank has projected K and V, before Q), the forward's stage-0 K,V pulls leave
    once both ends are there, and the backward's as the backward starts (during the MLP and O projection's
    gradients)."""
    forward = simulate_pass(fwd_input, links, overlap, record, 0.0, "fwd", rank_start=phases["fwd_before"],
                            stage_times=stage_times, prefetch_start=kv_ready)
    # The backward's are posted as the layer's backward starts: K and V are the forward's.
    backward = simulate_pass(bwd_input, links, overlap, record, float((forward.end + phases["fwd_after"]).max()),
                             "bwd", rank_start=phases["bwd_before"], stage_times=stage_times,
                             prefetch_start=None if kv_ready is None else np.zeros_like(kv_ready))
    if record:
        _linear_events(forward, backward, phases, kv_ready)
    return forward, backward


LAYER_STATS = ("layer_makespan_fwd_s", "layer_makespan_bwd_s", "layer_gap_fwd", "layer_gap_bwd", "layer_mfu",
               "normalized_layer_mfu")


def layer_seconds(figures: dict) -> float:
    """A plan's simulated layer time, forward plus backward, from its layer figures (:meth:`Simulation.layer_figures`,
    :func:`layer_stats`, or a stats row holding both makespans): what the floor, the byte budget and the finishing
    variants compare plans by."""
    return figures["layer_makespan_fwd_s"] + figures["layer_makespan_bwd_s"]


def layer_stats(plan) -> dict:
    """The simulated layer figures `fcp compile` adds to a plan's stats: each pass's layer makespan, its gap to the
    certified lower bound, and layer MFU (plain and normalised), for the model the plan was compiled for."""
    figures = simulate_plan(plan, attention_alone=False).layer_figures()
    return {name: figures[name] for name in LAYER_STATS}


def _linear_events(forward: PassResult, backward: PassResult, phases: dict, kv_ready: np.ndarray | None) -> None:
    """Each rank's linear layers on its compute track, before and after its attention, in both passes; with K,V
    prefetch (`kv_ready`) the forward's projection of K, V apart from Q's, the prefetched pulls leaving between."""
    backward_offset = float((forward.end + phases["fwd_after"]).max())
    for result, label, offset in ((forward, "fwd", 0.0), (backward, "bwd", backward_offset)):
        track = TRACKS[(label, "compute")]
        for rank in range(result.end.size):
            before, after = float(phases[f"{label}_before"][rank]), float(phases[f"{label}_after"][rank])
            split = float(kv_ready[rank]) if kv_ready is not None and label == "fwd" else 0.0
            for name, ts, dur in (("K, V projection", offset, split),
                                  ("linear before attention" if not split else "Q projection", offset + split,
                                   before - split),
                                  ("linear after attention", offset + float(result.end[rank]), after)):
                if dur > 0:
                    result.events.append({"name": name, "ph": "X", "ts": ts * 1e6, "dur": dur * 1e6, "pid": rank,
                                          "tid": track})


@dataclass(frozen=True, slots=True, kw_only=True)
class HeldPlan:
    """A plan as the compiler holds it, not encoded: every rank's arrays stacked as the encoder lays them out
    (core.plan_memory.stack_plan) and its tiles, costed on its own profile. The floor simulates its candidates so,
    since only the plan it keeps is written."""

    stacked: StackedRanks
    tiles: TileSet
    pairs: tuple | None = None  # tiles.segment_pairs(), where the holder keeps them for several plans of one tile set
    kinds: tuple | None = None  # pair_kinds(tiles, pairs), likewise
    final: Reshuffle | None = None  # its IR (whose tiles are `tiles`), where held: its tiles are read from it


@dataclass(frozen=True, slots=True, kw_only=True)
class _CostedPlan:
    """A plan read for simulation: its ranks stacked (with their header and tables), the profile it is simulated on,
    its tiles costed on that profile, and its IR where the source holds one (else None)."""

    stacked: StackedRanks
    profile: HardwareProfile
    tiles: TileSet
    final: Reshuffle | None

    @property
    def header(self):
        return self.stacked.header

    @property
    def tables(self):
        return self.stacked.tables


def _read_with_costs(source, profile: HardwareProfile | None) -> _CostedPlan:
    """The plan read for simulation (:class:`_CostedPlan`): its ranks stacked, and its tiles costed on
    `profile` (default: the plan's own; a CompiledPlan's or a HeldPlan's costs are reused on its own profile, and its
    tiles then read from its IR where it is held). A CompiledPlan is read from its IR, as the encoder lays it out,
    not decoded from its bytes (a 4096-rank plan is 100 MB), and its tile rows are not stacked where its IR gives
    them (millions at small blocks: the user layout's reshuffle overlap reads them)."""
    final = None
    if isinstance(source, HeldPlan):
        stacked, compiled_tiles, final = source.stacked, source.tiles, source.final
    elif hasattr(source, "ir") and hasattr(source, "to_bytes"):  # a CompiledPlan: its IR and tile costs, not its bytes
        final, header = source.ir, source.header
        tile_rows = header.layout is Layout.USER or (profile or header.profile) != final.tiles.profile
        stacked, compiled_tiles = stack_plan(final, header, rank_columns(final, tile_rows=tile_rows)), final.tiles
    else:
        compiled_tiles = None
        reader = source if isinstance(source, PlanReader) else PlanReader(source)
        # Read end to end, whole-block pulls written out once for all ranks (no rank decoded on its own).
        stacked = stack_reader(reader)
    header, tables = stacked.header, stacked.tables
    profile = profile or header.profile
    if compiled_tiles is not None and compiled_tiles.profile == profile:
        return _CostedPlan(stacked=stacked, profile=profile, tiles=compiled_tiles, final=final)
    sharding = Sharding(batch=Batch(lengths=tables.seq_lengths, windows=tables.seq_window),
                        block_size=header.block_size, zigzag=header.zigzag, seg_block=tables.seg_block,
                        seg_seq=tables.seg_seq, seg_start=tables.seg_start, seg_end=tables.seg_end)
    return _CostedPlan(stacked=stacked, profile=profile, tiles=_tile_costs(header, sharding, stacked, profile),
                       final=None)


def _tile_costs(header, sharding: Sharding, stacked: StackedRanks, profile: HardwareProfile):
    """The plan's tiles costed on `profile`: in closed form for a ring where the compiler costs it so, else pair
    by pair."""
    if header.planner == "ring" and ring_in_closed_form(sharding):
        held, held_rank = stacked.arrays["blocks"], stacked.rank_of("blocks")
        block_rank = np.empty(header.num_blocks, dtype=np.int64)
        block_rank[held] = held_rank
        return ring_cost(sharding, block_rank, header.num_ranks, header.shape, profile)
    return cost(sharding, header.shape, profile)


def _single_gpu_efficiency(lengths: np.ndarray, windows: np.ndarray, profile: HardwareProfile) -> float:
    """The efficiency one GPU reaches on the batch's work with one sequence per GPU (normalised MFU's divisor),
    each sequence's visible pairs under its own mask."""
    pairs = visible_pairs(0, lengths, 0, lengths, windows).astype(np.float64)
    return float(pairs.sum() / (pairs / tile_efficiency(profile, lengths.astype(np.float64))).sum())


def _layer_tokens(header, tables, stacked: StackedRanks) -> np.ndarray:
    """Tokens each rank's linear layers see: the user layout's even chunks, or the plan layout's blocks."""
    n = header.num_ranks
    if header.layout is Layout.USER:
        return np.diff((np.arange(n + 1) * header.total_tokens) // n).astype(np.float64)
    held, held_rank = stacked.arrays["blocks"], stacked.rank_of("blocks")
    block_tokens = np.bincount(tables.seg_block, weights=tables.seg_end - tables.seg_start,
                               minlength=header.num_blocks)
    return np.bincount(held_rank, weights=block_tokens[held], minlength=n)


def write_trace(simulation: Simulation, path) -> None:
    """Write the Chrome trace JSON atomically."""
    from fcp_compiler.format.safe_io import write_atomic

    write_atomic(path, json.dumps(simulation.chrome_trace()).encode())

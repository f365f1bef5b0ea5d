"""FCP against the baselines across scales (the seed's figures 9 to 12), and the block-size sweep."""

from __future__ import annotations

from collections.abc import Callable, Sequence

from fcp_compiler.core.baselines import OWN_BLOCK_SIZE, Planner
from fcp_compiler.core.options import CompileOptions
from fcp_compiler.core.pipeline import compile_plan, memory_budget_tokens
from fcp_compiler.errors import InfeasibleError
from fcp_compiler.format.validate import validate_plan
from fcp_compiler.tools.parallel import map_on_cores
from fcp_compiler.tools.report import kept_candidate
from fcp_compiler.core.simulate import layer_seconds, simulate_plan


_CONTEXT: dict = {}  # batch_for and the base CompileOptions, inherited by forked workers
FCP_USER = "fcp-user"  # FCP compiled for the user layout (reshuffle around attention), beside its plan layout


FIGURES = ("compute_imbalance", "comm_imbalance", "total_comm_bytes", "max_rank_comm_bytes", "num_rounds",
           "normalized_mfu_fwd", "normalized_mfu_bwd", "makespan_fwd_s", "makespan_bwd_s", "compile_seconds",
           "layer_makespan_fwd_s", "layer_makespan_bwd_s", "layer_gap_fwd", "layer_gap_bwd", "normalized_layer_mfu")
LAYER_FIGURES = ("layer_makespan_fwd_s", "layer_makespan_bwd_s", "layer_gap_fwd", "layer_gap_bwd",
                 "normalized_layer_mfu")


def _one(job: tuple[int, str]) -> dict:
    gpus, method = job
    batch_for, base = _CONTEXT["batch_for"], _CONTEXT["options"]
    batch = batch_for(gpus)
    planner, layout = (Planner.FCP, "user") if method == FCP_USER else (Planner(method), "plan")
    # A baseline is scored at its better node fan-out variant (its system may ship either), unless the options fix
    # one; FCP's floor already tries both.
    switches = [base.node_fan_out] if planner is Planner.FCP or base.node_fan_out is not None else [True, False]
    best = None
    for switch in switches:
        try:
            # Every method is held to the segment pairs fcp validates: past them (a ring over hundreds of GPUs on a
            # long-tail batch) a plan's memory grows with its pairs (a ring at 256 GPUs of 700M pairs reached 21 GB),
            # and it is refused right after sharding, in bounded memory, with the reason on its row.
            options = base.replace(num_ranks=gpus, planner=planner, layout=layout, node_fan_out=switch,
                                   block_size=None if planner in OWN_BLOCK_SIZE else base.block_size)
            plan = compile_plan(batch, options=options)
        except InfeasibleError as error:
            # A method that cannot plan this scale (too large, infeasible) leaves a row saying why; the rest run.
            return {"method": method, "gpus": gpus, "layout": layout, **dict.fromkeys(FIGURES), "error": str(error)}
        row = _scored(plan, method, gpus, layout)
        if best is None or _variant_rank(row, base) < _variant_rank(best, base):
            best = row
    return best


def _variant_rank(row: dict, options: CompileOptions) -> tuple[bool, float]:
    """How a method's node fan-out variants rank (the least first): by layer time, and with `fit_memory` those
    within FCP's live-buffer budget before those over it (a variant no smaller stages bring within it is scheduled
    as it is, and is kept only where no variant fits)."""
    over = options.fit_memory and row["max_buffer_tokens"] > memory_budget_tokens(options)
    return over, layer_seconds(row)


def _scored(plan, method: str, gpus: int, layout: str) -> dict:
    """One compiled plan's row: validated, then simulated."""
    # A plan is scored only if it keeps every invariant the simulator trusts (every method is compiled within the
    # segment pairs the validator enumerates, so every plan is validated).
    validate_plan(plan.to_bytes())
    figures = simulate_plan(plan).figures()
    stats = plan.stats
    return {"method": method, "gpus": gpus, "layout": layout, "compute_imbalance": stats["compute_imbalance"],
            "comm_imbalance": stats["comm_imbalance"], "total_comm_bytes": stats["total_comm_bytes"],
            "max_rank_comm_bytes": stats["max_rank_recv_bytes"], "num_rounds": stats["num_rounds"],
            "normalized_mfu_fwd": figures["normalized_mfu_fwd"], "normalized_mfu_bwd": figures["normalized_mfu_bwd"],
            "makespan_fwd_s": figures["makespan_fwd_s"], "makespan_bwd_s": figures["makespan_bwd_s"],
            "compile_seconds": stats["compile_seconds"], **{name: figures[name] for name in LAYER_FIGURES},
            "node_fan_out": stats["num_fanned_out_transfers"] > 0, "max_buffer_tokens": stats["max_buffer_tokens"],
            "validated": True,
            # What FCP kept: its floor's candidate (whose placement may be a baseline's, e.g. magi); a baseline's own.
            "placement": kept_candidate(stats) if stats.get("floor") else method}


def compare(batch_for: Callable[[int], object], scales: Sequence[int], methods: Sequence[Planner],
            progress: Callable[[str], None] | None = None, jobs: int | None = None,
            options: CompileOptions | None = None) -> list[dict]:
    """Compile and simulate every method at every scale, on every core.

    Every baseline runs in the plan layout, as its real system dispatches tokens once per step, at its better node
    fan-out variant (on or off, by layer makespan) unless `options` fix one; FCP runs in the plan layout (method
    "fcp") and in the user layout (method "fcp-user", the seed's reshuffle around attention).

    Args:
        batch_for: gpus -> batch (the same batch for every scale, or one generated per scale; deterministic).
        scales: GPU counts.
        methods: planners to run.
        progress: called with a line after each plan.
        jobs: processes (default: all cores); the largest scales start first.
        options: the other compile options (block size, profile, ...; default the seed's setting); each job sets its
            own ranks, planner and layout.
    Returns:
        one row per (method, gpus), in scale then method order, with the figures `fcp compare --json` writes, its
        place among the methods at that scale by layer makespan (forward plus backward, 1 the fastest) and FCP's
        speedup over it (its layer makespan over FCP's, each pass); a method that could not plan a scale has None
        figures and an "error" line. Every plan is validated before it is scored.
    """
    names = [Planner(method).value for method in methods]
    if Planner.FCP.value in names:
        names.insert(names.index(Planner.FCP.value) + 1, FCP_USER)
    order = [(gpus, name) for gpus in scales for name in names]
    _CONTEXT.update(batch_for=batch_for, options=options or CompileOptions(num_ranks=1))
    results: dict[tuple[int, str], dict] = {}
    for row in map_on_cores(_one, sorted(order, key=lambda job: -job[0]), jobs):
        results[(row["gpus"], row["method"])] = row
        if progress:
            progress(f"{row['method']:>9} @ {row['gpus']:>4} GPUs: " + (
                f"not planned: {row['error']}" if row.get("error") else
                f"normalized MFU fwd {row['normalized_mfu_fwd']:.3f}"))
    rows = [results[job] for job in order]
    for gpus in scales:
        planned = sorted((r for r in rows if r["gpus"] == gpus and not r.get("error")),
                         key=lambda r: (layer_seconds(r), r["method"]))
        for place, row in enumerate(planned, start=1):
            row["layer_rank"] = place
        fcp = results.get((gpus, Planner.FCP.value))
        if not fcp or fcp.get("error"):
            continue
        for row in planned:
            row["fcp_speedup_fwd"] = row["layer_makespan_fwd_s"] / fcp["layer_makespan_fwd_s"]
            row["fcp_speedup_bwd"] = row["layer_makespan_bwd_s"] / fcp["layer_makespan_bwd_s"]
    return rows


def sweep_block_sizes(batch, options: CompileOptions, block_sizes: Sequence[int]) -> list[dict]:
    """FCP at several block sizes: balance and simulated normalized MFU (the seed's figure 12)."""
    rows = []
    for block_size in block_sizes:
        plan = compile_plan(batch, options=options.replace(block_size=block_size))
        figures = simulate_plan(plan).figures()
        rows.append({"block_size": block_size, "compute_imbalance": plan.stats["compute_imbalance"],
                     "comm_imbalance": plan.stats["comm_imbalance"], "num_rounds": plan.stats["num_rounds"],
                     "normalized_mfu_fwd": figures["normalized_mfu_fwd"],
                     "normalized_mfu_bwd": figures["normalized_mfu_bwd"]})
    return rows

"""FCP against the baselines across scales (the seed's figures 9 to 12), and the block-size sweep."""

from __future__ import annotations

from collections.abc import Callable, Sequence

from fcp_compiler.baselines import Planner
from fcp_compiler.pipeline import compile_plan
from fcp_compiler.simulate import simulate_plan


def compare(batch_for: Callable[[int], object], scales: Sequence[int], methods: Sequence[Planner],
            progress: Callable[[str], None] | None = None, **compile_options) -> list[dict]:
    """Compile and simulate every method at every scale.

    Args:
        batch_for: gpus -> batch (the same batch for every scale, or one generated per scale).
        scales: GPU counts.
        methods: planners to run.
        progress: called with a line after each plan.
        compile_options: forwarded to compile_plan (block_size, profile, ...).
    Returns:
        one row per (method, gpus) with the figures `fcp compare --json` writes, and FCP's speedup over each.
    """
    rows = []
    for gpus in scales:
        batch = batch_for(gpus)
        by_method = {}
        for method in methods:
            plan = compile_plan(batch, gpus, planner=method, **compile_options)
            figures = simulate_plan(plan).figures()
            stats = plan.stats
            row = {"method": Planner(method).value, "gpus": gpus, "compute_imbalance": stats["compute_imbalance"],
                   "comm_imbalance": stats["comm_imbalance"], "total_comm_bytes": stats["total_comm_bytes"],
                   "max_rank_comm_bytes": stats["max_rank_recv_bytes"], "num_rounds": stats["num_rounds"],
                   "normalized_mfu_fwd": figures["normalized_mfu_fwd"],
                   "normalized_mfu_bwd": figures["normalized_mfu_bwd"],
                   "makespan_fwd_s": figures["makespan_fwd_s"], "makespan_bwd_s": figures["makespan_bwd_s"],
                   "compile_seconds": stats["compile_seconds"]}
            by_method[row["method"]] = row
            rows.append(row)
            if progress:
                progress(f"{row['method']:>9} @ {gpus:>4} GPUs: normalized MFU fwd {row['normalized_mfu_fwd']:.3f}")
        fcp = by_method.get(Planner.FCP.value)
        for row in by_method.values():
            if fcp:
                row["fcp_speedup_fwd"] = fcp["normalized_mfu_fwd"] / row["normalized_mfu_fwd"]
                row["fcp_speedup_bwd"] = fcp["normalized_mfu_bwd"] / row["normalized_mfu_bwd"]
    return rows


def sweep_block_sizes(batch, gpus: int, block_sizes: Sequence[int], **compile_options) -> list[dict]:
    """FCP at several block sizes: balance and simulated normalized MFU (the seed's figure 12)."""
    rows = []
    for block_size in block_sizes:
        plan = compile_plan(batch, gpus, block_size=block_size, **compile_options)
        figures = simulate_plan(plan).figures()
        rows.append({"block_size": block_size, "compute_imbalance": plan.stats["compute_imbalance"],
                     "comm_imbalance": plan.stats["comm_imbalance"], "num_rounds": plan.stats["num_rounds"],
                     "normalized_mfu_fwd": figures["normalized_mfu_fwd"],
                     "normalized_mfu_bwd": figures["normalized_mfu_bwd"]})
    return rows

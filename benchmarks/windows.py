"""Sliding windows against causal on the same batch: traffic, balance, rounds, validity, simulated MFU.

Usage: python benchmarks/windows.py [--trace traces/paper_lognormal_128gpu.json] [--gpus 128] [--window 4096]

Compiles the batch causal and with a sliding window of W keys (block 4096, coalesce 16, h100, plan layout), checks
both with the validator, simulates both, and prints the figures side by side with the traffic ratio.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from fcp_compiler import compile_plan
from fcp_compiler.format.inputs import load_batch
from fcp_compiler.format.validate import validate_plan
from fcp_compiler.tools.report import human_bytes, table
from fcp_compiler.core.simulate import simulate_plan

ROOT = Path(__file__).resolve().parents[1]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--trace", type=Path, default=ROOT / "traces" / "paper_lognormal_128gpu.json")
    parser.add_argument("--gpus", type=int, default=128)
    parser.add_argument("--window", type=int, default=4096)
    args = parser.parse_args()
    batch = load_batch(args.trace)
    rows, figures = [], {}
    for label, mask in (("causal", "causal"), (f"window {args.window}", f"sliding_window:{args.window}")):
        plan = compile_plan(batch, args.gpus, mask=mask)
        report = validate_plan(plan.to_bytes())  # raises on any broken invariant
        stats, sim = plan.stats, simulate_plan(plan).figures()
        figures[label] = stats
        rows.append([label, stats["num_tiles"], stats["num_transfers"], human_bytes(stats["total_comm_bytes"]),
                     f"{stats['compute_imbalance']:.4f}", f"{stats['pair_imbalance']:.4f}",
                     f"{report.num_rounds}/{report.max_degree}", "valid", f"{sim['normalized_mfu_fwd']:.3f}",
                     f"{sim['normalized_mfu_bwd']:.3f}", f"{stats['compile_seconds']:.2f}"])
    print(f"{args.trace.name} at {args.gpus} GPUs, block 4096, coalesce 16, h100, plan layout")
    print(table(["mask", "tiles", "pulls", "fwd traffic", "compute imb", "pair imb", "rounds/delta", "validate",
                 "MFU fwd", "MFU bwd", "compile s"], rows))
    causal, windowed = figures.values()
    print(f"  forward traffic, window / causal: {windowed['total_comm_bytes'] / causal['total_comm_bytes']:.4f}")


if __name__ == "__main__":
    main()

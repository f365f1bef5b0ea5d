"""Balance of compiled plans on the paper-like trace and on the real length distributions.

Usage: python benchmarks/balance.py [--gpus 64,128,256] [--seeds 3] [--eval-data ../shared/eval-data]
       [--zigzag auto|on|off]

For each batch prints compute and communication imbalance, the makespan / lower-bound ratio, the token high-water
mark against the cap, rounds against the largest degree, and how many tiles run away from their block's owner.
Real distributions are read from --eval-data when it exists (they are not part of the project).
"""

from __future__ import annotations

import argparse
from pathlib import Path

import numpy as np

from fcp_compiler import compile_plan
from fcp_compiler.report import table
from fcp_compiler.traces import (empirical_batch, histogram_batch, lognormal_batch, read_histogram_csv,
                                 read_lengths_file)

TOKENS_PER_GPU = 32768


def sources(eval_data: Path) -> dict:
    """Name -> function(total_tokens, seed) giving lengths."""
    out = {"paper-lognormal": lambda total, seed: lognormal_batch(total, 4096, 1.8, 64, 524288, seed)}
    files = {"distca-wlbllm": "distca/dist_wlbllm.json", "distca-prolong": "distca/dist_prolong.json",
             "flexsp-wikipedia": "flexsp/wikipedia.txt"}
    for name, relative in files.items():
        path = eval_data / relative
        if path.exists():
            values = read_lengths_file(path)
            # Clip at 512K as the paper-like trace does (wikipedia has documents up to 1.8M tokens).
            out[name] = lambda total, seed, values=values: empirical_batch(values, total, seed, max_len=524288)
    histogram = eval_data / "magiattention/doc_length_distribution.csv"
    if histogram.exists():
        edges, counts = read_histogram_csv(histogram)
        out["magi-histogram"] = lambda total, seed: histogram_batch(edges, counts, total, seed)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--gpus", default="64,128,256")
    parser.add_argument("--seeds", type=int, default=3)
    parser.add_argument("--eval-data", type=Path, default=Path(__file__).resolve().parents[1] / "../shared/eval-data")
    parser.add_argument("--zigzag", default="auto")
    args = parser.parse_args()
    rows, worst = [], {"compute": 0.0, "comm": 0.0, "lb": 0.0}
    for name, make in sources(args.eval_data).items():
        for gpus in [int(g) for g in args.gpus.split(",")]:
            for seed in range(args.seeds):
                lengths = make(gpus * TOKENS_PER_GPU, seed)
                s = compile_plan(lengths, gpus, zigzag=args.zigzag).stats
                worst = {"compute": max(worst["compute"], s["compute_imbalance"]),
                         "comm": max(worst["comm"], s["comm_imbalance"]),
                         "lb": max(worst["lb"], s["makespan_lower_bound_ratio"])}
                rows.append([name, gpus, seed, len(lengths), max(lengths), f"{s['compute_imbalance']:.4f}",
                             f"{s['comm_imbalance']:.4f}", f"{s['comm_sent_imbalance']:.4f}",
                             f"{s['makespan_lower_bound_ratio']:.4f}", f"{s['max_tokens_per_rank']}/{s['token_cap']}",
                             f"{s['num_rounds']}/{s['max_degree']}", s["num_offloaded_tiles"],
                             f"{s['compile_seconds']:.2f}"])
    print(table(["batch", "gpus", "seed", "seqs", "longest", "compute imb", "comm imb (recv)", "comm imb (sent)",
                 "LB ratio", "tokens/cap", "rounds/delta", "offloaded", "compile s"], rows))
    print(f"worst: compute imbalance {worst['compute']:.4f}, comm imbalance {worst['comm']:.4f}, "
          f"makespan / lower bound {worst['lb']:.4f}")


if __name__ == "__main__":
    main()

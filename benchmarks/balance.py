"""Balance of compiled plans on the paper-like trace and on the real length distributions.

Usage: python benchmarks/balance.py [--gpus 64,128,256] [--seeds 3] [--eval-data DIR]
       [--zigzag auto|on|off]

For each batch prints compute and communication imbalance, the makespan / lower-bound ratio, the token high-water
mark against the cap, rounds against the largest degree, and how many tiles run away from their block's owner.
Real distributions are read from --eval-data when it exists (they are not part of the project).
"""

from __future__ import annotations

import argparse
from pathlib import Path

import numpy as np

from placement import EVAL_DATA
from fcp_compiler import compile_plan
from fcp_compiler.tools.report import table
from fcp_compiler.tools.traces import (empirical_batch, histogram_batch, lognormal_batch, read_histogram_csv,
                                 read_lengths_file)

TOKENS_PER_GPU = 32768


def received_floor(plan) -> float:
    """A floor on comm imbalance for plans where every tile runs on its query block's owner.

    The rank holding a block of an n-block sequence receives the sequence's other blocks it does not hold itself;
    it can hold at most k of them, k limited by the compute budget (1.03 x the mean) and the token cap. So some rank
    receives at least (n - k) blocks' worth; with the plan's mean received volume R, the imbalance is at least
    1 - R / that. Running tiles elsewhere can go below it only by pulling Q and pushing partial outputs, each
    q_heads / (2 kv_heads) times a block's K,V.
    """
    tiles = plan.ir.tiles
    sharding = tiles.sharding
    stats = plan.stats
    per_block = tiles.block_seconds
    budget = 1.03 * float(tiles.tile_seconds.sum()) / stats["num_ranks"]
    max_blocks = stats["token_cap"] // sharding.block_size
    worst = 0.0
    full = sharding.seg_tokens == sharding.block_size if not sharding.zigzag else np.ones(sharding.num_segments, bool)
    for seq in np.unique(sharding.seg_seq[sharding.batch.lengths[sharding.seg_seq] >= 2 * sharding.block_size]):
        blocks = np.unique(sharding.seg_block[(sharding.seg_seq == seq) & full])
        n = blocks.size
        k = int(min(n, max_blocks, max(1, budget // max(float(per_block[blocks].max()), 1e-300))))
        worst = max(worst, (n - k) * sharding.block_size)
    mean_tokens = stats["total_comm_bytes"] / stats["num_ranks"] / tiles.shape.kv_bytes_per_token
    return max(0.0, 1.0 - mean_tokens / worst) if worst > 0 else 0.0


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
    parser.add_argument("--eval-data", type=Path, default=EVAL_DATA)
    parser.add_argument("--zigzag", default="auto")
    args = parser.parse_args()
    rows, worst = [], {"compute": 0.0, "comm": 0.0, "lb": 0.0}
    for name, make in sources(args.eval_data).items():
        for gpus in [int(g) for g in args.gpus.split(",")]:
            for seed in range(args.seeds):
                lengths = make(gpus * TOKENS_PER_GPU, seed)
                plan = compile_plan(lengths, gpus, zigzag=args.zigzag)
                s = plan.stats
                worst = {"compute": max(worst["compute"], s["compute_imbalance"]),
                         "comm": max(worst["comm"], s["comm_imbalance"]),
                         "lb": max(worst["lb"], s["makespan_lower_bound_ratio"])}
                rows.append([name, gpus, seed, len(lengths), max(lengths), f"{s['compute_imbalance']:.4f}",
                             f"{s['comm_imbalance']:.4f}", f"{received_floor(plan):.4f}",
                             f"{s['comm_sent_imbalance']:.4f}",
                             f"{s['makespan_lower_bound_ratio']:.4f}", f"{s['max_tokens_per_rank']}/{s['token_cap']}",
                             f"{s['num_rounds']}/{s['max_degree']}", s["num_offloaded_tiles"],
                             f"{s['compile_seconds']:.2f}"])
    print(table(["batch", "gpus", "seed", "seqs", "longest", "compute imb", "comm imb (recv)", "recv floor",
                 "comm imb (sent)",
                 "LB ratio", "tokens/cap", "rounds/delta", "offloaded", "compile s"], rows))
    print(f"worst: compute imbalance {worst['compute']:.4f}, comm imbalance {worst['comm']:.4f}, "
          f"makespan / lower bound {worst['lb']:.4f}")


if __name__ == "__main__":
    main()

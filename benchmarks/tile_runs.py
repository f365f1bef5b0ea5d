"""How far tiles would shrink as runs: a query block against consecutive key blocks on one rank, per plan.

Usage: python benchmarks/tile_runs.py [--gpus 64,256] [--seeds 1] [--eval-data DIR] [--batches a,b] [--small]

Issue 34 proposes carrying a tile as a run (one query block against a run of consecutive key blocks of its sequence
on one rank) through the passes, expecting the tile count to fall to about the number of (query block, rank)
pairs. A run can only stand for tiles that also run in the same stage of each pass, since levelling, the call plan,
the memory account and the simulation all read a tile's stage. For each compiled plan this prints:

- tiles: the plan's tiles (the unit every pass and the validator iterate over);
- pairs: its (query block, rank) pairs, the count the issue expects runs to approach;
- runs: maximal runs of consecutive key blocks of one query block on one rank, ignoring stages (the bound if the
  schedule placed every run's tiles together);
- arrival runs: those runs cut where the forward stage the tiles' data arrives in changes (before levelling);
- fwd runs, both runs: those runs cut where the forward stage changes, and where either pass's stage changes (what a
  run would have to carry under today's schedules, which pull each key block on its own and level tiles one by one).

The batches are the matrix of benchmarks/placement.py (32K tokens a GPU); --small adds traces/small_8gpu.json at
8 GPUs with 64-token blocks (7.3M tiles, about 15 s).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import numpy as np

from fcp_compiler import compile_plan
from placement import TOKENS_PER_GPU, chosen_batches, matrix_arguments

ROOT = Path(__file__).resolve().parents[1]


def run_counts(q_block: np.ndarray, kv_block: np.ndarray, rank: np.ndarray, *stages: np.ndarray) -> int:
    """Maximal runs of tiles with the same query block, rank and `stages`, over consecutive key blocks."""
    if q_block.size == 0:
        return 0
    columns = (kv_block, *stages, rank, q_block)  # lexsort: last key first
    order = np.lexsort(columns)
    starts = np.zeros(order.size, dtype=bool)
    starts[0] = True
    for column in (q_block, rank, *stages):
        ordered = column[order]
        starts[1:] |= ordered[1:] != ordered[:-1]
    kv = kv_block[order]
    starts[1:] |= kv[1:] != kv[:-1] + 1
    return int(starts.sum())


def plan_figures(lengths: list[int], num_gpus: int, block_size: int | None = None) -> dict:
    """The counts of one compiled plan (the module docstring)."""
    plan = compile_plan(lengths, num_gpus, **({"block_size": block_size} if block_size else {}))
    final = plan.ir
    tiles, rank = final.assignment.tiles, final.assignment.tile_rank
    q_block = tiles.tile_q_block.astype(np.int64)
    kv_block = tiles.tile_kv_block.astype(np.int64)
    schedule = final.schedule
    forward, backward = schedule.forward.tile_stage, schedule.backward.tile_stage
    # The forward stage each tile's data arrives in (0: all local), before levelling delays it.
    pull_round = np.append(schedule.forward.edge_round, -1)
    arrival = np.maximum(pull_round[schedule.tile_kv_edge], pull_round[schedule.tile_q_edge])
    arrival_stage = np.where(arrival >= 0, arrival // schedule.forward.coalesce + 1, 0)
    return {"tiles": tiles.num_tiles, "pairs": int(np.unique(q_block * num_gpus + rank).size),
            "runs": run_counts(q_block, kv_block, rank),
            "arrival runs": run_counts(q_block, kv_block, rank, arrival_stage),
            "fwd runs": run_counts(q_block, kv_block, rank, forward),
            "both runs": run_counts(q_block, kv_block, rank, forward, backward)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    matrix_arguments(parser)
    parser.set_defaults(seeds=1)
    parser.add_argument("--small", action="store_true", help="also traces/small_8gpu.json at 64-token blocks")
    args = parser.parse_args()
    kinds, wanted = chosen_batches(parser, args)
    cases = [(f"{name}/{gpus}/{seed}", [int(v) for v in kinds[name](gpus * TOKENS_PER_GPU, seed)], gpus, None)
             for name in wanted for gpus in [int(value) for value in args.gpus.split(",")]
             for seed in range(args.seeds)]
    if args.small:
        small = json.loads((ROOT / "traces" / "small_8gpu.json").read_text())["sequences"]
        cases.append(("small_8gpu/8 @64", small, 8, 64))
    columns = ("tiles", "pairs", "runs", "arrival runs", "fwd runs", "both runs")
    print(f"{'batch':<24}" + "".join(f"{name:>13}" for name in columns) + f"{'both/tiles':>12}")
    for label, lengths, gpus, block_size in cases:
        figures = plan_figures(lengths, gpus, block_size)
        print(f"{label:<24}" + "".join(f"{figures[name]:>13}" for name in columns)
              + f"{figures['both runs'] / max(figures['tiles'], 1):>12.3f}", flush=True)


if __name__ == "__main__":
    main()

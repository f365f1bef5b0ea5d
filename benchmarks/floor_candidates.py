"""What the floor's candidates are worth: which wins where, what keeping fewer would lose, and whether an estimate
made from a placement alone, before it is scheduled, names the winner.

Usage: python benchmarks/floor_candidates.py --eval-data DIR [--gpus 64,256] [--seeds 3] [--batches NAMES]
                                             [--write rows.json]

The batches are the matrix of benchmarks/placement.py (and compile_matrix.py), named kind/gpus/seed. Each is
compiled once in this process; for every candidate the floor schedules (`stats["floor"]["candidates"]`) it records
the simulated layer time, the live buffer tokens and the seconds it took, and, from the candidate's placement and
pulls as the floor routed them (read by wrapping the floor's scheduling step), each rank's linear and attention
compute and its NIC receive time. It prints:

- the winners by kind;
- keeping only some candidates: how many batches get more than 0.5% slower than with all of them, the worst, the
  geometric mean, and the share of the compile the dropped candidates took;
- per-rank estimates of the layer time computed before scheduling (compute alone, compute plus a share of the NIC
  time, the larger of the two): how often the candidate each ranks first, and the better of its first two, is more
  than 0.5% slower than the best.

About 2 minutes on 2 cores.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from compile_matrix import SLOWER  # noqa: E402
from placement import TOKENS_PER_GPU, chosen_batches, matrix_arguments  # noqa: E402

from fcp_compiler import compile_plan  # noqa: E402
from fcp_compiler.core.floor import FloorRun  # noqa: E402
from fcp_compiler.core.layer_model import BACKWARD_WORK, LayerCosts  # noqa: E402
from fcp_compiler.core.schedule_search import fanned_out  # noqa: E402
from fcp_compiler.core.simulate import coalesced_seconds  # noqa: E402


def _rank_figures(run, candidate) -> dict:
    """A scheduled candidate's per-rank forward and backward compute (linear layers and tiles, seconds) and its
    pulls' bytes received over the NIC, as the floor routed them (`run`: the floor's FloorRun)."""
    transfers = fanned_out(run.timer, run.routed[candidate.placement], run.options, candidate.fan_out)
    assignment = transfers.assignment
    tiles, num_ranks = assignment.tiles, assignment.num_ranks
    seconds = coalesced_seconds(tiles, np.arange(tiles.num_tiles), assignment.tile_rank,
                                np.zeros(tiles.num_tiles, dtype=np.int64), tiles.profile, run.segments.pairs_of(tiles))
    attention = np.bincount(assignment.tile_rank, weights=seconds, minlength=num_ranks)
    tokens = np.bincount(assignment.block_rank, weights=tiles.sharding.block_tokens, minlength=num_ranks)
    linear = LayerCosts.of(run.options.model, tiles.profile).phases(tokens)
    node = tiles.profile.gpus_per_node
    nic = (transfers.edge_src // node) != (transfers.edge_dst // node)
    nic_bytes = np.bincount(transfers.edge_dst[nic], weights=transfers.edge_bytes[nic].astype(float),
                            minlength=num_ranks)
    return {"fwd": (linear["fwd_before"] + attention + linear["fwd_after"]).tolist(),
            "bwd": (linear["bwd_before"] + BACKWARD_WORK * attention + linear["bwd_after"]).tolist(),
            "nic_s": (nic_bytes / (tiles.profile.network_gbps * 1e9)).tolist()}


def record_batches(batches: dict) -> dict:
    """Compile every batch; per batch its winner, budget and each scheduled candidate's figures."""
    captured: dict = {}
    recording_seconds = [0.0]  # the figures' own time, left out of the compile's
    schedule = FloorRun.schedule

    def recording(run, candidate):
        before = len(run.scores)
        going_on = schedule(run, candidate)
        if len(run.scores) > before:
            started = time.perf_counter()
            captured[run.scores[-1].name] = _rank_figures(run, candidate)
            recording_seconds[0] += time.perf_counter() - started
        return going_on

    FloorRun.schedule = recording
    rows = {}
    try:
        for name, (lengths, gpus) in batches.items():
            captured.clear()
            recording_seconds[0] = 0.0
            started = time.perf_counter()
            plan = compile_plan(lengths, gpus)
            floor = plan.stats["floor"]
            rows[name] = {"seconds": time.perf_counter() - started - recording_seconds[0], "winner": floor["winner"],
                          "budget": floor["memory_budget_tokens"],
                          "candidates": [{**record, **captured[record["name"]]} for record in floor["candidates"]]}
            print(f"{name}: {floor['winner']}", file=sys.stderr, flush=True)
    finally:
        FloorRun.schedule = schedule
    return rows


def _kind(name: str) -> str:
    return name.split(" ")[0]


def _layer(candidate: dict) -> float:
    fwd, bwd = candidate["layer_makespan_fwd_s"], candidate["layer_makespan_bwd_s"]
    return math.inf if fwd is None or bwd is None else fwd + bwd


def _fitting(row: dict) -> list[dict]:
    return [c for c in row["candidates"] if math.isfinite(_layer(c)) and c["max_buffer_tokens"] <= row["budget"]]


def losses(rows: dict, keep) -> tuple[int, float, float, float]:
    """Keeping only the candidates `keep(candidates)` returns: batches more than SLOWER slower than the best, the
    worst, the geometric mean of the slowdowns, and the share of all compile seconds the others took."""
    slower, worst, logs, saved = 0, 0.0, [], 0.0
    for row in rows.values():
        best = min(_layer(c) for c in _fitting(row))
        kept = keep(row["candidates"])
        saved += sum(c["seconds"] for c in row["candidates"] if c not in kept)
        mine = [_layer(c) for c in kept if c in _fitting(row)]
        change = min(mine) / best - 1.0 if mine else 1.0
        slower += change > SLOWER
        worst = max(worst, change)
        logs.append(math.log1p(change))
    return slower, worst, math.expm1(float(np.mean(logs))), saved / sum(row["seconds"] for row in rows.values())


ESTIMATES = {
    "busiest rank's compute": lambda fwd, bwd, nic: fwd.max() + bwd.max(),
    "compute + NIC time / 2": lambda fwd, bwd, nic: (fwd + nic / 2).max() + (bwd + nic).max(),
    "larger of compute, NIC time": lambda fwd, bwd, nic: np.maximum(fwd, nic).max() + np.maximum(bwd, 2 * nic).max(),
}


def estimate_misses(rows: dict, estimate) -> tuple[int, int]:
    """How many batches the fitting candidate an estimate ranks first, and the better of its first two, is more than
    SLOWER slower than the best."""
    first = two = 0
    for row in rows.values():
        fitting = _fitting(row)
        best = min(_layer(c) for c in fitting)
        ranked = sorted(fitting, key=lambda c: estimate(*(np.asarray(c[key]) for key in ("fwd", "bwd", "nic_s"))))
        first += _layer(ranked[0]) / best - 1.0 > SLOWER
        two += min(_layer(c) for c in ranked[:2]) / best - 1.0 > SLOWER
    return first, two


SUBSETS = {
    "FCP's own placement, direct (one candidate)": lambda cs: [c for c in cs if _kind(c["name"]) == "layer"],
    "the one with the least busy lower bound": lambda cs: sorted(cs, key=lambda c: c["busy_lower_bound_s"] or 0)[:1],
    "the two with the least busy lower bounds": lambda cs: sorted(cs, key=lambda c: c["busy_lower_bound_s"] or 0)[:2],
    "FCP's own at its three tolerances, direct": lambda cs: [
        c for c in cs if _kind(c["name"]) in ("layer", "layer-tokens-1%", "layer-tokens-10%")],
    "all but the equal-chunk ones (greedy, magi route)": lambda cs: [
        c for c in cs if _kind(c["name"]) not in ("greedy", "magi")],
    "all but node fan-out": lambda cs: [c for c in cs if "fan-out" not in c["name"]],
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    matrix_arguments(parser)
    parser.add_argument("--write", type=Path, help="write every batch's candidates as JSON")
    args = parser.parse_args()
    makers, chosen = chosen_batches(parser, args)
    rows = record_batches({f"{name}/{gpus}/{seed}": ([int(v) for v in makers[name](gpus * TOKENS_PER_GPU, seed)], gpus)
                           for name in chosen for gpus in [int(g) for g in args.gpus.split(",")]
                           for seed in range(args.seeds)})
    if args.write:
        args.write.write_text(json.dumps(rows))
    winners: dict[str, int] = {}
    for row in rows.values():
        winners[_kind(row["winner"])] = winners.get(_kind(row["winner"]), 0) + 1
    print(f"{len(rows)} batches, {np.mean([len(r['candidates']) for r in rows.values()]):.1f} candidates scheduled "
          f"a batch; winners: " + ", ".join(f"{kind} {count}" for kind, count in sorted(winners.items())))
    print(f"\n| candidates kept | batches > {SLOWER:.1%} slower | worst | geometric mean | compile saved |")
    print("|---|---:|---:|---:|---:|")
    for label, keep in SUBSETS.items():
        slower, worst, mean, saved = losses(rows, keep)
        print(f"| {label} | {slower} of {len(rows)} | {worst:.1%} | {mean:.2%} | {saved:.1%} |")
    print(f"\n| estimate before scheduling | its first > {SLOWER:.1%} slower | the better of its first two |")
    print("|---|---:|---:|")
    for label, estimate in ESTIMATES.items():
        first, two = estimate_misses(rows, estimate)
        print(f"| {label} | {first} of {len(rows)} | {two} |")


if __name__ == "__main__":
    main()

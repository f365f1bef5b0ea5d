"""Placement quality on real length distributions: balance under every measure, exposure, MFU, NIC hot spots.

Usage: python benchmarks/placement.py [--gpus 64,256] [--seeds 3] [--eval-data DIR]
       [--batches paper,magi] [--token-tolerance T] [--baselines [magi,bytescale]] [--user-layout]
       [--write figures.json]
       [--reference benchmarks/reference/placement_main.json]

The batches: the paper-like lognormal trace, and each length file in --eval-data with and without a 20% long tail
(128K-512K), 32768 tokens per GPU, three seeds, block 4096, coalesce 16, h100 profile, plan layout. For each batch
it prints compute, pair and token imbalance, rounds against the largest degree, simulated exposed communication as
a share of each pass's makespan, normalized MFU, the busiest rank's NIC send and receive bytes (beside the
reference run's, when given), the best baseline's MFU (--baselines) and, in the user layout, the share of tokens
that stay home (--user-layout). Alongside each figure it prints a floor computed from the batch alone where one
stops a target: token_floor is the least token imbalance any placement of these blocks can reach.
"""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path

import numpy as np

from fcp_compiler import compile_plan
from fcp_compiler.core.baselines import Planner
from fcp_compiler.tools.report import table
from fcp_compiler.core.simulate import simulate_plan
from fcp_compiler.tools.traces import empirical_batch, histogram_batch, read_histogram_csv, read_lengths_file

TOKENS_PER_GPU = 32768
# Where the public length files are (traces/README.md lists them): --eval-data, else $FCP_EVAL_DATA, else ./eval-data.
EVAL_DATA = Path(os.environ.get("FCP_EVAL_DATA", "eval-data"))
TAIL_FRACTION = 0.2
# The length files under --eval-data, by the distribution's name (the MagiAttention histogram is read apart).
LENGTH_FILES = {"wlbllm": "distca/dist_wlbllm.json", "prolong": "distca/dist_prolong.json",
                "wikipedia": "flexsp/wikipedia.txt"}
BASELINES = (Planner.RING, Planner.BYTESCALE, Planner.WLBLLM, Planner.MAGI)


def batches(eval_data: Path) -> dict:
    """Name -> function(total_tokens, seed) giving lengths."""
    from fcp_compiler.tools.traces import lognormal_batch

    out = {"paper": lambda total, seed: lognormal_batch(total, 4096, 1.8, 64, 524288, seed)}
    for name, relative in LENGTH_FILES.items():
        if (eval_data / relative).exists():
            values = read_lengths_file(eval_data / relative)
            for tail in (0.0, TAIL_FRACTION):
                label = name + ("+tail" if tail else "")
                out[label] = lambda total, seed, values=values, tail=tail: empirical_batch(
                    values, total, seed, max_len=524288, tail_fraction=tail)
    histogram = eval_data / "magiattention/doc_length_distribution.csv"
    if histogram.exists():
        edges, counts = read_histogram_csv(histogram)
        for tail in (0.0, TAIL_FRACTION):
            out["magi" + ("+tail" if tail else "")] = lambda total, seed, tail=tail: histogram_batch(
                edges, counts, total, seed, tail_fraction=tail)
    return out


def chosen_batches(parser: argparse.ArgumentParser, args: argparse.Namespace) -> tuple[dict, list[str]]:
    """The matrix's batch makers (:func:`batches` of --eval-data) and the names --batches chose, all by default; an
    unknown name is a usage error naming the valid ones."""
    makers = batches(args.eval_data)
    chosen = args.batches.split(",") if args.batches else list(makers)
    if unknown := [name for name in chosen if name not in makers]:
        parser.error(f"unknown batch {unknown[0]!r}; valid: {', '.join(makers)} (length files under --eval-data)")
    return makers, chosen


def matrix_arguments(parser: argparse.ArgumentParser) -> None:
    """The matrix's flags, shared by the benchmarks that run it: scales, seeds, where the length files are, which
    batches."""
    parser.add_argument("--gpus", default="64,256")
    parser.add_argument("--seeds", type=int, default=3)
    parser.add_argument("--eval-data", type=Path, default=EVAL_DATA)
    parser.add_argument("--batches", help="comma-separated batch names (default: all)")


def token_floor(plan) -> float:
    """A floor on the token imbalance of any placement of this plan's blocks, from the batch alone: the largest
    rank holds at least the mean, at least the largest block, and, by pigeonhole, ceil(F / N) full blocks of the F."""
    sharding = plan.ir.sharding
    gpus = plan.stats["num_ranks"]
    mean = sharding.batch.total_tokens / gpus
    num_full = int((sharding.block_tokens == sharding.block_size).sum())
    least_max = max(mean, float(sharding.block_tokens.max()), -(-num_full // gpus) * sharding.block_size)
    return 1.0 - mean / least_max


def measure(name: str, lengths: list[int], gpus: int, seed: int, args) -> dict:
    plan = compile_plan(lengths, gpus, token_tolerance=args.token_tolerance)
    stats, figures = plan.stats, simulate_plan(plan).figures()
    row = {"batch": name, "gpus": gpus, "seed": seed, **{key: stats[key] for key in (
        "compute_imbalance", "pair_imbalance", "token_imbalance", "num_rounds", "max_degree",
        "max_rank_nic_send_bytes", "max_rank_nic_recv_bytes", "max_link_to_compute", "compile_seconds")},
        "exposed_fwd": figures["exposed_comm_share_fwd"],
        "exposed_bwd": figures["exposed_comm_share_bwd"],
        "mfu_fwd": figures["normalized_mfu_fwd"], "mfu_bwd": figures["normalized_mfu_bwd"],
        "token_floor": token_floor(plan)}
    if args.baselines:
        row["best_baseline_mfu_fwd"] = max(
            simulate_plan(compile_plan(lengths, gpus, planner=Planner(method), validatable=False)).figures()[
                "normalized_mfu_fwd"]
            for method in args.baselines.split(","))
    if args.user_layout:
        user = compile_plan(lengths, gpus, layout="user").stats
        row["home_fraction"] = user["tokens_home_fraction"]
        row["user_compute_imbalance"] = user["compute_imbalance"]
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    matrix_arguments(parser)
    parser.add_argument("--token-tolerance", type=float, help="compile with this token tolerance")
    parser.add_argument("--baselines", nargs="?", const=",".join(method.value for method in BASELINES),
                        help="also the best of these baselines' MFU, comma-separated (default all: slow, ring and "
                             "wlbllm take about a minute a batch; magi,bytescale take seconds)")
    parser.add_argument("--user-layout", action="store_true", help="also the user layout's tokens at home")
    parser.add_argument("--write", type=Path, help="write the figures as JSON (a later run's --reference)")
    parser.add_argument("--reference", type=Path, help="figures of an earlier run, for the NIC columns")
    args = parser.parse_args()
    reference = {}
    if args.reference:
        for row in json.loads(args.reference.read_text()):
            reference[(row["batch"], row["gpus"], row["seed"])] = row
    rows = []
    makers, chosen = chosen_batches(parser, args)
    for name, make in makers.items():
        if name not in chosen:
            continue
        for gpus in [int(g) for g in args.gpus.split(",")]:
            for seed in range(args.seeds):
                rows.append(measure(name, make(gpus * TOKENS_PER_GPU, seed), gpus, seed, args))
                print(f"  {name} @ {gpus} seed {seed}: compiled and simulated", flush=True)
    if args.write:
        args.write.write_text(json.dumps(rows, indent=1))

    def nic(row, key):
        ref = reference.get((row["batch"], row["gpus"], row["seed"]))
        mib = row[key] / 2**20
        return f"{mib:.0f}" + (f" ({row[key] / ref[key]:.2f}x)" if ref and ref[key] else "")

    header = ["batch", "gpus", "seed", "compute", "pairs", "tokens", "token floor", "rounds/delta", "exposed fwd",
              "exposed bwd", "MFU fwd", "MFU bwd", "NIC send MiB", "NIC recv MiB", "link/compute", "compile s"]
    body = []
    for row in rows:
        line = [row["batch"], row["gpus"], row["seed"], f"{row['compute_imbalance']:.4f}",
                f"{row['pair_imbalance']:.4f}", f"{row['token_imbalance']:.4f}", f"{row['token_floor']:.4f}",
                f"{row['num_rounds']}/{row['max_degree']}", f"{row['exposed_fwd']:.3f}", f"{row['exposed_bwd']:.3f}",
                f"{row['mfu_fwd']:.3f}", f"{row['mfu_bwd']:.3f}", nic(row, "max_rank_nic_send_bytes"),
                nic(row, "max_rank_nic_recv_bytes"), f"{row['max_link_to_compute']:.2f}",
                f"{row['compile_seconds']:.2f}"]
        if args.baselines:
            line.append(f"{row['mfu_fwd'] / row['best_baseline_mfu_fwd']:.2f}")
        if args.user_layout:
            line += [f"{row['home_fraction']:.3f}", f"{row['user_compute_imbalance']:.4f}"]
        body.append(line)
    header += (["vs best baseline"] if args.baselines else []) + (
        ["home (user)", "compute (user)"] if args.user_layout else [])
    print(table(header, body))
    print("\nBy batch and scale (over seeds: worst imbalances and exposure, mean MFU):")
    summary = []
    for name in dict.fromkeys(row["batch"] for row in rows):
        for gpus in dict.fromkeys(row["gpus"] for row in rows):
            group = [row for row in rows if row["batch"] == name and row["gpus"] == gpus]
            if group:
                summary.append([name, gpus] + [f"{max(row[key] for row in group):.3f}" for key in (
                    "compute_imbalance", "pair_imbalance", "token_imbalance", "exposed_fwd", "exposed_bwd")]
                    + [f"{np.mean([row[key] for row in group]):.2f}" for key in ("mfu_fwd", "mfu_bwd")]
                    + [f"{max(row['max_link_to_compute'] for row in group):.2f}"])
    print(table(["batch", "gpus", "compute", "pairs", "tokens", "exposed fwd", "exposed bwd", "MFU fwd", "MFU bwd",
                 "link/compute"], summary))
    worst = {key: max(row[key] for row in rows) for key in ("compute_imbalance", "pair_imbalance", "token_imbalance",
                                                              "exposed_fwd", "exposed_bwd")}
    print("worst: " + ", ".join(f"{key} {value:.4f}" for key, value in worst.items())
          + f", MFU fwd {min(r['mfu_fwd'] for r in rows):.3f}, MFU bwd {min(r['mfu_bwd'] for r in rows):.3f}")
    if args.baselines:
        ratios = [row["mfu_fwd"] / row["best_baseline_mfu_fwd"] for row in rows]
        print(f"FCP forward MFU over the best of {args.baselines}: min {min(ratios):.2f}x, median "
              f"{np.median(ratios):.2f}x; below 1.0x on {sum(r < 1.0 for r in ratios)} of {len(ratios)}")
    means = {key: float(np.mean([row[key] for row in rows])) for key in (
        "compute_imbalance", "pair_imbalance", "token_imbalance", "mfu_fwd", "mfu_bwd")}
    print("mean: " + ", ".join(f"{key} {value:.4f}" for key, value in means.items()))
    for key, label in (("max_rank_nic_send_bytes", "NIC send"), ("max_rank_nic_recv_bytes", "NIC recv")):
        ratios = [row[key] / ref[key] for row in rows
                  if (ref := reference.get((row["batch"], row["gpus"], row["seed"]))) and ref[key]]
        if ratios:
            print(f"{label} against the reference: median {np.median(ratios):.2f}x, worst {max(ratios):.2f}x")


if __name__ == "__main__":
    main()

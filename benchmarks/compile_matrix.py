"""Compile time and plans over the matrix's batches, against another checkout: what a compile-speed change must show.

Usage: python benchmarks/compile_matrix.py --eval-data DIR [--gpus 64,256] [--seeds 3]
                                           [--against TREE [--turns 2]] [--write rows.json]

The batches are benchmarks/layer_objective.py's matrix (the paper-like trace and each length file in DIR, with and
without a 20% long tail; 32768 tokens per GPU), made once here so that both trees compile the same lengths. Each tree
compiles every batch once in one process of its own (imports excluded), with the trees taking turns --turns times.

It prints, per scale, each tree's summed compile seconds (the median over turns), their ratio and the full schedules
a compile made (mean, min-max: plans finished, its reshuffle pass's calls on the tree's own pass timer), then the
plans: every batch whose plan (sha256) or simulated layer makespan (forward plus backward) differs between the
trees, the worst change, and how many batches are more than 0.5% slower (issue 34: no batch slower than its start by
more than that). Without --against it prints this tree's figures only; --write keeps every row.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parents[1]
SLOWER = 0.005  # a plan slower than this (relative) counts against a change

# Run in the tree being measured (its own fcp_compiler): compile each batch of the lengths file once and print a row
# per batch (seconds, plan sha256, simulated layer makespan, floor winner) as JSON.
_TREE_RUN = """
import json, sys, time
from pathlib import Path
import fcp_compiler
assert Path(fcp_compiler.__file__).resolve().is_relative_to(Path(sys.argv[1]).resolve()), fcp_compiler.__file__
from fcp_compiler import compile_plan
from fcp_compiler.core.simulate import layer_stats
try:  # the full schedules a compile makes: its reshuffle pass's calls (every finished plan's last pass)
    from fcp_compiler.core.pass_timer import PassTimer as Timer
except ImportError:  # before the pipeline was split
    from fcp_compiler.core.pipeline import _PassTimer as Timer
timed, calls = Timer.run, []
def counted(self, name, function, *args, **kwargs):
    calls.append(name)
    return timed(self, name, function, *args, **kwargs)
Timer.run = counted
rows = {}
for name, (lengths, gpus) in json.loads(Path(sys.argv[2]).read_text()).items():
    calls.clear()
    start = time.perf_counter()
    plan = compile_plan(lengths, gpus)
    seconds = time.perf_counter() - start
    stats = plan.stats if "layer_makespan_fwd_s" in plan.stats else {**plan.stats, **layer_stats(plan)}
    floor = plan.stats.get("floor") or {}
    rows[name] = {"gpus": gpus, "seconds": seconds, "sha256": plan.stats["plan_sha256"],
                  "layer_s": stats["layer_makespan_fwd_s"] + stats["layer_makespan_bwd_s"],
                  "winner": floor.get("winner"), "schedules": calls.count("reshuffle")}
print(json.dumps(rows))
"""


def matrix_batches(eval_data: Path, scales: list[int], seeds: int) -> dict[str, tuple[list[int], int]]:
    """The matrix's batches by name ("kind/gpus/seed"): their lengths and GPU count."""
    sys.path.insert(0, str(HERE / "benchmarks"))
    from placement import TOKENS_PER_GPU, batches

    return {f"{name}/{gpus}/{seed}": ([int(v) for v in make(gpus * TOKENS_PER_GPU, seed)], gpus)
            for name, make in batches(eval_data).items() for gpus in scales for seed in range(seeds)}


def compile_in(tree: Path, lengths_file: Path) -> dict:
    """Every batch compiled once by `tree`'s compiler in a fresh process: the rows _TREE_RUN prints."""
    run = subprocess.run([sys.executable, "-c", _TREE_RUN, str(tree), str(lengths_file)], cwd=tree,
                         env={**os.environ, "PYTHONPATH": str(tree)}, check=True, capture_output=True, text=True)
    return json.loads(run.stdout.splitlines()[-1])


def summed_seconds(turns: list[dict], gpus: int) -> float:
    """The median over turns of a tree's compile seconds summed over the batches at `gpus`."""
    return statistics.median(sum(row["seconds"] for row in rows.values() if row["gpus"] == gpus) for rows in turns)


def schedules_per_compile(turns: list[dict], gpus: int) -> str:
    """A tree's full schedules per compile at `gpus` (its reshuffle pass's calls: the same every turn), as
    "mean (min-max)"."""
    counts = [row["schedules"] for row in turns[0].values() if row["gpus"] == gpus]
    return f"{statistics.mean(counts):.1f} ({min(counts)}-{max(counts)})"


def plan_changes(mine: dict, theirs: dict) -> list[tuple[str, float, bool]]:
    """Per batch whose plan or layer makespan differs: (name, relative makespan change, plan differs), worst first."""
    changes = [(name, mine[name]["layer_s"] / theirs[name]["layer_s"] - 1.0,
                mine[name]["sha256"] != theirs[name]["sha256"]) for name in mine]
    return sorted((change for change in changes if change[2] or change[1] != 0.0), key=lambda change: -change[1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--eval-data", type=Path, required=True, help="the length files of the matrix's kinds")
    parser.add_argument("--gpus", default="64,256")
    parser.add_argument("--seeds", type=int, default=3)
    parser.add_argument("--against", type=Path, help="another checkout (a worktree of an earlier commit)")
    parser.add_argument("--turns", type=int, default=2, help="rounds of the two trees taking turns")
    parser.add_argument("--write", type=Path, help="write every row of every turn as JSON")
    args = parser.parse_args()
    scales = [int(value) for value in args.gpus.split(",")]
    trees = [HERE] + ([args.against.resolve()] if args.against else [])
    turns: dict[Path, list[dict]] = {tree: [] for tree in trees}
    with tempfile.TemporaryDirectory() as folder:
        lengths_file = Path(folder) / "batches.json"
        lengths_file.write_text(json.dumps(matrix_batches(args.eval_data, scales, args.seeds)))
        for turn in range(args.turns if args.against else 1):
            for tree in trees:
                turns[tree].append(compile_in(tree, lengths_file))
                print(f"turn {turn + 1}: {tree} done", file=sys.stderr, flush=True)
    if args.write:
        args.write.write_text(json.dumps({str(tree): rows for tree, rows in turns.items()}))
    print(f"{'gpus':>5} {'batches':>8} {'this s':>8}" + (f" {'other s':>8} {'ratio':>6}" if args.against else "")
          + f"  {'schedules/compile':>18}" + (f" {'other':>18}" if args.against else ""))
    for gpus in scales:
        count = sum(row["gpus"] == gpus for row in turns[HERE][0].values())
        line = f"{gpus:>5} {count:>8} {summed_seconds(turns[HERE], gpus):>8.2f}"
        if args.against:
            theirs = summed_seconds(turns[trees[1]], gpus)
            line += f" {theirs:>8.2f} {summed_seconds(turns[HERE], gpus) / theirs:>6.3f}"
        line += f"  {schedules_per_compile(turns[HERE], gpus):>18}"
        if args.against:
            line += f" {schedules_per_compile(turns[trees[1]], gpus):>18}"
        print(line)
    if not args.against:
        return
    changes = plan_changes(turns[HERE][0], turns[trees[1]][0])
    for name, change, differs in changes:
        print(f"  {name:<24} layer {change:+.4%}{'' if differs else ' (same plan)'}")
    worst = max((change for _, change, _ in changes), default=0.0)
    print(f"plans that differ: {sum(differs for _, _, differs in changes)} of {len(turns[HERE][0])}; worst layer "
          f"change {worst:+.4%}; slower by more than {SLOWER:.1%}: {sum(c > SLOWER for _, c, _ in changes)}")


if __name__ == "__main__":
    main()

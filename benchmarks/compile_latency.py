"""Compile latency of `compile_plan` (lengths to serialised plan) per pass, and rank-slice read time.

Usage: python benchmarks/compile_latency.py [--gpus 64,128,256,1024] [--repeats 5] [--seeds 3]
                                           [--scaling 256,4096 [--pages]]
                                           [--against TREE [--turns 5] [--eval-data DIR]]

Batches are the paper-like trace (docs/DESIGN.md section 8: lognormal, median 4096, sigma 1.8, clipped to [64, 512K],
32K tokens per GPU). Prints the median over seeds x repeats of the whole compile and of each pass. --scaling
compiles seed 0 three times at each scale in a fresh process and prints the median, its ratio to the first scale
and the process's peak RSS (--gpus '' skips the per-pass table); with --pages, each scale is compiled again in a
fresh process with NumPy's huge-page advice left as NumPy sets it (fcp_compiler.algorithms.pages: the compiler turns
it off), and the process's user and system CPU seconds are printed beside each.

--against TREE compares this checkout with another (a worktree of an earlier commit): fresh processes, the two trees
taking turns, each compiling one batch once (compile_plan in process, imports excluded); it prints each tree's median
over --turns and their ratio, for the shipped paper trace at 256 GPUs and, with --eval-data, every batch kind of
benchmarks/layer_objective.py's matrix at 64 and 256 GPUs (seed 0).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from fcp_compiler import compile_plan
from fcp_compiler.format.plan_format import PlanReader
from fcp_compiler.core.simulate import simulate_plan
from fcp_compiler.tools.traces import lognormal_batch


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--gpus", default="64,128,256,1024")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--seeds", type=int, default=3)
    parser.add_argument("--scaling", default="", help="scales for the fresh-process median and peak RSS table")
    parser.add_argument("--pages", action="store_true", help="--scaling also with NumPy's huge-page advice on")
    parser.add_argument("--against", type=Path, help="another checkout to compare with, taking turns")
    parser.add_argument("--turns", type=int, default=5, help="fresh processes per tree and batch (--against)")
    parser.add_argument("--eval-data", type=Path, help="length files for the matrix's batch kinds (--against)")
    args = parser.parse_args()
    if args.against:
        _against(args.against, args.turns, args.eval_data)
        return
    if args.scaling:
        _scaling([int(value) for value in args.scaling.split(",")], args.pages)
    if not args.gpus:
        return
    for label, code in (("import fcp_compiler", "import fcp_compiler"),
                        ("from fcp_compiler import compile_plan", "from fcp_compiler import compile_plan")):
        times = []
        for _ in range(5):
            start = time.perf_counter()
            subprocess.run([sys.executable, "-c", code], check=True)
            times.append(time.perf_counter() - start)
            start = time.perf_counter()
            subprocess.run([sys.executable, "-c", "pass"], check=True)
            times[-1] -= time.perf_counter() - start
        print(f"{label}: {statistics.median(times) * 1e3:.0f} ms over a bare interpreter (median of 5)")
    print(f"{'gpus':>5} {'median s':>9} {'max s':>7}  per-pass medians (s)")
    for gpus in [int(value) for value in args.gpus.split(",")]:
        totals, passes = [], {}
        for seed in range(args.seeds):
            lengths = lognormal_batch(gpus * 32768, 4096, 1.8, 64, 524288, seed)
            compile_plan(lengths, gpus)  # warm caches and imports
            for _ in range(args.repeats):
                plan = compile_plan(lengths, gpus)
                totals.append(plan.stats["compile_seconds"])
                for name, seconds in plan.stats["pass_seconds"].items():
                    passes.setdefault(name, []).append(seconds)
        breakdown = "  ".join(f"{name} {statistics.median(values):.3f}" for name, values in passes.items())
        print(f"{gpus:>5} {statistics.median(totals):>9.3f} {max(totals):>7.3f}  {breakdown}")
        if gpus == 256:
            with tempfile.TemporaryDirectory() as folder:
                path = Path(folder) / "plan.fcp"
                plan.write(path)
                reads = []
                for rank in range(0, gpus, 8):
                    start = time.perf_counter()
                    PlanReader(path).rank(rank)
                    reads.append(time.perf_counter() - start)
                size_mb = path.stat().st_size / 1e6
            print(f"      read one rank of a {gpus}-rank plan ({size_mb:.1f} MB): "
                  f"median {statistics.median(reads) * 1e3:.2f} ms, max {max(reads) * 1e3:.2f} ms")
            sims = []
            for _ in range(args.repeats):
                start = time.perf_counter()
                simulate_plan(plan.to_bytes())
                sims.append(time.perf_counter() - start)
            print(f"      simulate the {gpus}-rank plan (forward and backward): "
                  f"median {statistics.median(sims):.3f} s, "
                  f"max {max(sims):.3f} s")


_SCALE_RUN = """
import json, resource, statistics, sys
from fcp_compiler import compile_plan
from fcp_compiler.algorithms import pages
from fcp_compiler.tools.traces import lognormal_batch
gpus = int(sys.argv[1])
if sys.argv[2] == "huge":
    pages._SWITCH = None  # leave NumPy's huge-page advice as NumPy set it
lengths = lognormal_batch(gpus * 32768, 4096, 1.8, 64, 524288, 0)
seconds = [compile_plan(lengths, gpus).stats["compile_seconds"] for _ in range(3)]
usage = resource.getrusage(resource.RUSAGE_SELF)
print(json.dumps({"median": statistics.median(seconds), "rss_kb": usage.ru_maxrss, "user": usage.ru_utime,
                  "system": usage.ru_stime}))
"""


def _scaling(scales: list[int], pages: bool = False) -> None:
    """Median of three compiles at each scale, each scale in a fresh process (so that its peak RSS is its own);
    with `pages`, again in another with NumPy's huge-page advice on (the process's user and system seconds)."""
    print(f"{'gpus':>5} {'pages':>6} {'median s':>9} {'x first':>8} {'peak RSS GB':>12} {'user s':>7} "
          f"{'system s':>9}")
    first = None
    for gpus in scales:
        for kind in ("base", "huge") if pages else ("base",):
            result = json.loads(subprocess.run([sys.executable, "-c", _SCALE_RUN, str(gpus), kind], check=True,
                                               capture_output=True, text=True).stdout)
            first = first or result["median"]
            print(f"{gpus:>5} {kind:>6} {result['median']:>9.3f} {result['median'] / first:>8.1f} "
                  f"{result['rss_kb'] / 1e6:>12.2f} {result['user']:>7.1f} {result['system']:>9.1f}", flush=True)


_TURN_RUN = """
import json, sys, time
from pathlib import Path
import fcp_compiler
assert Path(fcp_compiler.__file__).resolve().is_relative_to(Path(sys.argv[1]).resolve()), fcp_compiler.__file__
from fcp_compiler import compile_plan
lengths = json.loads(Path(sys.argv[2]).read_text())
start = time.perf_counter()
compile_plan(lengths, int(sys.argv[3]))
print(time.perf_counter() - start)
"""


def _against(other: Path, turns: int, eval_data: Path | None) -> None:
    """Each batch compiled in fresh processes by this tree and `other` in turn; medians and their ratio."""
    here = Path(__file__).resolve().parents[1]
    cases = [("paper trace", json.loads((here / "traces/paper_lognormal_256gpu.json").read_text())["sequences"],
              256)]
    if eval_data is not None:
        sys.path.insert(0, str(here / "benchmarks"))
        from placement import TOKENS_PER_GPU, batches

        for name, make in batches(eval_data).items():
            cases += [(name, [int(v) for v in make(gpus * TOKENS_PER_GPU, 0)], gpus) for gpus in (256, 64)]
    print(f"{'batch':>16} {'gpus':>5} {'this s':>8} {'other s':>8} {'ratio':>6}   (median of {turns} fresh processes "
          f"each, taking turns; other = {other})")
    with tempfile.TemporaryDirectory() as folder:
        for name, lengths, gpus in cases:
            path = Path(folder) / "lengths.json"
            path.write_text(json.dumps(lengths))
            seconds: dict[Path, list[float]] = {here: [], other.resolve(): []}
            for _ in range(turns):
                for tree, times in seconds.items():
                    run = subprocess.run([sys.executable, "-c", _TURN_RUN, str(tree), str(path), str(gpus)],
                                         cwd=tree, env={**os.environ, "PYTHONPATH": str(tree)}, check=True,
                                         capture_output=True, text=True)
                    times.append(float(run.stdout.split()[-1]))
            mine, theirs = (statistics.median(times) for times in seconds.values())
            print(f"{name:>16} {gpus:>5} {mine:>8.3f} {theirs:>8.3f} {mine / theirs:>6.2f}", flush=True)


if __name__ == "__main__":
    main()

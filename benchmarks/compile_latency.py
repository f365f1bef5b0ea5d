"""Compile latency of `compile_plan` (lengths to serialised plan) per pass, and rank-slice read time.

Usage: python benchmarks/compile_latency.py [--gpus 64,128,256,1024] [--repeats 5] [--seeds 3]

Batches are the paper-like trace (DESIGN section 8: lognormal, median 4096, sigma 1.8, clipped to [64, 512K],
32K tokens per GPU). Prints the median over seeds x repeats of the whole compile and of each pass.
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from fcp_compiler import compile_plan
from fcp_compiler.plan_format import PlanReader
from fcp_compiler.simulate import simulate_plan
from fcp_compiler.traces import lognormal_batch


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--gpus", default="64,128,256,1024")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--seeds", type=int, default=3)
    args = parser.parse_args()
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


if __name__ == "__main__":
    main()

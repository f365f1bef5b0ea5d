"""The ring baseline on every real-distribution batch at scale: compile time, peak memory, plan size.

Usage: python benchmarks/ring_scale.py [--gpus 256] [--seed 0] [--eval-data DIR]

Each batch of benchmarks/placement.py (each eval-data file, with and without a 20% long tail; 32K tokens per GPU)
compiles with --planner ring in a fresh process, which reports its compile seconds, peak RSS and plan size, and the
seconds to simulate the plan.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "benchmarks")]
from placement import EVAL_DATA  # noqa: E402

CHILD = """
import json, resource, sys, time
sys.path[:0] = {paths!r}
from pathlib import Path
from placement import batches
from fcp_compiler import compile_plan
from fcp_compiler.core.simulate import simulate_plan
lengths = batches(Path({eval_data!r}))[{name!r}]({tokens}, {seed})
start = time.perf_counter()
plan = compile_plan(lengths, {gpus}, planner="ring", validatable=False)
compiled = time.perf_counter() - start
start = time.perf_counter()
figures = simulate_plan(plan).figures()
print(json.dumps({{"compile_s": compiled, "simulate_s": time.perf_counter() - start,
                  "rss_gb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20,
                  "plan_mb": len(plan.to_bytes()) / 2**20, "mfu_fwd": figures["normalized_mfu_fwd"]}}))
"""


def main() -> None:
    from placement import TOKENS_PER_GPU, batches
    from fcp_compiler.tools.report import table

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--gpus", type=int, default=256)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--eval-data", type=Path, default=EVAL_DATA)
    args = parser.parse_args()
    rows = []
    for name in batches(args.eval_data):
        if name == "paper":
            continue
        code = CHILD.format(paths=[str(ROOT), str(ROOT / "benchmarks")], eval_data=str(args.eval_data), name=name,
                            tokens=args.gpus * TOKENS_PER_GPU, seed=args.seed, gpus=args.gpus)
        result = json.loads(subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                                           check=True).stdout)
        rows.append([name, f"{result['compile_s']:.1f}", f"{result['rss_gb']:.2f}", f"{result['plan_mb']:.0f}",
                     f"{result['simulate_s']:.2f}", f"{result['mfu_fwd']:.3f}"])
        print(f"  {name}: done", flush=True)
    print(table(["batch", "compile s", "peak RSS GB", "plan MB", "simulate s", "MFU fwd"], rows))


if __name__ == "__main__":
    main()

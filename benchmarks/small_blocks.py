"""Compile time and peak memory at small blocks, this tree beside another checkout in the same run.

Usage: python benchmarks/small_blocks.py [--main-tree PATH] [--repeat 3] [--timeout 600] [--memory-gb 8]

Cases: traces/small_8gpu.json at --gpus 8 --block-size 64 (4,100 blocks, 7.3M tiles), and 200,000 sequences of 64
tokens at --gpus 64 --block-size 64 (200,000 one-block sequences). Each compile runs in a fresh process under an
address-space limit (--memory-gb) and a timeout; the table gives the median wall time of --repeat runs (their range
in brackets) and the largest peak RSS, or why a run did not finish.

The trees take turns, each going first in every other repeat: on a VM whose host reclaims freed memory, the first
touch of a page costs far more than its reuse (here up to 2 s a GB), so a process started right after another one
released its memory runs faster, and a fixed order would favour the tree that goes second.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
CASES = {  # name: (batch, ranks, block size)
    "small_8gpu @64": (json.loads((ROOT / "traces" / "small_8gpu.json").read_text())["sequences"], 8, 64),
    "200k x 64 @64": ([64] * 200_000, 64, 64),
}
RUN = """
import json, resource, sys, time
sys.path.insert(0, sys.argv[1])
from fcp_compiler import compile_plan
lengths, ranks, block = json.load(open(sys.argv[2]))
start = time.perf_counter()
compile_plan(lengths, ranks, block_size=block)
print(json.dumps({"seconds": time.perf_counter() - start,
                  "rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024}))
"""


def _measure(tree: Path, case: tuple, timeout: float, memory_gb: float) -> tuple[float, float] | str:
    """(seconds, peak RSS in MB) of one compile in a fresh process, or why it did not finish."""
    with tempfile.NamedTemporaryFile("w", suffix=".json") as batch:
        json.dump(case, batch)
        batch.flush()
        limit = f"import resource; resource.setrlimit(resource.RLIMIT_AS, ({int(memory_gb * 2**30)},) * 2)\n"
        start = time.perf_counter()
        try:
            done = subprocess.run([sys.executable, "-c", limit + RUN, str(tree), batch.name], capture_output=True,
                                  text=True, timeout=timeout)
        except subprocess.TimeoutExpired:
            return f"timeout after {timeout:.0f} s"
        if done.returncode != 0:
            last = (done.stderr.strip().splitlines() or ["?"])[-1]
            return f"failed after {time.perf_counter() - start:.0f} s: {last[:70]}"
        figures = json.loads(done.stdout.strip().splitlines()[-1])
        return figures["seconds"], figures["rss_mb"]


def _cell(runs: list) -> str:
    failed = next((run for run in runs if isinstance(run, str)), None)
    if failed is not None:
        return failed
    seconds = sorted(run[0] for run in runs)
    spread = f" [{seconds[0]:.1f}-{seconds[-1]:.1f}]" if len(seconds) > 1 else ""
    return f"{statistics.median(seconds):7.2f} s{spread} {max(run[1] for run in runs):6.0f} MB"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--main-tree", type=Path, help="another checkout to measure beside this one")
    parser.add_argument("--repeat", type=int, default=3, help="runs of each case and tree (median reported)")
    parser.add_argument("--timeout", type=float, default=600)
    parser.add_argument("--memory-gb", type=float, default=8)
    args = parser.parse_args()
    trees = [("this tree", ROOT)] + ([("main tree", args.main_tree.resolve())] if args.main_tree else [])
    print(f"{'case':<16}" + "".join(f"  {name:>36}" for name, _ in trees))
    for name, case in CASES.items():
        runs: dict[int, list] = {idx: [] for idx in range(len(trees))}
        for repeat in range(max(args.repeat, 1)):
            turn = list(range(len(trees)))
            for idx in turn[repeat % len(turn):] + turn[:repeat % len(turn)]:
                if not any(isinstance(run, str) for run in runs[idx]):  # a failure repeats; once is enough
                    runs[idx].append(_measure(trees[idx][1], case, args.timeout, args.memory_gb))
        print(f"{name:<16}" + "".join(f"  {_cell(runs[idx]):>36}" for idx in range(len(trees))))


if __name__ == "__main__":
    main()

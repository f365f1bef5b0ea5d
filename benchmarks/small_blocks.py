"""Compile time and peak memory at small blocks, this tree beside another checkout in the same run.

Usage: python benchmarks/small_blocks.py [--main-tree PATH] [--timeout 600] [--memory-gb 8]

Cases: traces/small_8gpu.json at --gpus 8 --block-size 64 (4,100 blocks, about 2M segment pairs), and 200,000
sequences of 64 tokens at --gpus 64 --block-size 64 (200,000 one-block sequences). Each compile runs in a fresh
process under an address-space limit (--memory-gb) and a timeout; the table gives its wall time and peak RSS, or
why it did not finish.
"""

from __future__ import annotations

import argparse
import json
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


def _measure(tree: Path, case: tuple, timeout: float, memory_gb: float) -> str:
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
        return f"{figures['seconds']:8.2f} s {figures['rss_mb']:8.0f} MB"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--main-tree", type=Path, help="another checkout to measure beside this one")
    parser.add_argument("--timeout", type=float, default=600)
    parser.add_argument("--memory-gb", type=float, default=8)
    args = parser.parse_args()
    trees = [("this tree", ROOT)] + ([("main tree", args.main_tree.resolve())] if args.main_tree else [])
    print(f"{'case':<16}" + "".join(f"  {name:>28}" for name, _ in trees))
    for name, case in CASES.items():
        cells = [_measure(tree, case, args.timeout, args.memory_gb) for _, tree in trees]
        print(f"{name:<16}" + "".join(f"  {cell:>28}" for cell in cells))


if __name__ == "__main__":
    main()

"""Peak memory and CPU time of `fcp compile` at small blocks, this tree beside another checkout in the same run.

Usage: python benchmarks/compile_memory.py [--main-tree PATH] [--repeat 3] [--case NAME ...] [--quiet]

Each run is `fcp compile BATCH --gpus N --block-size 64 -o PLAN` as a user types it (summary and simulated layer
figures printed, unless --quiet passes -q), in a fresh process with the tree first on PYTHONPATH; the process's own
peak RSS and user + system CPU seconds are read from wait4 (what `/usr/bin/time -v` reports as "Maximum resident set
size", in kbytes, here over 10^6 as GB, and "User time" + "System time"). The table gives the largest peak RSS and the
median CPU seconds of --repeat runs (their range in brackets), and whether every run of every tree wrote the same
plan bytes.

Cases: traces/small_8gpu.json (262,144 tokens, ten sequences up to 128K) at 8 GPUs, the figure of issue 65 (F8:
"26 s of CPU at 2.76 GB"), and at 16; two 128K sequences at 8 GPUs. The trees take turns, each going first in every
other repeat (see benchmarks/small_blocks.py: on a VM the first touch of a page costs more than its reuse).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
CASES = {  # name: (batch, ranks)
    "small_8gpu @8": (ROOT / "traces" / "small_8gpu.json", 8),
    "small_8gpu @16": (ROOT / "traces" / "small_8gpu.json", 16),
    "2 x 128K @8": ([131072, 131072], 8),
}
BLOCK_SIZE = 64
RUN = "import sys; sys.path.insert(0, sys.argv.pop(1)); from cli import main; sys.argv[0] = 'fcp'; sys.exit(main())"


def measure(tree: Path, batch: Path, ranks: int, quiet: bool) -> tuple[float, float, str]:
    """(peak RSS in GB, as the issue reads /usr/bin/time's kbytes: kB / 10^6, user + system CPU seconds, sha256 of
    the plan) of one `fcp compile` in a fresh process."""
    with tempfile.TemporaryDirectory() as folder:
        plan = Path(folder) / "plan.fcp"
        command = [sys.executable, "-c", RUN, str(tree), "compile", str(batch), "--gpus", str(ranks), "--block-size",
                   str(BLOCK_SIZE), "-o", str(plan)] + (["-q"] if quiet else [])
        child = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
        _, status, usage = os.wait4(child.pid, 0)
        child.returncode = os.waitstatus_to_exitcode(status)
        errors = child.stderr.read().decode(errors="replace").strip().splitlines()
        child.stderr.close()
        if child.returncode != 0:
            raise SystemExit(f"{tree}: exit {child.returncode}: {errors[-1] if errors else '?'}")
        digest = hashlib.sha256(plan.read_bytes()).hexdigest()
    return usage.ru_maxrss / 1e6, usage.ru_utime + usage.ru_stime, digest


def _cell(runs: list[tuple[float, float, str]]) -> str:
    seconds = sorted(run[1] for run in runs)
    spread = f" [{seconds[0]:.1f}-{seconds[-1]:.1f}]" if len(seconds) > 1 else ""
    return f"{max(run[0] for run in runs):5.2f} GB {statistics.median(seconds):6.1f} s{spread}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--main-tree", type=Path, help="another checkout to measure beside this one")
    parser.add_argument("--repeat", type=int, default=3, help="runs of each case and tree")
    parser.add_argument("--case", action="append", choices=list(CASES), help="cases to run [all]")
    parser.add_argument("--quiet", action="store_true", help="compile with -q (no simulated figures printed)")
    args = parser.parse_args()
    trees = [("this tree", ROOT)] + ([("main tree", args.main_tree.resolve())] if args.main_tree else [])
    print(f"{'case':<16}" + "".join(f"  {name:>32}" for name, _ in trees) + "  same plan")
    with tempfile.TemporaryDirectory() as folder:
        for name in args.case or list(CASES):
            batch, ranks = CASES[name]
            if not isinstance(batch, Path):
                batch = Path(folder) / "batch.json"
                batch.write_text(json.dumps(CASES[name][0]))
            runs: dict[str, list] = {tree: [] for tree, _ in trees}
            for repeat in range(args.repeat):
                for tree, path in trees if repeat % 2 == 0 else trees[::-1]:
                    runs[tree].append(measure(path, batch, ranks, args.quiet))
            same = len({run[2] for tree_runs in runs.values() for run in tree_runs}) == 1
            print(f"{name:<16}" + "".join(f"  {_cell(runs[tree]):>32}" for tree, _ in trees) +
                  f"  {'yes' if same else 'NO'}", flush=True)


if __name__ == "__main__":
    main()

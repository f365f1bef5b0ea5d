"""Compile every shipped trace with every planner, in both layouts, and write the plans to a folder.

Usage: python benchmarks/plan_matrix.py OUT_DIR [--check REFERENCE_DIR]

For a refactor that must not change plans: write the matrix before the change, then run again with --check on the
old folder; it prints one line per plan, sha256-identical or not, and exits 1 if any plan differs.
"""

from __future__ import annotations

import argparse
import hashlib
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]  # the checkout this script belongs to
PLANNERS = ("fcp", "ring", "bytescale", "wlbllm", "magi")


def cases():
    for trace in sorted((ROOT / "traces").glob("*.json")):
        gpus = int(trace.stem.rsplit("_", 1)[-1].removesuffix("gpu"))  # the shipped traces name their GPU count
        for planner in PLANNERS:
            for layout in ("plan", "user") if planner == "fcp" else ("plan",):
                yield trace, gpus, planner, layout


def main() -> None:
    from fcp_compiler import compile_plan
    from fcp_compiler.format.inputs import load_batch

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out", type=Path)
    parser.add_argument("--check", type=Path)
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    differ = 0
    for trace, gpus, planner, layout in cases():
        data = compile_plan(load_batch(trace), gpus, planner=planner, layout=layout).to_bytes()
        name = f"{trace.stem}.{planner}.{layout}.fcp"
        (args.out / name).write_bytes(data)
        line = f"{name:50s} {len(data):>10d} B  sha256 {hashlib.sha256(data).hexdigest()[:16]}"
        if args.check:
            same = (args.check / name).read_bytes() == data
            differ += not same
            line += "  identical" if same else "  DIFFERS"
        print(line, flush=True)
    sys.exit(1 if differ else 0)


if __name__ == "__main__":
    main()

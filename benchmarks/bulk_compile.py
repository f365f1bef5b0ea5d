"""Bulk compile throughput: 200 paper-like batches at 64 GPUs, one process vs every core.

Usage: python benchmarks/bulk_compile.py [--batches 200] [--gpus 64]
"""

from __future__ import annotations

import argparse
import os
import tempfile
from pathlib import Path

from fcp_compiler import CompileOptions
from fcp_compiler.tools.bulk import bulk_compile
from fcp_compiler.format.inputs import parse_batch
from fcp_compiler.tools.traces import lognormal_batch


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batches", type=int, default=200)
    parser.add_argument("--gpus", type=int, default=64)
    args = parser.parse_args()
    batches = [(f"seed {seed}", parse_batch(lognormal_batch(args.gpus * 32768, 4096, 1.8, 64, 524288, seed)))
               for seed in range(args.batches)]
    cores = os.cpu_count() or 1
    walls = {}
    for jobs in (1, cores):
        with tempfile.TemporaryDirectory() as folder:
            summary = bulk_compile(batches, Path(folder), CompileOptions.of(args.gpus), jobs=jobs)
            walls[jobs] = summary.wall_seconds
            print(f"jobs {jobs}: {summary.compiled} plans in {summary.wall_seconds:.2f} s "
                  f"({summary.wall_seconds / summary.compiled * 1e3:.0f} ms a plan wall, "
                  f"{summary.compile_seconds / summary.compiled * 1e3:.0f} ms compile each)")
    print(f"{cores} processes take {walls[cores] / walls[1]:.2f}x the single-process wall time")


if __name__ == "__main__":
    main()

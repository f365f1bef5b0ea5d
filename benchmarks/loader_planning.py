"""Planning cost per training step in the data loader: `PlanningCollate` on one rank's worker.

Usage: python benchmarks/loader_planning.py [--gpus 64,256] [--steps 3]

Each step is a new paper-like batch (lognormal, median 4096, sigma 1.8, clipped to [64, 512K], 32K tokens per
GPU, seed = step) of int64 token documents. The collate compiles the plan, slices rank 0's share, builds its kernel
calls and takes its rows of tokens and labels: what a DataLoader worker does per step. Prints the median over the
steps of the whole call and of its parts (compile, slice = load_rank_plan + prepare_host, rows).
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from fcp_compiler.tools.traces import lognormal_batch
from fcp_runtime.loader import PlanningCollate

TOKENS_PER_GPU = 32768


def _documents(num_gpus: int, step: int) -> list[dict]:
    lengths = lognormal_batch(num_gpus * TOKENS_PER_GPU, 4096, 1.8, 64, 524288, seed=step)
    tokens = torch.arange(sum(lengths))
    return [{"tokens": doc, "labels": doc + 1} for doc in torch.split(tokens, lengths)]


def _timed_parts(collate: PlanningCollate, documents: list[dict]) -> dict[str, float]:
    """The collate's time, split by wrapping the functions it calls (same process, same work)."""
    import fcp_compiler.core.pipeline as pipeline
    import fcp_runtime.loader as loader

    parts = {"compile": 0.0, "slice": 0.0}

    def timed(name, function):
        def run(*args, **kwargs):
            start = time.perf_counter()
            try:
                return function(*args, **kwargs)
            finally:
                parts[name] += time.perf_counter() - start
        return run

    real = (pipeline.compile_plan, loader.load_rank_plan, loader.prepare_host)
    pipeline.compile_plan = timed("compile", real[0])
    loader.load_rank_plan, loader.prepare_host = timed("slice", real[1]), timed("slice", real[2])
    try:
        start = time.perf_counter()
        collate(documents)
        parts["total"] = time.perf_counter() - start
    finally:
        pipeline.compile_plan, loader.load_rank_plan, loader.prepare_host = real
    parts["rows"] = parts["total"] - parts["compile"] - parts["slice"]
    return parts


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--gpus", default="64,256")
    parser.add_argument("--steps", type=int, default=3)
    args = parser.parse_args()
    print(f"{'ranks':>5}  {'tokens':>9}  {'total s':>8}  {'compile s':>9}  {'slice s':>8}  {'rows s':>7}")
    for num_gpus in (int(value) for value in args.gpus.split(",")):
        collate = PlanningCollate(0, num_gpus)
        runs = [_timed_parts(collate, _documents(num_gpus, step)) for step in range(args.steps)]
        median = {key: statistics.median(run[key] for run in runs) for key in runs[0]}
        print(f"{num_gpus:>5}  {num_gpus * TOKENS_PER_GPU:>9}  {median['total']:>8.3f}  {median['compile']:>9.3f}  "
              f"{median['slice']:>8.3f}  {median['rows']:>7.3f}")


if __name__ == "__main__":
    main()

"""The trade between device memory and layer time: one batch compiled under several --memory-budget values.

Usage: python benchmarks/memory_budget.py [--trace traces/paper_lognormal_256gpu.json] [--gpus 256]
                                          [--budgets none,5,4.5,4,3.5,3]

Per budget: the busiest rank's peak bytes per pass (the plan header's max_buffer_bytes_fwd/_bwd, the memory account
of every tensor the runtime creates) and the median rank's, the simulated layer makespans (forward, backward, and
their sum against the unbudgeted plan's), the stages, how many refits the budget took, and the compile time. A
budget no schedule meets is reported as refused (fcp compile exits 2 on it).
"""

from __future__ import annotations

import argparse
import math
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from fcp_compiler import compile_plan  # noqa: E402
from fcp_compiler.core.simulate import layer_seconds, layer_stats  # noqa: E402
from fcp_compiler.errors import InfeasibleError  # noqa: E402
from fcp_compiler.format.inputs import load_batch  # noqa: E402
from fcp_compiler.tools.report import table  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--trace", default=str(ROOT / "traces" / "paper_lognormal_256gpu.json"))
    parser.add_argument("--gpus", type=int, default=256)
    parser.add_argument("--budgets", default="none,5,4.5,4,3.5,3")
    args = parser.parse_args()
    batch = load_batch(Path(args.trace))
    rows, reference = [], None
    for text in args.budgets.split(","):
        budget = math.inf if text == "none" else float(text)
        start = time.perf_counter()
        try:
            plan = compile_plan(batch, args.gpus, memory_budget_gib=budget)
        except InfeasibleError as refusal:
            rows.append([text, "refused", "", "", "", "", "", "", "", f"{time.perf_counter() - start:.1f}"])
            print(f"budget {text}: {refusal}", file=sys.stderr)
            continue
        seconds = time.perf_counter() - start
        figures = {**plan.stats, **layer_stats(plan)}
        header = plan.header
        total = layer_seconds(figures)
        reference = reference if reference is not None else total
        rows.append([text, f"{max(header.max_buffer_bytes_fwd) / 2**30:.2f}",
                     f"{max(header.max_buffer_bytes_bwd) / 2**30:.2f}",
                     f"{statistics.median(header.max_buffer_bytes_bwd) / 2**30:.2f}",
                     f"{figures['layer_makespan_fwd_s'] * 1e3:.2f}", f"{figures['layer_makespan_bwd_s'] * 1e3:.2f}",
                     f"{total / reference:.4f}", f"{header.num_fwd_stages}/{header.num_bwd_stages}",
                     plan.stats["memory"]["refits"], f"{seconds:.1f}"])
    print(f"{args.trace} at {args.gpus} GPUs (makespan x: against the first budget's plan)")
    print(table(["budget GiB", "fwd max GiB", "bwd max GiB", "bwd median GiB", "layer fwd ms", "layer bwd ms",
                 "makespan x", "stages", "refits", "compile s"], rows))


if __name__ == "__main__":
    main()

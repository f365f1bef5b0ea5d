"""A slow search over fcp's own compile options for batches whose layer gap is large: is there a better plan?

Usage: python benchmarks/option_search.py [--cases wlbllm+tail:256:1,prolong:256:0] [--eval-data DIR]

For each case (batch:gpus:seed of benchmarks/layer_objective.py's matrix) it compiles every combination of coalesce
(8, 16, 32), zig-zag (auto, off), token tolerance (0.005, 0.01, 0.02, the cap alone) and the placement objective
(the layer, or attention alone), validates and simulates each with the llama3-70b layer, and prints the default
plan's layer makespans and gaps beside the best found (by forward plus backward layer makespan) and what it took.
"""

from __future__ import annotations

import argparse
import itertools
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from placement import EVAL_DATA, TOKENS_PER_GPU, batches  # noqa: E402

from fcp_compiler import compile_plan  # noqa: E402
from fcp_compiler.format.validate import validate_plan  # noqa: E402
from fcp_compiler.tools.report import table  # noqa: E402
from fcp_compiler.core.simulate import layer_seconds, simulate_plan  # noqa: E402

WORST = "wlbllm+tail:256:1,prolong:256:0,prolong+tail:64:1,prolong+tail:256:0,prolong:256:1"
SPACE = {"coalesce": (8, 16, 32), "zigzag": ("auto", "off"), "token_tolerance": (0.005, 0.01, 0.02, 0.99),
         "model": ("llama3-70b", "none")}


def _score(lengths: list[int], gpus: int, options: dict) -> dict:
    plan = compile_plan(lengths, gpus, **options)
    validate_plan(plan.to_bytes())
    figures = simulate_plan(plan, model="llama3-70b").figures()
    return {key: figures[key] for key in ("layer_makespan_fwd_s", "layer_makespan_bwd_s", "layer_gap_fwd",
                                          "layer_gap_bwd")}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cases", default=WORST)
    parser.add_argument("--eval-data", type=Path, default=EVAL_DATA)
    args = parser.parse_args()
    makers = batches(args.eval_data)
    rows = []
    for case in args.cases.split(","):
        name, gpus, seed = case.split(":")
        lengths = makers[name](int(gpus) * TOKENS_PER_GPU, int(seed))
        default = _score(lengths, int(gpus), {})
        tried = []
        for values in itertools.product(*SPACE.values()):
            options = dict(zip(SPACE, values))
            tried.append((options, _score(lengths, int(gpus), options)))
            print(f"  {case} {options}: {tried[-1][1]['layer_gap_fwd']:.3f}/{tried[-1][1]['layer_gap_bwd']:.3f}",
                  file=sys.stderr, flush=True)
        options, best = min(tried, key=lambda t: layer_seconds(t[1]))
        rows.append([case, f"{default['layer_gap_fwd']:.3f}/{default['layer_gap_bwd']:.3f}",
                     f"{best['layer_gap_fwd']:.3f}/{best['layer_gap_bwd']:.3f}",
                     f"{layer_seconds(default) / layer_seconds(best):.3f}x", ", ".join(f"{k}={v}" for k, v in options.items()),
                     len(tried)])
    print(table(["case", "default gap fwd/bwd", "best gap fwd/bwd", "best over default", "best options", "plans"],
                rows))


if __name__ == "__main__":
    main()

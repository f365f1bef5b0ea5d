"""How much of the compile its loop-shaped algorithms take: the most that rewriting them could ever save.

Usage: python benchmarks/loop_share.py [--gpus 64,256] [--seeds 3] [--eval-data DIR] [--batches a,b]
                                       [--paper 4096]

The compile's array work is vectorised in numpy; what is left are algorithms that step through items, messages or
stages one at a time (some of them in numpy steps): levelling, the LPT refinement, the message placement loops, the
relay choice, the slot tables and the edge colouring's first fit. Each is timed around its calls (the outermost
call only) while the matrix's batches (benchmarks/placement.py, 32K tokens a GPU) compile once each in this process,
after one warm-up compile. It prints, per scale, the summed compile time, each algorithm's time and share, and what
the compile would take with all of them taking no time at all: a floor on the compile without changing what it
schedules (docs/RESULTS.md, "Compile time"). --paper N measures instead the
paper-like batch at N GPUs (seed 0, as `compile_latency.py --scaling` makes it), one compile after the warm-up.
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable

import fcp_compiler.algorithms.edge_colouring as edge_colouring
import fcp_compiler.algorithms.exchange as exchange
import fcp_compiler.core.passes.assign as assign_pass
import fcp_compiler.core.passes.coalesce as coalesce_pass
import fcp_compiler.core.passes.relay as relay_pass
from fcp_compiler import compile_plan
from fcp_compiler.tools.traces import lognormal_batch
from placement import TOKENS_PER_GPU, chosen_batches, matrix_arguments

# (label, module, attribute): each the name its caller looks up at call time, so that the timer wraps every call.
TIMED = (("levelling (level_stages)", coalesce_pass, "level_stages"),
         ("LPT refinement (refine_moves_swaps)", assign_pass, "refine_moves_swaps"),
         ("message placement (_place_around)", exchange, "_place_around"),
         ("relay choice (choose_relays)", relay_pass, "choose_relays"),
         ("colouring first fit (_first_fit)", edge_colouring, "_first_fit"))


class _Timers:
    """Seconds per label, counting only the outermost timed call (a timed algorithm inside another is its part)."""

    def __init__(self):
        self.seconds: dict[str, float] = {}
        self._depth = 0

    def wrap(self, label: str, function: Callable) -> Callable:
        def timed(*args, **kwargs):
            if self._depth:
                return function(*args, **kwargs)
            self._depth += 1
            start = time.perf_counter()
            try:
                return function(*args, **kwargs)
            finally:
                self.seconds[label] = self.seconds.get(label, 0.0) + time.perf_counter() - start
                self._depth -= 1
        return timed


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    matrix_arguments(parser)
    parser.add_argument("--paper", type=int, help="the paper-like batch at this many GPUs instead of the matrix")
    args = parser.parse_args()
    kinds, wanted = chosen_batches(parser, args)
    timers = _Timers()
    for label, module, name in TIMED:
        setattr(module, name, timers.wrap(label, getattr(module, name)))
    slots = exchange._Slots
    slots._masks = staticmethod(timers.wrap("slot tables (_Slots._masks)", slots._masks))
    for gpus in [args.paper] if args.paper else [int(value) for value in args.gpus.split(",")]:
        if args.paper:
            jobs = [lognormal_batch(gpus * TOKENS_PER_GPU, 4096, 1.8, 64, 524288, 0)]
        else:
            jobs = [[int(v) for v in kinds[name](gpus * TOKENS_PER_GPU, seed)] for name in wanted
                    for seed in range(args.seeds)]
        compile_plan(jobs[0], gpus)  # warm-up: imports, first-touch pages
        timers.seconds.clear()
        start = time.perf_counter()
        for lengths in jobs:
            compile_plan(lengths, gpus)
        total = time.perf_counter() - start
        print(f"{gpus} GPUs, {len(jobs)} batches: {total:.2f} s")
        for label, seconds in sorted(timers.seconds.items(), key=lambda item: -item[1]):
            print(f"  {label:<40} {seconds:7.2f} s {100 * seconds / total:6.1f}%")
        looped = sum(timers.seconds.values())
        print(f"  {'all of them':<40} {looped:7.2f} s {100 * looped / total:6.1f}%  -> {total - looped:.2f} s without",
              flush=True)


if __name__ == "__main__":
    main()

"""The seed's ablation (its Table 2): switch the techniques on one by one and simulate each plan."""

from __future__ import annotations

import math

from fcp_compiler.core.options import CompileOptions
from fcp_compiler.core.pipeline import compile_plan
from fcp_compiler.core.simulate import simulate_plan

# Normalised attention MFU of the seed's Table 2 (128 GPUs, forward / backward).
SEED_TABLE = {"base": (0.29, 0.37), "pipeline": (0.48, 0.46), "solver": (0.62, 0.59), "coalescer": (0.70, 0.69),
              "reshuffler": (0.75, 0.74), "plan layout": (None, None)}
# The seed's steps run in the user layout (its transparent reshuffle); the last step dispatches tokens once into the
# plan layout instead, as MagiAttention and DCP do, which is fcp's default.
STEPS = [
    ("base", dict(pipelined=False, matching_rounds=False, coalesce=1, reshuffle_overlap=False, layout="user")),
    ("pipeline", dict(pipelined=True, matching_rounds=False, coalesce=1, reshuffle_overlap=False,
                      layout="user")),
    ("solver", dict(pipelined=True, matching_rounds=True, coalesce=1, reshuffle_overlap=False, layout="user")),
    ("coalescer", dict(pipelined=True, matching_rounds=True, coalesce=16, reshuffle_overlap=False,
                       layout="user")),
    ("reshuffler", dict(pipelined=True, matching_rounds=True, coalesce=16, reshuffle_overlap=True,
                        layout="user")),
    ("plan layout", dict(pipelined=True, matching_rounds=True, coalesce=16, layout="plan")),
]


def run_ablation(batch, options: CompileOptions) -> list[dict]:
    """Compile and simulate the batch with each step of the ablation.

    Args:
        batch: lengths or a BatchSpec.
        options: ranks and the other compile options (block size, profile, ...); the ablated ones are set per step.
    Returns:
        one dict per step: name, normalized_mfu_fwd, normalized_mfu_bwd, makespans and the seed's figures.
    """
    steps = []
    # The techniques alone: the default memory budget (which refits only the plan layout's step, whose backward
    # holds more) is off unless the options give one.
    budget = math.inf if options.memory_budget_gib is None else options.memory_budget_gib
    for name, switches in STEPS:
        plan = compile_plan(batch, options=options.replace(**switches, memory_budget_gib=budget))
        figures = simulate_plan(plan).figures()
        steps.append({"name": name, "normalized_mfu_fwd": figures["normalized_mfu_fwd"],
                      "normalized_mfu_bwd": figures["normalized_mfu_bwd"],
                      "makespan_fwd_s": figures["makespan_fwd_s"], "makespan_bwd_s": figures["makespan_bwd_s"],
                      "exposed_comm_fwd_s": figures["exposed_comm_fwd_s"],
                      "seed_normalized_mfu_fwd": SEED_TABLE[name][0], "seed_normalized_mfu_bwd": SEED_TABLE[name][1],
                      "num_rounds": plan.stats["num_rounds"], "num_fwd_stages": plan.stats["num_fwd_stages"]})
    return steps

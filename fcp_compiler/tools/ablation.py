"""The seed's ablation (its Table 2): switch the techniques on one by one and simulate each plan."""

from __future__ import annotations

import math

import numpy as np

from fcp_compiler.algorithms.timeline import critical_path
from fcp_compiler.core.layer_model import LSE_BYTES
from fcp_compiler.core.options import CompileOptions
from fcp_compiler.core.pipeline import compile_plan
from fcp_compiler.core.simulate import simulate_plan
from fcp_compiler.format.call_plan import stacked_tiles_during_reshuffle
from fcp_compiler.format.inputs import Layout
from fcp_compiler.format.plan_format import PlanReader, TransferKind
from fcp_compiler.format.stacked import StackedRanks, stack_reader

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
        one dict per step: name, normalized_mfu_fwd, normalized_mfu_bwd, makespans, the busiest rank's compute,
        exposed communication, when the forward's stages 0 and 1 start (and, in the user layout, the bound on the
        latter: :func:`first_stage_bound`), the seed's figures and why_not_faster (:func:`why_not_faster`).
    """
    steps = []
    # The techniques alone: the default memory budget (which refits only the plan layout's step, whose backward
    # holds more) is off unless the options give one.
    budget = math.inf if options.memory_budget_gib is None else options.memory_budget_gib
    for name, switches in STEPS:
        plan = compile_plan(batch, options=options.replace(**switches, memory_budget_gib=budget))
        simulation = simulate_plan(plan)
        figures = simulation.figures()
        stacked = stack_reader(PlanReader(plan.to_bytes()))
        early = stacked_tiles_during_reshuffle(stacked)
        steps.append({"name": name, "normalized_mfu_fwd": figures["normalized_mfu_fwd"],
                      "normalized_mfu_bwd": figures["normalized_mfu_bwd"],
                      "makespan_fwd_s": figures["makespan_fwd_s"], "makespan_bwd_s": figures["makespan_bwd_s"],
                      **{f"{what}_{key}_s": figures[f"{what}_{key}_s"] for what in ("exposed_comm", "reshuffle")
                         for key in ("fwd", "bwd")},
                      **_path_figures(simulation),
                      # The busiest rank's attention compute in each pass (its kernels, at their calls' efficiency).
                      "busiest_compute_fwd_s": float(simulation.forward.busy.max()),
                      "busiest_compute_bwd_s": float(simulation.backward.busy.max()),
                      "num_tiles_during_reshuffle": int(early.sum()), "num_tiles": int(early.size),
                      **_first_stage_figures(stacked, simulation),
                      **{f"num_launch_stages_{key}": _launch_stages(stacked, f"tile_{column}")
                         for key, column in (("fwd", "stage"), ("bwd", "bwd_stage"))},
                      "seed_normalized_mfu_fwd": SEED_TABLE[name][0], "seed_normalized_mfu_bwd": SEED_TABLE[name][1],
                      "num_rounds": plan.stats["num_rounds"], "num_fwd_stages": plan.stats["num_fwd_stages"],
                      "num_bwd_stages": plan.stats["num_bwd_stages"]})
    for before, step in zip(steps, steps[1:]):
        step["why_not_faster"] = why_not_faster(before, step)
    return steps


def why_not_faster(before: dict, step: dict) -> str | None:
    """Why a step's normalized MFU did not rise over the step before it, in either pass, from what the two
    simulations measured; None where both rose. Each such pass names the two things a pass's time is made of: the
    busiest rank's kernels (slower in more, smaller launches: a pipeline without coalescing runs each rank's tiles
    in a launch a stage as their data arrives, where the step without it runs them in one launch after the last
    pull) and the pass's exposed communication (its critical path's messages and the reshuffles it waits for); the
    reshuffler also says how many tiles can run during the forward's input reshuffle (those whose tokens are on their
    rank in the user layout) and how much any order of the reshuffle could win before stage 1 at most (the simulated
    start of stage 1 less :func:`first_stage_bound`)."""
    passes = [key for key in ("fwd", "bwd") if step[f"normalized_mfu_{key}"] <= before[f"normalized_mfu_{key}"]]
    if not passes:
        return None
    reasons = []
    for key in passes:
        reason = (f"{key}: the busiest rank's kernels {before[f'busiest_compute_{key}_s'] * 1e3:.1f} -> "
                  f"{step[f'busiest_compute_{key}_s'] * 1e3:.1f} ms (tiles in {before[f'num_launch_stages_{key}']} "
                  f"-> {step[f'num_launch_stages_{key}']} launch stages a rank at most); its critical path "
                  f"{before[f'path_computing_{key}_s'] * 1e3:.1f} -> {step[f'path_computing_{key}_s'] * 1e3:.1f} ms "
                  f"computing across {before[f'path_ranks_{key}']} -> {step[f'path_ranks_{key}']} ranks (a stage "
                  f"waits for partners still computing the one before) and "
                  f"{before[f'exposed_comm_{key}_s'] * 1e3:.1f} -> {step[f'exposed_comm_{key}_s'] * 1e3:.1f} ms "
                  f"waiting on communication (messages and reshuffles)")
        if step["name"] == "reshuffler":
            reason += (f"; {step['num_tiles_during_reshuffle']} of {step['num_tiles']} tiles have their tokens on "
                       f"their rank in the user layout, to run during the input reshuffle (stage 0 starts at "
                       f"{step['stage0_start_fwd_s'] * 1e3:.1f} ms, both reshuffles take "
                       f"{step['reshuffle_fwd_s'] * 1e3:.1f} ms)" + _stage1_bound_text(step)
                       if key == "fwd" else "; only the forward's input reshuffle overlaps tiles")
        reasons.append(reason)
    return "; ".join(reasons)


def _launch_stages(stacked, column: str) -> int:
    """The most stages any rank runs tiles in, in a pass (the tile stage column `column`)."""
    stages, rank = stacked.arrays[column], stacked.rank_of(column)
    if stages.size == 0:
        return 0
    distinct = np.unique(rank * (int(stages.max()) + 1) + stages)
    return int(np.bincount(distinct // (int(stages.max()) + 1)).max())


def _path_figures(simulation) -> dict:
    """Each attention pass's critical path: its computing seconds and how many ranks it goes through."""
    figures = {}
    for key, result in (("fwd", simulation.forward), ("bwd", simulation.backward)):
        path = critical_path(result.stages)
        figures[f"path_computing_{key}_s"] = path["computing_s"]
        figures[f"path_ranks_{key}"] = len(set(path["ranks"]))
    return figures


def _stage1_bound_text(step: dict) -> str:
    """Why running tiles during the input reshuffle, in any order of its messages, can win little: the first
    stage's messages share the links with the reshuffle (:func:`first_stage_bound`)."""
    if step.get("stage1_bound_fwd_s") is None:
        return ""
    slack = step["stage1_start_fwd_s"] - step["stage1_bound_fwd_s"]
    return (f"; stage 1 cannot start before {step['stage1_bound_fwd_s'] * 1e3:.1f} ms, when the busiest link end "
            f"has carried the input reshuffle and the stage-0 messages "
            f"({step['stage1_bound_reshuffle_fwd_s'] * 1e3:.1f} + {step['stage1_bound_messages_fwd_s'] * 1e3:.1f} "
            f"ms), against {step['stage1_start_fwd_s'] * 1e3:.1f} ms simulated: whatever order the reshuffle's "
            f"messages take and whichever tiles run during it, the forward wins at most {slack * 1e3:.1f} ms "
            f"before stage 1")


def first_stage_bound(stacked: StackedRanks) -> dict | None:
    """In the user layout, the earliest the forward's stage 1 can start on its last rank, whatever the order of
    the input reshuffle's messages and whichever tiles run during it: a rank starts stage 1 after its stage-0
    messages (pulls and pushes) have landed, and a pull leaves only once its block has arrived through the
    reshuffle, so every link end (each rank's NIC and NVLink, each way) carries its share of the reshuffle and of
    the stage-0 messages before its rank's stage 1 (latencies left out). None in the plan layout or for a plan of
    one stage.

    Returns:
        {"bound_s": the most seconds any link end carries, "reshuffle_s" and "messages_s": that link end's
        seconds of each}.
    """
    header, a = stacked.header, stacked.arrays
    if header.layout is not Layout.USER or header.num_fwd_stages < 2:
        return None
    n, profile, shape = stacked.num_ranks, header.profile, header.shape
    node = stacked.ranks // profile.gpus_per_node
    q_bytes, kv_bytes = shape.q_bytes_per_token, shape.kv_bytes_per_token

    def seconds(src, dst, nbytes):
        """Per (rank, class, direction) seconds: [n, 2 (NVLink, NIC), 2 (out, in)]."""
        load = np.zeros((n, 2, 2))
        nic = (node[src] != node[dst]).astype(np.int64)
        rate = np.where(nic == 1, profile.network_gbps, profile.nvlink_gbps) * 1e9
        np.add.at(load, (src, nic, 0), nbytes / rate)
        np.add.at(load, (dst, nic, 1), nbytes / rate)
        return load

    sender = stacked.rank_of("reshuffle_send_peer")
    remote = a["reshuffle_send_peer"] != stacked.ranks[sender]
    reshuffle = seconds(sender[remote], a["reshuffle_send_peer"][remote],
                        a["reshuffle_send_length"][remote] * float(q_bytes + kv_bytes))
    receiver = stacked.rank_of("pull_recv_round")
    tokens = stacked.pull_tokens("recv").astype(np.float64)
    kind = a["pull_recv_kind"]
    first = a["pull_recv_round"] < header.coalesce
    messages = seconds(a["pull_recv_peer"][first], receiver[first],
                       tokens[first] * np.where(kind[first] == TransferKind.KV, kv_bytes, q_bytes))
    pusher = stacked.rank_of("fwd_push_send_round")
    pushed = a["fwd_push_send_round"] < header.coalesce
    row = a["fwd_push_send_pull"][pushed] + stacked.base("pull_recv_round")[pusher[pushed]]
    messages += seconds(pusher[pushed], a["pull_recv_peer"][row],
                        tokens[row] * float(q_bytes + LSE_BYTES * shape.q_heads))
    total = reshuffle + messages
    busiest = np.unravel_index(int(np.argmax(total)), total.shape)
    return {"bound_s": float(total[busiest]), "reshuffle_s": float(reshuffle[busiest]),
            "messages_s": float(messages[busiest])}


def _first_stage_figures(stacked: StackedRanks, simulation) -> dict:
    """When the forward's stage 0 and stage 1 start on their last rank (simulated) and, in the user layout, the
    bound on the latter (:func:`first_stage_bound`)."""
    stages = simulation.forward.stages
    bound = first_stage_bound(stacked)
    return {"stage0_start_fwd_s": float(stages.start[0].max()) if stages.start.size else 0.0,
            "stage1_start_fwd_s": float(stages.start[1].max()) if stages.start.shape[0] > 1 else None,
            "stage1_bound_fwd_s": bound["bound_s"] if bound else None,
            "stage1_bound_reshuffle_fwd_s": bound["reshuffle_s"] if bound else None,
            "stage1_bound_messages_fwd_s": bound["messages_s"] if bound else None}

"""Semantic diff of two plans: parameters, inputs, placement, schedule and quality figures."""

from __future__ import annotations

import numpy as np

from fcp_compiler.algorithms.bounds import imbalance_ratio, makespan_lower_bound
from fcp_compiler.core.layer_model import LSE_BYTES
from fcp_compiler.format.plan_format import PlanReader
from fcp_compiler.format.stacked import stack_reader

# What a regression is judged by: the simulated layer time of each pass (docs/USAGE.md, "fcp diff"). Every other
# figure is a proxy (balance, rounds, bytes) and is reported as a change: a proxy may improve while the time gets worse.
TIME_FIGURES = ("layer_makespan_fwd_s", "layer_makespan_bwd_s")
DEFAULT_TOLERANCE = 0.005  # simulated layer time may grow by 0.5% before it is a regression
MEMORY_FIGURES = ("max_buffer_bytes_fwd", "max_buffer_bytes_bwd")
PARAMETERS = ("planner", "num_ranks", "block_size", "coalesce", "token_cap", "zigzag", "layout", "mask",
              "num_sequences", "total_tokens", "num_blocks", "shape", "profile", "pipelined", "rounds_kind",
              "reshuffle_overlap", "kv_prefetch", "format_version", "model", "memory_budget_bytes")


def plan_figures(reader: PlanReader, simulate: bool = True) -> dict:
    """Quality figures of a plan, from the plan file alone (docs/DESIGN.md section 5)."""
    from fcp_compiler.core.simulate import simulate_plan

    header = reader.header
    simulation = simulate_plan(reader)
    compute = simulation.planned_compute
    stack = stack_reader(reader)  # whole-block pulls listed once, over the stack
    kv_bytes, q_bytes = header.shape.kv_bytes_per_token, header.shape.q_bytes_per_token
    kinds, pull_rank = stack.arrays["pull_recv_kind"], stack.rank_of("pull_recv_kind")
    per_pull = stack.pull_tokens("recv")
    received = np.bincount(pull_rank, weights=per_pull * np.where(kinds == 0, kv_bytes, q_bytes),
                           minlength=header.num_ranks)
    bound, _ = makespan_lower_bound(float(compute.sum()), header.num_ranks, 0.0)  # tiles may move: mean bound
    # Forward messages across nodes: pulls, and partial outputs pushed back along Q pulls.
    sender = stack.arrays["pull_recv_peer"]
    push_rank = stack.rank_of("fwd_push_send_pull")
    push_pull = stack.arrays["fwd_push_send_pull"] + stack.bounds["pull_recv_peer"][push_rank]
    push_bytes = per_pull[push_pull] * (q_bytes + LSE_BYTES * header.shape.q_heads)
    src = np.concatenate((sender, push_rank))
    dst = np.concatenate((pull_rank, sender[push_pull]))
    nbytes = np.concatenate((per_pull * np.where(kinds == 0, kv_bytes, q_bytes), push_bytes))
    per_node = header.profile.gpus_per_node
    across = src // per_node != dst // per_node
    figures = {"compute_imbalance": imbalance_ratio(compute), "comm_imbalance": imbalance_ratio(received),
               "makespan_lower_bound_ratio": float(compute.max() / bound) if bound > 0 else 1.0,
               "total_comm_bytes": int(received.sum()), "max_rank_recv_bytes": int(received.max()),
               "num_rounds": header.num_rounds, "num_fwd_rounds": header.num_fwd_rounds,
               "num_bwd_rounds": header.num_bwd_rounds, "num_fwd_stages": header.num_fwd_stages,
               "num_bwd_stages": header.num_bwd_stages, "max_buffer_tokens": header.max_buffer_tokens,
               "nic_bytes": int(nbytes[across].sum()),
               "max_rank_nic_send_bytes": int(np.bincount(src[across], weights=nbytes[across],
                                                          minlength=header.num_ranks).max()),
               "max_rank_nic_recv_bytes": int(np.bincount(dst[across], weights=nbytes[across],
                                                          minlength=header.num_ranks).max()),
               "nic_degree": header.nic_degree, "nvlink_degree": header.nvlink_degree,
               # The busiest rank's device memory per pass, as the header states it (fcp validate checks it).
               "max_buffer_bytes_fwd": max(header.max_buffer_bytes_fwd),
               "max_buffer_bytes_bwd": max(header.max_buffer_bytes_bwd)}
    if simulate:
        sim = simulation.figures()
        figures.update(normalized_mfu_fwd=sim["normalized_mfu_fwd"], normalized_mfu_bwd=sim["normalized_mfu_bwd"],
                       makespan_fwd_s=sim["makespan_fwd_s"], makespan_bwd_s=sim["makespan_bwd_s"],
                       layer_makespan_fwd_s=sim["layer_makespan_fwd_s"],
                       layer_makespan_bwd_s=sim["layer_makespan_bwd_s"], layer_gap_fwd=sim["layer_gap_fwd"],
                       layer_gap_bwd=sim["layer_gap_bwd"])
    return figures


def diff_plans(a: PlanReader, b: PlanReader, tolerance: float = DEFAULT_TOLERANCE, sample: int = 8) -> dict:
    """What differs between plan a (before) and plan b (after).

    Args:
        a, b: the two plans.
        tolerance: relative growth of a pass's simulated layer time (layer_makespan_fwd_s, _bwd_s) allowed before
            it is a regression.
        sample: how many moved blocks to list.
    Returns:
        {"identical", "changed", "regressed", "parameters", "inputs", "blocks", "windows" (sequences whose mask
        window differs), "programs" (ranks whose program arrays differ, with the arrays), "figures" (each changed
        figure's a, b and, from a non-zero a, its relative_change), "regressions" (a pass's layer time grown by
        more than `tolerance`, or device memory that crossed the budget: a, b and relative_change or budget)}.
    """
    ha, hb = a.header, b.header
    parameters = {}
    for name in PARAMETERS:
        va = getattr(ha, name)
        vb = getattr(hb, name)
        if va != vb:
            dump = lambda v: v.model_dump(mode="json") if hasattr(v, "model_dump") else (  # noqa: E731
                v.value if hasattr(v, "value") else v)
            parameters[name] = {"a": dump(va), "b": dump(vb)}
    inputs = {"a": ha.inputs_digest, "b": hb.inputs_digest} if ha.inputs_digest != hb.inputs_digest else {}
    blocks = {}
    ta, tb = a.tables, b.tables
    same_blocks = all(np.array_equal(getattr(ta, n), getattr(tb, n))
                      for n in ("seq_lengths", "seg_block", "seg_seq", "seg_start", "seg_end"))
    if same_blocks and ha.num_ranks == hb.num_ranks:
        owner_a = np.empty(ha.num_blocks, dtype=np.int64)
        owner_b = np.empty(hb.num_blocks, dtype=np.int64)
        for program in a.ranks():
            owner_a[program.blocks] = program.rank
        for program in b.ranks():
            owner_b[program.blocks] = program.rank
        moved = np.flatnonzero(owner_a != owner_b)
        if moved.size:
            blocks = {"moved": int(moved.size), "of": int(ha.num_blocks),
                      "sample": [{"block": int(x), "a": int(owner_a[x]), "b": int(owner_b[x])} for x in moved[:sample]]}
    elif not same_blocks:
        blocks = {"resharded": True, "a_blocks": ha.num_blocks, "b_blocks": hb.num_blocks}
    fa, fb = plan_figures(a), plan_figures(b)
    figures = {name: _change(fa[name], fb[name]) for name in fa if fa[name] != fb[name]}
    regressions = _regressions(fa, fb, ha.memory_budget_bytes or hb.memory_budget_bytes, tolerance)
    programs = _program_changes(a, b, sample)
    windows = {}
    if ta.seq_window.shape == tb.seq_window.shape and not np.array_equal(ta.seq_window, tb.seq_window):
        changed_windows = np.flatnonzero(ta.seq_window != tb.seq_window)
        windows = {"sequences": int(changed_windows.size),
                   "sample": [{"sequence": int(x), "a": int(ta.seq_window[x]), "b": int(tb.seq_window[x])}
                              for x in changed_windows[:sample]]}
    changed = bool(parameters or inputs or blocks or figures or programs or windows)
    return {"identical": not changed, "changed": changed, "regressed": bool(regressions),
            "parameters": parameters, "inputs": inputs, "blocks": blocks, "windows": windows, "programs": programs,
            "figures": figures, "regressions": regressions}


def _program_changes(a: PlanReader, b: PlanReader, sample: int) -> dict:
    """Which ranks' programs differ, and in which arrays (a sample of ranks); {} when every program is the same."""
    if a.header.num_ranks != b.header.num_ranks:
        return {"ranks": a.header.num_ranks, "of": a.header.num_ranks, "sample": []}
    differing = []
    for pa, pb in zip(a.ranks(), b.ranks()):
        names = [name for name in pa.arrays if not np.array_equal(pa.arrays[name], pb.arrays[name])]
        if names:
            differing.append({"rank": pa.rank, "arrays": names})
    return {"ranks": len(differing), "of": a.header.num_ranks, "sample": differing[:sample]} if differing else {}


def _change(before, after) -> dict:
    """A changed figure: both values, and the relative change where it has a base (none from zero)."""
    change = {"a": before, "b": after}
    if isinstance(before, (int, float)) and isinstance(after, (int, float)) and before != 0:
        change["relative_change"] = (after - before) / abs(before)
    return change


def _regressions(fa: dict, fb: dict, budget: int | None, tolerance: float) -> dict:
    """The figures by which plan b is worse than a: a pass's simulated layer time grown by more than `tolerance`
    (relative), or a pass's device memory over the memory budget where a's was within it."""
    regressions = {}
    for name in TIME_FIGURES:
        if fa[name] > 0 and (fb[name] - fa[name]) / fa[name] > tolerance:
            regressions[name] = _change(fa[name], fb[name])
    if budget is not None:
        for name in MEMORY_FIGURES:
            if fb[name] > budget >= fa[name]:
                regressions[name] = _change(fa[name], fb[name]) | {"budget": budget}
    return regressions


def invalid_after(error: Exception) -> dict:
    """The diff of a valid plan a against a plan b that does not validate: a regression, named by b's first broken
    invariant (b is not simulated: the simulator trusts only valid plans)."""
    regressions = {"validation": {"a": "valid", "b": str(error)}}
    return {"identical": False, "changed": True, "regressed": True, "parameters": {}, "inputs": {}, "blocks": {},
            "windows": {}, "programs": {}, "figures": {}, "regressions": regressions}

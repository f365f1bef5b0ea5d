"""Compact text tables for the command line, and the plan summaries `fcp inspect` shows."""

from __future__ import annotations

import math

from collections.abc import Sequence

import numpy as np

from fcp_compiler.format.plan_format import PlanReader, RankProgram
from fcp_compiler.tools.diff import TIME_FIGURES


def table(headers: Sequence[str], rows: Sequence[Sequence[object]], indent: str = "  ") -> str:
    """Right-aligned columns under a header line."""
    cells = [[str(h) for h in headers]] + [[_cell(v) for v in row] for row in rows]
    widths = [max(len(row[i]) for row in cells) for i in range(len(headers))]
    return "\n".join(indent + "  ".join(c.rjust(w) for c, w in zip(row, widths)) for row in cells)


def _cell(value: object) -> str:
    if isinstance(value, float):
        return f"{value:.4g}"
    return str(value)


def percent(value: float) -> str:
    return f"{100 * value:.2f}%"


def human_bytes(count: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(count) < 1024 or unit == "TiB":
            return f"{count:.1f} {unit}" if unit != "B" else f"{int(count)} B"
        count /= 1024
    return f"{count:.1f} TiB"


def _layer_line(stats: dict) -> list[str]:
    """The layer makespans beside their certified lower bounds, when the stats hold them."""
    if "layer_gap_fwd" not in stats:
        return []
    parts = [f"{name} {stats[f'layer_makespan_{name}_s'] * 1e3:.2f} ms (bound "
             f"{stats[f'layer_makespan_lower_bound_{name}_s'] * 1e3:.2f}, gap {stats[f'layer_gap_{name}']:.3f})"
             for name in ("fwd", "bwd")]
    return [f"  layer ({stats['model']}): " + ", ".join(parts) + f"; normalized layer MFU "
            f"{stats['normalized_layer_mfu']:.3f}"]


def _schedules(stats: dict) -> str:
    """", N schedules" where the compile finished several plans (its reshuffle pass, every finished plan's last, ran
    N times), else nothing."""
    made = stats.get("pass_calls", {}).get("reshuffle", 0)
    return f", {made} schedules" if made > 1 else ""


def _floor_line(stats: dict) -> list[str]:
    """The floor's verdict: which candidate won, what each scored (fwd + bwd layer ms, or over the memory budget)."""
    floor = stats.get("floor")
    if not floor:
        return []
    budget = floor["memory_budget_tokens"]
    scored = [f"{row['name']} " + _candidate_figure(row, row["max_buffer_tokens"] > budget)
              for row in floor["candidates"]]
    scored += [f"{row['placement']} placement skipped ({_skipped_because(row)})" for row in floor.get("pruned", [])]
    scored += [f"{row['candidate']} not scheduled (its busiest receiver takes in {row['most_received_tokens']} "
               f"tokens, {row['most_received_tokens'] / budget:.1f}x the budget)"
               for row in floor.get("out_of_reach", [])]
    count = len(floor["candidates"])
    last = floor.get("backward_last_stage") or {}
    if "kept" in last:  # the winner again with its backward's pulled-K,V tiles out of the last stage
        other = f"{last['out_of_last_stage_s'] * 1e3:.1f} ms" if last["out_of_last_stage_s"] is not None else \
            f"over memory ({last['max_buffer_tokens']} tokens)"
        scored.append(f"{floor['winner']}'s backward last stage: {last['kept']} (pulled-K,V tiles out of it {other})")
    if last.get("pulled_back_s") is not None:  # and with its tiles pulled back into stages with room
        scored.append(f"tiles pulled back: {'kept' if last['pulled_back'] else 'not kept'} "
                      f"({last['pulled_back_s'] * 1e3:.1f} ms)")
    return [f"  floor: kept {kept_candidate(stats)} of {count} candidate{'s' if count != 1 else ''} scheduled (layer "
            f"fwd + bwd, live buffers <= {budget} tokens): " + "; ".join(scored)]


def kept_candidate(stats: dict) -> str:
    """The floor candidate the written plan is: the floor's fastest, unless the device memory budget kept another
    (stats["memory"]["kept"]) or the fastest in smaller stages."""
    memory = stats.get("memory") or {}
    winner = stats["floor"]["winner"]
    if not memory.get("refitted"):
        return winner
    if memory["kept"] == "the winner, in smaller stages":
        return f"{winner} in smaller stages"
    return memory["kept"]


def floor_progress_line(row: dict) -> str:
    """What `fcp compile` shows on a terminal as each floor candidate is scheduled (a candidate over the memory
    budget is recorded with infinite times)."""
    over = row["layer_makespan_fwd_s"] is not None and math.isinf(row["layer_makespan_fwd_s"])
    return f"  floor: {row['name']} {_candidate_figure(row, over)} ({row['seconds']:.1f} s)"


def _candidate_figure(row: dict, over_memory: bool) -> str:
    """One floor candidate's layer time (fwd + bwd), or why it has none."""
    if over_memory:
        return f"over memory ({row['max_buffer_tokens']} tokens)"
    if row["layer_makespan_fwd_s"] is None:
        return "not simulated (the only candidate)"
    figure = f"{(row['layer_makespan_fwd_s'] + row['layer_makespan_bwd_s']) * 1e3:.1f} ms"
    if row.get("other_kinds_s"):  # layer kinds: the others' time a layer of this kind, by the mix
        figure += f" + {row['other_kinds_s'] * 1e3:.1f} ms other kinds"
    return figure


def _skipped_because(row: dict) -> str:
    """Why the floor did not schedule a placement."""
    if row.get("refused"):
        return f"refused: {row['refused']}"
    if row.get("same_as"):
        return f"the same as {row['same_as']}"
    return f"its busiest rank alone takes {row['busy_lower_bound_s'] * 1e3:.1f} ms"


def compile_summary(stats: dict, path: str | None) -> str:
    """The table `fcp compile` prints."""
    blocks = "zigzag" if stats["zigzag"] else "plain"
    lines = [
        f"fcp compile: {stats['total_tokens']} tokens in {stats['num_sequences']} sequences ({stats['mask']}) -> "
        f"{stats['num_ranks']} ranks, block {stats['block_size']} ({blocks}), "
        f"coalesce {stats['coalesce']}/{stats['bwd_coalesce']}, "
        f"{stats['layout']} layout" + (", K,V prefetch" if stats.get("kv_prefetch") else ""),
        table(["blocks", "tiles", "offloaded", "transfers", "relayed", "delta", "pull rounds", "stages fwd/bwd",
               "compute imb", "comm imb", "LB ratio", "tokens/rank", "cap"],
              [[stats["num_blocks"], stats["num_tiles"], stats["num_offloaded_tiles"], stats["num_transfers"],
                stats["num_relayed_transfers"], stats["max_degree"], stats["num_rounds"],
                f"{stats['num_fwd_stages']}/{stats['num_bwd_stages']}",
                percent(stats["compute_imbalance"]),
                percent(stats["comm_imbalance"]), f"{stats['makespan_lower_bound_ratio']:.4f}",
                stats["max_tokens_per_rank"], stats["token_cap"]]]),
        f"  traffic {human_bytes(stats['total_comm_bytes'])} forward, most received by one rank "
        f"{human_bytes(stats['max_rank_recv_bytes'])}; NIC {human_bytes(stats['nic_bytes'])} (busiest GPU sends "
        f"{human_bytes(stats['max_rank_nic_send_bytes'])}, receives {human_bytes(stats['max_rank_nic_recv_bytes'])}),"
        f" NVLink {human_bytes(stats['nvlink_bytes'])}, {stats['num_fanned_out_transfers']} pulls fanned out in "
        f"their node; Delta NIC {stats['nic_degree']}, NVLink {stats['nvlink_degree']} ({stats['nvlink_lanes']} a "
        f"round)",
        f"  rounds with pushes: fwd {stats['num_fwd_rounds']} (at least {stats['fwd_exchange_degree']}), bwd "
        f"{stats['num_bwd_rounds']} (at least {stats['bwd_exchange_degree']}); live buffers <= "
        f"{stats['max_buffer_tokens']} tokens",
        *_memory_line(stats),
        *_layer_line(stats),
        *_floor_line(stats),
        *kinds_lines(stats),
        "  compile {:.3f} s{}{}: {}".format(stats["compile_seconds"], f" ({stats['floor']['seconds']:.3f} s of it "
                                            "in the floor)" if stats.get("floor") else "", _schedules(stats), "  ".join(
            f"{name} {seconds:.3f}" for name, seconds in stats["pass_seconds"].items())),
    ]
    if path:
        lines.append(f"  wrote {path} ({human_bytes(stats['plan_bytes'])}, sha256 {stats['plan_sha256'][:16]})")
    return "\n".join(lines)


def _memory_line(stats: dict) -> list[str]:
    """The busiest rank's device memory per pass against the budget (stats["memory"]), where the plan has it."""
    memory = stats.get("memory")
    if not memory:
        return []
    budget = memory["budget_bytes"]
    held = f"budget {budget / 2**30:.2f} GiB" if budget is not None else "no budget"
    if memory["refitted"] and memory["kept"] == "the winner, in smaller stages":
        held += (f"; stages made smaller to fit, {memory['refits']} tr{'ies' if memory['refits'] > 1 else 'y'}: "
                 f"it peaked at {memory['unbudgeted_peak_bytes'] / 2**30:.2f} GiB")
    elif memory["refitted"]:
        held += (f"; the floor's fastest peaked at {memory['unbudgeted_peak_bytes'] / 2**30:.2f} GiB, and the kept "
                 f"candidate fits at its own stages and simulates faster than the fastest in smaller stages")
    elif not memory["met"]:
        why = {"own tokens": f"its own tokens need {memory['floor_bytes'] / 2**30:.2f} GiB",
               "no schedule": f"no schedule of this placement goes below {memory['least_peak_bytes'] / 2**30:.2f} GiB",
               "work": f"{memory['refits']} smaller schedules tried, as many as the floor's work bound allows at "
                       f"this size (a budget given with --memory-budget is met whatever it costs)"}[memory["unmet"]]
        held += f" not met: {why}; the plan is kept as scheduled, with no budget stated"
    return [f"  device memory: busiest rank {memory['peak_bytes_fwd'] / 2**30:.2f} GiB forward, "
            f"{memory['peak_bytes_bwd'] / 2**30:.2f} GiB backward ({held}{_finished_clause(memory)})"]


def _finished_clause(memory: dict) -> str:
    """How the plan kept in the winner's place was finished as the winner is (stats["memory"]["backward_last_stage"]),
    where it was."""
    record = memory.get("backward_last_stage")
    if not record:
        return ""
    moved = ["pulled-K,V tiles out of the backward's last stage"] if record.get("kept") == "out of last stage" else []
    moved += ["tiles pulled back"] if record.get("pulled_back") else []
    if not moved:
        return "; finished as the floor's winner: no variant faster"
    if not record.get("within_budget_bytes", True):
        return f"; finished as the floor's winner: {' and '.join(moved)} faster, but over the budget: not kept"
    return f"; finished as the floor's winner: {' and '.join(moved)}"


def memory_warning(stats: dict) -> str | None:
    """One stderr line where the default device memory budget was not met (the plan is written as scheduled, with
    no budget stated): the overrun, and what to do. None where the budget held or there was none."""
    memory = stats.get("memory")
    if not memory or memory["met"] or memory["budget_bytes"] is None:
        return None
    peak = max(memory["peak_bytes_fwd"], memory["peak_bytes_bwd"])
    budget = memory["budget_bytes"]
    return (f"fcp: warning: the plan's busiest rank peaks at {peak / 2**30:.2f} GiB, over the "
            f"{budget / 2**30:.2f} GiB device memory budget by {(peak - budget) / 2**30:.2f} GiB; it may not fit: "
            f"give more GPUs or a smaller --block-size, or --memory-budget none to accept it")


def compare_rows(rows: Sequence[dict]) -> str:
    """The table `fcp compare` prints, each scale's methods ranked by layer makespan; methods that could not plan a
    scale are listed under it with the reason."""
    def speedup(row: dict, key: str) -> str:
        return f"{row[f'fcp_speedup_{key}']:.2f}x" if row.get(f"fcp_speedup_{key}") else "-"

    planned = sorted((r for r in rows if not r.get("error")), key=lambda r: (r["gpus"], r["layer_rank"]))
    lines = [table(["gpus", "rank", "method", "placement", "fan-out", "live buffers", "layer fwd ms", "layer bwd ms",
                    "gap fwd", "gap bwd", "compute imb", "max rank bytes", "norm MFU fwd", "norm MFU bwd",
                    "FCP speedup fwd", "bwd"],
                   [[r["gpus"], r["layer_rank"], r["method"], r.get("placement", r["method"]),
                     "on" if r.get("node_fan_out") else "off",
                     r.get("max_buffer_tokens", "-"), f"{r['layer_makespan_fwd_s'] * 1e3:.2f}",
                     f"{r['layer_makespan_bwd_s'] * 1e3:.2f}", f"{r['layer_gap_fwd']:.3f}", f"{r['layer_gap_bwd']:.3f}",
                     f"{r['compute_imbalance']:.3f}", human_bytes(r["max_rank_comm_bytes"]),
                     f"{r['normalized_mfu_fwd']:.3f}", f"{r['normalized_mfu_bwd']:.3f}", speedup(r, "fwd"),
                     speedup(r, "bwd")]
                    for r in planned])]
    lines += [f"  not planned: {r['method']} at {r['gpus']} GPUs: {r['error']}" for r in rows if r.get("error")]
    lines += _ahead_of_fcp(planned)
    lines.append("  placement: what each plan placed its blocks by; fcp's is the floor candidate it kept, which may "
                 "be a baseline's placement (magi, greedy) where that simulated faster")
    lines.append("  every baseline in the plan layout (tokens dispatched once, as their systems do); fcp in the plan "
                 "layout and, as fcp-user, in the user layout (reshuffles around attention)")
    return "\n".join(lines)


def _ahead_of_fcp(planned: Sequence[dict]) -> list[str]:
    """A line for each method ranked above fcp at its scale, with its live buffers against fcp's (a method that holds
    more may buy its speed with memory: --fit-memory compares at fcp's budget)."""
    fcp = {r["gpus"]: r for r in planned if r["method"] == "fcp"}
    lines = []
    for row in planned:
        own = fcp.get(row["gpus"])
        if own is None or row["layer_rank"] >= own["layer_rank"] or row["method"] == "fcp":
            continue
        ratio = row["max_buffer_tokens"] / own["max_buffer_tokens"] if own["max_buffer_tokens"] else math.inf
        memory = (f"with {ratio:.2f}x fcp's live buffers (--fit-memory holds every method to fcp's budget)"
                  if ratio > 1 else f"with {ratio:.2f}x fcp's live buffers")
        lines.append(f"  {row['method']} is ahead of fcp at {row['gpus']} GPUs, {memory}")
    return lines


def rank_rows(reader: PlanReader) -> list[dict]:
    """Per-rank figures of a plan: tokens held, blocks, tiles, pulls (over the NIC, and re-sent from a received
    buffer: fan-out and relays) and pushes."""
    tables = reader.tables
    per_node = reader.header.profile.gpus_per_node
    seg_tokens = tables.seg_end - tables.seg_start
    block_tokens = np.bincount(tables.seg_block, weights=seg_tokens).astype(np.int64)
    rows = []
    for program in reader.ranks():
        a = program.arrays
        offloaded = int(np.isin(a["tile_q_block"], a["blocks"], invert=True).sum())
        rows.append({
            "rank": program.rank, "tokens": int(block_tokens[a["blocks"]].sum()), "blocks": int(a["blocks"].size),
            "tiles": int(a["tile_q_block"].size), "tiles_for_others": offloaded,
            "pulls_sent": int(a["pull_send_round"].size), "pulls_received": int(a["pull_recv_round"].size),
            "nic_sent": int((a["pull_send_peer"] // per_node != program.rank // per_node).sum()),
            "nic_received": int((a["pull_recv_peer"] // per_node != program.rank // per_node).sum()),
            "forwarded": int((a["pull_send_source"] >= 0).sum()),
            "tokens_received": int(seg_tokens[a["pull_recv_segs"]].sum()),
            "fwd_pushes_sent": int(a["fwd_push_send_round"].size),
            "bwd_pushes_sent": int(a["bwd_push_send_round"].size),
        })
    return rows


def add_memory_columns(reader: PlanReader, rows: list[dict]) -> None:
    """Add each rank's device memory peak per pass (GiB, the plan's dtype and layout) to its row of
    :func:`rank_rows`: as the header states it (the memory account, which fcp validate recomputes)."""
    header = reader.header
    for row, forward, backward in zip(rows, header.max_buffer_bytes_fwd, header.max_buffer_bytes_bwd):
        row["peak_fwd_gib"], row["peak_bwd_gib"] = round(forward / 2 ** 30, 3), round(backward / 2 ** 30, 3)


def rank_program_text(program: RankProgram) -> str:
    """Stage-by-stage view of one rank's forward and backward programs: messages, tiles and the kernel calls that
    compute them, and the device memory each pass peaks at (the plan's memory account, in the plan's dtype)."""
    from fcp_compiler.format.call_plan import rank_calls, step_requests
    from fcp_compiler.format.memory import rank_peak_bytes

    a = program.arrays
    header = program.header
    requests = step_requests(program)
    calls = rank_calls(program, requests)
    per_request = np.bincount(calls.call_request, minlength=len(requests))
    num_calls: dict[tuple[str, int], int] = {}
    for request, count in zip(requests, per_request.tolist()):
        key = (request.pass_name, max(request.stage, 0))
        num_calls[key] = num_calls.get(key, 0) + count
    peak = rank_peak_bytes(program, requests=requests, calls=calls)
    stage_rows = []
    for name, pull_round, tile_stage, coalesce in (("fwd", "round", "tile_stage", header.coalesce),
                                                   ("bwd", "bwd_round", "tile_bwd_stage", header.bwd_coalesce)):
        stages = np.concatenate((a[f"pull_send_{pull_round}"] // coalesce, a[f"pull_recv_{pull_round}"] // coalesce,
                                 a[tile_stage], a[f"{name}_push_send_round"] // coalesce,
                                 a[f"{name}_push_recv_round"] // coalesce))
        for stage in np.unique(stages).tolist():  # only the stages this rank uses (a header may claim many)
            counts = [int((a[f"pull_send_{pull_round}"] // coalesce == stage).sum()),
                      int((a[f"pull_recv_{pull_round}"] // coalesce == stage).sum()),
                      int((a[tile_stage] == stage).sum()),
                      int((a[f"{name}_push_send_round"] // coalesce == stage).sum()),
                      int((a[f"{name}_push_recv_round"] // coalesce == stage).sum())]
            if any(counts):
                stage_rows.append([name, stage, *counts[:3], num_calls.get((name, stage), 0), *counts[3:]])
    return "\n".join([
        f"rank {program.rank}: {a['blocks'].size} blocks {a['blocks'].tolist()[:16]}"
        f"{' ...' if a['blocks'].size > 16 else ''}",
        f"  reshuffle ({header.layout.value} layout: {'not run' if header.layout.value == 'plan' else 'per call'}): "
        f"sends {a['reshuffle_send_length'].sum()} tokens in {a['reshuffle_send_length'].size} runs, "
        f"receives {a['reshuffle_recv_length'].sum()} tokens in {a['reshuffle_recv_length'].size} runs",
        table(["pass", "stage", "pulls sent", "pulls recv", "tiles", "kernel calls", "pushes sent", "pushes recv"],
              stage_rows),
        f"  device memory at its peak ({header.shape.dtype.value}, {header.layout.value} layout): forward "
        f"{peak['fwd'] / 2 ** 30:.2f} GiB, backward {peak['bwd'] / 2 ** 30:.2f} GiB (accumulators, received buffers, "
        f"a kernel call's packed inputs and outputs; not the inputs Q, K, V or what the forward saves"
        f"{', nor the reshuffle buffers' if header.layout.value == 'user' else ''})",
    ])


def bulk_summary(summary, out_dir) -> str:
    """The table a bulk `fcp compile steps.jsonl` prints."""
    if not summary.compiled:  # no figure to show: a row of zeros would read like a measurement
        return f"  all {summary.total} plans were already in {out_dir}/ and intact; nothing compiled"
    per_plan = summary.compile_seconds / summary.compiled
    return table(["plans", "compiled", "skipped", "wall s", "s per plan", "worst compute imb", "worst comm imb"],
                 [[summary.total, summary.compiled, summary.skipped, f"{summary.wall_seconds:.2f}", f"{per_plan:.3f}",
                   f"{summary.worst_compute_imbalance:.4f}", f"{summary.worst_comm_imbalance:.4f}"]]) + \
        f"\n  plans in {out_dir}/"


def progress_bar(done: int, total: int, width: int = 30) -> str:
    """`[####......] done/total plans`, redrawn in place on a terminal."""
    filled = width * done // max(total, 1)
    return f"\r  [{'#' * filled}{'.' * (width - filled)}] {done}/{total} plans"


def validation_summary(path, report) -> str:
    """The line `fcp validate` prints for a valid plan."""
    return (f"{path}: valid. {report.num_ranks} ranks, {report.num_blocks} blocks, {report.num_tiles} tiles, "
            f"{report.num_pulls} pulls in {report.num_rounds} rounds (Delta NIC {report.nic_degree}, NVLink "
            f"{report.nvlink_degree}), {report.num_pushes_fwd} forward and {report.num_pushes_bwd} backward pushes, "
            f"every round congestion-free per link class over pulls and pushes, live buffers <= "
            f"{report.max_buffer_tokens} tokens as stated, device memory <= {report.max_buffer_bytes_fwd / 2**30:.2f} "
            f"GiB forward and {report.max_buffer_bytes_bwd / 2**30:.2f} GiB backward as stated")


def inspect_summary(path, header, rows: list[dict]) -> str:
    """What `fcp inspect PLAN` prints: the parameters, then per-rank figures (the first and last 16 of many)."""
    lines = [f"{path}: planner {header.planner}, format v{header.format_version}, {header.num_ranks} ranks, "
             f"{header.total_tokens} tokens in {header.num_sequences} sequences ({header.mask.value}), "
             f"block {header.block_size}{' zigzag' if header.zigzag else ''}, coalesce {header.coalesce}/"
             f"{header.bwd_coalesce}, {header.num_rounds} pull rounds, stages fwd/bwd {header.num_fwd_stages}/"
             f"{header.num_bwd_stages}, rounds with pushes fwd/bwd {header.num_fwd_rounds}/{header.num_bwd_rounds}, "
             f"{header.profile.gpus_per_node} GPUs a node (Delta NIC {header.nic_degree}, "
             f"NVLink {header.nvlink_degree}), digest {header.inputs_digest[:16]}"]
    keys = list(rows[0].keys())
    shown = rows if len(rows) <= 32 else rows[:16] + rows[-16:]
    lines.append(table(keys, [[row[k] for k in keys] for row in shown]))
    if len(rows) > 32:
        lines.append(f"  ... {len(rows) - 32} more ranks (--json for all)")
    if "peak_fwd_gib" in keys:
        for name, key in (("forward", "peak_fwd_gib"), ("backward", "peak_bwd_gib")):
            worst = max(rows, key=lambda row: row[key])
            lines.append(f"  device memory, {name}: at most {worst[key]:.2f} GiB (rank {worst['rank']}), median "
                         f"{float(np.median([row[key] for row in rows])):.2f} GiB ({header.shape.dtype.value}, "
                         f"{header.layout.value} layout; accumulators, received buffers, a kernel call's packed "
                         f"inputs and outputs; not Q, K, V themselves)")
    return "\n".join(lines)


def simulation_summary(figures: dict, trace=None) -> str:
    """The tables `fcp simulate` prints: each pass's attention makespan and MFU, then the whole layer of the
    plan's model (or --model) rank by rank, beside its certified lower bound."""
    busy_fwd = [row["busy_fwd_s"] for row in figures["per_rank"]]
    lines = [table(["pass", "makespan ms", "attention MFU", "normalized MFU", "exposed comm ms", "share"], [
        [name, f"{figures[f'makespan_{key}_s'] * 1e3:.2f}", f"{figures[f'attention_mfu_{key}']:.3f}",
         f"{figures[f'normalized_mfu_{key}']:.3f}", *_exposure_cells(figures, key)]
        for name, key in (("forward", "fwd"), ("backward", "bwd"))]),
        *(["  exposed comm: the makespan less the computing on the pass's critical path (its messages and, in the "
           "user layout, its reshuffles: what the pass waited for)"] if figures["exposed_comm_fwd_s"] is not None
          else []),
        f"  {len(busy_fwd)} ranks; forward busy {min(busy_fwd) * 1e3:.2f}-{max(busy_fwd) * 1e3:.2f} ms; "
        f"single-GPU efficiency on this batch {figures['single_gpu_efficiency']:.3f}"
        + (f"; trace in {trace}" if trace else "")]
    terms = figures["layer_bound_terms"]
    prefetch = ", each pass's first K,V pulls early" if figures.get("kv_prefetch") else ""
    lines.append(f"  one layer ({figures['model']}), {figures['layout']} layout{prefetch}, each rank's linear layers "
                 f"around its attention:")
    lines.append(table(["pass", "linear ms", "reshuffle ms", "layer ms", "bound ms", "bound by", "gap"], [
        [name, f"{figures[f'linear_{key}_s'] * 1e3:.2f}", f"{figures[f'reshuffle_{key}_s'] * 1e3:.2f}",
         f"{figures[f'layer_makespan_{key}_s'] * 1e3:.2f}",
         f"{figures[f'layer_makespan_lower_bound_{key}_s'] * 1e3:.2f}", terms[key]["binding"],
         f"{figures[f'layer_gap_{key}']:.3f}"]
        for name, key in (("forward", "fwd"), ("backward", "bwd"))]))
    lines.append(f"  layer MFU (forward and backward) {figures['layer_mfu']:.3f}, normalized "
                 f"{figures['normalized_layer_mfu']:.3f}")
    if "peak_bytes_fwd" in figures:
        budget = figures["memory_budget_bytes"]
        lines.append(f"  device memory (the plan's account of the runtime's tensors): busiest rank "
                     f"{figures['peak_bytes_fwd'] / 2**30:.2f} GiB forward, {figures['peak_bytes_bwd'] / 2**30:.2f} GiB "
                     f"backward" + (f" (budget {budget / 2**30:.2f} GiB)" if budget is not None else " (no budget)"))
    if "moved_bytes_fwd" in figures:
        rate = figures["hbm_bytes_per_s"]
        lines.append(f"  data moved outside the kernels (range path, charged at {rate / 1e9:.0f} GB/s HBM): busiest "
                     f"rank {figures['moved_bytes_fwd'] / 1e9:.2f} GB forward "
                     f"({figures['moved_bytes_fwd'] / rate * 1e3:.2f} ms), {figures['moved_bytes_bwd'] / 1e9:.2f} GB "
                     f"backward ({figures['moved_bytes_bwd'] / rate * 1e3:.2f} ms)")
    paths = [(name, figures[f"critical_path_{key}"]) for name, key in (("forward", "fwd"), ("backward", "bwd"))]
    if all(path is not None for _, path in paths):  # None: simulated without stage times
        lines.append("  critical path of each pass's attention (what ended each stage, back from the rank that ends "
                     "last; ranks in time order):")
        lines.append(table(["pass", "computing ms", "messages ms", "ranks"], [
            [name, f"{path['computing_s'] * 1e3:.2f}", f"{path['messages_s'] * 1e3:.2f}", _path_ranks(path["ranks"])]
            for name, path in paths]))
    return "\n".join(lines)


def _exposure_cells(figures: dict, key: str) -> list[str]:
    """A pass's exposed communication (ms) and its share of the makespan; "-" where no stage times were kept."""
    exposed, share = figures[f"exposed_comm_{key}_s"], figures[f"exposed_comm_share_{key}"]
    if exposed is None:
        return ["-", "-"]
    return [f"{exposed * 1e3:.2f}", percent(share) if share is not None else "-"]


def _path_ranks(ranks: list[int]) -> str:
    """A critical path's ranks in time order, first to last (a long path shortened in the middle)."""
    ordered = [str(rank) for rank in reversed(ranks)]
    return " > ".join(ordered if len(ordered) <= 5 else ordered[:2] + ["..."] + ordered[-2:])


def ablation_table(steps: list[dict]) -> str:
    """`fcp ablate`: each step's normalized MFU beside the seed's Table 2."""
    def seed(value) -> str:
        return "-" if value is None else f"{value:.2f}"

    return table(["step", "fwd", "seed fwd", "bwd", "seed bwd", "fwd ms", "bwd ms", "stages"], [
        [s["name"], f"{s['normalized_mfu_fwd']:.2f}", seed(s["seed_normalized_mfu_fwd"]),
         f"{s['normalized_mfu_bwd']:.2f}", seed(s["seed_normalized_mfu_bwd"]), f"{s['makespan_fwd_s'] * 1e3:.1f}",
         f"{s['makespan_bwd_s'] * 1e3:.1f}", s["num_fwd_stages"]] for s in steps]) + "".join(
        f"\n  {s['name']} is not faster than the step before: {s['why_not_faster']}" for s in steps
        if s.get("why_not_faster"))


def sweep_table(rows: list[dict]) -> str:
    """`fcp sweep`: balance and normalized MFU at each block size."""
    return table(["block", "compute imb", "comm imb", "rounds", "norm MFU fwd", "norm MFU bwd"],
                 [[r["block_size"], f"{r['compute_imbalance']:.3f}", f"{r['comm_imbalance']:.3f}", r["num_rounds"],
                   f"{r['normalized_mfu_fwd']:.3f}", f"{r['normalized_mfu_bwd']:.3f}"] for r in rows])


def diff_summary(result: dict, path_a, path_b) -> str:
    """`fcp diff`: what changed between two plans, regressions marked."""
    if result["identical"]:
        return f"{path_a} and {path_b}: no semantic difference\n{diff_verdict(result)}"
    rows = [[f"param {name}", _short(v["a"]), _short(v["b"]), "", ""] for name, v in result["parameters"].items()]
    if result["inputs"]:
        rows.append(["inputs digest", result["inputs"]["a"][:16], result["inputs"]["b"][:16], "", ""])
    blocks = result["blocks"]
    if blocks.get("moved"):
        rows.append(["blocks moved", "", f"{blocks['moved']} of {blocks['of']}", "",
                     ", ".join(f"{m['block']}: {m['a']}->{m['b']}" for m in blocks["sample"][:4])])
    if blocks.get("resharded"):
        rows.append(["blocks", blocks["a_blocks"], blocks["b_blocks"], "", "resharded"])
    windows, programs = result.get("windows"), result.get("programs")
    if windows:
        rows.append(["mask windows", "", f"{windows['sequences']} sequences", "",
                     ", ".join(f"seq {w['sequence']}: {w['a']}->{w['b']}" for w in windows["sample"][:4])])
    if programs:
        rows.append(["rank programs", "", f"{programs['ranks']} of {programs['of']} ranks", "",
                     _short("; ".join(f"rank {p['rank']}: {', '.join(p['arrays'])}" for p in programs["sample"][:2]))])
    for name, v in result["figures"].items():
        rows.append([name, _short(v["a"]), _short(v["b"]), _relative(v),
                     "REGRESSION" if name in result["regressions"] else ""])
    if "validation" in result["regressions"]:
        rows.append(["validation", "valid", _short(result["regressions"]["validation"]["b"]), "", "REGRESSION"])
    return table(["what", "a", "b", "change", "note"], rows) + "\n" + diff_verdict(result)


def _relative(change: dict) -> str:
    """A figure's relative change, or "" where it has no base (from zero, or not a number)."""
    return f"{change['relative_change']:+.1%}" if "relative_change" in change else ""


def diff_verdict(result: dict) -> str:
    """The one line a CI log ends with: the worst regression and how many more, or that nothing regressed (with the
    change of each pass's layer time)."""
    if result["identical"]:
        return "no change"
    regressions = result["regressions"]
    if not regressions:
        times = [f"{name.removeprefix('layer_makespan_').removesuffix('_s')} {_relative(result['figures'][name])}"
                 for name in TIME_FIGURES if _relative(result["figures"].get(name, {}))]
        time_note = f"; layer time {', '.join(times)}" if times else "; layer time unchanged"
        return f"changed, no regression ({len(result['figures'])} figures differ{time_note})"
    if "validation" in regressions:
        return f"regression: B does not validate: {regressions['validation']['b']}"
    name, worst = max(regressions.items(), key=lambda item: item[1].get("relative_change", float("inf")))
    more = f", {len(regressions) - 1} more" if len(regressions) > 1 else ""
    why = f"over the memory budget of {worst['budget']}" if "budget" in worst else f"({_relative(worst)})"
    return f"regression: {name} {_short(worst['a'])} -> {_short(worst['b'])} {why}{more}"


def _short(value) -> str:
    if isinstance(value, float):
        return f"{value:.4g}"
    text = str(value)
    return text if len(text) <= 40 else text[:37] + "..."


def mask_text(mask: dict) -> str:
    """A mask as --layer-masks spells it: causal, full or sliding_window:W."""
    return f"sliding_window:{mask['window']}" if mask["kind"] == "sliding_window" else mask["kind"]


def kinds_lines(stats: dict) -> list[str]:
    """`fcp compile`'s lines for a plan of layer kinds: each kind's schedule and simulated layer time, and the mix's."""
    rows = stats.get("layer_kinds")
    if not rows:
        return []
    lines = [f"  layer kinds: one placement (scheduled for {stats['primary_kind']}, chosen by the mix's time), one "
             f"dispatch, one schedule a kind:",
             table(["kind", "mask", "layers", "tiles", "transfers", "traffic", "stages fwd/bwd", "peak GiB",
                    "layer fwd ms", "layer bwd ms"],
                   [[row["name"], mask_text(row["mask"]), row["num_layers"], row["num_tiles"], row["num_transfers"],
                     human_bytes(row["total_comm_bytes"]), f"{row['num_fwd_stages']}/{row['num_bwd_stages']}",
                     f"{row['peak_bytes'] / 2**30:.2f}", f"{row['layer_makespan_fwd_s'] * 1e3:.2f}",
                     f"{row['layer_makespan_bwd_s'] * 1e3:.2f}"] for row in rows])]
    terms = " + ".join(f"{row['num_layers']} x {row['layer_seconds'] * 1e3:.2f}" for row in rows)
    lines.append(f"  layer mix: {terms} = {stats['layer_mix_s'] * 1e3:.1f} ms a step (forward + backward)")
    return lines

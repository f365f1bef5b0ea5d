"""Compact text tables for the command line, and the plan summaries `fcp inspect` shows."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from fcp_compiler.format.plan_format import PlanReader, RankProgram


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


def compile_summary(stats: dict, path: str | None) -> str:
    """The table `fcp compile` prints."""
    blocks = "zigzag" if stats["zigzag"] else "plain"
    lines = [
        f"fcp compile: {stats['total_tokens']} tokens in {stats['num_sequences']} sequences ({stats['mask']}) -> "
        f"{stats['gpus']} ranks, block {stats['block_size']} ({blocks}), coalesce {stats['coalesce']}, "
        f"{stats['layout']} layout",
        table(["blocks", "tiles", "offloaded", "transfers", "relayed", "delta", "rounds", "stages", "compute imb",
               "comm imb", "LB ratio", "tokens/rank", "cap"],
              [[stats["num_blocks"], stats["num_tiles"], stats["num_offloaded_tiles"], stats["num_transfers"],
                stats["num_relayed_transfers"], stats["max_degree"], stats["num_rounds"], stats["num_stages"],
                percent(stats["compute_imbalance"]),
                percent(stats["comm_imbalance"]), f"{stats['makespan_lower_bound_ratio']:.4f}",
                stats["max_tokens_per_rank"], stats["token_cap"]]]),
        f"  traffic {human_bytes(stats['total_comm_bytes'])} forward, most received by one rank "
        f"{human_bytes(stats['max_rank_recv_bytes'])}; exchange rounds fwd {stats['num_fwd_rounds']} "
        f"(degree {stats['fwd_exchange_degree']}), bwd {stats['num_bwd_rounds']} (degree "
        f"{stats['bwd_exchange_degree']}); live buffers <= {stats['max_buffer_tokens']} tokens",
        "  compile {:.3f} s: {}".format(stats["compile_seconds"], "  ".join(
            f"{name} {seconds:.3f}" for name, seconds in stats["pass_seconds"].items())),
    ]
    if path:
        lines.append(f"  wrote {path} ({human_bytes(stats['plan_bytes'])}, sha256 {stats['plan_sha256'][:16]})")
    return "\n".join(lines)


def compare_rows(rows: Sequence[dict]) -> str:
    """The table `fcp compare` prints; methods that could not plan a scale are listed under it with the reason."""
    def speedup(row: dict) -> str:
        return f"{row['fcp_speedup_fwd']:.2f}x" if row.get("fcp_speedup_fwd") else "-"

    planned = [r for r in rows if not r.get("error")]
    lines = [table(["method", "gpus", "compute imb", "comm imb", "total bytes", "max rank bytes", "rounds",
                    "norm MFU fwd", "norm MFU bwd", "FCP speedup fwd"],
                   [[r["method"], r["gpus"], f"{r['compute_imbalance']:.3f}", f"{r['comm_imbalance']:.3f}",
                     human_bytes(r["total_comm_bytes"]), human_bytes(r["max_rank_comm_bytes"]), r["num_rounds"],
                     f"{r['normalized_mfu_fwd']:.3f}", f"{r['normalized_mfu_bwd']:.3f}", speedup(r)]
                    for r in planned])]
    lines += [f"  not planned: {r['method']} at {r['gpus']} GPUs: {r['error']}" for r in rows if r.get("error")]
    lines.append("  every baseline in the plan layout (tokens dispatched once, as their systems do); fcp in the plan "
                 "layout and, as fcp-user, in the user layout (reshuffles around attention)")
    return "\n".join(lines)


def rank_rows(reader: PlanReader) -> list[dict]:
    """Per-rank figures of a plan: tokens held, blocks, tiles, pulls and pushes."""
    tables = reader.tables
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
            "tokens_received": int(seg_tokens[a["pull_recv_segs"]].sum()),
            "fwd_pushes_sent": int(a["fwd_push_send_round"].size),
            "bwd_pushes_sent": int(a["bwd_push_send_round"].size),
        })
    return rows


def rank_program_text(program: RankProgram) -> str:
    """Stage-by-stage view of one rank's forward and backward programs."""
    a = program.arrays
    header = program.header
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
                stage_rows.append([name, stage, *counts])
    return "\n".join([
        f"rank {program.rank}: {a['blocks'].size} blocks {a['blocks'].tolist()[:16]}"
        f"{' ...' if a['blocks'].size > 16 else ''}",
        f"  reshuffle ({header.layout.value} layout: {'not run' if header.layout.value == 'plan' else 'per call'}): "
        f"sends {a['reshuffle_send_length'].sum()} tokens in {a['reshuffle_send_length'].size} runs, "
        f"receives {a['reshuffle_recv_length'].sum()} tokens in {a['reshuffle_recv_length'].size} runs",
        table(["pass", "stage", "pulls sent", "pulls recv", "tiles", "pushes sent", "pushes recv"], stage_rows),
    ])

"""Write docs/RESULTS.md: FCP beside the baselines, in the shape of the seed's figures 9 to 12.

Usage: python benchmarks/results.py [--gpus 16,32,64,128,256] [--seeds 0,1,2] [--out docs]
                                    [--eval-data DIR]

Figure 9: compute and communication imbalance vs GPUs (paper-like trace, weak scaling at 32K tokens per GPU).
Figure 10: normalized attention MFU with every sequence at the same length (no imbalance to hide).
Figure 11: normalized attention MFU, weak scaling, on the paper-like trace (one table per seed, and the mean).
Figure 12: normalized attention MFU vs block size (FCP, 128 GPUs).
Also: the same comparison on ProLong lengths with a long tail (30% of tokens in 128K-512K sequences), read from
--eval-data when it is there. Each of the seed's claims is checked against the numbers and stated as met or not.
The seed's figures measure attention alone, so FCP is compiled here with attention alone as its objective
(`--model none`); the whole layer, FCP's default objective, is measured by benchmarks/layer_objective.py.
About 2.5 minutes on 2 cores with three seeds. Plots need matplotlib (pip install 'fcp[plot]'); tables are written
without it.
"""

from __future__ import annotations

import argparse
import statistics
from pathlib import Path

from placement import EVAL_DATA
from fcp_compiler import CompileOptions
from fcp_compiler.core.baselines import Planner
from fcp_compiler.tools.compare import compare, sweep_block_sizes
from fcp_compiler.errors import InvalidInputError
from fcp_compiler.format.inputs import load_batch
from fcp_compiler.tools.plots import compare_figure, line_plot, series_by_method, sweep_figure
from fcp_compiler.tools.traces import empirical_batch, lognormal_batch, read_lengths_file

ROOT = Path(__file__).resolve().parents[1]
METHODS = list(Planner)
ATTENTION = CompileOptions.of(1, model="none")  # the seed's figures are attention's
TAIL_FRACTION = 0.3


def _table(headers, rows) -> str:
    lines = ["| " + " | ".join(headers) + " |", "|" + "---|" * len(headers)]
    lines += ["| " + " | ".join(str(c) for c in row) + " |" for row in rows]
    return "\n".join(lines)


def _fmt(value, digits: int = 3) -> str:
    return "-" if value is None else f"{value:.{digits}f}"


def _speedup(row) -> str:
    return f"{row['attention_speedup_fwd']:.2f}x" if row.get("attention_speedup_fwd") else "-"


def _attention_speedups(rows: list[dict]) -> list[dict]:
    """FCP's forward normalized attention MFU over each row's (the tables here are attention's; `fcp compare`'s own
    fcp_speedup is the layer makespan ratio)."""
    for row in rows:
        fcp = _value(rows, "fcp", row["gpus"], "normalized_mfu_fwd")
        if fcp and row.get("normalized_mfu_fwd"):
            row["attention_speedup_fwd"] = fcp / row["normalized_mfu_fwd"]
    return rows


def _by_gpus(rows, cell) -> str:
    """One row per GPU count and one column per method (in the rows' order), each cell `cell(row)`."""
    methods = list(dict.fromkeys(r["method"] for r in rows))
    scales = sorted({r["gpus"] for r in rows})
    cells = {(r["method"], r["gpus"]): cell(r) for r in rows}
    return _table(["GPUs", *methods], [[g, *[cells.get((m, g), "-") for m in methods]] for g in scales])


def _imbalance_cell(row) -> str:
    return f"{_fmt(row.get('compute_imbalance'))} / {_fmt(row.get('comm_imbalance'))}"


def _mfu_cell(row) -> str:
    speedup = _speedup(row)
    return f"{_fmt(row.get('normalized_mfu_fwd'))} / {_fmt(row.get('normalized_mfu_bwd'))}" + \
        (f" ({speedup})" if speedup != "-" and row["method"] != "fcp" else "")


def _mean_cell(row) -> str:
    speedup = _speedup(row)
    return _fmt(row.get("normalized_mfu_fwd")) + (f" ({speedup})" if speedup != "-" and row["method"] != "fcp" else "")


def _not_planned(rows) -> list[str]:
    return [f"- not planned: {r['method']} at {r['gpus']} GPUs: {r['error']}" for r in rows if r.get("error")]


def _value(rows, method: str, gpus: int, key: str):
    return next((r[key] for r in rows if r["method"] == method and r["gpus"] == gpus), None)


def mean_over_seeds(runs: list[list[dict]]) -> list[dict]:
    """Per (method, gpus), the mean normalized MFU over seeds, and FCP's speedup on the means."""
    out = []
    for row in runs[0]:
        values = [_value(run, row["method"], row["gpus"], "normalized_mfu_fwd") for run in runs]
        values = [v for v in values if v is not None]
        out.append({"method": row["method"], "gpus": row["gpus"],
                    "normalized_mfu_fwd": statistics.fmean(values) if values else None, "seeds": len(values)})
    for row in out:
        fcp = _value(out, "fcp", row["gpus"], "normalized_mfu_fwd")
        if fcp and row["normalized_mfu_fwd"]:
            row["attention_speedup_fwd"] = fcp / row["normalized_mfu_fwd"]
    return out


def _verdict(ok: bool) -> str:
    return "met" if ok else "NOT met"


def imbalance_claims(rows: list[dict], scales: list[int], label: str) -> list[str]:
    """Issue 5's imbalance claims, each stated as met or not met with the numbers behind it."""
    lines = []
    verdict = _verdict
    fcp = {r["gpus"]: r for r in rows if r["method"] == "fcp" and not r.get("error")}
    worst_compute = max(r["compute_imbalance"] for r in fcp.values())
    worst_comm = max(fcp.values(), key=lambda r: r["comm_imbalance"])
    lines.append(f"- {label}: FCP compute imbalance < 0.05 at every scale: {verdict(worst_compute < 0.05)} "
                 f"(worst {worst_compute:.3f}); communication imbalance < 0.05: "
                 f"{verdict(worst_comm['comm_imbalance'] < 0.05)} (worst {worst_comm['comm_imbalance']:.3f} at "
                 f"{worst_comm['gpus']} GPUs; " + ", ".join(f"{g}: {fcp[g]['comm_imbalance']:.3f}" for g in sorted(fcp))
                 + ").")
    largest = max(scales)
    bytescale = _value(rows, "bytescale", largest, "compute_imbalance")
    if bytescale is not None:
        lines.append(f"- {label}: ByteScale-like compute imbalance > 0.3 at {largest} GPUs: "
                     f"{verdict(bytescale > 0.3)} ({bytescale:.3f}).")
    magi_above = [(g, _value(rows, "magi", g, "comm_imbalance"), fcp[g]["comm_imbalance"]) for g in sorted(fcp)
                  if _value(rows, "magi", g, "comm_imbalance") is not None]
    below = [f"{g} ({m:.3f} vs {f:.3f})" for g, m, f in magi_above if m <= f]
    lines.append(f"- {label}: MagiAttention-like communication imbalance above FCP's: "
                 f"{verdict(not below)}" + (f" (not at {', '.join(below)})" if below else "") + ".")
    return lines


def speed_claims(rows: list[dict], label: str) -> list[str]:
    """Issue 5's speedup and ring claims, each stated as met or not met with the numbers behind it."""
    lines = []
    verdict = _verdict
    fcp = {r["gpus"]: r for r in rows if r["method"] == "fcp" and r.get("normalized_mfu_fwd")}
    for method in (m.value for m in METHODS[1:]):
        points = [(g, r["attention_speedup_fwd"]) for g in sorted(fcp) for r in rows
                  if r["method"] == method and r["gpus"] == g and g >= 64 and r.get("attention_speedup_fwd")]
        if not points:
            continue
        low = min(v for _, v in points)
        shrinks = [f"{a[0]}->{b[0]}" for a, b in zip(points, points[1:]) if b[1] < a[1]]
        lines.append(f"- {label}: FCP >= 1.13x {method} from 64 GPUs, gap not shrinking: "
                     f"{verdict(low >= 1.13 and not shrinks)} (" + ", ".join(f"{v:.2f}x at {g}" for g, v in points)
                     + (f"; narrows {', '.join(shrinks)}" if shrinks else "") + ").")
    ring = [(g, _value(rows, "ring", g, "normalized_mfu_fwd")) for g in sorted(fcp)]
    ring = [(g, v) for g, v in ring if v is not None]
    rises = [f"{a[0]}->{b[0]}" for a, b in zip(ring, ring[1:]) if b[1] > a[1]]
    lines.append(f"- {label}: ring's normalized MFU falls with scale: {verdict(not rises)} ("
                 + ", ".join(f"{v:.3f} at {g}" for g, v in ring) + (f"; rises {', '.join(rises)}" if rises else "")
                 + ").")
    return lines


KEPT_MARKER = ("<!-- Everything below is kept by benchmarks/results.py; each section names the benchmark that "
               "measures it. -->")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--gpus", default="16,32,64,128,256")
    parser.add_argument("--seeds", default="0,1,2", help="paper-like trace seeds (the first one is tabulated)")
    parser.add_argument("--out", type=Path, default=ROOT / "docs")
    parser.add_argument("--eval-data", type=Path, default=EVAL_DATA)
    args = parser.parse_args()
    scales = [int(g) for g in args.gpus.split(",")]
    seeds = [int(s) for s in args.seeds.split(",")]
    args.out.mkdir(parents=True, exist_ok=True)

    def progress(line: str) -> None:
        print(line, flush=True)

    paper_runs = [_attention_speedups(compare(lambda n, seed=seed: lognormal_batch(n * 32768, 4096, 1.8, 64, 524288,
                                                                                  seed), scales, METHODS,
                                              progress=progress, options=ATTENTION)) for seed in seeds]
    paper, paper_mean = paper_runs[0], mean_over_seeds(paper_runs)
    even = _attention_speedups(compare(lambda n: [16384] * (n * 2), scales, METHODS, progress=progress,
                                       options=ATTENTION))
    prolong_file = args.eval_data / "distca" / "dist_prolong.json"
    prolong = []
    if prolong_file.exists():
        values = read_lengths_file(prolong_file)
        prolong = _attention_speedups(compare(lambda n: empirical_batch(values, n * 32768, 0, 524288, TAIL_FRACTION),
                                              scales, METHODS, progress=progress, options=ATTENTION))
    sweep = sweep_block_sizes(load_batch(ROOT / "traces" / "paper_lognormal_128gpu.json"), ATTENTION.replace(num_ranks=128),
                              [1024, 2048, 4096, 8192])

    plotted = []
    try:
        for name, title, ylabel, data in (
                ("fig9_compute_imbalance.png", "Fig. 9 (top): compute imbalance", "imbalance",
                 series_by_method(paper, "compute_imbalance")),
                ("fig9_comm_imbalance.png", "Fig. 9 (bottom): communication imbalance", "imbalance",
                 series_by_method(paper, "comm_imbalance")),
                ("fig10_even_lengths.png", "Fig. 10: normalized MFU, all sequences 16K", "normalized MFU (fwd)",
                 series_by_method(even, "normalized_mfu_fwd")),
                ("fig11_weak_scaling.png", f"Fig. 11: normalized MFU, weak scaling (mean of {len(seeds)} seeds)",
                 "normalized MFU (fwd)", series_by_method(paper_mean, "normalized_mfu_fwd"))):
            line_plot(args.out / name, title, ylabel, data)
            plotted.append(name)
        sweep_figure(sweep, args.out / "fig12_block_size.png", "Fig. 12: FCP normalized MFU vs block size (128 GPUs)")
        plotted.append("fig12_block_size.png")
        if prolong:
            compare_figure(prolong, args.out / "prolong_tail.png",
                           f"ProLong lengths + {TAIL_FRACTION:.0%} of tokens in 128K-512K sequences")
            plotted.append("prolong_tail.png")
    except InvalidInputError as error:
        print(f"plots skipped: {error}")

    best = max(r["normalized_mfu_fwd"] for r in sweep)
    best_size = max(sweep, key=lambda r: r["normalized_mfu_fwd"])["block_size"]
    within = next(r["normalized_mfu_fwd"] for r in sweep if r["block_size"] == 4096) / best
    text = [
        "# Results: FCP beside the baselines",
        "",
        f"Generated by `python benchmarks/results.py` (simulated on the h100 profile, 32K tokens per GPU, paper-like "
        f"trace seeds {args.seeds}; the simulator and the baselines are described below the marker further down). "
        "Every plan here is in the same format and passes `fcp validate`. The same comparison for any batch or trace: `fcp compare`.",
        "",
        "**Attention alone.** Every figure on this page down to the marker is for plans placed and simulated for "
        "attention alone (`--model none`), as the seed's figures are. `fcp compile`'s default places for a whole "
        "layer (`--model llama3-70b`: linear layers on each rank's tokens plus its attention), which trades "
        "attention's traffic balance for layer time: the quick start's 256-GPU plan shows 19.88% communication "
        "imbalance, where the same trace with `--model none` gives 4.30%.",
        "",
        "## Figure 9: imbalance vs GPUs (paper-like trace, seed 0, attention alone)",
        "",
        "Seed: FCP < 5% compute and communication imbalance; MagiAttention up to 17% communication imbalance;"
        " ByteScale up to 70% compute imbalance.",
        "",
        "Each cell: compute imbalance / communication imbalance.",
        "",
        _by_gpus(paper, _imbalance_cell),
        "",
        "FCP over every seed: " + "; ".join(
            f"seed {seed}: compute <= {max(r['compute_imbalance'] for r in run if r['method'] == 'fcp'):.3f}, "
            f"comm <= {max(r['comm_imbalance'] for r in run if r['method'] == 'fcp'):.3f}"
            for seed, run in zip(seeds, paper_runs)) + ".",
        "",
        "## Figure 10: normalized MFU at even lengths (every sequence 16K)",
        "",
        "Seed: FCP above 90% (only the SMs given to communication cost it); ring falls as short sequences are "
        "over-sharded.",
        "",
        "Each cell: normalized MFU forward / backward (FCP's forward speedup over the method).",
        "",
        _by_gpus(even, _mfu_cell),
        "",
        "## Figure 11: normalized MFU, weak scaling (paper-like trace)",
        "",
        "Seed: methods are close at 16 GPUs; FCP ahead of every baseline from there, 1.13x-2.21x.",
        "",
        "Seed 0; each cell: normalized MFU forward / backward (FCP's forward speedup over the method):",
        "",
        _by_gpus(paper, _mfu_cell),
        "",
        f"Mean over seeds {args.seeds} (each scale draws its own batch per seed); each cell: normalized MFU "
        "forward (FCP's speedup on the means):",
        "",
        _by_gpus(paper_mean, _mean_cell),
        "",
        "## Figure 12: FCP vs block size (paper-like trace, 128 GPUs)",
        "",
        f"Seed: 4K is the best block size. Here: {best_size} is best; 4K reaches {within:.3f} of it.",
        "",
        _table(["block size", "normalized MFU fwd", "normalized MFU bwd", "within best"],
               [[r["block_size"], f"{r['normalized_mfu_fwd']:.3f}", f"{r['normalized_mfu_bwd']:.3f}",
                 f"{r['normalized_mfu_fwd'] / best:.3f}"] for r in sweep]),
        "",
    ]
    if prolong:
        text += [
            f"## ProLong lengths with a long tail ({TAIL_FRACTION:.0%} of tokens in 128K-512K sequences, seed 0)",
            "",
            "Lengths drawn from DistCA's ProLong distribution (`$EVAL_DATA/distca/dist_prolong.json`, "
            "median 1.9K), the tail drawn log-uniformly: `fcp compare --trace-spec "
            f"file:$EVAL_DATA/distca/dist_prolong.json:{TAIL_FRACTION}`.",
            "",
            "Each cell: compute imbalance / communication imbalance, then normalized MFU forward / backward (FCP's "
            "forward speedup over the method).",
            "",
            _by_gpus(prolong, lambda r: f"{_imbalance_cell(r)}, {_mfu_cell(r)}"),
            "",
            *_not_planned(prolong),
            "",
        ]
    text += ["## The seed's claims, checked", ""]
    text += imbalance_claims(paper, scales, "paper-like, seed 0") + speed_claims(paper, "paper-like, seed 0")
    text += speed_claims(paper_mean, f"paper-like, mean of {len(seeds)} seeds")
    if prolong:
        text += imbalance_claims(prolong, scales, "ProLong + tail") + speed_claims(prolong, "ProLong + tail")
    even_fcp = [r["normalized_mfu_fwd"] for r in even if r["method"] == "fcp"]
    text += [
        f"- Even lengths: FCP above 0.9 normalized MFU: {'met' if min(even_fcp) > 0.9 else 'NOT met'} "
        f"({min(even_fcp):.3f}-{max(even_fcp):.3f}).",
        f"- Block size: 4K within 3% of the best: {'met' if within >= 0.97 else 'NOT met'} ({within:.3f} of "
        f"{best_size}).",
        "",
        "## Where we differ, and why",
        "",
        "- MagiAttention-like follows MagiAttention's dispatch solver (fixed 4K slices of the packed sequence across"
        " document boundaries, min-heap on attention area, an equal slice count per rank, so equal tokens), run by"
        " FCP's execution (pipelined, congestion-free, ordered, coalesced, stage-levelled): it gets every FCP"
        " technique but traffic balance and zig-zag, so it stays close at small scale; the seed's MagiAttention has"
        " its own kernels and communication.",
        "- Ring is expressed as N-1 shift rounds from each block's owner (the traffic of a ring, not its"
        " neighbour-only pattern); its plans grow as sequences x N^2 segment pairs, and past 64M pairs (ProLong at"
        " 256 GPUs: 269M) a plan is refused rather than left to exhaust memory.",
        "- Each scale draws its own batch, and tails differ a lot between draws: one seed's curve is not monotone"
        " even when the mean is; the mean over seeds is the fairer reading of figure 11.",
        "- Memory: the baselines here are not held to FCP's live-buffer budget (4 x c x B tokens) nor its 4 GiB"
        " device budget, and each is scored at its better node fan-out variant; where the magi-like baseline is"
        " ahead of FCP it holds several times FCP's live buffers (`fcp compare` prints how many). With"
        " `fcp compare --fit-memory` every method is held to FCP's budgets, and on the whole layer at equal memory FCP"
        " is at least as fast on every batch of the matrix (the geometric mean of its two passes; below the marker).",
        "- FCP's plan is the fastest of several placements it schedules (the floor, below the marker), one of them"
        " the equal-chunk greedy that the magi-like baseline uses; its communication imbalance is that of the"
        " placement kept, so it can equal magi's (ProLong + tail: each rank holding a block of a long sequence"
        " pulls the rest of that sequence, and compute balance makes ranks combine blocks of two).",
        "- Every baseline runs in the plan layout (tokens dispatched once per step, as their systems do); FCP runs in"
        " it too, and in the user layout as `fcp-user`. All run under the same schedule rules (every round a"
        " matching over pulls and pushes, live received buffers bounded), which is why the MagiAttention-like"
        " placement stays close.",
        "",
    ]
    if plotted:
        text += ["## Plots", ""] + [f"![{name}]({name})" for name in plotted] + [""]
    target = args.out / "RESULTS.md"
    # The sections after the marker are measured by other benchmarks (each names its own): keep them.
    kept = target.read_text().partition(KEPT_MARKER) if target.exists() else ("", "", "")
    target.write_text("\n".join(text) + ("\n" + KEPT_MARKER + kept[2] if kept[1] else ""))
    print(f"wrote {args.out / 'RESULTS.md'} and {len(plotted)} plots")


if __name__ == "__main__":
    main()

"""The layer objective (issue 20): every plan's layer makespan against its certified lower bound, beside today's main
and the strongest baseline of each batch.

Usage: python benchmarks/layer_objective.py [--gpus 64,256] [--seeds 3] [--eval-data DIR]
       [--batches paper,magi] [--model llama3-70b] [--jobs 2] [--main-tree PATH] [--write rows.json]

The matrix: the paper-like lognormal trace and each length file in --eval-data with and without a 20% long tail,
32768 tokens per GPU, three seeds, 64 and 256 GPUs, block 4096, coalesce 16, h100, plan layout. For every batch:

- fcp: this tree, placed for the model's per-rank layer time;
- main: the placement of main before issue 20, which balanced attention alone: the same code with --model none and
  no floor (--main-tree checks main's own plan on the first batch and times main's own compile_plan, median of 3, on
  the 256-GPU paper batch);
- ring, bytescale, wlbllm, magi: the baselines, on the same executor, each at its better node fan-out variant (on or
  off, scored by the layer makespan, forward plus backward).

Every plan is validated and simulated with the model's layer around attention. It prints each batch's layer gaps, FCP
over the best baseline and over main (layer makespan ratios, > 1 is FCP faster), then the summary the issue asks for.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from placement import TOKENS_PER_GPU, chosen_batches, matrix_arguments  # noqa: E402

from fcp_compiler import compile_plan  # noqa: E402
from fcp_compiler.core.baselines import Planner  # noqa: E402
from fcp_compiler.errors import InfeasibleError  # noqa: E402
from fcp_compiler.format.validate import validate_unless_too_large  # noqa: E402
from fcp_compiler.tools.parallel import map_on_cores  # noqa: E402
from fcp_compiler.tools.report import table  # noqa: E402
from fcp_compiler.core.layer_model import BACKWARD_WORK  # noqa: E402
from fcp_compiler.core.simulate import coalesced_seconds, simulate_plan  # noqa: E402

BASELINES = ("ring", "bytescale", "wlbllm", "magi")
BUFFER_BUDGET = 4 * 16 * 4096  # 4cB live buffer tokens at the matrix's coalesce 16 and block 4096
_CONTEXT: dict = {}


def _score(lengths: list[int], gpus: int, method: str, model: str) -> dict:
    """Compile, validate and simulate one plan; the layer figures with the model's layer around attention. A
    baseline is scored at its better node fan-out variant (on or off), as the issue asks; with
    --baselines-fit-memory, at its better variant within the 4cB budget (either, when neither fits)."""
    if method == "main":
        variants = [dict(model="none", floor=False)]
    elif method == "fcp":
        variants = [{"model": model, **_CONTEXT.get("fcp_options", {})}]  # --fcp-options may place for another model
    else:
        variants = [dict(planner=Planner(method), model=model, node_fan_out=switch, validatable=False,
                         fit_memory=_CONTEXT.get("fit_memory", False)) for switch in (True, False)]
    def rank(row: dict) -> tuple:
        over = _CONTEXT.get("fit_memory", False) and row["max_buffer_tokens"] > BUFFER_BUDGET
        return over, row["layer_s"]

    best = None
    for options in variants:
        row = _score_one(lengths, gpus, method, model, options)
        if best is None or (not row.get("error") and (best.get("error") or rank(row) < rank(best))):
            best = row
    return best


def _score_one(lengths: list[int], gpus: int, method: str, model: str, options: dict) -> dict:
    if _CONTEXT.get("mask"):
        options = {**options, "mask": _CONTEXT["mask"]}
    started = time.perf_counter()
    try:
        plan = compile_plan(lengths, gpus, **options)
    except InfeasibleError as error:
        return {"method": method, "error": str(error)}
    seconds = time.perf_counter() - started
    # Rings past the validator's 64M segment pairs are not validated; --validate fcp validates fcp's plans alone.
    validated = validate_unless_too_large(plan.to_bytes()) if method in _CONTEXT.get("validate", (method,)) else None
    figures = simulate_plan(plan, model=model).figures()
    floor = plan.stats.get("floor")
    return {"factors": _gap_factors(figures, _staging_seconds(plan)), "method": method, "compile_s": seconds,
            "rank_sha256": plan.header.rank_sha256, "validated": validated,
            "node_fan_out": options.get("node_fan_out"), "winner": floor["winner"] if floor else None,
            "max_buffer_tokens": plan.header.max_buffer_tokens,
            "buffer_budget": BUFFER_BUDGET,
            "layer_s": figures["layer_makespan_fwd_s"] + figures["layer_makespan_bwd_s"],
            **{key: figures[key] for key in ("layer_makespan_fwd_s", "layer_makespan_bwd_s", "layer_gap_fwd",
                                             "layer_gap_bwd", "normalized_layer_mfu",
                                             "layer_makespan_lower_bound_fwd_s",
                                             "layer_makespan_lower_bound_bwd_s")},
            "binding": {key: figures["layer_bound_terms"][key]["binding"] for key in ("fwd", "bwd")},
            "compute_imbalance": plan.stats["compute_imbalance"], "token_imbalance": plan.stats["token_imbalance"]}


def _number(text: str):
    for kind in (int, float):  # "inf": memory_budget_gib=inf (no budget)
        try:
            return kind(text)
        except ValueError:
            pass
    return text


def _staging_seconds(plan) -> dict:
    """Per pass, the attention seconds the mean rank spends because its stages split a query segment's keys over
    several kernel calls: its tiles at their stages' calls less the same tiles with one call per (rank, query
    segment), whose larger calls the efficiency curve charges less (the bound's side of the efficiency factor)."""
    tiles, assignment, schedule = plan.ir.tiles, plan.ir.assignment, plan.ir.schedule
    everything = np.arange(tiles.num_tiles)
    pairs = tiles.segment_pairs() if tiles.has_pairs else None
    merged = coalesced_seconds(tiles, everything, assignment.tile_rank, np.zeros(tiles.num_tiles, dtype=np.int64),
                               tiles.profile, pairs).sum()
    out = {}
    for key, program, work in (("fwd", schedule.forward, 1.0), ("bwd", schedule.backward, BACKWARD_WORK)):
        staged = coalesced_seconds(tiles, everything, assignment.tile_rank, program.tile_stage, tiles.profile,
                                   pairs).sum()
        out[key] = work * float(staged - merged) / assignment.num_ranks
    return out


def _gap_factors(figures: dict, staging_seconds: dict) -> dict:
    """Each pass's gap as a product of three factors: efficiency (the mean rank's busy time, linear layers and
    attention, over the bound: kernel efficiency below the bound's cap, launches), imbalance (the busiest rank over
    the mean one) and exposure (the makespan over the busiest rank's busy time: waiting for messages and partners).
    Beside them, the part of efficiency that staging costs (`staging`: the mean busy time over the same less
    `staging_seconds`, what one kernel call per query segment would have saved)."""
    out = {}
    for key in ("fwd", "bwd"):
        busy = np.array([row[f"layer_busy_{key}_s"] for row in figures["per_rank"]])
        out[key] = {"efficiency": float(busy.mean()) / figures[f"layer_makespan_lower_bound_{key}_s"],
                    "imbalance": float(busy.max() / busy.mean()),
                    "exposure": figures[f"layer_makespan_{key}_s"] / float(busy.max()),
                    "staging": float(busy.mean()) / (float(busy.mean()) - staging_seconds[key])}
    return out


def _job(job: tuple) -> dict:
    name, gpus, seed, method = job
    lengths = _CONTEXT["makers"][name](gpus * TOKENS_PER_GPU, seed)
    return {"batch": name, "gpus": gpus, "seed": seed, **_score(lengths, gpus, method, _CONTEXT["model"])}


_TIMING_SCRIPT = """import json, sys, time
from fcp_compiler import compile_plan
lengths, options = json.loads(sys.stdin.read())
compile_plan(lengths[:50], 8)  # imports and first-call costs outside the timing
started = time.perf_counter()
plan = compile_plan(lengths, 256, **options)
print(json.dumps({"seconds": time.perf_counter() - started}))
"""


def _compile_seconds(tree: Path, lengths: list[int], options: dict) -> float:
    """One compile_plan of `lengths` at 256 GPUs in a fresh process running the code in `tree`."""
    done = subprocess.run([sys.executable, "-c", _TIMING_SCRIPT], input=json.dumps([lengths, options]), text=True,
                          capture_output=True, check=True, cwd=tree, env={"PYTHONPATH": str(tree), "PATH": ""})
    return json.loads(done.stdout)["seconds"]


def _main_tree_check(tree: Path, makers: dict, model: str, timed: list[str]) -> list[str]:
    """Main's own compile_plan in `tree` (a checkout of main before issue 20): its rank sections beside this tree's
    --model none on the paper batch at 64 GPUs; and compile_plan at 256 GPUs on each of the `timed` batches (seed
    0), each tree in fresh processes taking turns, median of 3."""
    lengths_64 = makers["paper"](64 * TOKENS_PER_GPU, 0)
    script = ("import json, sys; from fcp_compiler import compile_plan\n"
              "print(json.dumps(compile_plan(json.loads(sys.stdin.read()), 64).header.rank_sha256))\n")
    done = subprocess.run([sys.executable, "-c", script], input=json.dumps(lengths_64), text=True,
                          capture_output=True, check=True, cwd=tree, env={"PYTHONPATH": str(tree), "PATH": ""})
    same = json.loads(done.stdout) == compile_plan(lengths_64, 64, model="none").header.rank_sha256
    lines = [f"main's own plan (paper, 64 GPUs) rank by rank {'==' if same else '!='} this tree's --model none"]
    here = Path(__file__).resolve().parents[1]
    for name in timed:
        lengths = makers[name](256 * TOKENS_PER_GPU, 0)
        main_times, our_times = [], []
        for _ in range(3):
            main_times.append(_compile_seconds(tree, lengths, {}))
            our_times.append(_compile_seconds(here, lengths, {"model": model}))
        main_median, ours = statistics.median(main_times), statistics.median(our_times)
        lines.append(f"compile_plan, {name} seed 0 at 256 GPUs, fresh processes taking turns, median of 3: main "
                     f"{main_median:.3f} s, this tree ({model}) {ours:.3f} s: {ours / main_median:.2f}x")
    return lines


def _report(rows: list[dict], model: str) -> None:
    if "fcp" not in {row["method"] for row in rows} or not {row["method"] for row in rows} & set(BASELINES):
        gaps = [row[f"layer_gap_{p}"] for row in rows if not row.get("error") for p in ("fwd", "bwd")]
        print(f"{len(rows)} plans; layer gap median {statistics.median(gaps):.3f}, max {max(gaps):.3f} (the table "
              f"needs fcp, main and a baseline: --write keeps every row)")
        return
    by_batch: dict[tuple, dict] = {}
    for row in rows:
        by_batch.setdefault((row["batch"], row["gpus"], row["seed"]), {})[row["method"]] = row
    body, summary = [], {"gaps": [], "speedups": [], "losses": [], "vs_main": [], "mfu_gain": []}
    for (name, gpus, seed), methods in by_batch.items():
        fcp = methods["fcp"]
        main = methods.get("main", fcp)  # without the main method, its columns repeat fcp's
        base = {m: r for m, r in methods.items() if m in BASELINES and not r.get("error")}
        best = min(base.values(), key=lambda r: r["layer_makespan_fwd_s"] + r["layer_makespan_bwd_s"])
        speed = [best[f"layer_makespan_{p}_s"] / fcp[f"layer_makespan_{p}_s"] for p in ("fwd", "bwd")]
        worst_baseline = min(r[f"layer_makespan_{p}_s"] / fcp[f"layer_makespan_{p}_s"] for r in base.values()
                             for p in ("fwd", "bwd"))
        over_main = [main[f"layer_makespan_{p}_s"] / fcp[f"layer_makespan_{p}_s"] for p in ("fwd", "bwd")]
        summary["gaps"] += [fcp["layer_gap_fwd"], fcp["layer_gap_bwd"]]
        summary["speedups"].append(float(np.sqrt(speed[0] * speed[1])))
        summary["losses"].append(worst_baseline < 1.0)
        summary["vs_main"] += over_main
        summary["mfu_gain"].append(fcp["normalized_layer_mfu"] - main["normalized_layer_mfu"])
        body.append([name, gpus, seed, f"{fcp['layer_gap_fwd']:.3f}", f"{fcp['layer_gap_bwd']:.3f}",
                     f"{main['layer_gap_fwd']:.3f}", f"{main['layer_gap_bwd']:.3f}",
                     f"{fcp['binding']['fwd']}/{fcp['binding']['bwd']}", best["method"],
                     f"{speed[0]:.3f}x", f"{speed[1]:.3f}x", f"{worst_baseline:.3f}x",
                     f"{over_main[0]:.3f}x", f"{over_main[1]:.3f}x",
                     f"{fcp['normalized_layer_mfu']:.3f}", f"{main['normalized_layer_mfu']:.3f}",
                     f"{fcp['token_imbalance']:.3f}", f"{fcp['compute_imbalance']:.3f}",
                     "/".join(f"{fcp['factors'][p][k]:.3f}" for p in ("fwd", "bwd")
                              for k in ("efficiency", "imbalance", "exposure"))])
    print(table(["batch", "gpus", "seed", "gap fwd", "gap bwd", "main gap fwd", "main gap bwd", "bound by",
                 "best baseline", "vs best fwd", "vs best bwd", "vs worst-case baseline", "vs main fwd",
                 "vs main bwd", "norm layer MFU", "main", "token imb", "compute imb",
                 "gap = efficiency x imbalance x exposure (fwd/bwd)"], body))
    gaps = summary["gaps"]
    unvalidated = sorted({(r["method"], r["batch"], r["gpus"]) for r in rows if r.get("validated") is False})
    skipped = sorted({r["method"] for r in rows if r.get("validated") is None and not r.get("error")})
    if skipped:
        print(f"not validated (--validate): {', '.join(skipped)}")
    print(f"\nmodel {model}; {len(by_batch)} batches; every plan validated except "
          f"{len(unvalidated)} with more segment pairs than the validator enumerates: "
          + ", ".join(f"{m} {b}@{g}" for m, b, g in unvalidated[:6]) + ("..." if len(unvalidated) > 6 else ""))
    print(f"layer gap (fcp, both passes): max {max(gaps):.3f}, median {statistics.median(gaps):.3f}, "
          f"above 1.10 on {sum(g > 1.10 for g in gaps)} of {len(gaps)}")
    print(f"fcp over the best baseline of each batch (layer makespan, geometric mean of the passes): geometric mean "
          f"{float(np.exp(np.mean(np.log(summary['speedups'])))):.3f}x, min {min(summary['speedups']):.3f}x; some "
          f"baseline faster in either pass on {sum(summary['losses'])} of {len(by_batch)} batches")
    over = [(f, p) for f in (m["fcp"] for m in by_batch.values()) for p in ("fwd", "bwd") if f[f"layer_gap_{p}"] > 1.10]
    if over:
        mean_factor = {k: float(np.exp(np.mean([np.log(f["factors"][p][k]) for f, p in over])))
                       for k in ("efficiency", "imbalance", "exposure")}
        staging = float(np.exp(np.mean([np.log(f["factors"][p]["staging"]) for f, p in over])))
        print(f"the {len(over)} passes above 1.10, geometric mean factors: " + ", ".join(
            f"{k} {v:.3f}" for k, v in mean_factor.items()) + f" (of efficiency, staging {staging:.3f})")
    fcp_rows = [m["fcp"] for m in by_batch.values()]
    exposures = [f["factors"][p]["exposure"] for f in fcp_rows for p in ("fwd", "bwd")]
    print(f"exposed time (layer makespan over the busiest rank's layer busy time) <= 5% on "
          f"{sum(e <= 1.05 for e in exposures)} of {len(exposures)} fcp passes")
    staging = [f["factors"][p]["staging"] for f in fcp_rows for p in ("fwd", "bwd")]
    print(f"staging (the mean rank's busy time over the same with one kernel call per query segment): median "
          f"{statistics.median(staging):.3f}, max {max(staging):.3f} over the fcp passes")
    planned = [r for r in rows if not r.get("error")]
    over_memory = {m: sum(r["max_buffer_tokens"] > BUFFER_BUDGET for r in planned if r["method"] == m)
                   for m in sorted({r["method"] for r in planned})}
    print(f"plans whose live buffers exceed 4cB = {BUFFER_BUDGET} tokens: "
          + ", ".join(f"{m} {n}" for m, n in over_memory.items()))
    winners: dict = {}
    for f in fcp_rows:
        if f.get("winner"):
            winners[f["winner"].split(" c")[0]] = winners.get(f["winner"].split(" c")[0], 0) + 1
    print("floor winners: " + ", ".join(f"{name} {count}" for name, count in sorted(winners.items())))
    print("baselines' better fan-out variant: " + ", ".join(
        f"{m} on {sum(r.get('node_fan_out') is True for r in rows if r['method'] == m)}/off "
        f"{sum(r.get('node_fan_out') is False for r in rows if r['method'] == m)}" for m in BASELINES
        if any(r["method"] == m for r in rows)))
    print(f"fcp over main: min {min(summary['vs_main']):.3f}x (either pass), slower than main on "
          f"{sum(v < 1.0 for v in summary['vs_main'])} of {len(summary['vs_main'])} pass-batches; mean "
          f"normalized_layer_mfu gain {float(np.mean(summary['mfu_gain'])):+.4f}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    matrix_arguments(parser)
    parser.add_argument("--model", default="llama3-70b")
    parser.add_argument("--methods", default="fcp,main," + ",".join(BASELINES))
    parser.add_argument("--jobs", type=int, help="processes [all cores]")
    parser.add_argument("--fcp-options", default="",
                        help="compile options for fcp, e.g. zigzag=off,token_tolerance=0.02")
    parser.add_argument("--main-tree", type=Path, help="a checkout of main before issue 20 (identity and timing)")
    parser.add_argument("--write", type=Path, help="write every row as JSON")
    parser.add_argument("--mask", help="override every batch's mask, e.g. sliding_window:4096")
    parser.add_argument("--validate", help="comma-separated methods whose plans are validated [all]")
    parser.add_argument("--baselines-fit-memory", action="store_true",
                        help="hold the baselines to FCP's live-buffer budget (4cB, smaller stages where needed)")
    parser.add_argument("--timing-only", action="store_true",
                        help="only the --main-tree checks, timing each of --batches at 256 GPUs")
    args = parser.parse_args()
    makers, chosen = chosen_batches(parser, args)
    _CONTEXT.update(makers=makers, model=args.model, mask=args.mask, fit_memory=args.baselines_fit_memory)
    if args.validate:
        _CONTEXT["validate"] = tuple(args.validate.split(","))
    _CONTEXT["fcp_options"] = {key: _number(value) for key, value in
                               (item.split("=", 1) for item in args.fcp_options.split(",") if item)}
    if args.timing_only:
        print("\n".join(_main_tree_check(args.main_tree, makers, args.model, chosen)))
        return
    jobs = [(name, gpus, seed, method) for name in chosen for gpus in (int(g) for g in args.gpus.split(","))
            for seed in range(args.seeds) for method in args.methods.split(",")]
    jobs.sort(key=lambda job: (-job[1], job[3] != "ring"))  # the slowest first
    rows = []
    for row in map_on_cores(_job, jobs, args.jobs):
        rows.append(row)
        print(f"  {len(rows)}/{len(jobs)} {row['batch']} @ {row['gpus']} seed {row['seed']} {row['method']}",
              file=sys.stderr, flush=True)
    rows.sort(key=lambda r: (chosen.index(r["batch"]), r["gpus"], r["seed"], r["method"]))
    if args.write:
        args.write.write_text(json.dumps(rows, indent=1))
    _report(rows, args.model)
    if args.main_tree:
        print("\n".join(_main_tree_check(args.main_tree, makers, args.model, ["paper"])))


if __name__ == "__main__":
    main()

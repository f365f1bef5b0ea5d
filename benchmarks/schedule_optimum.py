"""The schedule against its optimum: for each small plan's placement, the least layer time any schedule of it takes
(CP-SAT, fcp_compiler.algorithms.job_shop), beside what the compiler's schedule takes and the certified lower bound.

Usage: python benchmarks/schedule_optimum.py [--eval-data DIR] [--instances 108] [--ids 98,101] [--time-limit 60]
       [--jobs 2] [--options '{"schedule_search": false}'] [--staged-calls] [--write rows.json]
       [--compare old_rows.json]

Instances: 4, 8 and 16 ranks (one node of 8 GPUs, or two: NVLink and the NIC); every distribution of the matrix
(the paper-like lognormal, and each length file of --eval-data with and without a long tail, scaled to the batch);
causal and a sliding window of 2048; 4096 tokens per rank at block 512 or 8192 at block 1024; every third plan with
a device memory budget below the unbudgeted peak of FCP's own placement (BUDGET_CUTS), so that the compiler refits
its stages. Each plan is compiled with the floor as `fcp compile` does, validated, and simulated on its profile
without what the job shop leaves out (launches, copies outside the kernels, the SMs messages take:
schedule_problem.ideal_profile). The optimum is per pass (forward, backward) with the plan's own live buffer tokens
as each rank's budget; the layer time is forward plus backward.

--staged-calls charges each tile in the job shop at the efficiency of the kernel call the plan's own stages put it in
(schedule_problem.pass_problem's staged_calls), not at one launch a rank: that optimum bounds only schedules making
the plan's calls, so plan / it is what the plan's order and waiting lose, and the default run's optimum over it what
its call sizes lose.

Prints per instance: the plan's layer time over the optimum, the certified bound over it, CP-SAT's proof (optimal or
its gap); then median, 90th percentile and max of each ratio. --compare prints a second plan column from an earlier
run's --write (the same instances: their placements must match, else the row says so).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from placement import EVAL_DATA, LENGTH_FILES  # noqa: E402

from fcp_compiler import compile_plan  # noqa: E402
from fcp_compiler.algorithms.job_shop import solve_job_shop  # noqa: E402
from fcp_compiler.errors import InfeasibleError  # noqa: E402
from fcp_compiler.core.schedule_problem import ideal_profile, problems_of  # noqa: E402
from fcp_compiler.core.simulate import simulate_plan  # noqa: E402
from fcp_compiler.format.validate import validate_plan  # noqa: E402
from fcp_compiler.tools.parallel import map_on_cores  # noqa: E402
from fcp_compiler.tools.report import table  # noqa: E402
from fcp_compiler.tools.traces import (empirical_batch, histogram_batch, lognormal_batch, read_histogram_csv,  # noqa: E402
                                       read_lengths_file)

RANKS = (4, 8, 16)
SIZES = ((4096, 512), (8192, 1024))  # (tokens per rank, block size)
WINDOW = 2048
TAIL_FRACTION = 0.2
# A budgeted instance's device memory budget: a share of what its unbudgeted plan peaks at, the first the compiler
# meets (its own tokens' accumulators and outputs set a floor no schedule goes below).
BUDGET_CUTS = (0.8, 0.9, 0.95)
# An optimum counts as found when CP-SAT proves it, or its proven bound is within PROOF_GAP; else it is solved again
# from its best schedule for RETRY_FACTOR times as long.
PROOF_GAP = 0.01
RETRY_FACTOR = 4
_CONTEXT: dict = {}


def distributions(eval_data: Path) -> dict:
    """Name -> function(total tokens, seed) -> lengths: the matrix's distributions at a small plan's scale (sequences
    up to the batch, a tail of an eighth to a half of it)."""
    out = {"paper": lambda total, seed: lognormal_batch(total, total // 64, 1.8, 16, total // 2, seed)}
    for name, relative in LENGTH_FILES.items():
        if (eval_data / relative).exists():
            values = read_lengths_file(eval_data / relative)
            for tail in (0.0, TAIL_FRACTION):
                out[name + ("+tail" if tail else "")] = lambda total, seed, values=values, tail=tail: empirical_batch(
                    values, total, seed, max_len=total // 2, tail_fraction=tail, tail_min=total // 8,
                    tail_max=total // 2)
    histogram = eval_data / "magiattention/doc_length_distribution.csv"
    if histogram.exists():
        edges, counts = read_histogram_csv(histogram)
        for tail in (0.0, TAIL_FRACTION):
            out["magi" + ("+tail" if tail else "")] = lambda total, seed, tail=tail: [
                min(length, total // 2) for length in histogram_batch(edges, counts, total, seed, tail_fraction=tail,
                                                                      tail_min=total // 8, tail_max=total // 2)]
    return out


def instances(eval_data: Path, count: int) -> list[dict]:
    """`count` instances cycling through ranks, distributions, masks, sizes and budgets (module docstring)."""
    makers = distributions(eval_data)
    out, seed = [], 0
    while len(out) < count:
        for name in makers:
            if len(out) == count:
                break
            idx = len(out)
            ranks, (per_rank, block) = RANKS[idx % 3], SIZES[(idx // 3) % 2]
            mask = "causal" if (idx // 6) % 2 == 0 else f"sliding_window:{WINDOW}"
            out.append({"id": idx, "distribution": name, "seed": seed, "ranks": ranks, "block": block,
                        "mask": mask, "tokens": per_rank * ranks, "budget": idx % 3 == 2})
        seed += 1
    return out


def _lengths(case: dict) -> list[int]:
    return [int(x) for x in distributions(_CONTEXT["eval_data"])[case["distribution"]](case["tokens"], case["seed"])]


def _own_peak_bytes(lengths: list[int], num_ranks: int, fields: dict) -> int:
    """The peak device memory of FCP's own placement scheduled once at the requested rounds a stage, direct (what
    `--no-floor` compiled before it was scheduled and finished as the floor's first candidate): the same whatever the
    floor's or --no-floor's choices, so that trees compare on one budget and the instances stay RESULTS.md's: at the 1%
    token tolerance FCP's own placement kept before it kept 5% (options.LAYER_TOKEN_TOLERANCE). It runs the
    pipeline's one-placement path (no public option reaches it for FCP any more)."""
    from fcp_compiler.core import floor, pipeline
    from fcp_compiler.core.memory_budget import within_budget
    from fcp_compiler.core.pass_timer import PassTimer

    timer = PassTimer()
    prepared = pipeline._prepare(lengths, num_ranks, None, {"token_tolerance": 0.01, **fields, "floor": False})
    digest = pipeline.inputs_digest(prepared.batch, prepared.options, prepared.token_cap)
    kept = pipeline._compile_alone(timer, prepared.batch, prepared.options, prepared.token_cap, digest)
    decision = within_budget(timer, kept, prepared.options, digest, floor.TILE_BUDGET).decision
    assert not decision.refitted, "a small plan over the default device budget"
    return decision.unbudgeted_peak_bytes


def _compile(case: dict, options: dict):
    """The instance's plan; with a budget, the peak device memory of FCP's own placement alone
    (:func:`_own_peak_bytes`) cut by the first of BUDGET_CUTS the compiler can meet (its stages refitted), else
    unbudgeted."""
    fields = {"block_size": case["block"], "mask": case["mask"], **options}
    lengths = _lengths(case)
    if case["budget"]:
        peak_bytes = _own_peak_bytes(lengths, case["ranks"], fields)
        for cut in BUDGET_CUTS:
            try:
                return compile_plan(lengths, case["ranks"], memory_budget_gib=cut * peak_bytes / 2 ** 30, **fields)
            except InfeasibleError:
                continue
    return compile_plan(lengths, case["ranks"], **fields)


def _measure(case: dict) -> dict:
    """One instance: the plan's layer time on the ideal profile, the optimum of its placement, the bound."""
    plan = _compile(case, _CONTEXT["options"])
    validate_plan(plan.to_bytes())
    figures = simulate_plan(plan, profile=ideal_profile(plan.header.profile)).layer_figures()
    budget_tokens = int(plan.header.max_buffer_tokens)
    row = {**case, "placement": _placement_key(plan), "budget_tokens": budget_tokens,
           "max_buffer_tokens": budget_tokens, "num_fwd_stages": plan.header.num_fwd_stages,
           "num_bwd_stages": plan.header.num_bwd_stages}
    row["staged_calls"] = _CONTEXT.get("staged_calls", False)
    for name, problem in problems_of(plan, budget_tokens, staged_calls=row["staged_calls"]).items():
        result = solve_job_shop(problem, time_limit_s=_CONTEXT["time_limit"])
        if not result.optimal and result.gap > PROOF_GAP:  # longer, from the schedule found
            result = solve_job_shop(problem, time_limit_s=RETRY_FACTOR * _CONTEXT["time_limit"], hint=result)
        row[f"plan_{name}_s"] = figures[f"layer_makespan_{name}_s"]
        row[f"bound_{name}_s"] = figures[f"layer_makespan_lower_bound_{name}_s"]
        row[f"optimum_{name}_s"] = result.makespan_s
        row[f"optimum_bound_{name}_s"] = result.lower_bound_s
        row[f"optimal_{name}"] = result.optimal
        row[f"solve_{name}_s"] = result.solve_seconds
        row[f"jobs_{name}"], row[f"messages_{name}"] = problem.num_jobs, problem.num_messages
    for key in ("plan", "bound", "optimum", "optimum_bound"):
        row[f"{key}_s"] = row[f"{key}_fwd_s"] + row[f"{key}_bwd_s"]
    return row


def _placement_key(plan) -> str:
    """A digest of the placement (block and tile ranks, pulls and their sources): equal placements, equal optima."""
    import hashlib

    final = plan.ir
    digest = hashlib.sha256()
    for array in (final.assignment.block_rank, final.assignment.tile_rank, final.transfers.edge_src,
                  final.transfers.edge_dst, final.transfers.edge_block):
        digest.update(np.ascontiguousarray(array, dtype=np.int64).tobytes())
    return digest.hexdigest()[:16]


def _quantiles(values: list[float]) -> tuple[float, float, float]:
    ordered = sorted(values)
    return statistics.median(ordered), ordered[min(len(ordered) - 1, int(np.ceil(0.9 * len(ordered))) - 1)], ordered[-1]


def _report(rows: list[dict], old: dict[int, dict]) -> None:
    headers = ["id", "distribution", "N", "B", "mask", "budget", "jobs", "msgs", "stages", "plan/opt"]
    headers += ["old/opt"] if old else []
    headers += ["bound/opt", "proof", "solve s"]
    lines = []
    for row in rows:
        proof = "optimal" if row["optimal_fwd"] and row["optimal_bwd"] else \
            f"gap {max(row['optimum_s'] / row['optimum_bound_s'] - 1, 0):.2%}"
        cells = [row["id"], row["distribution"], row["ranks"], row["block"], row["mask"].split(":")[0],
                 row["budget_tokens"] if row["budget"] else "-", row["jobs_fwd"], row["messages_bwd"],
                 f"{row['num_fwd_stages']}/{row['num_bwd_stages']}", f"{row['plan_s'] / row['optimum_s']:.4f}"]
        if old:
            previous = old.get(row["id"])
            cells.append("n/a" if previous is None else f"{previous['plan_s'] / previous['optimum_s']:.4f}")
        cells += [f"{row['bound_s'] / row['optimum_s']:.4f}", proof, f"{row['solve_fwd_s'] + row['solve_bwd_s']:.1f}"]
        lines.append(cells)
    print(table(headers, lines))
    print()
    summary = [("plan / optimum", [r["plan_s"] / r["optimum_s"] for r in rows])]
    if old:
        summary.append(("old plan / its optimum", [old[r["id"]]["plan_s"] / old[r["id"]]["optimum_s"]
                                                  for r in rows if r["id"] in old]))
    summary.append(("certified bound / optimum", [r["bound_s"] / r["optimum_s"] for r in rows]))
    for name, values in summary:
        median, p90, most = _quantiles(values)
        print(f"  {name:28s} median {median:.4f}  p90 {p90:.4f}  max {most:.4f}  min {min(values):.4f}")
    proven = sum(r["optimal_fwd"] and r["optimal_bwd"] for r in rows)
    within = sum(r["optimum_s"] <= r["optimum_bound_s"] * 1.01 for r in rows)
    print(f"  {len(rows)} instances: {proven} proven optimal, {within} within 1% of CP-SAT's bound; "
          f"{sum(r['bound_s'] > r['optimum_s'] * (1 + 1e-9) for r in rows)} with the certified bound above the optimum")
    below = [r["id"] for r in rows if r["plan_s"] < r["optimum_bound_s"] * (1 - 1e-6)]
    if below:  # the simulator shares a link end between a stage's messages, the job shop sends them in turn
        print(f"  plans faster than the optimum's proven bound (link sharing): {below}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--eval-data", type=Path, default=EVAL_DATA)
    parser.add_argument("--instances", type=int, default=108)
    parser.add_argument("--ids", help="only these instances, by id: 98,101")
    parser.add_argument("--time-limit", type=float, default=60.0, help="CP-SAT seconds per pass")
    parser.add_argument("--jobs", type=int, default=None)
    parser.add_argument("--options", default="{}", help="compile options as JSON, e.g. an ablation switch")
    parser.add_argument("--staged-calls", action="store_true",
                        help="the optimum at the plan's own kernel calls (what its order loses, apart from its calls)")
    parser.add_argument("--write", type=Path)
    parser.add_argument("--compare", type=Path, help="an earlier run's --write: its plan column beside this one")
    args = parser.parse_args()
    _CONTEXT.update(eval_data=args.eval_data, time_limit=args.time_limit, options=json.loads(args.options),
                    staged_calls=args.staged_calls)
    cases = instances(args.eval_data, args.instances)
    if args.ids:
        wanted = {int(value) for value in args.ids.split(",")}
        cases = [case for case in cases if case["id"] in wanted]
    started, rows = time.perf_counter(), []
    for done, row in enumerate(map_on_cores(_measure, cases, args.jobs), 1):
        rows.append(row)
        print(f"\r  {done}/{len(cases)} instances ({time.perf_counter() - started:.0f} s)", end="", file=sys.stderr,
              flush=True)
    print(file=sys.stderr)
    rows.sort(key=lambda r: r["id"])
    old = {}
    if args.compare:
        old = {r["id"]: r for r in json.loads(args.compare.read_text())}
    _report(rows, old)
    if args.write:
        args.write.write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()

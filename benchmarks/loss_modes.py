"""FCP's own placement beside the magi-like baseline's, batch by batch: what each of three loss modes costs.

Usage: python benchmarks/loss_modes.py [--eval-data DIR] [--gpus 64,256] [--seeds 3] [--jobs 2] [--write rows.json]

Every batch of the matrix (benchmarks/placement.py) is compiled three ways, each validated and simulated with its
model's layer: FCP's own placement alone (`floor=False`) within the default device memory budget; the same
unbudgeted (`memory_budget_gib=math.inf`: what the budget costs it); and the magi-like baseline held to the floor's
live-buffer budget (`fit_memory`), at its better node fan-out variant. Per batch it prints own / magi layer time and,
for each loss mode, its measure:

- pairing: own tiles / magi's tiles, and the busiest rank's attention compute (forward) own / magi's: zig-zag
  pairing and smaller tiles make more kernel calls, each lower on the efficiency curve (the compute also differs
  by what the placement balances: the whole layer, not attention alone);
- stages: own forward/backward stages against magi's, and own layer time within the budget / unbudgeted: a
  budget that needs small stages;
- NIC receiver: the busiest rank's NIC receive bytes own / magi's, and the exposed time (each pass's layer makespan
  less the busiest rank's busy time, forward plus backward) own less magi's, in ms: one receiver everyone waits
  for.

It also compiles each batch as `fcp compile` does (the floor) and counts the batches where own is within 0.5% and
2% of it.

Then, for each mode, the batch where its measure is worst, with own / magi there. Run it in two trees
(`PYTHONPATH=TREE python TREE/benchmarks/loss_modes.py ...`, or this script with --write in each) to see a mode
before and after a change.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from placement import EVAL_DATA, TOKENS_PER_GPU, batches  # noqa: E402

from fcp_compiler import compile_plan  # noqa: E402
from fcp_compiler.core.simulate import layer_stats, simulate_plan  # noqa: E402
from fcp_compiler.format.validate import validate_plan  # noqa: E402
from fcp_compiler.tools.parallel import map_on_cores  # noqa: E402
from fcp_compiler.tools.report import table  # noqa: E402

_CONTEXT: dict = {}


def _figures(plan) -> dict:
    """One plan's figures: layer time, tiles, stages, the busiest rank's forward compute and NIC receive bytes, the
    forward's exposure."""
    validate_plan(plan.to_bytes())
    simulation = simulate_plan(plan)
    figures = simulation.layer_figures()
    exposed_s = sum(figures[f"layer_makespan_{name}_s"] - float(result.busy.max())
                    for name, result in (("fwd", simulation.layer_forward), ("bwd", simulation.layer_backward)))
    stats = plan.stats
    return {"layer_s": figures["layer_makespan_fwd_s"] + figures["layer_makespan_bwd_s"],
            "tiles": stats["num_tiles"], "stages": f"{stats['num_fwd_stages']}/{stats['num_bwd_stages']}",
            "compute_fwd_s": float(simulation.forward.compute.max()),
            "nic_recv_bytes": stats["max_rank_nic_recv_bytes"],
            "exposed_s": exposed_s}


def _measure(case: tuple[str, int, int]) -> dict:
    """One batch compiled the three ways (module docstring)."""
    name, gpus, seed = case
    lengths = [int(v) for v in batches(_CONTEXT["eval_data"])[name](gpus * TOKENS_PER_GPU, seed)]
    own = _figures(compile_plan(lengths, gpus, floor=False))
    unbudgeted = layer_stats(compile_plan(lengths, gpus, floor=False, memory_budget_gib=math.inf))
    unbudgeted_s = unbudgeted["layer_makespan_fwd_s"] + unbudgeted["layer_makespan_bwd_s"]
    floor = layer_stats(compile_plan(lengths, gpus))
    magi = min((_figures(compile_plan(lengths, gpus, planner="magi", node_fan_out=switch, fit_memory=True,
                                      validatable=False)) for switch in (True, False)), key=lambda row: row["layer_s"])
    return {"batch": f"{name}/{gpus}/{seed}", "own": own, "magi": magi, "own_unbudgeted_s": unbudgeted_s,
            "floor_s": floor["layer_makespan_fwd_s"] + floor["layer_makespan_bwd_s"]}


def _modes(row: dict) -> dict:
    own, magi = row["own"], row["magi"]
    return {"own/magi": own["layer_s"] / magi["layer_s"], "tiles": own["tiles"] / magi["tiles"],
            "compute": own["compute_fwd_s"] / magi["compute_fwd_s"],
            "budget": own["layer_s"] / row["own_unbudgeted_s"],
            "nic": own["nic_recv_bytes"] / max(magi["nic_recv_bytes"], 1),
            "exposed_ms": 1e3 * (own["exposed_s"] - magi["exposed_s"])}


def _report(rows: list[dict]) -> None:
    body = []
    for row in rows:
        mode = _modes(row)
        body.append([row["batch"], f"{mode['own/magi']:.3f}", f"{mode['tiles']:.2f}", f"{mode['compute']:.3f}",
                     f"{row['own']['stages']} / {row['magi']['stages']}", f"{mode['budget']:.3f}",
                     f"{mode['nic']:.2f}", f"{mode['exposed_ms']:+.1f}"])
    print(table(["batch", "own/magi", "tiles", "compute fwd", "stages own / magi", "budget cost", "NIC recv",
                 "exposed ms"], body))
    print()
    own_floor = [row["own"]["layer_s"] / row["floor_s"] for row in rows]
    print(f"  own / the floor (default compile): within 0.5% on {sum(r <= 1.005 for r in own_floor)} of "
          f"{len(rows)}, within 2% on {sum(r <= 1.02 for r in own_floor)}, worst {max(own_floor):.3f}")
    for title, key in (("pairing: own/magi tiles", "tiles"), ("stages: own in budget/unbudgeted", "budget"),
                       ("NIC receiver: own-magi exposed ms", "exposed_ms")):
        worst = max(rows, key=lambda row: _modes(row)[key])
        mode = _modes(worst)
        print(f"  {title:36s} worst {worst['batch']:<22} {mode[key]:.3f}  (own/magi layer there "
              f"{mode['own/magi']:.3f})")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--eval-data", type=Path, default=EVAL_DATA)
    parser.add_argument("--gpus", default="64,256")
    parser.add_argument("--seeds", type=int, default=3)
    parser.add_argument("--jobs", type=int, default=None)
    parser.add_argument("--write", type=Path)
    args = parser.parse_args()
    _CONTEXT["eval_data"] = args.eval_data
    cases = [(name, int(gpus), seed) for name in batches(args.eval_data) for gpus in args.gpus.split(",")
             for seed in range(args.seeds)]
    rows = []
    for done, row in enumerate(map_on_cores(_measure, cases, args.jobs), 1):
        rows.append(row)
        print(f"\r  {done}/{len(cases)} batches", end="", file=sys.stderr, flush=True)
    print(file=sys.stderr)
    rows.sort(key=lambda row: [row["batch"].split("/")[0], int(row["batch"].split("/")[1]), row["batch"]])
    _report(rows)
    if args.write:
        args.write.write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()

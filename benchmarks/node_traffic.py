"""Node-aware plans (issue 21): NIC traffic, speed and compile time of every plan, beside today's main.

Usage: python benchmarks/node_traffic.py --main-tree PATH [--gpus 64,256] [--seeds 3] [--eval-data DIR]
       [--batches paper,magi] [--jobs 2] [--write rows.json] [--timing-runs 3]

The matrix: the paper-like lognormal trace and each length file in --eval-data with and without a 20% long tail,
32768 tokens per GPU, three seeds, 64 and 256 GPUs, block 4096, coalesce 16, h100 (8 GPUs a node), plan layout,
the default model. Each plan is compiled, validated and simulated in a fresh process running either this tree or
--main-tree (a checkout of main before issue 21), so each side is scored by its own code. Per plan:

- nic: forward bytes over NICs (pulls and pushes between nodes, each crossing counted once);
- once: main's forward pull bytes if every (block, kind) crossed into each node that needs it once (the union of
  the segments its pulls there carry), the figure the issue's targets are stated against;
- send / recv: the busiest GPU's forward NIC bytes each way (max_rank_nic_send_bytes, _recv_bytes);
- mfu: attention's normalized MFU, forward and backward; exposed: the share of the layer makespan the busiest rank
  (linear layers and attention) is not computing, i.e. waits for messages or partners (the simulator's
  max_rank_idle_*_s, the most idle time of any rank in attention alone, counts the idle time of ranks that the layer
  objective gives little attention and much linear work, so it is reported as idle, not as exposure);
- gap: layer makespan over the certified bound, forward and backward; compile: compile_plan's seconds.

It prints a table per batch and then the issue's checks. --timing-runs times compile_plan at 256 GPUs on the
paper-like batch (seed 0), the trees taking turns in fresh processes, median of the runs.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from placement import TOKENS_PER_GPU, chosen_batches, matrix_arguments  # noqa: E402

from fcp_compiler.tools.parallel import map_on_cores  # noqa: E402
from fcp_compiler.tools.report import table  # noqa: E402

HERE = Path(__file__).resolve().parents[1]
_CONTEXT: dict = {}

# Runs in a fresh process inside either tree: only APIs both trees have.
_JOB_SCRIPT = """import json, sys, time
import numpy as np
from fcp_compiler import compile_plan
from fcp_compiler.format.validate import validate_plan
from fcp_compiler.core.simulate import simulate_plan
lengths, gpus = json.loads(sys.stdin.read())
compile_plan(lengths[:50], 8)  # imports and first-call costs outside the timing
started = time.perf_counter()
plan = compile_plan(lengths, gpus)
seconds = time.perf_counter() - started
validate_plan(plan.data)
f = simulate_plan(plan).figures()
transfers = plan.ir.transfers
sharding = plan.ir.sharding
per_node = plan.ir.tiles.profile.gpus_per_node
owner_node = transfers.assignment.block_rank[transfers.edge_block] // per_node
group = ((transfers.edge_kind * sharding.num_blocks + transfers.edge_block) * (gpus // per_node + 1)
         + transfers.edge_dst // per_node)
edge_of_seg = np.repeat(np.arange(transfers.num_edges), np.diff(transfers.edge_seg_offsets))
across = (owner_node != transfers.edge_dst // per_node)[edge_of_seg]
per_token = np.where(transfers.edge_kind == 0, plan.ir.tiles.shape.kv_bytes_per_token,
                     plan.ir.tiles.shape.q_bytes_per_token)
key, first = np.unique(group[edge_of_seg[across]] * sharding.num_segments + transfers.edge_segs[across],
                       return_index=True)
once = float((sharding.seg_tokens[key % sharding.num_segments] * per_token[edge_of_seg[across][first]]).sum())
s = plan.stats
print(json.dumps({"compile_s": seconds, "nic": s["nic_bytes"], "once": once, "send": s["max_rank_nic_send_bytes"],
                  "recv": s["max_rank_nic_recv_bytes"], "mfu_fwd": f["normalized_mfu_fwd"],
                  "mfu_bwd": f["normalized_mfu_bwd"],
                  "exposed_fwd": 1 - max(r["layer_busy_fwd_s"] for r in f["per_rank"]) / f["layer_makespan_fwd_s"],
                  "exposed_bwd": 1 - max(r["layer_busy_bwd_s"] for r in f["per_rank"]) / f["layer_makespan_bwd_s"],
                  "idle_fwd": f["max_rank_idle_fwd_s"] / f["makespan_fwd_s"],
                  "idle_bwd": f["max_rank_idle_bwd_s"] / f["makespan_bwd_s"],
                  "gap_fwd": f["layer_gap_fwd"], "gap_bwd": f["layer_gap_bwd"],
                  "fwd_stages": s["num_fwd_stages"], "max_buffer_tokens": s["max_buffer_tokens"]}))
"""


def _run_in(tree: Path, lengths: list[int], gpus: int) -> dict:
    """One plan compiled, validated and simulated by the code in `tree`, in a fresh process."""
    done = subprocess.run([sys.executable, "-c", _JOB_SCRIPT], input=json.dumps([lengths, gpus]), text=True,
                          capture_output=True, check=True, cwd=tree, env={"PYTHONPATH": str(tree), "PATH": ""})
    return json.loads(done.stdout)


def _job(job: tuple) -> dict:
    name, gpus, seed, side = job
    lengths = _CONTEXT["makers"][name](gpus * TOKENS_PER_GPU, seed)
    tree = HERE if side == "fcp" else _CONTEXT["main_tree"]
    return {"batch": name, "gpus": gpus, "seed": seed, "side": side, **_run_in(tree, lengths, gpus)}


def _table(pairs: list[tuple[dict, dict]]) -> str:
    rows = []
    for ours, main in pairs:
        rows.append([f"{ours['batch']} @{ours['gpus']} s{ours['seed']}",
                     f"{main['nic'] / 1e9:.1f}", f"{main['once'] / 1e9:.1f}", f"{ours['nic'] / 1e9:.1f}",
                     f"{ours['nic'] / main['nic']:.2f}" if main["nic"] else "-",
                     f"{ours['send'] / main['send']:.2f}" if main["send"] else "-",
                     f"{ours['recv'] / main['recv']:.2f}" if main["recv"] else "-",
                     f"{main['mfu_fwd']:.2f}/{main['mfu_bwd']:.2f}", f"{ours['mfu_fwd']:.2f}/{ours['mfu_bwd']:.2f}",
                     f"{ours['exposed_fwd']:.2f}/{ours['exposed_bwd']:.2f}",
                     f"{ours['gap_fwd']:.3f}/{ours['gap_bwd']:.3f}"])
    return table(["batch", "main NIC GB", "once GB", "NIC GB", "x main", "send x", "recv x", "main mfu f/b",
                  "mfu f/b", "exposed f/b", "gap f/b"], rows)


def _checks(pairs: list[tuple[dict, dict]]) -> list[str]:
    """The issue's must-show figures, each with how many plans meet it."""
    heavy = [(o, m) for o, m in pairs if m["nic"] > 2 * m["once"]]
    light = [(o, m) for o, m in pairs if m["nic"] <= 2 * m["once"] and m["nic"] > 0]
    at_256 = [(o, m) for o, m in pairs if o["gpus"] == 256]
    ours = [o for o, _ in pairs]
    exposed = [max(o["exposed_fwd"], o["exposed_bwd"]) for o in ours]
    gaps = [max(o["gap_fwd"], o["gap_bwd"]) for o in ours]
    mfu = [min(o["mfu_fwd"], o["mfu_bwd"]) for o in ours]

    def worst(values, fn=max) -> str:
        return f"{fn(values):.3f}" if values else "-"

    return [
        f"NIC bytes where main moves > 2x once a node: max {worst([o['nic'] / m['nic'] for o, m in heavy])}x main "
        f"(<= 0.35 on {sum(o['nic'] <= 0.35 * m['nic'] for o, m in heavy)} of {len(heavy)})",
        f"NIC bytes elsewhere: max {worst([o['nic'] / m['nic'] for o, m in light])}x main "
        f"(<= 0.8 on {sum(o['nic'] <= 0.8 * m['nic'] for o, m in light)} of {len(light)})",
        f"busiest NIC sender at 256 GPUs: max {worst([o['send'] / m['send'] for o, m in at_256 if m['send']])}x main, "
        f"receiver max {worst([o['recv'] / m['recv'] for o, m in at_256 if m['recv']])}x main (<= 0.5 on "
        f"{sum(o['send'] <= 0.5 * m['send'] and o['recv'] <= 0.5 * m['recv'] for o, m in at_256)} of {len(at_256)})",
        f"attention normalized MFU, min of the passes: min {worst(mfu, min)}, median {statistics.median(mfu):.3f}; "
        f">= 0.80 on {sum(v >= 0.80 for v in mfu)} of {len(mfu)} (main: "
        f"{sum(min(m['mfu_fwd'], m['mfu_bwd']) >= 0.80 for _, m in pairs)})",
        f"exposed communication (layer makespan not covered by the busiest rank's compute) <= 5%, both passes: "
        f"{sum(v <= 0.05 for v in exposed)} of {len(exposed)}, median {statistics.median(exposed):.3f} (main: "
        f"{sum(max(m['exposed_fwd'], m['exposed_bwd']) <= 0.05 for _, m in pairs)}); any rank's idle share of "
        f"attention alone <= 5%: {sum(max(o['idle_fwd'], o['idle_bwd']) <= 0.05 for o in ours)} (main: "
        f"{sum(max(m['idle_fwd'], m['idle_bwd']) <= 0.05 for _, m in pairs)})",
        f"layer gap: max {worst(gaps)}, median {statistics.median(gaps):.3f}, <= 1.10 on "
        f"{sum(g <= 1.10 for g in gaps)} of {len(gaps)} (main: max {max(max(m['gap_fwd'], m['gap_bwd']) for _, m in pairs):.3f}, "
        f"<= 1.10 on {sum(max(m['gap_fwd'], m['gap_bwd']) <= 1.10 for _, m in pairs)})",
        f"layer makespan vs main: slower in some pass on "
        f"{sum(o['gap_fwd'] > m['gap_fwd'] * 1.001 or o['gap_bwd'] > m['gap_bwd'] * 1.001 for o, m in pairs)} "
        f"of {len(pairs)} batches",
        f"every plan validated: {len(pairs)} pairs",
    ]


def _timing(makers: dict, runs: int) -> str:
    lengths = makers["paper"](256 * TOKENS_PER_GPU, 0)
    times: dict[str, list[float]] = {"main": [], "fcp": []}
    for _ in range(runs):
        times["main"].append(_run_in(_CONTEXT["main_tree"], lengths, 256)["compile_s"])
        times["fcp"].append(_run_in(HERE, lengths, 256)["compile_s"])
    main, ours = statistics.median(times["main"]), statistics.median(times["fcp"])
    return (f"compile_plan, paper seed 0 at 256 GPUs, fresh processes taking turns, median of {runs}: main "
            f"{main:.3f} s, this tree {ours:.3f} s: {ours / main:.2f}x")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    matrix_arguments(parser)
    parser.add_argument("--main-tree", type=Path, required=True, help="a checkout of main before issue 21")
    parser.add_argument("--jobs", type=int, help="processes [all cores]")
    parser.add_argument("--write", type=Path, help="write every row as JSON")
    parser.add_argument("--timing-runs", type=int, default=3)
    args = parser.parse_args()
    makers, chosen = chosen_batches(parser, args)
    _CONTEXT.update(makers=makers, main_tree=args.main_tree.resolve())
    jobs = [(name, gpus, seed, side) for name in chosen for gpus in (int(g) for g in args.gpus.split(","))
            for seed in range(args.seeds) for side in ("fcp", "main")]
    jobs.sort(key=lambda job: -job[1])  # the slowest first
    rows = []
    for row in map_on_cores(_job, jobs, args.jobs):
        rows.append(row)
        print(f"  {len(rows)}/{len(jobs)} {row['batch']} @ {row['gpus']} seed {row['seed']} {row['side']}",
              file=sys.stderr, flush=True)
    key = {(r["batch"], r["gpus"], r["seed"], r["side"]): r for r in rows}
    pairs = [(key[(n, g, s, "fcp")], key[(n, g, s, "main")]) for n, g, s, side in sorted(
        key, key=lambda k: (chosen.index(k[0]), k[1], k[2])) if side == "fcp"]
    if args.write:
        args.write.write_text(json.dumps(rows, indent=1))
    print(_table(pairs))
    print("\n".join(_checks(pairs)))
    if args.timing_runs:
        print(_timing(makers, args.timing_runs))


if __name__ == "__main__":
    main()

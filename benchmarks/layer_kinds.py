"""Layer kinds: a model that alternates a sliding window with causal layers, compiled as one plan of layer kinds,
against the two ways to do without kinds.

Usage: python benchmarks/layer_kinds.py [--case paper|gpt-oss|both] [--turns 3]

Cases: the shipped paper-like trace at 128 GPUs, llama3-70b, a 1:1 mix of window 4096 and causal layers; and the
shipped 64-GPU trace with gpt-oss-120b (its attention shape, its preset's mix: 18 layers of window 128, 18 causal).
For each case it compiles and validates:

- the plan of layer kinds (one placement chosen by the mix, one schedule a kind);
- one causal plan used for both kinds: the window layers run the causal schedule (every pull and stage of the causal
  plan), each tile computing only its window's pairs; simulated by the causal plan with each sequence's window
  narrowed in its batch table, which only the simulator reads (the plan is no longer a valid window plan: its pulls
  are the causal ones);
- two plans, one a kind, each with its own placement: their layer times, plus what switching layouts costs. Layers
  alternate (gpt-oss does), so a step moves the hidden states from one layout to the other before every layer but
  the first, forward and (their gradients) backward: 2 (L - 1) all-to-alls of hidden x 2 bytes a token (L layers), each charged
  at the lower bound of each all-to-all (the busiest rank's NIC and NVLink bytes at the profile's bandwidth, sends
  and receives overlapped, plus one latency), which favours the two plans. The second dispatch is not counted.

It prints each method's time for the mix (forward + backward, every layer), the sliding kind's forward traffic against
a sliding-only plan's, and the compile time of the plan of layer kinds against a causal-only plan's (median of --turns,
taking turns in this process).
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

import numpy as np

from fcp_compiler import compile_plan
from fcp_compiler.core.simulate import layer_seconds as seconds_of, simulate_plan
from fcp_compiler.format.inputs import BatchSpec, load_batch
from fcp_compiler.format.models import DEFAULT_MODEL, MODEL_PRESETS
from fcp_compiler.format.plan_format import GLOBAL_ARRAYS, PlanReader, assemble
from fcp_compiler.format.validate import validate_plan
from fcp_compiler.format.validate_kinds import validate_kinds
from fcp_compiler.tools.report import human_bytes, table

ROOT = Path(__file__).resolve().parents[1]
CASES = {
    "paper": dict(trace="paper_lognormal_128gpu.json", gpus=128, window=4096, mix=(1, 1), options={}),
    "gpt-oss": dict(trace="paper_lognormal_64gpu.json", gpus=64, window=128, mix=(18, 18),
                    options=dict(model="gpt-oss-120b", shape={"q_heads": 64, "kv_heads": 8, "head_dim": 64})),
}


def layer_seconds(plan_or_bytes) -> float:
    """A plan's simulated layer time, forward plus backward."""
    return seconds_of(simulate_plan(plan_or_bytes, attention_alone=False).layer_figures())


def window_on_causal_schedule(causal_bytes: bytes, window: int) -> bytes:
    """The causal plan with every sequence's window narrowed to `window` in its batch table: its pulls and stages
    unchanged, each tile's cost its window's pairs (for the simulator only)."""
    reader = PlanReader(causal_bytes)
    tables = reader.tables
    arrays = {name: getattr(tables, name) for name in GLOBAL_ARRAYS}
    arrays["seq_window"] = np.minimum(tables.seq_lengths, window).astype(tables.seq_window.dtype)
    fields = reader.header.model_dump(exclude={"global_section", "rank_sections", "global_sha256", "rank_sha256"})
    return assemble(fields, arrays, [program.arrays for program in reader.ranks()])


def token_ranks(plan) -> np.ndarray:
    """Each token's rank in a plan's layout (tokens in batch order)."""
    assignment, sharding = plan.ir.transfers.assignment, plan.ir.transfers.assignment.tiles.sharding
    starts = sharding.batch.seq_offsets[sharding.seg_seq] + sharding.seg_start
    ranks = np.empty(sharding.batch.total_tokens, dtype=np.int64)
    owner = assignment.block_rank[sharding.seg_block]
    for start, tokens, rank in zip(starts.tolist(), sharding.seg_tokens.tolist(), owner.tolist()):
        ranks[start:start + tokens] = rank
    return ranks


def relayout_seconds(first, second, bytes_per_token: int) -> float:
    """A lower bound on one all-to-all moving every token from `first`'s layout to `second`'s: the busiest rank's
    bytes on each link class at the profile's bandwidth (sends and receives overlapped), plus one latency."""
    profile = first.ir.tiles.profile
    src, dst = token_ranks(first), token_ranks(second)
    moved = src != dst
    src, dst = src[moved], dst[moved]
    nic = src // profile.gpus_per_node != dst // profile.gpus_per_node
    num_ranks = first.ir.transfers.assignment.num_ranks
    worst = 0.0
    for link, rate in ((nic, profile.network_gbps), (~nic, profile.nvlink_gbps)):
        for ends in (src, dst):
            tokens = np.bincount(ends[link], minlength=num_ranks).max(initial=0)
            worst = max(worst, tokens * bytes_per_token / (rate * 1e9))
    return worst + profile.latency_us * 1e-6


def run_case(name: str, turns: int) -> list:
    case = CASES[name]
    lengths = load_batch(ROOT / "traces" / case["trace"]).sequences
    gpus, window, (causal_layers, window_layers) = case["gpus"], case["window"], case["mix"]
    layers = {"full_attention": "causal", "sliding_attention": {"kind": "sliding_window", "window": window}}
    mix = {"full_attention": causal_layers, "sliding_attention": window_layers}
    kinds_spec = BatchSpec(sequences=lengths, layers=layers, layer_mix=mix)
    causal_spec = BatchSpec(sequences=lengths)
    sliding_spec = BatchSpec(sequences=lengths, mask=layers["sliding_attention"])
    options = case["options"]
    seconds = {"kinds": [], "causal": []}
    for _ in range(turns):  # taking turns, so that the machine's speed moves both alike
        for label, spec in (("kinds", kinds_spec), ("causal", causal_spec)):
            started = time.perf_counter()
            plan = compile_plan(spec, gpus, **options)
            seconds[label].append(time.perf_counter() - started)
            if label == "kinds":
                kinds_plan = plan
            else:
                causal = plan
    sliding = compile_plan(sliding_spec, gpus, **options)
    validate_kinds(kinds_plan.data)
    for plan in (causal, sliding):
        validate_plan(plan.data)
    kinds = {row["name"]: row for row in kinds_plan.stats["layer_kinds"]}
    mixed_s = kinds_plan.stats["layer_mix_s"]
    causal_s, sliding_s = layer_seconds(causal), layer_seconds(sliding)
    one_causal_s = causal_layers * causal_s + window_layers * layer_seconds(
        window_on_causal_schedule(causal.data, window))
    hidden_bytes = 2 * MODEL_PRESETS[options.get("model", DEFAULT_MODEL)].hidden  # bf16 hidden states a token
    num_layers = causal_layers + window_layers
    switch_s = relayout_seconds(causal, sliding, hidden_bytes)
    two_plans_s = causal_layers * causal_s + window_layers * sliding_s + 2 * (num_layers - 1) * switch_s
    traffic = kinds["sliding_attention"]["total_comm_bytes"], sliding.stats["total_comm_bytes"]
    compile_kinds, compile_causal = statistics.median(seconds["kinds"]), statistics.median(seconds["causal"])
    print(f"{name}: {case['trace']} at {gpus} GPUs, {options.get('model', 'llama3-70b')}, {causal_layers} causal + "
          f"{window_layers} window-{window} layers (placed for {kinds_plan.stats['primary_kind']}, kept "
          f"{kinds_plan.stats['floor']['winner']}); relayout {switch_s * 1e3:.2f} ms each, "
          f"{2 * (num_layers - 1)} a step")
    print(table(["method", "mix ms (fwd + bwd, every layer)", "vs kinds plan"], [
        ["plan of layer kinds (one placement, a schedule a kind)", f"{mixed_s * 1e3:.1f}", "1.000"],
        ["one causal plan for both kinds", f"{one_causal_s * 1e3:.1f}", f"{one_causal_s / mixed_s:.3f}"],
        ["two plans + relayouts", f"{two_plans_s * 1e3:.1f}", f"{two_plans_s / mixed_s:.3f}"]]))
    print(f"  window kind's forward traffic {human_bytes(traffic[0])} vs a window-only plan's {human_bytes(traffic[1])}"
          f": {traffic[0] / traffic[1]:.3f}x; causal kind {kinds['full_attention']['layer_seconds'] * 1e3:.2f} ms vs "
          f"the causal plan's {causal_s * 1e3:.2f}; window kind {kinds['sliding_attention']['layer_seconds'] * 1e3:.2f}"
          f" ms vs the window plan's {sliding_s * 1e3:.2f}")
    print(f"  compile (median of {turns}): kinds plan {compile_kinds:.2f} s, causal only {compile_causal:.2f} s: "
          f"{compile_kinds / compile_causal:.2f}x")
    return [name, mixed_s, one_causal_s, two_plans_s, traffic[0] / traffic[1], compile_kinds / compile_causal]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--case", choices=["paper", "gpt-oss", "both"], default="both")
    parser.add_argument("--turns", type=int, default=3)
    args = parser.parse_args()
    names = list(CASES) if args.case == "both" else [args.case]
    for name in names:
        run_case(name, args.turns)


if __name__ == "__main__":
    main()

"""The certified layer lower bound (algorithms/layer_bound.py): each piece against brute force, the whole bound
against exact optima of the model on small instances (CP-SAT), against the simulated makespan of every planner's plans,
and tight where it can be."""

from __future__ import annotations

import itertools

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st
from ortools.sat.python import cp_model

from fcp_compiler.algorithms.layer_bound import (Machine, PassCosts, bytes_for_excess, efficiency_cap, held_pairs,
                                                 layer_lower_bound, pair_efficiency, _held_tokens_for)
from fcp_compiler.algorithms.visibility import visible_pairs
from fcp_compiler.core.launches import coalesced_seconds
from fcp_compiler.core.layer_model import attention_costs, longest_segments
from fcp_compiler.core.passes.cost import tile_efficiency
from fcp_compiler.format.inputs import PRESET_PROFILES, BatchSpec
from fcp_compiler.core.simulate import simulate_plan
from conftest import compile_valid


def _visible(query: int, key: int, window: int) -> bool:
    return key <= query and query - key < window if window > 0 else True


@pytest.mark.parametrize("length", [1, 2, 5, 7])
def test_held_pairs_is_the_most_any_set_of_held_tokens_sees(length):
    for window in sorted({0, 1, 2, 3, length}):
        for count in range(length + 1):
            best = max(sum(_visible(q, k, window) for q in chosen for k in chosen)
                       for chosen in itertools.combinations(range(length), count))
            assert held_pairs(np.array([count]), np.array([length]), np.array([window]))[0] == best


@given(st.integers(1, 5000), st.integers(0, 5000), st.floats(0, 1e7))
def test_held_tokens_for_inverts_held_pairs(length, window, budget):
    window = min(window, length)
    x = _held_tokens_for(np.array([budget]), np.array([length]), np.array([window]))[0]
    pairs = held_pairs(np.array([x]), np.array([length]), np.array([window]))[0]
    assert x <= length
    assert pairs == pytest.approx(budget, rel=1e-9, abs=1e-6) if x < length else pairs <= budget * (1 + 1e-12) + 1e-6


@given(st.floats(0, 1e6), st.integers(0, 200), st.integers(1, 16), st.integers(1, 16))
def test_bytes_for_excess_is_at_most_what_any_received_rows_cost(excess, reach, q_bytes, kv_bytes):
    least = bytes_for_excess(np.array([excess]), np.array([reach]), q_bytes, kv_bytes)[0]
    # Every (q, k) that adds at least `excess` pairs, (q + k) reach + q k >= excess, costs at least `least`.
    for q in range(0, 60):
        k = max(0.0, (excess - q * reach) / (reach + q)) if reach + q > 0 else np.inf
        if np.isfinite(k):
            assert q * q_bytes + np.ceil(k) * kv_bytes >= least * (1 - 1e-9) - 1e-9
            assert q * q_bytes + k * kv_bytes >= least * (1 - 1e-9) - 1e-9


def test_bytes_for_excess_is_concave_and_zero_at_zero():
    excess = np.linspace(0, 1e6, 2001)
    phi = bytes_for_excess(excess, np.full(excess.size, 300.0), 16.0, 4.0)
    assert phi[0] == 0
    assert (np.diff(phi, 2) <= 1e-6).all()


@pytest.mark.parametrize("profile", sorted(PRESET_PROFILES))
def test_efficiency_cap_is_the_best_tile_up_to_that_size(profile):
    curve = PRESET_PROFILES[profile].efficiency_curve
    tokens = np.array([p.tokens for p in curve], dtype=float)
    efficiency = np.array([p.efficiency for p in curve])
    grid = np.arange(1, 40000)
    running = np.maximum.accumulate(tile_efficiency(PRESET_PROFILES[profile], grid))
    for size in (1, 100, 128, 700, 4096, 5000, 16384, 39999):
        assert efficiency_cap(np.array([size]), tokens, efficiency)[0] == pytest.approx(running[size - 1])
    # A curve that dips: the cap keeps the best point below.
    dipping = efficiency_cap(np.array([3000.0]), np.array([1000.0, 2000.0, 4000.0]), np.array([0.5, 0.8, 0.6]))
    assert dipping[0] == pytest.approx(0.8)


_STEP_CURVE = (np.array([1.0, 4.0, 16.0, 64.0]), np.array([0.1, 0.3, 0.6, 0.9]))  # steep at a few tokens


@given(length=st.integers(1, 300), segment=st.integers(1, 300), window=st.sampled_from([0, -1, 1, 3, 20]))
def test_pair_efficiency_caps_every_pair_at_its_largest_possible_call(length, segment, window):
    """Against the caps written out position by position: no looser than the old cap at the sequence's length,
    never tighter than each position's own cap (a query at p calls over fewer than p + S keys, w + 2S under a
    window, all L full), and its best is the best position's."""
    window = length if window == -1 else min(window, length)  # -1: causal
    curve_tokens, curve_efficiency = _STEP_CURVE
    got = pair_efficiency(np.array([length]), np.array([window]), np.array([segment]), curve_tokens,
                          curve_efficiency)
    q = min(segment, length)
    by_position, caps = 0.0, []
    for position in range(length):
        seen = length if window == 0 else min(position + 1, window)
        keys = length if window == 0 else min(length, position + q, window + 2 * q if window < length else length)
        cap = efficiency_cap(np.array([np.sqrt(q * keys)]), curve_tokens, curve_efficiency)[0]
        by_position += seen / cap
        caps.append(cap)
    visible = float(visible_pairs(0, length, 0, length, window))
    old = visible / efficiency_cap(np.array([length]), curve_tokens, curve_efficiency)[0]
    assert old * (1 - 1e-9) <= got.weighted_pairs[0] <= by_position * (1 + 1e-9)
    assert got.best[0] == pytest.approx(max(caps))
    if segment >= length:  # a segment as long as the sequence: the old cap exactly
        assert got.weighted_pairs[0] == pytest.approx(old)


@pytest.mark.parametrize("planner,mask,block,lengths", [
    ("fcp", "causal", 256, [3000, 700, 90, 1500, 260, 1200, 5000, 64]),
    ("fcp", "full", 256, [3000, 700, 90, 1500, 260]),
    ("fcp", "sliding_window:300", 128, [3000, 700, 1500, 4100]),
    ("fcp", "causal", 512, [9000]),  # one sequence: its own pairs against its own bound
    ("magi", "causal", None, [3000, 700, 90, 1500, 260, 1200, 5000, 64]),
    ("ring", "causal", None, [3000, 700, 1500, 5000]),
    ("wlbllm", "sliding_window:500", None, [3000, 700, 1500, 5000])])
def test_no_plan_runs_its_pairs_faster_than_their_segments_allow(planner, mask, block, lengths):
    """The least attention time the bound charges each sequence at the plan's longest segments is at most what the
    simulator charges the plan's tiles with every tile of a rank in one launch (its largest calls)."""
    options = {"planner": planner, "mask": mask, **({"block_size": block, "coalesce": 2} if block else {})}
    plan = compile_valid(lengths, 4, **options)
    final = plan.ir
    tiles, sharding = final.tiles, final.tiles.sharding
    one_launch = coalesced_seconds(tiles, np.arange(tiles.num_tiles), final.assignment.tile_rank.astype(np.int64),
                                   np.zeros(tiles.num_tiles, dtype=np.int64), tiles.profile)
    longest = longest_segments(sharding.seg_seq, sharding.seg_tokens, sharding.batch.num_sequences)
    costs = attention_costs(sharding.batch.lengths, sharding.batch.windows, tiles.shape, tiles.profile, longest)
    assert costs.attention_seconds.sum() <= one_launch.sum() * (1 + 1e-9)
    old = attention_costs(sharding.batch.lengths, sharding.batch.windows, tiles.shape, tiles.profile)
    assert costs.attention_seconds.sum() >= old.attention_seconds.sum() * (1 - 1e-9)


def _optimum(lengths, windows, pair_cost, linear, q_bytes, kv_bytes, num_ranks, per_node, cap, nvlink, nic):
    """The least makespan T over every token-level placement in the model, exactly (CP-SAT): each token held by one
    rank within the cap, each visible pair computed by one rank, which holds or receives its query and key rows;
    each rank's linear and pair work within T; each rank's received bytes within (NVLink + NIC) T (NVLink alone on
    one node) and each node's bytes from other nodes within its NICs' T. Every plan the compiler can emit is one of
    these (blocks hold whole tokens; relays and fan-outs do not lower what a rank or a node must receive), so this
    optimum is at most the best plan's makespan. Returns the best T found and whether it is proven optimal."""
    model = cp_model.CpModel()
    seq_of = np.repeat(np.arange(len(lengths)), lengths)
    position = np.concatenate([np.arange(n) for n in lengths])
    tokens = range(len(seq_of))
    ranks = range(num_ranks)
    nodes = range(-(-num_ranks // per_node))
    held = {(t, r): model.NewBoolVar("") for t in tokens for r in ranks}
    for t in tokens:
        model.AddExactlyOne(held[t, r] for r in ranks)
    for r in ranks:
        model.Add(sum(held[t, r] for t in tokens) <= cap)
    pairs = [(q, k) for q in tokens for k in tokens
             if seq_of[q] == seq_of[k] and _visible(position[q], position[k], windows[seq_of[q]])]
    runs = {(p, r): model.NewBoolVar("") for p in range(len(pairs)) for r in ranks}
    recv = {(kind, t, r): model.NewBoolVar("") for kind in "qk" for t in tokens for r in ranks}
    node_recv = {(kind, t, n): model.NewBoolVar("") for kind in "qk" for t in tokens for n in nodes}
    for index, (q, k) in enumerate(pairs):
        model.AddExactlyOne(runs[index, r] for r in ranks)
        for r in ranks:
            node = r // per_node
            model.Add(recv["q", q, r] >= runs[index, r] - held[q, r])
            model.Add(recv["k", k, r] >= runs[index, r] - held[k, r])
            mates = [m for m in ranks if m // per_node == node]
            model.Add(node_recv["q", q, node] >= runs[index, r] - sum(held[q, m] for m in mates))
            model.Add(node_recv["k", k, node] >= runs[index, r] - sum(held[k, m] for m in mates))
    makespan = model.NewIntVar(0, 10**7, "T")
    rank_bandwidth = nvlink + (nic if len(nodes) > 1 else 0)
    work = [linear * sum(held[t, r] for t in tokens)
            + sum(int(pair_cost[seq_of[q]]) * runs[i, r] for i, (q, _) in enumerate(pairs)) for r in ranks]
    for r in ranks:
        model.Add(work[r] <= makespan)
        if r + 1 < num_ranks and (r + 1) // per_node == r // per_node:
            model.Add(work[r] >= work[r + 1])  # ranks of one node are interchangeable: order them by work
        model.Add(sum(q_bytes * recv["q", t, r] + kv_bytes * recv["k", t, r] for t in tokens)
                  <= rank_bandwidth * makespan)
    if len(nodes) > 1:
        for n in nodes:
            gpus = sum(1 for r in ranks if r // per_node == n)
            model.Add(sum(q_bytes * node_recv["q", t, n] + kv_bytes * node_recv["k", t, n] for t in tokens)
                      <= gpus * nic * makespan)
    model.Minimize(makespan)
    solver = cp_model.CpSolver()
    solver.parameters.num_workers = 1
    solver.parameters.max_time_in_seconds = 1.0
    solver.parameters.random_seed = 0
    status = solver.Solve(model)
    assert status in (cp_model.OPTIMAL, cp_model.FEASIBLE)
    return solver.ObjectiveValue(), status == cp_model.OPTIMAL


def _instance(rng: np.random.Generator):
    num_ranks = int(rng.integers(2, 9))
    per_node = int(rng.choice([num_ranks, max(1, num_ranks // 2)]))  # one node or two
    if rng.random() < 0.5:  # one or two sequences longer than a rank's share: their pairs must travel
        lengths = rng.integers(4, 9, size=int(rng.integers(1, 3)))
        while lengths.sum() > 8:
            lengths = rng.integers(3, 6, size=lengths.size)
    else:
        lengths = rng.integers(1, 6, size=int(rng.integers(1, 4)))
        while lengths.sum() > 8:
            lengths = rng.integers(1, 4, size=lengths.size)
    num_seqs = lengths.size
    row_scale = int(rng.choice([1, 30, 30]))  # rows cheap against the links, or dear
    windows = np.array([int(rng.choice([0, n, max(1, n // 2), 1])) for n in lengths])
    # Integer costs, time in tenths of a pair, so that an integral makespan is close to the real-valued optimum.
    return dict(lengths=lengths, windows=windows, pair_cost=rng.integers(1, 4, size=num_seqs) * 10,
                linear=int(rng.integers(0, 3)) * 10, q_bytes=int(rng.integers(2, 9)) * 10 * row_scale,
                kv_bytes=int(rng.integers(1, 5)) * 10 * row_scale, num_ranks=num_ranks, per_node=per_node,
                cap=int(rng.integers(-(-int(lengths.sum()) // num_ranks), int(lengths.sum()) + 1)),
                nvlink=int(rng.integers(1, 30)), nic=int(rng.integers(1, 10)))


def _bound(case) -> dict:
    costs = PassCosts(pair_seconds=case["pair_cost"].astype(float), linear_seconds_per_token=float(case["linear"]),
                      q_row_bytes=float(case["q_bytes"]), kv_row_bytes=float(case["kv_bytes"]))
    machine = Machine(num_ranks=case["num_ranks"], gpus_per_node=case["per_node"], token_cap=case["cap"],
                      nvlink_bytes_per_s=float(case["nvlink"]), nic_bytes_per_s=float(case["nic"]))
    visible = visible_pairs(0, case["lengths"], 0, case["lengths"], case["windows"]).astype(float)
    return layer_lower_bound(case["lengths"], case["windows"], visible, costs, machine)


@pytest.mark.parametrize("count", [40, pytest.param(200, marks=pytest.mark.long)])
def test_the_bound_is_never_above_the_exact_optimum_of_small_instances(count):
    rng = np.random.default_rng(20)
    solved, binding = 0, {"compute": 0, "communication": 0, "largest_unit": 0}
    for _ in range(count):
        case = _instance(rng)
        bound = _bound(case)
        optimum, proven = _optimum(**case)
        # Unproven, the solver's best plan is still a plan: the bound stays below it.
        assert bound["bound_s"] <= optimum + 1e-9, (case, bound, optimum)
        solved += proven
        binding[bound["binding"]] += 1
    assert solved >= 0.9 * count  # the comparison is with the optimum itself, not a weaker bound on it
    assert binding["communication"] >= count // 20  # the communication term is exercised, not only the mean


@pytest.mark.long
def test_the_bound_is_never_above_any_planners_simulated_layer_makespan():
    lengths = [3000, 700, 90, 1500, 260, 1200, 5000, 64]
    for planner in ("fcp", "ring", "bytescale", "wlbllm", "magi"):
        for model in ("llama3-8b", "llama3-70b", "none"):
            for mask in ("causal", "full", "sliding_window:300"):
                for num_ranks in (2, 5, 12):
                    layouts = ("plan", "user") if planner == "fcp" else ("plan",)
                    for layout in layouts:
                        options = dict(planner=planner, model=model, mask=mask, layout=layout)
                        if planner == "fcp":
                            options.update(block_size=256, coalesce=2)
                        plan = compile_valid(lengths, num_ranks, **options)
                        figures = simulate_plan(plan).figures()
                        for key in ("fwd", "bwd"):
                            bound = figures[f"layer_makespan_lower_bound_{key}_s"]
                            assert 0 < bound <= figures[f"layer_makespan_{key}_s"], (options, num_ranks, key)
                            assert figures[f"layer_gap_{key}"] >= 1.0


def test_mixed_masks_keep_the_bound_below_the_simulation():
    batch = BatchSpec.model_validate({"masks": ["causal", "full", {"kind": "sliding_window", "window": 100},
                                                "causal"], "sequences": [2000, 300, 1700, 900]})
    plan = compile_valid(batch, 4, block_size=256, coalesce=2)
    figures = simulate_plan(plan).figures()
    assert figures["layer_makespan_lower_bound_fwd_s"] <= figures["layer_makespan_fwd_s"]
    assert figures["layer_makespan_lower_bound_bwd_s"] <= figures["layer_makespan_bwd_s"]


@pytest.mark.parametrize("mask", ["causal", "full"])
@pytest.mark.parametrize("model", ["none", "llama3-8b"])
def test_the_bound_is_tight_on_one_whole_sequence_per_rank(mask, model):
    # N sequences of one block each: one per rank, no transfer; every tile is the whole sequence, at the
    # efficiency cap, and tokens are balanced. Only a kernel launch separates the plan from the bound.
    length, num_ranks = 16384, 4
    plan = compile_valid([length] * num_ranks, num_ranks, block_size=length, mask=mask, model=model)
    figures = simulate_plan(plan).figures()
    assert plan.stats["num_transfers"] == 0
    for key in ("fwd", "bwd"):
        assert 1.0 <= figures[f"layer_gap_{key}"] <= 1.002

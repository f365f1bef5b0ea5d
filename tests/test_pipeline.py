import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from conftest import compile_own, compile_valid
from fcp_compiler import InfeasibleError, InvalidInputError, compile_plan
from fcp_compiler.format.inputs import load_batch
from fcp_compiler.format.plan_format import PlanReader

ROOT = Path(__file__).resolve().parents[1]
STATS_KEYS = {"num_ranks", "block_size", "coalesce", "num_blocks", "num_transfers", "max_degree", "num_rounds", "memory",
              "compute_imbalance", "comm_imbalance", "max_tokens_per_rank", "token_cap",
              "makespan_lower_bound_ratio", "total_comm_bytes", "compile_seconds", "pass_seconds", "pass_calls",
              "plan_sha256", "num_relayed_transfers"}
# In the plan layout the pulls are listed before localize, which renumbers them with the ranks.
# "memory": the returned plan's memory account (and, over the budget, its refits' passes, already listed).
PASSES = ["shard", "cost", "assign", "plan_transfers", "localize", "fan_out", "schedule_rounds", "coalesce", "relay", "reshuffle",
          "memory", "encode"]
USER_LAYOUT_PASSES = ["shard", "cost", "assign", "localize", "plan_transfers", "fan_out", "schedule_rounds", "coalesce", "relay",
                      "reshuffle", "memory", "encode"]


@given(st.lists(st.integers(1, 12000), min_size=1, max_size=25), st.integers(1, 9),
       st.sampled_from([256, 512, 1024]), st.sampled_from([1, 2, 16]), st.sampled_from(["causal", "full"]),
       st.sampled_from(["auto", "on", "off"]), st.sampled_from([1, 2, 8]))
def test_random_batches_give_valid_delta_optimal_plans(lengths, gpus, block_size, coalesce, mask, zigzag, per_node):
    plan = compile_own(lengths, gpus, block_size=block_size, coalesce=coalesce, mask=mask, zigzag=zigzag,
                         gpus_per_node=per_node)
    stats = plan.stats
    assert stats["max_tokens_per_rank"] <= stats["token_cap"] <= -(-sum(lengths) // gpus) + block_size
    # The coalescer keeps every rank's messages a stage, each way, pulls and pushes together, within the stage's
    # rounds, per link class: c forward, 2c backward, NVLink lanes times that (docs/DESIGN.md, Stages).
    lanes = stats["nvlink_lanes"]
    for rank in range(gpus):
        a = plan.rank(rank).arrays
        for stage_rounds, rounds, peers in (
                (coalesce, ("pull_recv_round", "fwd_push_recv_round"), ("pull_recv_peer", "fwd_push_recv_pull")),
                (coalesce, ("pull_send_round", "fwd_push_send_round"), ("pull_send_peer", "fwd_push_send_pull")),
                (2 * coalesce, ("pull_recv_bwd_round", "bwd_push_recv_round"),
                 ("pull_recv_peer", "bwd_push_recv_pull")),
                (2 * coalesce, ("pull_send_bwd_round", "bwd_push_send_round"),
                 ("pull_send_peer", "bwd_push_send_pull"))):
            # A push's peer is the peer of the pull it returns along (pull_send rows for a push received).
            pull_peer = a[peers[0]]
            push_side = "send" if "recv" in peers[1] else "recv"
            push_peer = a[f"pull_{push_side}_peer"][a[peers[1]]]
            peer = np.concatenate((pull_peer, push_peer))
            nic = peer // per_node != rank // per_node
            stage = np.concatenate([a[name] for name in rounds]) // stage_rounds
            assert np.bincount(stage[nic]).max(initial=0) <= stage_rounds
            assert np.bincount(stage[~nic]).max(initial=0) <= stage_rounds * lanes


def test_stats_hold_every_documented_key(small_plan):
    assert STATS_KEYS <= set(small_plan.stats)
    # The floor runs the passes once per candidate (some candidates skip fan_out) and times its own memory checks
    # and scoring as an entry of its own: every pass is there, in the order the candidates first ran them.
    assert set(small_plan.stats["pass_seconds"]) == {"parse", "score", *PASSES}
    # Alone, FCP's own placement is scored as the floor scores its candidates (its stage variants simulated).
    own = compile_own([5000, 300, 70000, 12, 4096, 8192, 20000, 999], 4, block_size=1024, coalesce=4)
    assert [name for name in own.stats["pass_seconds"] if name != "score"] == ["parse"] + PASSES
    user = compile_own([5000, 300, 70000], 4, block_size=1024, layout="user")
    assert [name for name in user.stats["pass_seconds"] if name != "score"] == ["parse"] + USER_LAYOUT_PASSES
    # Alone, FCP's own placement goes direct unless fan-out is asked for: no fan_out pass.
    direct = compile_valid([5000, 300, 70000], 4, block_size=1024, floor=False)
    assert [name for name in direct.stats["pass_seconds"] if name != "score"] == \
        ["parse"] + [name for name in PASSES if name != "fan_out"]
    # How often each pass ran: an ablation step is scheduled and finished once, the floor finishes several.
    ablation = compile_own([5000, 300, 70000, 12, 4096, 8192, 20000, 999], 4, block_size=1024, pipelined=False)
    assert list(ablation.stats["pass_seconds"]) == ["parse"] + PASSES
    assert ablation.stats["pass_calls"]["reshuffle"] == ablation.stats["pass_calls"]["coalesce"] == 1
    assert set(own.stats["pass_calls"]) == set(own.stats["pass_seconds"])
    assert small_plan.stats["pass_calls"]["reshuffle"] > 1
    json.dumps(small_plan.stats)


@pytest.mark.parametrize("name,gpus", [("paper_lognormal_64gpu", 64), ("paper_lognormal_128gpu", 128),
                                       pytest.param("paper_lognormal_256gpu", 256, marks=pytest.mark.long)])
def test_shipped_paper_traces_are_balanced(name, gpus):
    batch = load_batch(ROOT / "traces" / f"{name}.json")
    # The default objective, each rank's layer time: linear layers on its tokens plus modelled tiles within 2% of
    # the mean; tokens near the 5% tolerance where whole blocks allow, below the cap (mean + one block, 11%).
    layer = compile_own(batch, gpus).stats
    assert layer["layer_imbalance"] <= 0.02 and layer["token_imbalance"] <= 0.07
    attention_alone = compile_own(batch, gpus, model="none").stats
    assert attention_alone["token_imbalance"] > 0.1 > layer["token_imbalance"]
    # Attention alone as the objective: compute balanced.
    plan = compile_own(batch, gpus, model="none")
    stats = plan.stats
    assert stats["compute_imbalance"] <= 0.03
    assert stats["makespan_lower_bound_ratio"] <= 1.03
    # Bytes received, both links: an entry of node fan-out receives the union of its node's segments and forwarders
    # receive what they read in no tile (0.04-0.05 without fan-out, 0.08-0.12 with). The busiest NIC receiver
    # takes at most half of what it would without fan-out (2.5-4x less measured).
    assert stats["comm_imbalance"] <= 0.15
    direct = compile_own(batch, gpus, model="none", node_fan_out=False).stats
    assert stats["max_rank_nic_recv_bytes"] <= 0.5 * direct["max_rank_nic_recv_bytes"]
    # Live received buffers (pulls, pushes, the stage in flight). A stage brings up to c NIC pulls and 2c NVLink
    # pulls (node fan-out), an entry holds its block until it has re-sent it and summed its fan-out's gradients:
    # within twelve stages of c full blocks (6.5, 9.4 and 10.3 measured at 64, 128 and 256 GPUs; 4 before fan-out).
    assert plan.header.max_buffer_tokens <= 12 * stats["coalesce"] * stats["block_size"]
    assert stats["max_tokens_per_rank"] <= sum(load_batch(ROOT / "traces" / f"{name}.json").sequences) // gpus + 4096


def test_short_only_batch_needs_no_transfers_for_attention_and_few_for_the_layer():
    batch = load_batch(ROOT / "traces" / "short_only_64gpu.json")
    plan = compile_own(batch, 64, model="none")
    assert plan.stats["num_transfers"] == 0 and plan.stats["num_rounds"] == 0
    assert plan.stats["compute_imbalance"] <= 0.03
    # With the linear layers in the objective the rank with the most tokens gives some attention away: a few
    # offloaded tiles, each a pull of its query block (and of the key block unless held).
    layer = compile_own(batch, 64).stats
    assert layer["layer_imbalance"] <= 0.03 and layer["token_imbalance"] < plan.stats["token_imbalance"]
    assert layer["num_transfers"] <= 2 * layer["num_offloaded_tiles"]


def test_one_rank_and_more_ranks_than_tokens():
    compile_own([100, 5000], 1, block_size=1024)
    compile_own([3], 8, block_size=64)


def test_a_block_heavier_than_the_mean_is_split_by_tiles():
    # Full mask: each of the 8 blocks of a 32K sequence is 8 tiles, twice the mean over 16 ranks.
    plan = compile_own([32768], 16, block_size=4096, mask="full", coalesce=2, model="none")
    assert plan.stats["num_offloaded_tiles"] >= 32
    assert plan.stats["makespan_lower_bound_ratio"] <= 1.03


def test_rank_slices_decode_the_same_as_the_whole(small_plan, tmp_path):
    from fcp_compiler import load_rank_program

    path = tmp_path / "plan.fcp"
    small_plan.write(path)
    whole = PlanReader(small_plan.to_bytes()).ranks()
    for rank in range(small_plan.num_ranks):
        alone = load_rank_program(path, rank)  # only the header and this rank's section are read
        assert alone.rank == rank and set(alone.arrays) == set(whole[rank].arrays)
        for name, values in whole[rank].arrays.items():
            np.testing.assert_array_equal(alone.arrays[name], values, err_msg=f"rank {rank} {name}")
    # The blocks of all ranks together are every block once: the slices are the plan, not copies of one rank.
    held = np.concatenate([program.arrays["blocks"] for program in whole])
    assert np.array_equal(np.sort(held), np.arange(small_plan.header.num_blocks))


def test_bad_parameters_are_named():
    with pytest.raises(InvalidInputError, match="--block-size 100"):
        compile_plan([10], 1, block_size=100)
    with pytest.raises(InvalidInputError, match="--gpus 0"):
        compile_plan([10], 0)
    with pytest.raises(InvalidInputError, match="length 0"):
        compile_plan([10, 0], 2)
    with pytest.raises(InfeasibleError, match="token cap 10"):
        compile_plan([4096, 4096], 2, token_cap=10)
    with pytest.raises(InvalidInputError, match="--token-tolerance 1.5"):
        compile_plan([10], 1, token_tolerance=1.5)


def test_token_tolerance_brings_ranks_near_the_mean_tokens():
    from fcp_compiler.tools.traces import lognormal_batch

    lengths = lognormal_batch(16 * 32768, 4096, 1.8, 64, 131072, seed=0)
    loose = compile_own(lengths, 16, model="none").stats  # attention alone: the cap alone, no tolerance
    tight = compile_own(lengths, 16, token_tolerance=0.02, model="none").stats
    assert loose["token_imbalance"] > 0.1  # the default cap, mean + one block, is where ranks sit
    assert tight["token_imbalance"] <= 0.02 and tight["max_tokens_per_rank"] <= tight["token_cap"] <= 33424
    assert tight["compute_imbalance"] <= 0.02


def test_same_inputs_give_byte_identical_plans_across_hash_seeds(tmp_path):
    script = ("import sys; from fcp_compiler import compile_plan; from fcp_compiler.format.inputs import load_batch; "
              "compile_plan(load_batch(sys.argv[1]), 64, block_size=2048).write(sys.argv[2])")
    outputs = []
    for seed in ("0", "12345"):
        out = tmp_path / f"plan_{seed}.fcp"
        env = dict(os.environ, PYTHONHASHSEED=seed)
        subprocess.run([sys.executable, "-c", script, str(ROOT / "traces" / "paper_lognormal_64gpu.json"), str(out)],
                       check=True, env=env, cwd=ROOT)
        outputs.append(out.read_bytes())
    assert outputs[0] == outputs[1]
    assert outputs[0] == compile_plan(load_batch(ROOT / "traces" / "paper_lognormal_64gpu.json"), 64,
                                      block_size=2048).to_bytes()


def test_pair_token_and_link_figures_agree_with_the_plan(small_plan):
    import numpy as np

    stats = small_plan.stats
    ir = small_plan.ir
    assignment, sharding, tiles = ir.assignment, ir.sharding, ir.tiles
    # Visible pairs per rank, counted token by token from the tiles' segment pairs (causal: key position <= query).
    pairs = np.zeros(assignment.num_ranks)
    for pair in range(tiles.pair_tile.size):
        q, k = tiles.pair_q_seg[pair], tiles.pair_kv_seg[pair]
        q_pos = np.arange(sharding.seg_start[q], sharding.seg_end[q])
        k_pos = np.arange(sharding.seg_start[k], sharding.seg_end[k])
        pairs[assignment.tile_rank[tiles.pair_tile[pair]]] += (k_pos[None, :] <= q_pos[:, None]).sum()
    assert stats["pair_imbalance"] == pytest.approx((pairs.max() - pairs.mean()) / pairs.max())
    tokens = assignment.rank_tokens
    assert stats["token_imbalance"] == pytest.approx((tokens.max() - tokens.mean()) / tokens.max())
    assert stats["nic_bytes"] + stats["nvlink_bytes"] == stats["total_comm_bytes"]
    # Tokens that stay on their user-layout rank, counted token by token from the plan layout.
    total = sum(int(x) for x in sharding.batch.lengths)
    bounds = [(r * total) // assignment.num_ranks for r in range(assignment.num_ranks + 1)]
    offsets = np.concatenate(([0], np.cumsum(sharding.batch.lengths)))
    home = 0
    for seg in range(sharding.num_segments):
        rank = assignment.block_rank[sharding.seg_block[seg]]
        first = offsets[sharding.seg_seq[seg]] + sharding.seg_start[seg]
        last = offsets[sharding.seg_seq[seg]] + sharding.seg_end[seg]
        home += max(0, min(last, bounds[rank + 1]) - max(first, bounds[rank]))
    assert stats["tokens_home_fraction"] == pytest.approx(home / total)
    assert 0 <= stats["max_rank_nic_recv_bytes"] <= stats["max_rank_recv_bytes"]
    assert stats["max_link_to_compute"] > 0


def test_one_compile_options_object_gives_the_same_plan_as_keywords():
    from fcp_compiler import CompileOptions

    lengths = [5000, 300, 9000, 12000]
    options = CompileOptions.of(4, block_size=1024, coalesce=4, layout="user", profile="h200")
    via_options = compile_plan(lengths, options=options)
    assert via_options.to_bytes() == compile_plan(lengths, 4, block_size=1024, coalesce=4, layout="user",
                                                  profile="h200").to_bytes()
    # A variant is the same options with one field replaced, checked like the original.
    assert compile_plan(lengths, options=options.replace(coalesce=2)).to_bytes() == compile_plan(
        lengths, 4, block_size=1024, coalesce=2, layout="user", profile="h200").to_bytes()
    with pytest.raises(InvalidInputError, match="--coalesce 0"):
        options.replace(coalesce=0)
    with pytest.raises(InvalidInputError, match="unknown compile option 'coalesce_degree'"):
        CompileOptions.of(4, coalesce_degree=4)
    with pytest.raises(InvalidInputError, match="layout 'users' must be one of plan, user"):
        CompileOptions.of(4, layout="users")
    with pytest.raises(InvalidInputError, match="fit_memory 'yes' must be True or False"):
        CompileOptions.of(4, fit_memory="yes")  # a truthy string would silently switch it on

"""Node fan-out (algorithms/fan_out.py, passes/fan_out.py) and the two link classes: a K,V block crosses into a node
once and fans out over NVLink; rounds are congestion-free per class; a one-node plan has no NIC message."""

import dataclasses

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from conftest import compile_own, congestion_free
from fcp_compiler.algorithms.exchange import place_messages, spread_messages
from fcp_compiler.algorithms.fan_out import class_degrees, node_fan_out, nvlink_lanes
from fcp_compiler.algorithms.round_order import order_rounds
from fcp_compiler.core.ir import TransferKind
from fcp_compiler.format.plan_format import PlanReader
from fcp_compiler.tools.diff import plan_figures


@given(st.lists(st.tuples(st.integers(0, 5), st.integers(0, 11), st.integers(0, 11), st.booleans()), min_size=1,
                max_size=60, unique_by=lambda e: (e[0], e[2])), st.sampled_from([1, 2, 3, 4]))
def test_each_block_enters_a_node_once_through_one_of_its_gpus(edges, per_node):
    block, src, dst, eligible = (np.array(column) for column in zip(*edges))
    eligible = eligible.astype(bool)
    nbytes = np.ones(block.size)
    parent, forward_group, forward_rank = node_fan_out(block, src, dst, eligible, nbytes, per_node, 12)
    node = dst // per_node
    crossing = eligible & (src // per_node != node)
    # Only eligible pulls into another node take part, and parents are pulls from their sender (depth one).
    assert (parent[~crossing] == -1).all()
    assert (parent[parent >= 0] >= 0).all() and (parent[parent[parent >= 0]] == -1).all()
    for key in set(zip(block[crossing].tolist(), node[crossing].tolist())):
        group = np.flatnonzero(crossing & (block == key[0]) & (node == key[1]))
        entries = group[parent[group] == -1]
        forwarded = group[parent[group] <= -2]
        # One NIC crossing into the node: one member, or a forwarder of the node (a GPU no pull of the group
        # goes to) that all members then read from.
        if forwarded.size:
            assert entries.size == 0 and forwarded.size == group.size and np.unique(parent[group]).size == 1
            f = -2 - parent[group[0]]
            assert block[forward_group[f]] == key[0] and forward_rank[f] // per_node == key[1]
            assert forward_rank[f] not in dst[group].tolist()
        else:
            assert entries.size == 1
            assert (parent[group[group != entries[0]]] == entries[0]).all()


def test_entries_spread_a_nodes_nic_load():
    # Four blocks, each needed by both GPUs of node 1 from node 0: each GPU's NIC takes two.
    block = np.repeat(np.arange(4), 2)
    src = np.zeros(8, dtype=np.int64)
    dst = np.tile([2, 3], 4)
    parent, _, forward_rank = node_fan_out(block, src, dst, np.ones(8, dtype=bool), np.ones(8), 2, 4)
    assert forward_rank.size == 0
    assert sorted(dst[parent == -1].tolist()) == [2, 2, 3, 3]


def test_a_gpu_alone_in_its_node_reading_many_blocks_shares_its_nic_through_forwarders():
    # Rank 2 alone reads 4 blocks from node 0; rank 3 of its node reads none: it forwards two of them.
    block = np.arange(4)
    parent, forward_group, forward_rank = node_fan_out(block, np.zeros(4, dtype=np.int64), np.full(4, 2),
                                                       np.ones(4, dtype=bool), np.ones(4), 2, 4)
    assert forward_rank.tolist() == [3, 3] and (parent == -1).sum() == 2 and (parent <= -2).sum() == 2


def test_nvlink_lanes_follow_the_bandwidth_ratio():
    assert nvlink_lanes(450.0, 50.0) == 2  # 9x, capped
    assert nvlink_lanes(50.0, 50.0) == 1
    assert nvlink_lanes(10.0, 50.0) == 1
    assert class_degrees(np.array([0, 0, 1]), np.array([1, 2, 3]), np.array([0, 1, 1]), 4) == (1, 1)


@given(st.lists(st.tuples(st.integers(0, 5), st.integers(0, 5)), min_size=1, max_size=40), st.integers(0, 6),
       st.sampled_from([1, 2, 3]))
def test_placed_messages_keep_each_end_within_its_slots(pairs, ready_max, slots):
    src, dst = (np.array(column) for column in zip(*pairs))
    ready = np.arange(src.size) % (ready_max + 1)
    capacity = np.full(6, slots)
    placed = place_messages(ready, src, dst, 6, np.zeros(0, dtype=np.int64), np.zeros(0, dtype=np.int64),
                            np.zeros(0, dtype=np.int64), capacity)
    assert (placed >= ready).all()
    for who in (src, dst):
        assert np.unique(who * 1000 + placed, return_counts=True)[1].max() <= slots


def test_spread_messages_put_work_where_the_stage_has_room():
    # Rank 1's stage 1 is already full; rank 2's stage 2 is empty below the stage's level. A message ready in stage
    # 0 whose work lands on rank 1 goes a stage later, where it fits under the level.
    load = np.array([[0.0, 0.0, 0.0], [5.0, 5.0, 0.0], [5.0, 0.0, 0.0], [0.0, 0.0, 0.0]])
    placed = spread_messages(np.array([0]), np.array([0]), np.array([1]), np.array([2.0]), load, 2,
                             np.zeros(0, dtype=np.int64), np.zeros(0, dtype=np.int64), np.zeros(0, dtype=np.int64))
    assert placed.tolist() == [2]  # round 2: stage 1, its work runnable in stage 2


def test_round_order_gives_each_class_its_lanes_per_position():
    work = np.random.default_rng(0).random((12, 3))
    cls = np.array([0] * 8 + [1] * 4)
    position = order_rounds(work, 2, cls, (2, 1))
    for c, lanes in ((0, 2), (1, 1)):
        mine = position[cls == c]
        assert np.unique(mine, return_counts=True)[1].max() <= lanes
    assert position.max() < 4  # two stages of two positions hold 8 NVLink and 4 NIC rounds


@settings(max_examples=25, deadline=None)
@given(st.lists(st.integers(64, 5000), min_size=1, max_size=12), st.integers(2, 12), st.sampled_from([1, 2, 4]),
       st.sampled_from(["causal", "full"]), st.sampled_from(["plan", "user"]))
def test_every_kv_block_crosses_into_a_node_once(lengths, gpus, per_node, mask, layout):
    plan = compile_own(lengths, gpus, block_size=128, coalesce=2, mask=mask, layout=layout,
                         gpus_per_node=per_node)
    transfers = plan.ir.transfers
    node = transfers.edge_dst // per_node
    owner_node = transfers.edge_owner // per_node
    kv = transfers.edge_kind == TransferKind.KV
    across = transfers.edge_src // per_node != node
    # Per (block, node other than the owner's) one K,V pull crosses a NIC; the rest of the node's pulls of it
    # re-send that one's received buffer over NVLink (fan-out), or a relay's.
    for block, target in set(zip(transfers.edge_block[kv & (owner_node != node)].tolist(),
                                 node[kv & (owner_node != node)].tolist())):
        group = np.flatnonzero(kv & (transfers.edge_block == block) & (node == target))
        assert (across[group]).sum() == 1
    if gpus <= per_node:  # one node: no NIC message at all
        assert plan.stats["nic_bytes"] == 0 and plan.stats["nic_degree"] == 0
    schedule = plan.ir.schedule
    for program in (schedule.forward, schedule.backward):
        rounds = np.concatenate((program.edge_round, program.push_round))
        src = np.concatenate((transfers.edge_src, transfers.edge_dst[program.push_edge]))
        dst = np.concatenate((transfers.edge_dst, transfers.edge_src[program.push_edge]))
        assert congestion_free(rounds, src, dst, per_node, plan.ir.rounds.nvlink_lanes)


def test_diff_reads_the_same_nic_figures_from_the_file_as_the_compiler_states():
    plan = compile_own([9000, 3000, 1200, 700, 300], 8, block_size=512, coalesce=2, gpus_per_node=2)
    figures = plan_figures(PlanReader(plan.to_bytes()), simulate=False)
    for key in ("nic_bytes", "max_rank_nic_send_bytes", "max_rank_nic_recv_bytes", "nic_degree", "nvlink_degree"):
        assert figures[key] == plan.stats[key], key
    assert plan.stats["nic_bytes"] > 0 and plan.stats["num_fanned_out_transfers"] > 0
    # Without fan-out the same placement moves more over the NICs.
    direct = compile_own([9000, 3000, 1200, 700, 300], 8, block_size=512, coalesce=2, gpus_per_node=2,
                           node_fan_out=False)
    assert direct.stats["nic_bytes"] > plan.stats["nic_bytes"]


@settings(max_examples=25, deadline=None)
@given(st.lists(st.integers(64, 5000), min_size=1, max_size=12), st.integers(2, 12), st.sampled_from([1, 2, 4]))
def test_pulls_from_owners_take_exactly_each_class_delta_over_its_lanes(lengths, gpus, per_node):
    """Konig per link class: max(NIC Delta, ceil(NVLink Delta / lanes)) rounds, on the pulls fan-out leaves."""
    from fcp_compiler.core.passes.fan_out import fan_out
    from fcp_compiler.core.passes.rounds import schedule_rounds

    plan = compile_own(lengths, gpus, block_size=128, coalesce=2, gpus_per_node=per_node, node_fan_out=False)
    before = plan.ir.transfers
    before = dataclasses.replace(before, edge_src=before.edge_owner, edge_parent=np.full(before.num_edges, -1))
    rounds = schedule_rounds(fan_out(before))
    from_owner = rounds.transfers.edge_parent < 0
    link = rounds.transfers.edge_link
    assert rounds.num_rounds == rounds.lane_rounds
    for cls in (0, 1):
        mine = from_owner & (link == cls)
        colours = rounds.edge_round[mine]
        assert colours.size == 0 or colours.max() + 1 == rounds.owner_degrees[cls]
        keys = np.concatenate((rounds.transfers.edge_src[mine] * 10**6 + colours,
                               -(rounds.transfers.edge_dst[mine] * 10**6 + colours) - 1))
        assert np.unique(keys).size == keys.size  # each colour a matching
    assert (rounds.edge_round[~from_owner] == -1).all()

"""Relays (passes/relay.py, algorithms/relays.py): a relayed pull leaves a rank that received the same block earlier,
keeps its round, and the validator refuses relays that send what they do not hold or push before their children."""

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from conftest import compile_own
from fcp_compiler.algorithms.relays import (RelayEdges, RelayLinks, busiest_send_seconds, choose_relays,
                                          stage_gain_bounds)
from fcp_compiler.format.inputs import PRESET_PROFILES
from fcp_compiler.core.ir import TransferKind
from plan_helpers import edited, expect

# Traffic 1000x slower than H100's: stages are bound by their sends, so relays are worth choosing.
SLOW_NETWORK = PRESET_PROFILES["h100"].model_copy(update={"network_gbps": 0.05, "nvlink_gbps": 0.05,
                                                          "gpus_per_node": 2})


def _star(num_receivers: int, num_colours: int):
    """One block owned by rank 0 pulled by ranks 1..num_receivers, one pull a stage, each in its own colour."""
    receivers = np.arange(1, num_receivers + 1)
    stage = np.arange(num_receivers)
    return RelayEdges(block=np.zeros(num_receivers, dtype=np.int64), src=np.zeros(num_receivers, dtype=np.int64),
                      dst=receivers, colour=stage % num_colours, bwd_round=stage % num_colours,
                      parent=np.full(num_receivers, -1), stage=stage, bwd_stage=stage,
                      nbytes=np.full(num_receivers, 1e6), seg_mask=np.ones(num_receivers, dtype=np.int64),
                      relayable=np.ones(num_receivers, dtype=bool))


def test_a_star_becomes_a_tree_that_respects_holding_colours_and_depth():
    edges = _star(6, 6)
    links = RelayLinks(node=np.arange(7), nic_bytes_per_s=1e9, nvlink_bytes_per_s=1e10)
    # Two pulls of the same stage from rank 0: one of them moves to a holder.
    edges = RelayEdges(**{**{name: getattr(edges, name) for name in RelayEdges.__slots__},
                          "stage": np.array([0, 1, 2, 2, 3, 3]), "bwd_stage": np.array([0, 1, 2, 2, 3, 3]),
                          "colour": np.array([0, 1, 2, 3, 4, 5]), "bwd_round": np.array([0, 1, 2, 3, 4, 5])})
    parent = choose_relays(edges, links, 7, np.zeros(4), max_gap=2)
    relayed = np.flatnonzero(parent >= 0)
    assert relayed.size >= 1
    for edge in relayed.tolist():
        p = parent[edge]
        assert parent[p] == -1  # depth one
        assert edges.stage[p] < edges.stage[edge] and edges.bwd_stage[p] < edges.bwd_stage[edge]
        assert edges.stage[edge] - edges.stage[p] <= 2
        assert edges.dst[p] != edges.dst[edge]
    # Per colour, every sender still sends at most once.
    senders = np.where(parent >= 0, edges.dst[np.maximum(parent, 0)], edges.src)
    keys = senders * 6 + edges.colour
    assert np.unique(keys).size == keys.size
    # In each stage, the busiest sender's bytes did not grow.
    for stage in np.unique(edges.stage):
        mask = edges.stage == stage
        before = np.bincount(edges.src[mask], weights=edges.nbytes[mask]).max()
        after = np.bincount(senders[mask], weights=edges.nbytes[mask]).max()
        assert after <= before


def test_no_relay_without_a_holder_of_every_segment():
    edges = _star(3, 3)
    edges = RelayEdges(**{**{name: getattr(edges, name) for name in RelayEdges.__slots__},
                          "stage": np.array([0, 1, 1]), "bwd_stage": np.array([0, 1, 1]),
                          "seg_mask": np.array([0b01, 0b10, 0b11])})  # the stage-0 puller lacks segment 1
    links = RelayLinks(node=np.arange(4), nic_bytes_per_s=1e9, nvlink_bytes_per_s=1e10)
    assert (choose_relays(edges, links, 4, np.zeros(2), max_gap=2) == -1).all()


def _check_relays(plan):
    schedule, transfers = plan.ir.schedule, plan.ir.transfers
    parent = transfers.edge_parent
    relayed = np.flatnonzero(parent >= 0)
    owner = transfers.edge_owner
    assert (transfers.edge_src[parent < 0] == owner[parent < 0]).all()
    for edge in relayed.tolist():
        p = parent[edge]
        assert transfers.edge_kind[edge] == transfers.edge_kind[p] == TransferKind.KV
        assert transfers.edge_block[p] == transfers.edge_block[edge]
        assert transfers.edge_dst[p] == transfers.edge_src[edge]
        for program in (schedule.forward, schedule.backward):
            assert program.edge_stage[p] < program.edge_stage[edge]
        segs = lambda e: set(transfers.edge_segs[transfers.edge_seg_offsets[e]:transfers.edge_seg_offsets[e + 1]])
        assert segs(edge) <= segs(p)
    # A relay's dK, dV leave after those of every pull it re-sent have landed.
    backward = schedule.backward
    push_stage = np.empty(transfers.num_edges, dtype=np.int64)
    push_stage[backward.push_edge] = backward.push_stage
    assert (push_stage[parent[relayed]] > push_stage[relayed]).all()
    return relayed.size


@given(st.lists(st.integers(64, 4000), min_size=2, max_size=10), st.integers(3, 8), st.sampled_from([1, 2]),
       st.sampled_from(["causal", "full"]), st.sampled_from(["plan", "user"]))
def test_random_batches_on_a_slow_network_give_valid_relayed_plans(lengths, gpus, coalesce, mask, layout):
    plan = compile_own(lengths, gpus, block_size=128, coalesce=coalesce, mask=mask, layout=layout,
                         profile=SLOW_NETWORK)
    assert _check_relays(plan) == plan.stats["num_relayed_transfers"]


@pytest.fixture(scope="module")
def relayed_bytes():
    plan = compile_own([752, 2962, 580, 999], 6, block_size=128, coalesce=2, profile=SLOW_NETWORK, model="none")
    assert plan.stats["num_relayed_transfers"] > 0
    return plan.to_bytes()


def _relayed_row(arrays):
    rank = next(r for r, a in enumerate(arrays) if (a["pull_send_source"] >= 0).any())
    return arrays[rank], int(np.flatnonzero(arrays[rank]["pull_send_source"] >= 0)[0])


def test_a_relay_that_claims_its_own_block_is_refused(relayed_bytes):
    def forget_source(arrays):
        a, row = _relayed_row(arrays)
        a["pull_send_source"][row] = -1
    expect(edited(relayed_bytes, forget_source), 2, "names no pull it received")


def test_a_relay_that_sends_before_its_block_arrives_is_refused(relayed_bytes):
    def too_early(arrays):
        relay = next(r for r, a in enumerate(arrays) if (a["pull_send_source"] >= 0).any())
        a = arrays[relay]
        row = int(np.flatnonzero(a["pull_send_source"] >= 0)[0])
        arrival = a["pull_recv_round"][a["pull_send_source"][row]]
        child = arrays[a["pull_send_peer"][row]]
        match = np.flatnonzero((child["pull_recv_peer"] == relay)
                               & (child["pull_recv_block"] == a["pull_send_block"][row])
                               & (child["pull_recv_kind"] == a["pull_send_kind"][row]))
        a["pull_send_round"][row] = child["pull_recv_round"][match] = arrival  # re-sent as it arrives
    expect(edited(relayed_bytes, too_early), 2, "relays block .* but receives it in stage")


def test_a_relay_pushing_before_its_children_land_is_refused(relayed_bytes):
    def push_first(arrays):
        a, row = _relayed_row(arrays)
        source = a["pull_send_source"][row]
        pushes = np.flatnonzero(a["bwd_push_send_pull"] == source)
        landed = np.flatnonzero(a["bwd_push_recv_pull"] == row)
        a["bwd_push_send_round"][pushes] = a["bwd_push_recv_round"][landed]
    expect(edited(relayed_bytes, push_first), 2)


def test_a_relay_of_a_pull_from_another_block_is_refused(relayed_bytes):
    def other_block(arrays):
        a, row = _relayed_row(arrays)
        others = np.flatnonzero(a["pull_recv_block"] != a["pull_send_block"][row])
        a["pull_send_source"][row] = others[0]
    expect(edited(relayed_bytes, other_block), 2, "another block|arrives|relays")


@given(st.integers(0, 2**32 - 1), st.integers(4, 12), st.integers(1, 3))
def test_stage_gain_bounds_bound_what_the_greedy_gains(seed, num_ranks, max_gap):
    rng = np.random.default_rng(seed)
    num_edges = int(rng.integers(1, 40))
    num_blocks = int(rng.integers(1, 6))
    block = rng.integers(0, num_blocks, num_edges)
    owner = rng.integers(0, num_ranks, num_blocks)
    dst = (owner[block] + rng.integers(1, num_ranks, num_edges)) % num_ranks
    stage = rng.integers(0, 5, num_edges)
    edges = RelayEdges(block=block, src=owner[block], dst=dst, colour=rng.integers(0, 8, num_edges),
                       bwd_round=rng.integers(0, 8, num_edges), parent=np.full(num_edges, -1), stage=stage,
                       bwd_stage=stage, nbytes=rng.integers(1, 4, num_edges) * 1e6,
                       seg_mask=np.ones(num_edges, dtype=np.int64), relayable=rng.random(num_edges) < 0.8)
    links = RelayLinks(node=np.arange(num_ranks) // 2, nic_bytes_per_s=1e9, nvlink_bytes_per_s=4e9, nvlink_lanes=2)
    floor = rng.random(5) * 2e-3
    bounds = stage_gain_bounds(edges, links, num_ranks, floor, max_gap)
    parent = choose_relays(edges, links, num_ranks, floor, max_gap)
    src = np.where(parent >= 0, dst[np.maximum(parent, 0)], edges.src)
    gained = busiest_send_seconds(edges, edges.src, links, num_ranks) - busiest_send_seconds(edges, src, links,
                                                                                            num_ranks)
    assert (gained <= bounds + 1e-12).all()
    # Asked for more than the bounds allow, the greedy gives up and keeps no relay.
    unreachable = choose_relays(edges, links, num_ranks, floor, max_gap, min_gain=bounds.sum() + 1e-9)
    assert (unreachable == -1).all()

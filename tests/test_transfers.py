"""plan_transfers: exactly the pulls the tiles need, each once, carrying exactly the segments its tiles read."""

import numpy as np
from hypothesis import given
from hypothesis import strategies as st

from fcp_compiler.core.ir import AttentionShape, Batch, TransferKind
from fcp_compiler.core.passes.assign import assign
from fcp_compiler.core.passes.cost import cost
from fcp_compiler.core.passes.shard import shard
from fcp_compiler.core.passes.transfers import plan_transfers
from fcp_compiler.format.inputs import PRESET_PROFILES, MaskKind


def needed_by_brute_force(assignment) -> dict:
    """(kind, block, rank) -> the set of segments that rank's tiles read of that block, pair by pair."""
    tiles, sharding = assignment.tiles, assignment.tiles.sharding
    needs: dict = {}
    for pair in range(tiles.pair_tile.size):
        rank = int(assignment.tile_rank[tiles.pair_tile[pair]])
        for kind, seg in ((TransferKind.KV, tiles.pair_kv_seg[pair]), (TransferKind.Q, tiles.pair_q_seg[pair])):
            block = int(sharding.seg_block[seg])
            if assignment.block_rank[block] != rank:
                needs.setdefault((int(kind), block, rank), set()).add(int(seg))
    return needs


@given(st.lists(st.integers(64, 9000), min_size=1, max_size=12), st.integers(2, 6),
       st.sampled_from(["causal", "full", "window 300", "window 2500"]))
def test_pulls_are_the_tiles_needs(lengths, num_ranks, mask):
    if mask.startswith("window"):  # a sliding window: blocks wholly out of reach are never pulled
        batch = Batch.uniform(np.array(lengths), MaskKind.SLIDING_WINDOW, int(mask.split()[1]))
    else:
        batch = Batch.uniform(np.array(lengths), MaskKind(mask))
    tiles = cost(shard(batch, 1024, mask != "full"), AttentionShape(), PRESET_PROFILES["h100"])
    cap = -(-batch.total_tokens // num_ranks) + 1024
    assignment = assign(tiles, num_ranks, cap, 0.01)
    transfers = plan_transfers(assignment)
    found = {}
    for edge in range(transfers.num_edges):
        key = (int(transfers.edge_kind[edge]), int(transfers.edge_block[edge]), int(transfers.edge_dst[edge]))
        assert key not in found, f"pull {key} listed twice"
        segs = transfers.edge_segs[transfers.edge_seg_offsets[edge]:transfers.edge_seg_offsets[edge + 1]]
        assert (np.diff(segs) > 0).all()
        found[key] = set(segs.tolist())
        assert transfers.edge_src[edge] == assignment.block_rank[key[1]] != key[2]  # from the owner, to another
    assert found == needed_by_brute_force(assignment)
    assert (transfers.edge_parent == -1).all()
    # Edges sorted by (kind, block, receiver), as coalesce's lookups need.
    order = np.lexsort((transfers.edge_dst, transfers.edge_block, transfers.edge_kind))
    assert np.array_equal(order, np.arange(transfers.num_edges))


@given(st.lists(st.integers(64, 6000), min_size=1, max_size=8), st.integers(2, 5), st.integers(0, 10_000),
       st.sampled_from([0.002, 0.05, 1.0]))
def test_pulls_are_the_needs_of_tiles_run_anywhere(lengths, num_ranks, seed, moved):
    # A fraction of the tiles run on random ranks, away from their query block's owner: Q pulls of causal zig-zag
    # blocks (whose needs come in closed form, not from listed pairs) are exercised as much as K, V pulls, and
    # sequences with no tile moved (needs from the block owners) sit beside sequences with some.
    import dataclasses

    batch = Batch.uniform(np.array(lengths), MaskKind.CAUSAL)
    tiles = cost(shard(batch, 512, True), AttentionShape(), PRESET_PROFILES["h100"])
    rng = np.random.default_rng(seed)
    assignment = assign(tiles, num_ranks, batch.total_tokens, 0.01)
    elsewhere = rng.random(tiles.num_tiles) < moved
    assignment = dataclasses.replace(assignment, tile_rank=np.where(
        elsewhere, rng.integers(0, num_ranks, size=tiles.num_tiles), assignment.tile_rank))
    transfers = plan_transfers(assignment)
    found = {}
    for edge in range(transfers.num_edges):
        key = (int(transfers.edge_kind[edge]), int(transfers.edge_block[edge]), int(transfers.edge_dst[edge]))
        found[key] = set(transfers.edge_segs[transfers.edge_seg_offsets[edge]:
                                             transfers.edge_seg_offsets[edge + 1]].tolist())
    assert found == needed_by_brute_force(assignment)

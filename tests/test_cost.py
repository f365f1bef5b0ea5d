import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from fcp_compiler.format.inputs import PRESET_PROFILES, AttentionShape, MaskKind
from fcp_compiler.core.ir import Batch
from fcp_compiler.core.passes.cost import cost, tile_efficiency
from fcp_compiler.core.passes.shard import shard


@given(st.lists(st.integers(1, 9000), min_size=1, max_size=12), st.sampled_from(["causal", "full"]),
       st.booleans())
def test_tiles_cover_exactly_the_visible_pairs(values, mask, zigzag):
    shape = AttentionShape(q_heads=8, kv_heads=2, head_dim=16)
    batch = Batch.uniform(np.array(values), MaskKind(mask))
    tiles = cost(shard(batch, 1024, zigzag), shape, PRESET_PROFILES["h100"])
    lengths = np.array(values, dtype=np.int64)
    visible = (lengths * (lengths + 1) // 2).sum() if mask == "causal" else (lengths ** 2).sum()
    assert np.isclose(tiles.tile_flops.sum(), 4.0 * visible * 8 * 16)
    keys = tiles.tile_q_block * tiles.sharding.num_blocks + tiles.tile_kv_block
    assert np.unique(keys).size == keys.size and (tiles.tile_seconds > 0).all()


def test_efficiency_curve_interpolates_and_saturates():
    profile = PRESET_PROFILES["h100"]
    eff = tile_efficiency(profile, np.array([512, 4096, 1 << 20, 64]))
    assert eff[0] == 0.25 and eff[1] == 0.73 and eff[2] == profile.efficiency_curve[-1].efficiency
    assert 0 < eff[3] < profile.efficiency_curve[0].efficiency


@given(st.lists(st.tuples(st.integers(1, 1500), st.integers(0, 1600)), min_size=1, max_size=8), st.booleans())
def test_windowed_and_mixed_masks_give_exactly_the_visible_pairs(sequences, zigzag):
    # Each sequence its own mask: window 0 is full, a window >= its length causal, anything between a window.
    lengths = np.array([length for length, _ in sequences], dtype=np.int64)
    windows = np.array([0 if w == 0 else min(w, length) for length, w in sequences], dtype=np.int64)
    shape = AttentionShape(q_heads=8, kv_heads=2, head_dim=16)
    tiles = cost(shard(Batch(lengths=lengths, windows=windows), 256, zigzag), shape, PRESET_PROFILES["h100"])
    sharding = tiles.sharding
    # Every segment pair counted token by token: k <= q < k + w, or all for a full mask.
    for q_seg, k_seg, flops in zip(tiles.pair_q_seg, tiles.pair_kv_seg, tiles.pair_flops):
        q = np.arange(sharding.seg_start[q_seg], sharding.seg_end[q_seg])[:, None]
        k = np.arange(sharding.seg_start[k_seg], sharding.seg_end[k_seg])[None, :]
        w = windows[sharding.seg_seq[q_seg]]
        seen = np.ones((q.size, k.size), dtype=bool) if w == 0 else (k <= q) & (q - k < w)
        assert flops == 4.0 * seen.sum() * 8 * 16 and seen.any()  # and no tile without a visible pair
    # ... and together they are every visible pair of the batch (per sequence: W(W+1)/2 + (L - W) W, or L^2).
    per_seq = np.where(windows == 0, lengths ** 2, windows * (windows + 1) // 2 + (lengths - windows) * windows)
    assert tiles.tile_flops.sum() == 4.0 * per_seq.sum() * 8 * 16


@settings(max_examples=60)
@given(st.lists(st.tuples(st.integers(1, 1500), st.integers(0, 1600)), min_size=1, max_size=8), st.booleans(),
       st.sampled_from([128, 320]))
def test_dense_zigzag_tiles_equal_the_pair_by_pair_listing_to_the_bit(sequences, zigzag, block_size):
    # The closed form for causal zig-zag sequences must give the very figures (float sums in the same order) and the
    # same pairs of every tile, in the same order, as listing every segment pair; plans then stay byte-identical.
    # At 320 tokens a block the h100 figures of a diagonal tile differ with the order of the sum, so a wrong order
    # fails here.
    from fcp_compiler.core.passes import cost as cost_module

    lengths = np.array([length for length, _ in sequences], dtype=np.int64)
    windows = np.array([length if w == 0 else min(w, length) for length, w in sequences], dtype=np.int64)
    windows[::3] = 0  # some full masks among them
    shape = AttentionShape(q_heads=8, kv_heads=2, head_dim=16)
    sharding = shard(Batch(lengths=lengths, windows=windows), block_size, zigzag)
    profile = PRESET_PROFILES["h100"]
    fast = cost(sharding, shape, profile)
    plain = cost_module._segment_pair_tiles(sharding, shape, profile, np.zeros(sharding.num_segments, dtype=bool))
    num_blocks = sharding.num_blocks
    assert np.array_equal(fast.tile_q_block * num_blocks + fast.tile_kv_block, plain.key)
    assert fast.tile_seconds.tobytes() == plain.seconds.tobytes()
    assert fast.tile_flops.tobytes() == plain.flops.tobytes()

    def by_tile(tile, *columns):
        order = np.argsort(tile, kind="stable")
        return [np.asarray(column)[order].tolist() for column in (tile, *columns)]
    assert by_tile(fast.pair_tile, fast.pair_q_seg, fast.pair_kv_seg, fast.pair_flops) == by_tile(
        plain.pair_tile, plain.pair_q_seg, plain.pair_kv_seg, plain.pair_flops)

"""The assign pass's helpers, against plain recomputation from the segment pairs."""

import numpy as np
from hypothesis import given
from hypothesis import strategies as st

from fcp_compiler.core.ir import Batch
from fcp_compiler.core.passes.assign import block_needs
from fcp_compiler.core.passes.cost import cost
from fcp_compiler.core.passes.shard import shard
from fcp_compiler.format.inputs import PRESET_PROFILES, AttentionShape


@given(st.lists(st.tuples(st.integers(1, 1500), st.sampled_from([0, 1, 90, 10**6])), min_size=1, max_size=10),
       st.booleans())
def test_block_needs_are_the_unique_foreign_segments_of_every_block_s_pairs(sequences, zigzag):
    # Dense zig-zag sequences' needs come in closed form and are merged between the others' in block order; the
    # result must be exactly what the pairs say, sorted.
    lengths = np.array([length for length, _ in sequences], dtype=np.int64)
    windows = np.array([min(w, length) for length, w in sequences], dtype=np.int64)
    tiles = cost(shard(Batch(lengths=lengths, windows=windows), 128, zigzag),
                 AttentionShape(q_heads=4, kv_heads=2, head_dim=16), PRESET_PROFILES["h100"])
    seg_block, num_segments = tiles.sharding.seg_block, tiles.sharding.num_segments
    q_block = seg_block[tiles.pair_q_seg]
    foreign = seg_block[tiles.pair_kv_seg] != q_block
    expected = np.unique(q_block[foreign] * num_segments + tiles.pair_kv_seg[foreign])
    need_block, need_seg = block_needs(tiles)
    assert np.array_equal(need_block * num_segments + need_seg, expected)

import numpy as np
from hypothesis import given
from hypothesis import strategies as st

from fcp_compiler.format.inputs import PRESET_PROFILES, AttentionShape, MaskKind
from fcp_compiler.core.ir import Batch
from fcp_compiler.core.passes.cost import cost, tile_efficiency
from fcp_compiler.core.passes.shard import shard


@given(st.lists(st.integers(1, 9000), min_size=1, max_size=12), st.sampled_from(["causal", "full"]),
       st.booleans())
def test_tiles_cover_exactly_the_visible_pairs(values, mask, zigzag):
    shape = AttentionShape(q_heads=8, kv_heads=2, head_dim=16)
    batch = Batch(lengths=np.array(values), mask=MaskKind(mask))
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

import numpy as np
from hypothesis import given
from hypothesis import strategies as st

from fcp_compiler.inputs import MaskKind
from fcp_compiler.ir import Batch
from fcp_compiler.passes.shard import shard

lengths = st.lists(st.integers(1, 20000), min_size=1, max_size=30)


@given(lengths, st.sampled_from([64, 256, 1024, 4096]), st.booleans())
def test_segments_partition_every_sequence_and_blocks_fit(values, block_size, zigzag):
    batch = Batch(lengths=np.array(values), mask=MaskKind.CAUSAL)
    sharding = shard(batch, block_size, zigzag)
    assert sharding.block_tokens.max() <= block_size
    covered = np.zeros(batch.total_tokens, dtype=int)
    offsets = batch.seq_offsets
    for seq, start, end in zip(sharding.seg_seq, sharding.seg_start, sharding.seg_end):
        assert 0 <= start < end <= values[seq]
        covered[offsets[seq] + start:offsets[seq] + end] += 1
    assert (covered == 1).all()
    # Full blocks: one per floor(L / B); packed blocks hold the rest.
    num_full = sum(v // block_size for v in values)
    rest = sum(v % block_size for v in values)
    assert sharding.num_blocks >= num_full + -(-rest // block_size)


def test_zigzag_pairs_chunk_i_with_its_mirror():
    batch = Batch(lengths=np.array([8 * 1024]), mask=MaskKind.CAUSAL)
    sharding = shard(batch, 1024, zigzag=True)
    assert sharding.num_blocks == 8
    for block in range(8):
        segs = np.flatnonzero(sharding.seg_block == block)
        starts = sorted(sharding.seg_start[segs].tolist())
        assert starts == [block * 512, (15 - block) * 512]


def test_short_sequences_are_packed_whole():
    batch = Batch(lengths=np.array([100, 200, 300, 4000]), mask=MaskKind.CAUSAL)
    sharding = shard(batch, 4096, zigzag=False)
    assert sharding.num_segments == 4  # none split
    assert sharding.num_blocks == 2

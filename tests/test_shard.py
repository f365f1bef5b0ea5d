import numpy as np
from hypothesis import given
from hypothesis import strategies as st

from fcp_compiler.algorithms.packing import best_fit_decreasing
from fcp_compiler.core.ir import Batch
from fcp_compiler.core.passes.shard import shard
from fcp_compiler.format.inputs import MaskKind

lengths = st.lists(st.integers(1, 20000), min_size=1, max_size=30)


@given(lengths, st.sampled_from([64, 256, 1024, 4096]), st.booleans())
def test_segments_partition_every_sequence_and_blocks_fit(values, block_size, zigzag):
    batch = Batch.uniform(np.array(values), MaskKind.CAUSAL)
    sharding = shard(batch, block_size, zigzag)
    assert sharding.block_tokens.max() <= block_size
    covered = np.zeros(batch.total_tokens, dtype=int)
    offsets = batch.seq_offsets
    for seq, start, end in zip(sharding.seg_seq, sharding.seg_start, sharding.seg_end):
        assert 0 <= start < end <= values[seq]
        covered[offsets[seq] + start:offsets[seq] + end] += 1
    assert (covered == 1).all()
    # floor(L / B) full blocks a sequence, and the tails packed into exactly as many blocks as best-fit decreasing
    # needs (seeding the longest sequences' tails into blocks of their own must cost no block).
    num_full = sum(v // block_size for v in values)
    assert (sharding.block_tokens == block_size).sum() >= num_full
    tails = np.array([v % block_size for v in values if v % block_size])
    packed = int(best_fit_decreasing(tails, block_size).max()) + 1 if tails.size else 0
    assert sharding.num_blocks == num_full + packed


def test_zigzag_pairs_chunk_i_with_its_mirror():
    batch = Batch.uniform(np.array([8 * 1024]), MaskKind.CAUSAL)
    sharding = shard(batch, 1024, zigzag=True)
    assert sharding.num_blocks == 8
    for block in range(8):
        segs = np.flatnonzero(sharding.seg_block == block)
        starts = sorted(sharding.seg_start[segs].tolist())
        assert starts == [block * 512, (15 - block) * 512]


def test_short_sequences_are_packed_whole():
    batch = Batch.uniform(np.array([100, 200, 300, 4000]), MaskKind.CAUSAL)
    sharding = shard(batch, 4096, zigzag=False)
    assert sharding.num_segments == 4  # none split
    assert sharding.num_blocks == 2

"""Dense causal zig-zag sequences in closed form, against the pair-by-pair enumeration and brute force."""

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from fcp_compiler.algorithms.dense_zigzag import (dense_row_spans, dense_zigzag_needs, dense_zigzag_pairs,
                                                  dense_zigzag_rows, dense_zigzag_sequences, num_dense_pairs)
from fcp_compiler.algorithms.visibility import visible_pairs
from fcp_compiler.core.ir import Batch
from fcp_compiler.core.passes.shard import pairs_chunks, shard

BLOCK = 128

batches = st.lists(st.tuples(st.integers(1, 1400), st.sampled_from(["causal", "full", "window", "long window"])),
                   min_size=1, max_size=9)


def _batch(sequences) -> Batch:
    lengths = np.array([length for length, _ in sequences], dtype=np.int64)
    windows = np.array([{"causal": length, "full": 0, "window": min(100, length),
                         "long window": min(length - 1, 900) or 1}[mask] for length, mask in sequences],
                       dtype=np.int64)
    return Batch(lengths=lengths, windows=windows)


def _dense(sharding):
    batch = sharding.batch
    return dense_zigzag_sequences(sharding.seg_block, sharding.seg_seq, sharding.seg_start, sharding.seg_end,
                                  batch.windows == batch.lengths, sharding.block_size // 2)


@given(batches, st.booleans())
def test_the_dense_sequences_are_the_causal_ones_shard_pairs(sequences, zigzag):
    batch = _batch(sequences)
    sharding = shard(batch, BLOCK, zigzag)
    first_block, num_blocks, first_seg = _dense(sharding)
    num_full = batch.lengths // BLOCK
    paired = zigzag & (num_full >= 2) & pairs_chunks(batch) & (batch.windows == batch.lengths)
    seqs = sharding.seg_seq[first_seg]
    assert sorted(seqs.tolist()) == np.flatnonzero(paired).tolist()
    assert np.array_equal(num_blocks, num_full[seqs])
    for block, num, seg in zip(first_block, num_blocks, first_seg):
        segs = np.arange(seg, seg + 2 * num)
        assert (sharding.seg_block[segs] == block + np.arange(2 * num) // 2).all()
        assert (sharding.seg_seq[segs] == sharding.seg_seq[seg]).all()


def test_a_block_that_only_looks_zigzag_is_refused():
    # Two blocks of one sequence, each two half-block segments, but block 0 holds chunks 0 and 2 (and block 1
    # chunks 1 and 3): not a zig-zag, whose block 0 holds the first chunk and the last.
    half = BLOCK // 2
    seg_block = np.array([0, 0, 1, 1])
    seg_seq = np.zeros(4, dtype=np.int64)
    seg_start = np.array([0, 2, 1, 3]) * half
    found = dense_zigzag_sequences(seg_block, seg_seq, seg_start, seg_start + half, np.array([True]), half)
    assert all(part.size == 0 for part in found)
    right = np.array([0, 3, 1, 2]) * half  # block 0: chunks 0 and 3; block 1: chunks 1 and 2
    found = dense_zigzag_sequences(seg_block, seg_seq, right, right + half, np.array([True]), half)
    assert [part.tolist() for part in found] == [[0], [2], [0]]
    found = dense_zigzag_sequences(seg_block, seg_seq, right, right + half, np.array([False]), half)
    assert all(part.size == 0 for part in found)


@settings(max_examples=30)
@given(st.lists(st.integers(1, 7), min_size=1, max_size=3))
def test_pairs_are_every_visible_chunk_pair_in_listing_order(block_counts):
    half = 4
    num_blocks = np.array(block_counts, dtype=np.int64)
    first_block = np.concatenate(([0], np.cumsum(num_blocks)[:-1]))
    first_seg = 2 * first_block
    tile_offset = np.concatenate(([0], np.cumsum(num_blocks ** 2)[:-1])) + 5
    pair_tile, q_seg, kv_seg, itself = dense_zigzag_pairs(first_seg, num_blocks, tile_offset)
    assert pair_tile.size == num_dense_pairs(num_blocks)
    expected = []
    for seq, num in enumerate(block_counts):
        # Segment first_seg + 2i is chunk i, + 2i + 1 chunk 2n-1-i; list each tile's visible pairs by (query
        # start, key start), as the pair-by-pair enumeration adds them.
        chunk = {int(first_seg[seq]) + 2 * i + side: (i if side == 0 else 2 * num - 1 - i)
                 for i in range(num) for side in (0, 1)}
        for i in range(num):
            for j in range(num):
                q_segs = sorted((s for s in chunk if (s - first_seg[seq]) // 2 == i), key=chunk.get)
                k_segs = sorted((s for s in chunk if (s - first_seg[seq]) // 2 == j), key=chunk.get)
                for q in q_segs:
                    for k in k_segs:
                        seen = visible_pairs(chunk[q] * half, (chunk[q] + 1) * half, chunk[k] * half,
                                             (chunk[k] + 1) * half, 2 * num * half)
                        if seen:
                            expected.append((int(tile_offset[seq]) + i * num + j, q, k, q == k))
    assert list(zip(pair_tile.tolist(), q_seg.tolist(), kv_seg.tolist(), itself.tolist())) == expected


@settings(max_examples=30)
@given(st.lists(st.integers(1, 9), min_size=1, max_size=4), st.integers(1, 60))
def test_row_spans_list_the_pairs_in_parts(block_counts, most):
    """dense_row_spans' parts, each listed by dense_zigzag_rows, are dense_zigzag_pairs cut at row boundaries:
    about `most` pairs a part, at least one row."""
    num_blocks = np.array(block_counts, dtype=np.int64)
    first_seg = 2 * np.concatenate(([0], np.cumsum(num_blocks)[:-1]))
    tile_offset = np.concatenate(([0], np.cumsum(num_blocks ** 2)[:-1])) + 3
    whole = dense_zigzag_pairs(first_seg, num_blocks, tile_offset)
    parts = [dense_zigzag_rows(spans) for spans in dense_row_spans(first_seg, num_blocks, tile_offset, most)]
    for column, cut in zip(whole, zip(*parts)):
        assert np.array_equal(column, np.concatenate(cut))
    for part in parts:
        assert part[0].size <= most or np.unique(part[1] // 2).size == 1  # over `most`: one row of one sequence


@given(batches)
def test_needs_are_those_of_the_pairs(sequences):
    from fcp_compiler.core.passes.cost import cost
    from fcp_compiler.format.inputs import PRESET_PROFILES, AttentionShape

    sharding = shard(_batch(sequences), BLOCK, True)
    tiles = cost(sharding, AttentionShape(q_heads=4, kv_heads=2, head_dim=16), PRESET_PROFILES["h100"])
    first_block, num_blocks, first_seg = _dense(sharding)
    need_block, need_seg = dense_zigzag_needs(first_block, num_blocks, first_seg)
    q_block = sharding.seg_block[tiles.pair_q_seg]
    dense = np.isin(q_block, np.concatenate([np.arange(b, b + n) for b, n in zip(first_block, num_blocks)] + [[]]))
    foreign = dense & (sharding.seg_block[tiles.pair_kv_seg] != q_block)
    key = np.unique(q_block[foreign] * sharding.num_segments + tiles.pair_kv_seg[foreign])
    assert np.array_equal(need_block * sharding.num_segments + need_seg, key)


@given(st.lists(st.integers(1, 9), min_size=1, max_size=4), st.integers(1, 5), st.integers(0, 10_000))
def test_home_needs_are_the_per_tile_needs_of_tiles_run_by_their_owner(block_counts, num_ranks, seed):
    from fcp_compiler.algorithms.dense_zigzag import dense_zigzag_home_needs, dense_zigzag_pull_needs

    num_blocks = np.array(block_counts, dtype=np.int64)
    first_block = np.concatenate(([0], np.cumsum(num_blocks)[:-1]))
    owner = np.random.default_rng(seed).integers(0, num_ranks, size=int(num_blocks.sum()))
    first_seg = 2 * np.arange(owner.size)
    q_block = np.concatenate([b + np.repeat(np.arange(n), n) for b, n in zip(first_block, num_blocks)])
    kv_block = np.concatenate([b + np.tile(np.arange(n), n) for b, n in zip(first_block, num_blocks)])
    kv_seg, kv_rank, q_seg, _ = dense_zigzag_pull_needs(q_block, kv_block, owner[q_block], owner, first_seg,
                                                        num_ranks)
    assert q_seg.size == 0  # every tile at home: no query block is pulled
    home_seg, home_rank = dense_zigzag_home_needs(first_block, num_blocks, owner, first_seg, num_ranks)
    assert sorted(zip(home_seg.tolist(), home_rank.tolist())) == sorted(zip(kv_seg.tolist(), kv_rank.tolist()))

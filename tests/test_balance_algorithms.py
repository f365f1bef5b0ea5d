import numpy as np
from hypothesis import given
from hypothesis import strategies as st

from fcp_compiler.algorithms.bounds import imbalance_ratio, makespan_lower_bound
from fcp_compiler.algorithms.comm_balance import RankNeeds, balance_two_dimensional
from fcp_compiler.algorithms.offload import _HelpedBlocks, offload_tiles


def test_imbalance_ratio_and_bound():
    assert imbalance_ratio(np.array([1.0, 1.0])) == 0.0
    assert imbalance_ratio(np.array([2.0, 0.0])) == 0.5
    assert makespan_lower_bound(10.0, 4, 1.0) == (2.5, "mean")
    assert makespan_lower_bound(10.0, 4, 3.0) == (3.0, "largest_piece")


def test_offload_moves_tiles_of_a_heavy_block_to_idle_ranks():
    # One query block with 8 tiles of work 1 on rank 0; ranks 1-3 idle.
    tile_q = np.zeros(8, dtype=int)
    tile_kv = np.arange(8)
    block_rank = np.array([0, 0, 0, 0, 1, 1, 2, 3])
    tile_rank = offload_tiles(tile_q, tile_kv, np.ones(8), block_rank, 4, target=2.0)
    loads = np.bincount(tile_rank, minlength=4)
    assert loads.max() == 2
    # Tiles whose K,V the helper holds go there first.
    assert set(tile_kv[tile_rank == 1]) == {4, 5}


def _helped_tokens(tile_q, tile_rank, block_rank, block_tokens, num_ranks):
    """Per rank, the tokens of the other owners' query blocks it runs tiles of (written out)."""
    out = np.zeros(num_ranks, dtype=np.int64)
    for rank in range(num_ranks):
        out[rank] = sum(block_tokens[b] for b in {int(q) for q, r in zip(tile_q, tile_rank) if r == rank}
                        if block_rank[b] != rank)
    return out


def test_offload_limits_the_blocks_a_helper_takes():
    # Ranks 2 and 1 run 3 tiles each (query blocks 0; 2 and 5), rank 3 one, rank 0 none; the target is 2.
    num_ranks = 4
    block_rank = np.array([2, 1, 1, 3, 1, 1])
    tile_q = np.array([0, 0, 0, 2, 3, 5, 5])
    tokens = np.full(block_rank.size, 100)
    free = offload_tiles(tile_q, tile_q, np.ones(tile_q.size), block_rank, num_ranks, target=2.0)
    capped = offload_tiles(tile_q, tile_q, np.ones(tile_q.size), block_rank, num_ranks, target=2.0,
                           block_tokens=tokens, max_helped_tokens=100)
    # Unlimited, the idle rank 0 takes tiles of two blocks (two Q pulls); limited to one block's tokens, the second
    # block's tile goes to rank 3, and the balance is the same.
    assert _helped_tokens(tile_q, free, block_rank, tokens, num_ranks).tolist() == [200, 0, 0, 0]
    assert _helped_tokens(tile_q, capped, block_rank, tokens, num_ranks).tolist() == [100, 0, 0, 100]
    assert np.bincount(free, minlength=num_ranks).max() == np.bincount(capped, minlength=num_ranks).max() == 2


@given(st.integers(2, 6), st.integers(0, 10_000), st.integers(1, 4))
def test_offload_limit_holds_and_changes_nothing_when_loose(num_ranks, seed, limit_blocks):
    rng = np.random.default_rng(seed)
    num_blocks = 3 * num_ranks
    block_rank = rng.integers(0, num_ranks, num_blocks)
    tokens = rng.integers(1, 5, num_blocks) * 64
    tile_q = np.repeat(np.arange(num_blocks), rng.integers(1, 6, num_blocks))
    tile_kv = rng.integers(0, num_blocks, tile_q.size)
    seconds = rng.uniform(0.5, 2.0, tile_q.size)
    loads = np.bincount(block_rank[tile_q], weights=seconds, minlength=num_ranks)
    target = float(loads.mean()) * 1.01
    free = offload_tiles(tile_q, tile_kv, seconds, block_rank, num_ranks, target=target)
    loose = offload_tiles(tile_q, tile_kv, seconds, block_rank, num_ranks, target=target, block_tokens=tokens,
                          max_helped_tokens=int(tokens.sum()))
    assert np.array_equal(free, loose)
    limit = limit_blocks * 128
    capped = offload_tiles(tile_q, tile_kv, seconds, block_rank, num_ranks, target=target, block_tokens=tokens,
                           max_helped_tokens=limit)
    # Every helper keeps within the limit (none ran tiles for others on entry), a block's own tiles may always go
    # back to it, and no rank ends above the most loaded one on entry.
    assert (_helped_tokens(tile_q, capped, block_rank, tokens, num_ranks) <= limit).all()
    assert np.bincount(capped, weights=seconds, minlength=num_ranks).max() <= loads.max() + 1e-9


@given(st.integers(0, 10_000))
def test_helped_blocks_follow_their_tiles(seed):
    # The helped-block tally after random moves equals the tokens recounted from where the tiles are.
    rng = np.random.default_rng(seed)
    num_ranks, num_blocks = 4, 6
    block_rank = rng.integers(0, num_ranks, num_blocks)
    tokens = rng.integers(1, 9, num_blocks) * 64
    tile_q = rng.integers(0, num_blocks, 20)
    tile_rank = rng.integers(0, num_ranks, tile_q.size)
    helped = _HelpedBlocks.of(tile_q, tile_rank, block_rank, num_ranks, tokens, 10**9)
    for _ in range(30):
        block = int(rng.integers(0, num_blocks))
        ranks = np.unique(tile_rank[tile_q == block])
        if ranks.size == 0:
            continue
        source, helper = int(rng.choice(ranks)), int(rng.integers(0, num_ranks))
        if helper == source:
            continue
        mine = np.flatnonzero((tile_q == block) & (tile_rank == source))
        moved = mine[:int(rng.integers(1, mine.size + 1))]
        tile_rank[moved] = helper
        helped.move(block, source, helper, moved.size)
        assert helped.tokens.tolist() == _helped_tokens(tile_q, tile_rank, block_rank, tokens, num_ranks).tolist()


def brute_received(block_rank, seg_block, seg_tokens, need_block, need_seg, num_ranks):
    out = np.zeros(num_ranks)
    for rank in range(num_ranks):
        needed = {k for b, k in zip(need_block, need_seg) if block_rank[b] == rank}
        out[rank] = sum(seg_tokens[k] for k in needed if block_rank[seg_block[k]] != rank)
    return out


@given(st.integers(2, 4), st.integers(0, 10_000), st.booleans())
def test_two_dimensional_search_is_exact_and_never_worse(num_ranks, seed, with_tokens_and_pairs):
    rng = np.random.default_rng(seed)
    num_blocks = 4 * num_ranks
    seg_block = np.sort(rng.integers(0, num_blocks, size=2 * num_blocks))
    seg_block = np.concatenate((np.arange(num_blocks), seg_block))
    seg_block.sort()
    seg_tokens = rng.integers(1, 50, size=seg_block.size)
    pairs = {(int(b), int(k)) for b, k in zip(rng.integers(0, num_blocks, 60), rng.integers(0, seg_block.size, 60))
             if seg_block[k] != b}
    pairs = sorted(pairs)
    need_block = np.array([p[0] for p in pairs], dtype=np.int64)
    need_seg = np.array([p[1] for p in pairs], dtype=np.int64)
    weights = rng.uniform(1, 5, size=num_blocks)
    tokens = np.bincount(seg_block, weights=seg_tokens, minlength=num_blocks).astype(int)
    start = np.arange(num_blocks) % num_ranks
    # The search takes a feasible placement: the cap holds the start.
    cap = max(int(tokens.sum() // num_ranks + tokens.max()), int(np.bincount(start, weights=tokens).max()))
    seg_seq = np.arange(seg_block.size) % 3
    needs = RankNeeds(start[need_block], need_seg, num_ranks, seg_block.size)
    assert np.array_equal(needs.received(start[seg_block], seg_tokens),
                          brute_received(start, seg_block, seg_tokens, need_block, need_seg, num_ranks))
    # Counts stay exact through moves: every block of rank 0 leaves, then comes back.
    for block in np.flatnonzero(start == 0).tolist():
        mine = need_seg[need_block == block]
        needs.add(0, mine, -1)
        needs.add(1 % num_ranks, mine, 1)
    moved = np.where(start == 0, 1 % num_ranks, start)
    assert np.array_equal(needs.received(moved[seg_block], seg_tokens),
                          brute_received(moved, seg_block, seg_tokens, need_block, need_seg, num_ranks))

    entry_received = brute_received(start, seg_block, seg_tokens, need_block, need_seg, num_ranks).mean()

    pairs = rng.uniform(1, 5, size=num_blocks)
    fixed_pairs = rng.uniform(0, 2, size=num_ranks)
    extra = dict(token_tolerance=0.05, block_pairs=pairs, fixed_pairs=fixed_pairs, pair_tolerance=0.05) \
        if with_tokens_and_pairs else {}

    def worst(block_rank):  # the search's objective, with the means as on entry
        compute = np.bincount(block_rank, weights=weights, minlength=num_ranks)
        received = brute_received(block_rank, seg_block, seg_tokens, need_block, need_seg, num_ranks)
        terms = [((compute / compute.mean() - 1) / 0.05).max(), ((received / max(entry_received, 1) - 1) / 0.1).max()]
        if with_tokens_and_pairs:
            held = np.bincount(block_rank, weights=tokens, minlength=num_ranks)
            rank_pairs = np.bincount(block_rank, weights=pairs, minlength=num_ranks) + fixed_pairs
            terms += [((held / held.mean() - 1) / 0.05).max(), ((rank_pairs / rank_pairs.mean() - 1) / 0.05).max()]
        return max(terms)

    result = balance_two_dimensional(start, weights, tokens, seg_block, seg_seq, seg_tokens, need_block, need_seg,
                                     num_ranks, cap, 0.05, 0.1, num_partner_ranks=num_ranks, **extra)
    assert np.bincount(result, weights=tokens, minlength=num_ranks).max() <= cap
    assert worst(result) <= worst(start) + 1e-9


@given(st.lists(st.integers(0, 5), min_size=1, max_size=30), st.integers(1, 35))
def test_least_is_the_head_of_a_stable_argsort(values, count):
    from fcp_compiler.algorithms.comm_balance import _least

    values = np.array(values, dtype=float)
    assert np.array_equal(_least(values, count), np.argsort(values, kind="stable")[:count])


def test_chunk_pair_sums_equal_brute_force():
    from fcp_compiler.algorithms.chunk_pairs import chunk_pair_sums

    rng = np.random.default_rng(3)
    tokens = rng.integers(0, 6, size=(5, 4))
    weights = rng.random(5)
    for causal in (True, False):
        want = np.zeros((4, 4))
        for s in range(5):
            starts = np.concatenate(([0], np.cumsum(tokens[s])))
            for a in range(4):
                for b in range(4):
                    for q in range(starts[a], starts[a + 1]):
                        for k in range(starts[b], starts[b + 1]):
                            want[a, b] += weights[s] * (k <= q if causal else 1)
        np.testing.assert_allclose(chunk_pair_sums(tokens, weights, causal), want)

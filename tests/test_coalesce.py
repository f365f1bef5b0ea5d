"""The coalesce pass and its plain-array helpers: every round of a pass is a matching over pulls and pushes,
pushes leave after their tiles, and levelling never lifts live buffers over the budget."""

import numpy as np
from hypothesis import given
from hypothesis import strategies as st

from conftest import compile_valid, congestion_free
from fcp_compiler.algorithms.exchange import place_messages
from fcp_compiler.algorithms.liveness import live_tokens, peak_live_tokens
from fcp_compiler.core.passes.coalesce import coalesce, max_buffer_tokens, pass_buffers
from fcp_compiler.core.stats import exchange_degree


def _is_matching(rounds, src, dst):
    return (np.unique(np.stack((src, rounds)), axis=1, return_counts=True)[1].max(initial=0) <= 1
            and np.unique(np.stack((dst, rounds)), axis=1, return_counts=True)[1].max(initial=0) <= 1)


@given(st.integers(1, 6), st.integers(0, 40), st.integers(0, 40), st.integers(0, 10_000))
def test_placed_messages_keep_every_round_a_matching_and_never_leave_early(num_ranks, num_fixed, num_new, seed):
    rng = np.random.default_rng(seed)
    # Fixed messages: a random matching per round, built by taking each (sender, receiver) at most once a round.
    fixed = [(r, a, b) for r in range(8) for a, b in zip(rng.permutation(num_ranks), rng.permutation(num_ranks))
             if rng.random() < num_fixed / 60]
    fixed_round, fixed_src, fixed_dst = (np.array([f[i] for f in fixed], dtype=np.int64) for i in range(3))
    ready = rng.integers(0, 10, size=num_new)
    src, dst = rng.integers(0, num_ranks, size=num_new), rng.integers(0, num_ranks, size=num_new)
    placed = place_messages(ready, src, dst, num_ranks, fixed_round, fixed_src, fixed_dst)
    assert (placed >= ready).all()
    assert _is_matching(np.concatenate((fixed_round, placed)), np.concatenate((fixed_src, src)),
                        np.concatenate((fixed_dst, dst)))
    # Greedy in ready order: every earlier round from its ready one had one of its two ends taken.
    taken_send = {(int(r), int(a)) for r, a in zip(np.concatenate((fixed_round, placed)),
                                                   np.concatenate((fixed_src, src)))}
    taken_recv = {(int(r), int(b)) for r, b in zip(np.concatenate((fixed_round, placed)),
                                                   np.concatenate((fixed_dst, dst)))}
    for m in range(num_new):
        for r in range(int(ready[m]), int(placed[m])):
            assert (r, int(src[m])) in taken_send or (r, int(dst[m])) in taken_recv


def _placed_one_at_a_time(ready, src, dst, capacity, fixed_round, fixed_src, fixed_dst):
    """The greedy as it reads: messages by ready round (ties by index), each in the first round from its ready one
    where its sender and its receiver both have a slot left."""
    send, recv = {}, {}
    for r, a, b in zip(fixed_round.tolist(), fixed_src.tolist(), fixed_dst.tolist()):
        send[a, r] = send.get((a, r), 0) + 1
        recv[b, r] = recv.get((b, r), 0) + 1
    placed = np.zeros(ready.size, dtype=np.int64)
    for m in sorted(range(ready.size), key=lambda m: (int(ready[m]), m)):
        a, b, r = int(src[m]), int(dst[m]), int(ready[m])
        while send.get((a, r), 0) >= capacity[a] or recv.get((b, r), 0) >= capacity[b]:
            r += 1
        send[a, r] = send.get((a, r), 0) + 1
        recv[b, r] = recv.get((b, r), 0) + 1
        placed[m] = r
    return placed


@given(st.integers(1, 6), st.integers(0, 80), st.integers(0, 200), st.sampled_from([1, 2, 3]), st.integers(0, 10_000))
def test_placed_messages_take_the_plain_greedys_rounds(num_ends, num_fixed, num_new, most_slots, seed):
    """place_messages finds free rounds with bit masks, one per end and slot: the rounds must be the plain greedy's,
    with several slots an end, fixed messages beyond an end's slots, and messages that wait many rounds."""
    rng = np.random.default_rng(seed)
    capacity = rng.integers(1, most_slots + 1, size=num_ends)
    fixed_round = rng.integers(0, 12, size=num_fixed)
    fixed_src, fixed_dst = rng.integers(0, num_ends, size=num_fixed), rng.integers(0, num_ends, size=num_fixed)
    ready = rng.integers(0, 6, size=num_new)
    src, dst = rng.integers(0, num_ends, size=num_new), rng.integers(0, num_ends, size=num_new)
    placed = place_messages(ready, src, dst, num_ends, fixed_round, fixed_src, fixed_dst, capacity)
    want = _placed_one_at_a_time(ready, src, dst, capacity, fixed_round, fixed_src, fixed_dst)
    assert np.array_equal(placed, want)


@given(st.integers(1, 4), st.integers(0, 30), st.integers(0, 10_000))
def test_live_tokens_equal_a_brute_force_count(num_ranks, num_buffers, seed):
    rng = np.random.default_rng(seed)
    rank = rng.integers(0, num_ranks, size=num_buffers)
    first = rng.integers(0, 6, size=num_buffers)
    last = first + rng.integers(0, 4, size=num_buffers)
    tokens = rng.integers(1, 100, size=num_buffers)
    live = live_tokens(rank, first, last, tokens, num_ranks, 10)
    for r in range(num_ranks):
        for s in range(10):
            assert live[r, s] == tokens[(rank == r) & (first <= s) & (s <= last)].sum()
    if num_buffers:
        assert np.array_equal(peak_live_tokens(rank, first, last, tokens, num_ranks), live.max(axis=1))


@given(st.lists(st.integers(1, 9000), min_size=1, max_size=16), st.integers(2, 8), st.sampled_from([1, 2, 4]),
       st.sampled_from(["causal", "full"]))
def test_both_passes_are_congestion_free_exchanges_with_pushes_after_their_tiles(lengths, gpus, degree, mask):
    plan = compile_valid(lengths, gpus, block_size=512, coalesce=degree, mask=mask)
    schedule, transfers = plan.ir.schedule, plan.ir.transfers
    for program in (schedule.forward, schedule.backward):
        rounds = np.concatenate((program.edge_round, program.push_round))
        src = np.concatenate((transfers.edge_src, transfers.edge_dst[program.push_edge]))
        dst = np.concatenate((transfers.edge_dst, transfers.edge_src[program.push_edge]))
        profile = plan.ir.tiles.profile
        assert congestion_free(rounds, src, dst, profile.gpus_per_node, plan.ir.rounds.nvlink_lanes)
        assert program.num_rounds >= exchange_degree(transfers, program, plan.ir.rounds.nvlink_lanes)
        for edge in (schedule.tile_kv_edge, schedule.tile_q_edge):
            reads = edge >= 0
            assert (program.tile_stage[reads] > program.edge_stage[edge[reads]]).all()
            pushed_at = np.full(transfers.num_edges, np.iinfo(np.int64).max)
            pushed_at[program.push_edge] = program.push_stage
            assert (pushed_at[edge[reads]] > program.tile_stage[reads]).all()
    assert plan.header.max_buffer_tokens == max_buffer_tokens(schedule)


def test_levelling_stays_within_the_buffer_budget_that_the_earliest_placement_meets(small_plan):
    rounds = small_plan.ir.rounds
    transfers = rounds.transfers
    tile_rank = transfers.assignment.tile_rank

    def forward_peak(schedule):  # levelling and its budget are the forward pass's
        return int(peak_live_tokens(*pass_buffers(schedule.forward, transfers, tile_rank, schedule.tile_kv_edge,
                                                  schedule.tile_q_edge), transfers.assignment.num_ranks).max())

    earliest = coalesce(rounds, 2, buffer_budget=0)  # a zero budget forbids every delay that holds a buffer
    budget = forward_peak(earliest)
    levelled = coalesce(rounds, 2, buffer_budget=budget)
    assert forward_peak(levelled) <= budget
    assert (levelled.forward.tile_stage != earliest.forward.tile_stage).any()
    assert forward_peak(coalesce(rounds, 2, buffer_budget=10**9)) > budget  # the budget is what binds
    # The levelled forward pass moves some tiles later, and holds no buffer past the budget doing it.
    assert (levelled.forward.tile_stage >= earliest.forward.tile_stage).all()


def test_round_order_is_a_permutation_that_pairs_complementary_rounds():
    from fcp_compiler.algorithms.round_order import order_rounds

    # Rounds 0 and 1 load rank 0, rounds 2 and 3 rank 1. In their own order, stages of two rounds cost 2 + 2;
    # pairing a rank-0 round with a rank-1 round costs 1 + 1.
    work = np.array([[1.0, 0.0], [1.0, 0.0], [0.0, 1.0], [0.0, 1.0]])
    position = order_rounds(work, 2)
    assert sorted(position.tolist()) == [0, 1, 2, 3]
    stage = position // 2
    loads = np.zeros((2, 2))
    np.add.at(loads, stage, work)
    assert loads.max(axis=1).sum() == 2.0


@given(st.integers(1, 12), st.integers(1, 4), st.integers(1, 4), st.integers(0, 10_000))
def test_round_order_fills_every_stage_but_the_last(num_rounds, num_ranks, per_stage, seed):
    from fcp_compiler.algorithms.round_order import order_rounds

    work = np.random.default_rng(seed).random((num_rounds, num_ranks))
    position = order_rounds(work, per_stage)
    assert np.array_equal(np.sort(position), np.arange(num_rounds))


def _greedy_stages(round_work, rounds_per_stage, round_class, class_lanes):
    """order_rounds' stage choice written plainly: per round, the stage with room for its class whose busiest rank
    grows least, then ends lowest, then the earliest (a lexsort over the stages each time)."""
    num_rounds, num_ranks = round_work.shape
    # A stage holds c x lanes rounds of a class; the stages a class needs beyond its own last are full but the last.
    per_stage = [rounds_per_stage * lanes for lanes in class_lanes]
    count = [int((round_class == cls).sum()) for cls in (0, 1)]
    num_stages = max(-(-count[cls] // per_stage[cls]) for cls in (0, 1))
    room = np.array([[per_stage[cls]] * (num_stages - 1) + [count[cls] - (num_stages - 1) * per_stage[cls]
                                                             if count[cls] > (num_stages - 1) * per_stage[cls]
                                                             else per_stage[cls]] for cls in (0, 1)])
    load = np.zeros((num_stages, num_ranks))
    stage_of = np.empty(num_rounds, dtype=np.int64)
    for rnd in np.lexsort((np.arange(num_rounds), -round_work.max(axis=1))):
        new_max = (load + round_work[rnd]).max(axis=1)
        growth = new_max - load.max(axis=1)
        growth[room[round_class[rnd]] <= 0] = np.inf
        stage_of[rnd] = stage = np.lexsort((np.arange(num_stages), new_max, growth))[0]
        load[stage] += round_work[rnd]
        room[round_class[rnd], stage] -= 1
    return stage_of


@given(st.integers(1, 30), st.integers(1, 4), st.integers(1, 4), st.integers(0, 10_000))
def test_round_order_chooses_the_stages_of_the_plain_greedy(num_rounds, num_ranks, per_stage, seed):
    from fcp_compiler.algorithms.round_order import order_rounds

    rng = np.random.default_rng(seed)
    work = rng.integers(0, 3, size=(num_rounds, num_ranks)).astype(float)  # many ties, where the rules matter
    round_class = rng.integers(0, 2, size=num_rounds)
    position = order_rounds(work, per_stage, round_class, (2, 1))
    assert np.array_equal(position // per_stage, _greedy_stages(work, per_stage, round_class, (2, 1)))


@given(st.integers(1, 4), st.integers(0, 300), st.integers(1, 3), st.integers(0, 10_000))
def test_pipeline_order_is_the_lexsort_by_rank_stage_arrival_and_index(num_ranks, num_tiles, per_stage, seed):
    from fcp_compiler.core.passes.coalesce import _pipeline_order

    rng = np.random.default_rng(seed)
    rank = rng.integers(0, num_ranks, size=num_tiles)
    arrival = rng.integers(-1, 12, size=num_tiles)  # -1: local data
    earliest = np.where(arrival >= 0, arrival // per_stage + 1, 0)
    # Levelling delays a few tiles past their earliest stage, never earlier.
    stage = earliest + np.where(rng.random(num_tiles) < 0.2, rng.integers(1, 4, size=num_tiles), 0)
    want = np.lexsort((np.arange(num_tiles), arrival, stage, rank))
    assert np.array_equal(_pipeline_order(rank, stage, arrival, stage != earliest), want)


def test_smaller_backward_stages_keep_the_forward_and_are_the_default_at_twice_the_forward(small_plan):
    from fcp_compiler.core.passes.coalesce import pass_peaks, with_backward_rounds

    schedule = coalesce(small_plan.ir.rounds, 4)
    same = with_backward_rounds(schedule, 8)  # twice the forward's: what coalesce itself builds
    for name in ("edge_round", "tile_stage", "push_edge", "push_round"):
        assert np.array_equal(getattr(same.backward, name), getattr(schedule.backward, name)), name
    smaller = with_backward_rounds(schedule, 2)
    assert smaller.forward is schedule.forward and smaller.backward.coalesce == 2
    assert pass_peaks(smaller)[0] == pass_peaks(schedule)[0]
    assert pass_peaks(smaller)[1] <= pass_peaks(schedule)[1]
    # Pulls keep their rounds; every gradient still leaves after the tiles that made it.
    assert np.array_equal(smaller.backward.edge_round, schedule.backward.edge_round)
    tile_edge = schedule.tile_kv_edge
    reads = tile_edge >= 0
    push_stage = np.full(small_plan.ir.transfers.num_edges, -1)
    push_stage[smaller.backward.push_edge] = smaller.backward.push_round // 2
    assert (push_stage[tile_edge[reads]] > smaller.backward.tile_stage[reads]).all()


def test_smaller_backward_stages_keep_every_later_forward_stage_later():
    """A pull re-sent inside a node (or relayed) lands in a later forward stage than its entry; with backward stages
    of r rounds (pull in round 2 x its forward round) it must land in a later backward stage too, which holds for
    every pair of rounds exactly when r divides 2c. smaller_backward_rounds picks the largest such even r <= c."""
    from fcp_compiler.core.passes.coalesce import smaller_backward_rounds

    def keeps_order(c, r):
        return all(2 * a // r < 2 * b // r for a in range(4 * c) for b in range(a + 1, 4 * c) if a // c < b // c)

    assert smaller_backward_rounds(1) is None
    for c in range(2, 40):
        r = smaller_backward_rounds(c)
        assert r % 2 == 0 and 2 <= r <= c and keeps_order(c, r)
        assert not any(keeps_order(c, bigger) for bigger in range(r + 2, c + 1, 2))
    assert not keeps_order(11, 10) and not keeps_order(9, 8)  # what rounding c down to even gave

"""The coalesce pass and its plain-array helpers: every round of a pass is a matching over pulls and pushes,
pushes leave after their tiles, and levelling never lifts live buffers over the budget."""

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from conftest import compile_own, compile_valid, congestion_free
from fcp_compiler.algorithms.exchange import link_capacity, link_ends, place_messages
from fcp_compiler.algorithms.liveness import live_tokens, peak_live_tokens
from fcp_compiler.core.passes.coalesce import coalesce, max_buffer_tokens, pass_buffers
from fcp_compiler.core.stats import exchange_degree
from fcp_compiler.format.plan_format import TransferKind


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
    """place_messages finds free rounds with a bit mask of full rounds an end and counts an end of several slots
    takes a round: the rounds must be the plain greedy's, with several slots an end, fixed messages beyond an end's
    slots, and messages that wait many rounds."""
    rng = np.random.default_rng(seed)
    capacity = rng.integers(1, most_slots + 1, size=num_ends)
    fixed_round = rng.integers(0, 12, size=num_fixed)
    fixed_src, fixed_dst = rng.integers(0, num_ends, size=num_fixed), rng.integers(0, num_ends, size=num_fixed)
    ready = rng.integers(0, 6, size=num_new)
    src, dst = rng.integers(0, num_ends, size=num_new), rng.integers(0, num_ends, size=num_new)
    placed = place_messages(ready, src, dst, num_ends, fixed_round, fixed_src, fixed_dst, capacity)
    want = _placed_one_at_a_time(ready, src, dst, capacity, fixed_round, fixed_src, fixed_dst)
    assert np.array_equal(placed, want)


@given(st.integers(1, 5), st.integers(0, 80), st.integers(0, 200), st.integers(1, 3), st.integers(0, 10_000))
def test_messages_between_link_ends_take_the_plain_greedys_rounds(num_ranks, num_fixed, num_new, lanes, seed):
    """Where every message joins two ends of one link class (NIC ends one slot, NVLink ends `lanes`), the messages
    between one-slot ends are placed apart from the others: the rounds must still be the plain greedy's."""
    rng = np.random.default_rng(seed)
    capacity = link_capacity(num_ranks, lanes)

    def messages(count):
        src, dst, link = (rng.integers(0, num_ranks, size=count), rng.integers(0, num_ranks, size=count),
                          rng.integers(0, 2, size=count))
        return link_ends(src, dst, link)

    fixed_src, fixed_dst = messages(num_fixed)
    fixed_round = rng.integers(0, 12, size=num_fixed)
    src, dst = messages(num_new)
    ready = rng.integers(0, 6, size=num_new)
    placed = place_messages(ready, src, dst, 2 * num_ranks, fixed_round, fixed_src, fixed_dst, capacity)
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
    from fcp_compiler.algorithms.leveling import pipeline_order as _pipeline_order

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
    from fcp_compiler.core.passes.coalesce import deeper_backward_rounds

    for c in range(2, 40):  # the memory budget's deeper steps: every even count below the halved that keeps it
        r = smaller_backward_rounds(c)
        assert deeper_backward_rounds(c, r) == [rounds for rounds in range(r - 2, 1, -2) if keeps_order(c, rounds)]


@given(st.integers(1, 24), st.integers(1, 4), st.integers(1, 3), st.integers(0, 10_000))
def test_rounds_first_fills_the_first_stage_with_them_and_moves_nothing_else_but_the_rounds_they_displace(
        num_rounds, per_stage, nvlink_lanes, seed):
    from fcp_compiler.algorithms.round_order import order_rounds, rounds_first

    rng = np.random.default_rng(seed)
    round_class = rng.integers(0, 2, size=num_rounds)
    lanes = (nvlink_lanes, 1)
    position = order_rounds(rng.random((num_rounds, 3)), per_stage, round_class, lanes)
    first = np.flatnonzero(rng.random(num_rounds) < 0.4)
    moved = rounds_first(position, round_class, first, per_stage, lanes)
    is_first = np.isin(np.arange(num_rounds), first)
    for cls in (0, 1):
        mine = round_class == cls
        # Still an order: no position holds more rounds of a class than its lanes.
        assert np.bincount(moved[mine], minlength=1).max(initial=0) <= lanes[cls]
        # The first stage holds as many of `first` as it can: all of them, or nothing else.
        in_stage = moved[mine] < per_stage
        assert (in_stage & is_first[mine]).sum() == min(is_first[mine].sum(), per_stage * lanes[cls])
        # A round of `first` leaves only for the first stage; any other leaves it only for a position a round of
        # `first` left.
        changed = mine & (moved != position)
        assert (moved[changed & is_first] < per_stage).all()
        displaced = changed & ~is_first
        assert (position[displaced] < per_stage).all()
        assert set(moved[displaced].tolist()) <= set(position[changed & is_first].tolist())


def _earliest_rounds_case():
    """A 16-rank batch whose helper ranks (tiles run away from their query block's owner) get their Q pulls late in
    the plain round order, and the pulls that order schedules: (options, assignment, rounds)."""
    from fcp_compiler.core import pipeline, schedule_search
    from fcp_compiler.core.floor import Placement
    from fcp_compiler.core.options import CompileOptions
    from fcp_compiler.core.pass_timer import PassTimer
    from fcp_compiler.core.passes.assign import default_token_cap
    from fcp_compiler.core.placement import place

    # (Helpers take at most assign.HELPED_TOKENS of other owners' blocks: of seeds 0-39 of this shape only 30 gives a
    # helper so many Q pulls that they go first.)
    rng = np.random.default_rng(30)
    lengths = [int(x) for x in rng.integers(200, 3000, size=40)] + [int(rng.integers(16 * 2048, 16 * 6000))]
    options = CompileOptions.of(16, model="llama3-70b", block_size=1024, node_fan_out=False)
    batch = pipeline._to_batch(lengths, None)
    timer = PassTimer()
    assignment = place(timer, batch, options, default_token_cap(batch.total_tokens, 16, 1024), Placement.LAYER)
    return options, assignment, schedule_search.make_rounds(timer, schedule_search.route(timer, assignment, options),
                                                            options, False)


def test_q_pulls_go_first_where_that_levels_the_stages_and_the_plan_stays_valid():
    """A helper's tiles need its Q pull and a K,V pull; the plain order let the Q land after most K,V, so its tiles
    bunched into one stage. coalesce moves the rounds carrying Q pulls into the first stage when that lowers the sum
    over stages of the busiest rank's work (each tile after its data) by Q_PULLS_FIRST_GAIN, and not otherwise."""
    from fcp_compiler.core.passes.coalesce import (Q_PULLS_FIRST_GAIN, TransferKind, _earliest_levels,
                                                   coalesce_forward)

    options, assignment, rounds = _earliest_rounds_case()
    is_q = rounds.transfers.edge_kind == TransferKind.Q
    assert is_q.any() and (assignment.tile_rank != assignment.block_rank[assignment.tiles.tile_q_block]).any()
    moved, plain = (coalesce_forward(rounds, 16, q_first=switch) for switch in (True, False))
    assert moved.q_pulls_first and not plain.q_pulls_first
    assert (moved.forward.edge_round[is_q] < 16).all() and not (plain.forward.edge_round[is_q] < 16).all()
    levels = [_earliest_levels(part.forward.edge_round, 16, part.tile_kv_edge, part.tile_q_edge, assignment)
              for part in (moved, plain)]
    assert levels[0] < (1 - Q_PULLS_FIRST_GAIN) * levels[1]
    # Any order of the matchings is one: the whole plan still validates, with its Q pulls in the first stage.
    lengths = assignment.tiles.sharding.batch.lengths.tolist()
    plan = compile_valid(lengths, 16, model="llama3-70b", block_size=1024, node_fan_out=False, floor=False)
    assert (plan.ir.schedule.forward.edge_round[plan.ir.transfers.edge_kind == TransferKind.Q] < 16).all()


@pytest.mark.parametrize("budget", [40_000, 60_000, 65_536, 80_000])
def test_fit_memory_keeps_the_first_order_to_fit_a_step_at_a_time_the_q_pulls_first_on_a_tie(budget):
    """Where moving the Q pulls first leaves a plan over the budget, the plain order is refitted beside it, step by
    step; the first schedule to fit is kept (the Q pulls first on the same step), else the completed one with the
    least memory."""
    from fcp_compiler.core import schedule_search
    from fcp_compiler.core.pass_timer import PassTimer
    from fcp_compiler.core.passes.coalesce import pass_peaks

    options, _, rounds = _earliest_rounds_case()
    timer = PassTimer()
    kept = schedule_search.fit_memory(timer, rounds, options, budget)
    fitted, peak = kept.schedule, kept.peak_tokens
    first = schedule_search.schedule_at(timer, rounds, options, budget, q_first=True)
    chains = [list(schedule_search.refits(timer, rounds, options, budget, first))]
    if first.q_pulls_first and first.peak_tokens > budget:
        chains.append(list(schedule_search.refits(timer, rounds, options, budget,
                                                  schedule_search.schedule_at(timer, rounds, options, budget, False))))
    steps = [chain[step] for step in range(max(map(len, chains))) for chain in chains if step < len(chain)]
    fitting = [step for step in steps if step.schedule is not None and step.peak_tokens <= budget]
    expected = fitting[0] if fitting else min(steps, key=lambda step: (step.schedule is None, step.peak_tokens))
    assert peak == expected.peak_tokens and (fitted is None) == (expected.schedule is None)
    # coalesce's own schedule, Q pulls first
    assert kept.plain == (expected.schedule is not None and expected is steps[0])
    if fitted is not None:
        assert peak == max(pass_peaks(fitted))
        assert np.array_equal(fitted.forward.edge_round, expected.schedule.forward.edge_round)
        assert np.array_equal(fitted.backward.tile_stage, expected.schedule.backward.tile_stage)


@pytest.mark.parametrize("seed", range(3))
def test_backward_tiles_out_of_the_last_stage_go_back_to_their_earliest_and_the_passes_stay_exchanges(seed):
    """remote_tiles_out_of_last_stage moves exactly the backward's pulled-K,V tiles (queries local) that levelling
    put into the last stage, each to its earliest stage; nothing else moves, and the backward stays a congestion-free
    exchange whose pushes leave after the tiles that make them."""
    from fcp_compiler.core.passes.coalesce import remote_tiles_out_of_last_stage

    rng = np.random.default_rng(seed)
    lengths = [int(x) for x in rng.integers(300, 6000, size=12)]
    plan = compile_valid(lengths, 8, block_size=256, coalesce=2, floor=False, gpus_per_node=4)
    schedule, transfers = plan.ir.schedule, plan.ir.transfers
    moved = remote_tiles_out_of_last_stage(schedule)
    before, after = schedule.backward.tile_stage, None if moved is None else moved.backward.tile_stage
    kv_edge, q_edge = schedule.tile_kv_edge, schedule.tile_q_edge
    arrival = np.maximum(np.where(kv_edge >= 0, schedule.forward.edge_round[kv_edge], -1),
                         np.where(q_edge >= 0, schedule.forward.edge_round[q_edge], -1))
    earliest = np.where(arrival >= 0, 2 * arrival // schedule.backward.coalesce + 1, 0)
    last = before.max()
    candidates = (kv_edge >= 0) & (q_edge < 0) & (before == last) & (earliest < last)
    assert (moved is None) == (not candidates.any())
    if moved is None:
        return
    assert np.array_equal(after, np.where(candidates, earliest, before))
    assert moved.forward is schedule.forward and np.array_equal(moved.backward.edge_round, schedule.backward.edge_round)
    program = moved.backward
    rounds = np.concatenate((program.edge_round, program.push_round))
    src = np.concatenate((transfers.edge_src, transfers.edge_dst[program.push_edge]))
    dst = np.concatenate((transfers.edge_dst, transfers.edge_src[program.push_edge]))
    assert congestion_free(rounds, src, dst, 4, plan.ir.rounds.nvlink_lanes)
    pushed_at = np.full(transfers.num_edges, np.iinfo(np.int64).max)
    pushed_at[program.push_edge] = program.push_stage
    for edge in (kv_edge, q_edge):
        reads = edge >= 0
        assert (program.tile_stage[reads] > program.edge_stage[edge[reads]]).all()
        assert (pushed_at[edge[reads]] > program.tile_stage[reads]).all()


def test_levelling_delays_tiles_run_for_another_rank_and_their_outputs_leave_after_them():
    """A helper's tiles for a heavy block become runnable together once its Q and K,V land; levelling may delay
    them like any other (pinned at their earliest stage, one helper's tiles made a stage several times as long).
    Delayed, each still runs after its data arrives, and its partial output is pushed back after its last tile."""
    plan = compile_own([3000, 120], 8, block_size=256, coalesce=1, mask="causal", zigzag="off", model="none",
                       layout="user")
    header, delayed = plan.header, 0
    assert plan.stats["num_offloaded_tiles"] > 0
    for rank in range(header.num_ranks):
        program = plan.rank(rank)
        arrays, held = program.arrays, set(program.blocks.tolist())
        arrival = {(kind, block): recv_round // header.coalesce + 1 for kind, block, recv_round in
                   zip(arrays["pull_recv_kind"].tolist(), arrays["pull_recv_block"].tolist(),
                       arrays["pull_recv_round"].tolist())}
        last_stage: dict[int, int] = {}
        for q_block, kv_block, stage in zip(arrays["tile_q_block"].tolist(), arrays["tile_kv_block"].tolist(),
                                            arrays["tile_stage"].tolist()):
            if q_block in held:
                continue
            earliest = max(arrival[(TransferKind.Q, q_block)],
                           0 if kv_block in held else arrival[(TransferKind.KV, kv_block)])
            assert stage >= earliest
            delayed += stage > earliest
            last_stage[q_block] = max(last_stage.get(q_block, 0), stage)
        pushes = dict(zip(arrays["pull_recv_block"][arrays["fwd_push_send_pull"]].tolist(),
                          (arrays["fwd_push_send_round"] // header.coalesce).tolist()))
        for q_block, stage in last_stage.items():
            assert pushes[q_block] >= stage
    assert delayed > 0

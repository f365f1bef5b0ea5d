"""Arenas and range calls (fcp_compiler/algorithms/arena.py, fcp_compiler/format/arena.py): buffers live at once
never share rows, and on compiled plans every visible (query, key) token pair of every tile is computed exactly
once by the range calls, reading each pull where the arena placed it at that stage."""

from __future__ import annotations

import numpy as np
import pytest

from fcp_compiler.algorithms import arena
from fcp_compiler.algorithms.arena import max_live, place_buffers
from fcp_compiler.format.arena import rank_arenas, rank_range_calls, ranges_per_request
from fcp_compiler.format.call_plan import rank_calls, step_requests
from fcp_compiler.format.liveness import stacked_messages
from fcp_compiler.format.plan_format import PlanReader, TransferKind
from fcp_compiler.format.stacked import stack_programs
from plan_helpers import masked_plan, needed_pairs, store_tokens


def _check_placement(rows, first, last, offset, extent):
    """No two buffers live in a common stage overlap, and all lie inside the arena."""
    assert (offset >= 0).all() and (offset + rows <= extent).all()
    for i in range(rows.size):
        for j in range(i):
            if first[i] <= last[j] and first[j] <= last[i] and rows[i] and rows[j]:
                assert offset[i] + rows[i] <= offset[j] or offset[j] + rows[j] <= offset[i], (i, j)


@pytest.mark.parametrize("seed", range(30))
def test_buffers_live_together_never_overlap_and_the_arena_is_near_the_live_peak(seed):
    rng = np.random.default_rng(seed)
    count = int(rng.integers(1, 40))
    rows = rng.integers(1, 9, count) if seed % 3 else np.full(count, 4)
    first = rng.integers(0, 12, count)
    last = first + rng.integers(0, 5, count)
    placed = place_buffers(rows, first, last, rng.permutation(count))
    offset, extent = placed.offset, int(placed.arena_rows[0])
    _check_placement(rows, first, last, offset, extent)
    assert max_live(rows, first, last) <= extent <= rows.sum()
    if seed % 3 == 0:  # equal sizes: first fit in order of start needs exactly the live peak
        assert extent == max_live(rows, first, last)


def test_buffers_of_one_stage_sit_side_by_side_in_order_where_a_gap_holds_them():
    # Stage 0: two buffers, freed after it; stage 1: three buffers whose total fits the freed gap, in `order`.
    placed = place_buffers([3, 3, 2, 1, 2], [0, 0, 1, 1, 1], [0, 0, 1, 1, 1], [0, 1, 2, 0, 1])
    offset, extent = placed.offset, int(placed.arena_rows[0])
    assert extent == 6
    assert offset[3] == 0 and offset[4] == 1 and offset[2] == 3  # by order: 3, 4, 2, one run


def _first_fit_by_scan(rows, first, last, order):
    """The placement rule spelled out on an array of rows: per stage, release the buffers last live before it, then
    the stage's buffers (by order, then index) as one run at the lowest free offset that holds them all below the
    arena's end, else each at the lowest free offset holding it below the end, else at the start of the free tail."""
    rows, first, last = (np.asarray(a) for a in (rows, first, last))
    owner = np.full(int(rows.sum()) + 1, -1)
    offset, extent = np.zeros(rows.size, dtype=np.int64), 0

    def lowest(size, limit):
        for at in range(limit - size + 1):
            if (owner[at:at + size] == -1).all():
                return at
        return None

    by_start = sorted(range(rows.size), key=lambda b: (first[b], order[b], b))
    for stage in sorted(set(first.tolist())):
        owner[np.isin(owner, np.flatnonzero(last < stage))] = -1
        group = [b for b in by_start if first[b] == stage]
        start = lowest(int(rows[group].sum()), extent)
        for b in group:
            if start is not None:
                at, start = start, start + int(rows[b])
            else:
                at = lowest(int(rows[b]), extent)
                if at is None:
                    used = np.flatnonzero(owner[:extent] != -1)
                    at = int(used[-1]) + 1 if used.size else 0
                    extent = max(extent, at + int(rows[b]))
            owner[at:at + int(rows[b])] = b
            offset[b] = at
    return offset, extent


@pytest.mark.parametrize("seed", range(60))
def test_both_placements_are_the_rule_spelled_out(seed, monkeypatch):
    rng = np.random.default_rng(100 + seed)
    count = int(rng.integers(1, 30))
    unit = int(rng.choice([1, 3, 512]))
    rows = unit * rng.choice([1, 2, 2, 4, 5], count) * (rng.random(count) > 0.05)  # some empty buffers
    first = rng.integers(0, 8, count)
    last = first + rng.integers(0, 4, count)
    order = rng.permutation(count)
    placed = place_buffers(rows, first, last, order)
    offset, extent = placed.offset, int(placed.arena_rows[0])
    monkeypatch.setattr(arena, "MAX_MASK_UNITS", 0)  # every arena over the bitmask's units: the list of gaps
    by_gaps = place_buffers(rows, first, last, order)
    assert np.array_equal(offset, by_gaps.offset) and extent == by_gaps.arena_rows[0]
    expected, expected_extent = _first_fit_by_scan(rows // unit, first, last, order)
    if rows.any():  # (an empty buffer's offset is where the rule finds room for nothing)
        assert extent == expected_extent * unit
        assert np.array_equal(offset[rows > 0], expected[rows > 0] * unit)
    _check_placement(rows, first, last, offset, extent)


@pytest.mark.parametrize("seed", range(20))
def test_arenas_placed_at_once_are_each_arena_placed_alone(seed, monkeypatch):
    rng = np.random.default_rng(300 + seed)
    num_arenas = int(rng.integers(1, 7))
    count = int(rng.integers(0, 80))
    which = rng.integers(0, num_arenas, count)  # some arenas empty
    unit = rng.choice([1, 3, 64], num_arenas)[which]
    rows = unit * rng.choice([0, 1, 2, 5, 64], count)
    first = rng.integers(0, 6, count)
    last = first + rng.integers(0, 3, count)
    order = rng.integers(0, 4, count)
    monkeypatch.setattr(arena, "MAX_MASK_UNITS", int(rng.choice([0, 64, 4096])))  # some arenas by their gaps
    placed = arena.place_arenas(which, rows, first, last, order, num_arenas)
    for index in range(num_arenas):
        mine = np.flatnonzero(which == index)
        alone = place_buffers(rows[mine], first[mine], last[mine], order[mine])
        assert np.array_equal(placed.offset[mine], alone.offset)
        assert placed.arena_rows[index] == alone.arena_rows[0]
        _check_placement(rows[mine], first[mine], last[mine], alone.offset, int(alone.arena_rows[0]))


def _arena_tokens(program, arenas, messages, stores, pass_name, stage):
    """What each arena row holds at `stage`: the tokens of the pulls live then (a row two live pulls claim fails)."""
    a = program.arrays
    held = {}
    for kind, size in ((TransferKind.Q, arenas[pass_name].q_rows), (TransferKind.KV, arenas[pass_name].kv_rows)):
        tokens = np.full(size, -1, dtype=np.int64)
        for row in np.flatnonzero(a["pull_recv_kind"] == kind).tolist():
            if messages[pass_name].pull_recv_stage[row] <= stage <= messages[pass_name].pull_recv_last[row]:
                at = arenas[pass_name].pull_offset[row]
                assert (tokens[at:at + stores[row].size] == -1).all(), "two live pulls share arena rows"
                tokens[at:at + stores[row].size] = stores[row]
        held[kind] = tokens
    return held


def _range_pairs(calls, index, local, held, total):
    """Every (query token, key token) pair the request's range calls compute, as codes."""
    computed = [np.zeros(0, dtype=np.int64)]
    for call in np.flatnonzero(calls.call_request == index).tolist():
        q_tokens = held[TransferKind.Q] if calls.call_q_arena[call] else local
        k_tokens = held[TransferKind.KV] if calls.call_kv_arena[call] else local
        for r in range(calls.call_range_ptr[call], calls.call_range_ptr[call + 1]):
            q = q_tokens[calls.q_start[r]:calls.q_end[r]]
            k = k_tokens[calls.k_start[r]:calls.k_end[r]]
            assert (q >= 0).all() and (k >= 0).all(), "a range reads arena rows no live pull holds"
            shift = np.arange(k.size)[None, :] - np.arange(q.size)[:, None] - (k.size - q.size)
            visible = np.ones(shift.shape, bool)
            if calls.right[r] >= 0:
                visible &= shift <= calls.right[r]
            if calls.left[r] >= 0:
                visible &= shift >= -calls.left[r]
            qq, kk = np.nonzero(visible)
            computed.append(q[qq] * total + k[kk])
    return np.sort(np.concatenate(computed))


@pytest.mark.parametrize("mask,layout", [("causal", "plan"), ("causal", "user"), ("full", "plan"),
                                         ("window", "plan"), ("mixed", "user")])
def test_range_calls_compute_every_visible_token_pair_exactly_once_from_the_arenas(mask, layout):
    reader = PlanReader(masked_plan(mask, layout).to_bytes())
    merged = pieces = 0
    for rank in range(reader.header.num_ranks):
        program = reader.rank(rank)
        requests = step_requests(program)
        arenas = rank_arenas(program)
        calls = rank_range_calls(program, requests, arenas)
        stacked = stack_programs([program])
        messages = {name: stacked_messages(stacked, name) for name in ("fwd", "bwd")}
        stores = store_tokens(program)
        total = int(program.tables.seq_lengths.sum())
        for index, request in enumerate(requests):
            held = _arena_tokens(program, arenas, messages, stores, request.pass_name, request.stage)
            computed = _range_pairs(calls, index, stores[-1], held, total)
            assert not (computed[1:] == computed[:-1]).any(), (rank, request, "a pair computed twice")
            assert np.array_equal(computed, np.sort(needed_pairs(program, request.tiles))), (rank, request)
            assert (np.bincount(calls.call_request, minlength=len(requests)) <= 4).all()  # per (query, key) tensor
        merged += calls.q_start.size
        packed = rank_calls(program, requests)
        pieces += packed.key_rows.size
        # The memory account's count of them, without making them.
        backward = np.asarray([request.pass_name == "bwd" for request in requests])
        np.testing.assert_array_equal(ranges_per_request(packed, backward, arenas, len(requests)),
                                      np.bincount(calls.call_request, weights=np.diff(calls.call_range_ptr),
                                                  minlength=len(requests)))
    # Key pieces that are consecutive arena or local rows became one range.
    assert 0 < merged < pieces

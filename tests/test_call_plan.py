"""The call plan (fcp_compiler/algorithms/call_plan.py, fcp_compiler/format/call_plan.py): grouping against a plain
reference on random pairs, and on compiled plans every visible (query, key) token pair of every tile computed
exactly once, under the mask flash-attn applies to each entry."""

from __future__ import annotations

import numpy as np
import pytest

from conftest import compile_valid
from fcp_compiler.algorithms.call_plan import GAP_LIMIT, LOCAL, plan_calls
from fcp_compiler.algorithms.kernel_entries import CAUSAL, UNMASKED, WINDOW_DIAGONAL, classify_pairs
from fcp_compiler.format.call_plan import Request, rank_calls, step_requests
from fcp_compiler.format.inputs import BatchSpec
from fcp_compiler.errors import PlanFormatError
from fcp_compiler.format.plan_format import PlanReader
from plan_helpers import masked_plan, needed_pairs, store_tokens


def _reference(pairs, local_len):
    """The rule, written plainly: pairs are dicts in tile order; returns calls as
    (request, causal, (left, right), [(q source, q row, q rows, [(k source, k row, k rows)])])."""
    prefix = np.concatenate(([0], np.cumsum(local_len))).tolist()
    calls = []
    for request in sorted({p["request"] for p in pairs}):
        entries: dict = {}
        for p in pairs:
            w = p["window"]
            if p["request"] != request or (w and (p["k_start"] >= p["q_end"] or p["q_start"] - p["k_end"] + 1 >= w)):
                continue
            entries.setdefault((p["q_source"], p["q_seg"]), []).append(p)
        groups: dict = {}
        for query_pairs in entries.values():
            packed, diagonal = [], False
            for p in query_pairs:
                kind, left, rows, first = (int(x[0]) for x in classify_pairs(
                    [p["q_start"]], [p["q_end"]], [p["k_start"]], [p["k_end"]], [p["window"]]))
                key = (p["k_source"], p["k_row"] + first, p["k_end"] - p["k_start"] - first)
                if kind in (UNMASKED, CAUSAL):
                    packed.append((kind == CAUSAL, p["k_start"], key))
                    diagonal |= kind == CAUSAL
                    continue
                mask = (True, (left, 0)) if kind == WINDOW_DIAGONAL else (False, (left, -1))
                groups.setdefault(mask, []).append(((p["q_source"], p["q_seg"], p["q_row"], rows), [key]))
            if packed:
                p = query_pairs[0]
                query = (p["q_source"], p["q_seg"], p["q_row"], p["q_end"] - p["q_start"])
                groups.setdefault((diagonal, (-1, -1)), []).append((query, [k for *_, k in sorted(packed)]))
        for (causal, window), group in sorted(groups.items(), key=lambda item: (not item[0][0], item[0][1])):
            split: list[list] = []
            for entry in group:
                slot = next((c for c in split if all(e[0][:2] != entry[0][:2] for e in c)), None)
                if slot is None:
                    split.append(slot := [])
                slot.append(entry)
            for entries_of_call in split:
                calls.append((request, int(causal), window, _gaps(entries_of_call, local_len, prefix)))
    return calls


def _gaps(entries, local_len, prefix):
    whole = [q for q, _ in entries if q[0] == LOCAL and q[3] == local_len[prefix.index(q[2])]] \
        if all(q[0] == LOCAL and q[2] in prefix[:-1] for q, _ in entries) else []
    out = [((q[0], q[2], q[3]), keys) for q, keys in entries]
    if len(whole) != len(entries):
        return out
    positions = {prefix.index(q[2]): keys for q, keys in entries}
    low, high = min(positions), max(positions)
    if prefix[high + 1] - prefix[low] > (1 + GAP_LIMIT) * sum(q[3] for q, _ in entries):
        return out
    return [((LOCAL, prefix[p], local_len[p]), positions.get(p, [])) for p in range(low, high + 1)]


def _ours(arrays):
    calls = []
    for c in range(arrays.num_calls):
        entries = []
        for e in range(arrays.call_entry_ptr[c], arrays.call_entry_ptr[c + 1]):
            keys = [(int(arrays.key_source[k]), int(arrays.key_row[k]), int(arrays.key_rows[k]))
                    for k in range(arrays.entry_key_ptr[e], arrays.entry_key_ptr[e + 1])]
            entries.append(((int(arrays.entry_q_source[e]), int(arrays.entry_q_row[e]), int(arrays.entry_q_rows[e])),
                            keys))
        calls.append((int(arrays.call_request[c]), int(arrays.call_causal[c]),
                      (int(arrays.call_left[c]), int(arrays.call_right[c])), entries))
    return calls


def _random_pairs(rng):
    """Segments of a few sequences cut at random, spread over the local layout and two pulls; every (query, key)
    segment pair of one sequence in a random order of requests."""
    num_seqs = int(rng.integers(1, 4))
    segs = []  # (seq, start, end)
    for seq in range(num_seqs):
        cuts = np.unique(np.concatenate(([0, int(rng.integers(2, 200))], rng.integers(1, 200, 3))))
        segs += [(seq, int(a), int(b)) for a, b in zip(cuts[:-1], cuts[1:]) if b > a]
    windows = [int(rng.choice([0, 10 ** 6, int(rng.integers(1, 80))])) for _ in range(num_seqs)]
    source = rng.integers(-1, 2, len(segs))
    local = [i for i in range(len(segs)) if source[i] == LOCAL]
    rng.shuffle(local)
    local_len = [segs[i][2] - segs[i][1] for i in local]
    row = {}
    for position, i in enumerate(local):
        row[i] = sum(local_len[:position])
    for s in (0, 1):
        offset = 0
        for i in np.flatnonzero(source == s).tolist():
            row[i] = offset
            offset += segs[i][2] - segs[i][1]
    pairs = []
    for qi in range(len(segs)):
        for ki in range(len(segs)):
            if segs[qi][0] != segs[ki][0] or (windows[segs[qi][0]] and segs[ki][1] > segs[qi][1]):
                continue
            pairs.append(dict(request=int(rng.integers(0, 3)), q_source=int(source[qi]), q_seg=qi, q_row=row[qi],
                              q_start=segs[qi][1], q_end=segs[qi][2], k_source=int(source[ki]), k_seg=ki,
                              k_row=row[ki], k_start=segs[ki][1], k_end=segs[ki][2],
                              window=windows[segs[qi][0]]))
    order = rng.permutation(len(pairs))
    return [pairs[i] for i in order], local_len


@pytest.mark.parametrize("seed", range(60))
def test_calls_match_the_plain_rule_on_random_pairs(seed):
    pairs, local_len = _random_pairs(np.random.default_rng(seed))
    columns = {name: [p[name] for p in pairs] for name in ("request", "q_source", "q_seg", "q_row", "q_start",
                                                           "q_end", "k_source", "k_seg", "k_row", "k_start",
                                                           "k_end", "window")}
    arrays = plan_calls(**columns, local_seg_len=local_len)
    assert _ours(arrays) == _reference(pairs, local_len)


def test_no_pairs_make_no_calls():
    empty = np.zeros(0, dtype=np.int64)
    arrays = plan_calls(*([empty] * 12), local_seg_len=empty)
    assert arrays.num_calls == 0 and arrays.call_entry_ptr.tolist() == [0] and arrays.entry_key_ptr.tolist() == [0]


def _computed(arrays, stores, call_ids, total):
    """Every (query token, key token) pair the calls compute under flash-attn's bottom-right mask, as codes; and
    whether a query row appears at most once per call."""
    computed, once = [np.zeros(0, dtype=np.int64)], True
    for c in call_ids:
        left, right = int(arrays.call_left[c]), 0 if arrays.call_causal[c] else int(arrays.call_right[c])
        seen = []
        for e in range(arrays.call_entry_ptr[c], arrays.call_entry_ptr[c + 1]):
            q_rows = stores[int(arrays.entry_q_source[e])][arrays.entry_q_row[e]:
                                                            arrays.entry_q_row[e] + arrays.entry_q_rows[e]]
            seen.append(q_rows)
            keys = [stores[int(arrays.key_source[k])][arrays.key_row[k]:arrays.key_row[k] + arrays.key_rows[k]]
                    for k in range(arrays.entry_key_ptr[e], arrays.entry_key_ptr[e + 1])]
            if not keys:
                continue
            k_rows = np.concatenate(keys)
            shift = np.arange(k_rows.size)[None, :] - np.arange(q_rows.size)[:, None] - (k_rows.size - q_rows.size)
            visible = np.ones(shift.shape, bool)
            if right >= 0:
                visible &= shift <= right
            if left >= 0:
                visible &= shift >= -left
            qq, kk = np.nonzero(visible)
            computed.append(q_rows[qq] * total + k_rows[kk])
        rows = np.concatenate(seen) if seen else np.zeros(0)
        once &= np.unique(rows).size == rows.size
    return np.concatenate(computed), once


@pytest.mark.parametrize("mask,layout", [("causal", "plan"), ("causal", "user"), ("full", "plan"),
                                         ("window", "plan"), ("mixed", "user"), ("offloaded", "plan"),
                                         ("small calls", "plan"), ("small calls", "user")])
def test_every_visible_token_pair_of_every_tile_is_computed_exactly_once(mask, layout, monkeypatch):
    if mask == "small calls":  # large packed calls cut into several (call_plan.split_calls), every mask
        import fcp_compiler.algorithms.call_plan as call_plan

        monkeypatch.setattr(call_plan, "MAX_CALL_QUERY_ROWS", 150)
        monkeypatch.setattr(call_plan, "MAX_CALL_KEY_ROWS", 300)
        mask = "mixed"
    if mask == "offloaded":  # ranks that hold no block and compute others' tiles
        plan = compile_valid([1024, 100, 60], 8, block_size=256, coalesce=2, mask="full", floor=False)
        assert any(PlanReader(plan.to_bytes()).rank(rank).arrays["blocks"].size == 0 for rank in range(8))
    else:
        plan = masked_plan(mask, layout)
    reader = PlanReader(plan.to_bytes())
    for rank in range(reader.header.num_ranks):
        program = reader.rank(rank)
        requests = step_requests(program)
        arrays = rank_calls(program, requests)
        stores = store_tokens(program)
        total = int(program.tables.seq_lengths.sum())
        for index, request in enumerate(requests):
            computed, once = _computed(arrays, stores, np.flatnonzero(arrays.call_request == index), total)
            needed = np.sort(needed_pairs(program, request.tiles))
            assert once, (rank, request)
            computed.sort()
            assert not (computed[1:] == computed[:-1]).any(), (rank, request, "a pair computed twice")
            assert np.array_equal(computed, needed), (rank, request)
        # Both passes compute every tile once.
        assert sorted(t for r in requests if r.pass_name == "fwd" for t in r.tiles) == \
            list(range(program.arrays["tile_stage"].size))


def test_a_tile_reading_a_block_the_rank_does_not_have_is_refused():
    plan = compile_valid([3000, 700, 1500], 4, block_size=256, coalesce=2)
    program = PlanReader(plan.to_bytes()).rank(0)
    a = dict(program.arrays)
    held = set(a["blocks"].tolist()) | set(a["pull_recv_block"].tolist())
    missing = next(b for b in range(program.header.num_blocks) if b not in held)
    a["tile_q_block"] = a["tile_q_block"].copy()
    a["tile_q_block"][0] = missing
    broken = type(program)(rank=program.rank, header=program.header, tables=program.tables, arrays=a)
    with pytest.raises(PlanFormatError, match="neither holds nor receives"):
        rank_calls(broken, [Request(pass_name="fwd", stage=0, tiles=(0,))])


def test_the_calls_of_all_ranks_at_once_are_each_ranks_own():
    from fcp_compiler.format.call_plan import ranks_calls

    plan = compile_valid([3000, 700, 90, 1500, 260, 1200], 4, block_size=256, coalesce=2, layout="user")
    reader = PlanReader(plan.to_bytes())
    programs = [reader.rank(rank) for rank in range(4)]
    requests = [step_requests(program) for program in programs]
    together = _ours(ranks_calls(programs, requests))
    alone, base = [], 0
    for program, rank_requests in zip(programs, requests):
        alone += [(request + base, *rest) for request, *rest in _ours(rank_calls(program, rank_requests))]
        base += len(rank_requests)
    assert together == alone and len({call[0] for call in alone}) > 4


def _plain_early_tiles(program):
    """Stage-0 tiles whose query and key blocks the rank holds with every token received from itself, written
    plainly (a token at a time)."""
    a, tables = program.arrays, program.tables
    own = set()
    for peer, offset, length in zip(a["reshuffle_recv_peer"], a["reshuffle_recv_offset"], a["reshuffle_recv_length"]):
        if peer == program.rank:
            own.update(range(int(offset), int(offset) + int(length)))
    seg_tokens = np.bincount(tables.seg_block, weights=tables.seg_end - tables.seg_start).astype(int)
    stays, row = set(), 0
    for block in a["blocks"].tolist():
        if all(token in own for token in range(row, row + seg_tokens[block])):
            stays.add(block)
        row += seg_tokens[block]
    return np.asarray([stage == 0 and q in stays and k in stays for stage, q, k in zip(
        a["tile_stage"].tolist(), a["tile_q_block"].tolist(), a["tile_kv_block"].tolist())], dtype=bool)


def _plain_step_requests(program, layout):
    """A step's requests written plainly: in the user layout the stage-0 tiles that run during the reshuffle first,
    then each forward stage's other tiles, then each backward stage's, each in tile row order."""
    a, header = program.arrays, program.header
    early = _plain_early_tiles(program) if layout == "user" else np.zeros(a["tile_stage"].size, dtype=bool)
    requests = [Request(pass_name="fwd", stage=-1, tiles=tuple(np.flatnonzero(early).tolist()))] if early.any() else []
    for stage in range(header.num_fwd_stages):
        rows = np.flatnonzero((a["tile_stage"] == stage) & ~early)
        requests.append(Request(pass_name="fwd", stage=stage, tiles=tuple(rows.tolist())))
    for stage in range(header.num_bwd_stages):
        rows = np.flatnonzero(a["tile_bwd_stage"] == stage)
        requests.append(Request(pass_name="bwd", stage=stage, tiles=tuple(rows.tolist())))
    return requests


@pytest.mark.parametrize("layout", ["plan", "user"])
def test_every_ranks_step_requests_at_once_are_each_ranks_own(layout):
    from fcp_compiler.format.call_plan import step_table
    from fcp_compiler.format.stacked import stack_programs

    plan = compile_valid([3000, 700, 90, 1500, 260, 1200, 64, 64, 900], 4, block_size=256, coalesce=2,
                         layout=layout)
    programs = PlanReader(plan.to_bytes()).ranks()
    table = step_table(stack_programs(programs))
    bounds = np.searchsorted(table.tile_request, np.arange(table.request_rank.size + 1))
    tile_base = np.cumsum([0] + [p.arrays["tile_stage"].size for p in programs])
    expected = []
    for rank, program in enumerate(programs):
        plain = _plain_step_requests(program, layout)
        assert step_requests(program) == plain
        expected += [(rank, r.pass_name, r.stage, r.tiles) for r in plain]
    ours = [(int(rank), "bwd" if backward else "fwd", int(stage),
             tuple((table.tile[low:high] - tile_base[rank]).tolist()))
            for rank, backward, stage, low, high in zip(table.request_rank, table.request_backward,
                                                        table.request_stage, bounds[:-1], bounds[1:])]
    assert ours == expected
    assert layout == "plan" or any(stage == -1 for _, _, stage, _ in expected)


def test_a_large_packed_call_is_cut_into_calls_of_consecutive_entries():
    from fcp_compiler.algorithms.call_plan import MAX_CALL_KEY_ROWS, MAX_CALL_QUERY_ROWS, call_parts, split_calls

    rng = np.random.default_rng(5)
    most = 0
    for _ in range(200):
        num_calls = int(rng.integers(1, 6))
        sizes = rng.integers(1, 12, num_calls)
        entry_call = np.repeat(np.arange(num_calls), sizes)
        real = rng.random(entry_call.size) < 0.8
        q_rows = rng.integers(1, 3000, entry_call.size)
        k_rows = np.where(real, rng.integers(1, 20000, entry_call.size), 0)
        splittable = rng.random(num_calls) < 0.7
        parts, new_call = split_calls(entry_call, real, q_rows, k_rows, splittable)
        assert (np.diff(new_call) >= 0).all() and new_call.size == entry_call.size
        base = np.cumsum(parts) - parts
        for call in range(num_calls):
            mine = entry_call == call
            n = int(real[mine].sum())
            wanted = max(-(-int(q_rows[mine & real].sum()) // MAX_CALL_QUERY_ROWS),
                         -(-int(k_rows[mine].sum()) // MAX_CALL_KEY_ROWS))
            expected = max(1, min(n, wanted)) if splittable[call] else 1
            assert parts[call] == expected
            most = max(most, int(parts[call]))
            assert max(1, min(n, wanted)) == call_parts(np.array([n]), np.array([q_rows[mine & real].sum()]),
                                                        np.array([k_rows[mine].sum()]))[0]
            # Every part of the call has an entry with keys, parts in entry order, each near an equal share.
            got = new_call[mine] - base[call]
            assert set(got[real[mine]].tolist()) == set(range(parts[call])) if n else parts[call] == 1
            assert (got >= 0).all() and (got < parts[call]).all()
    assert most > 2  # the cases do cut calls


@pytest.mark.parametrize("max_tiles", [1, 5, 40])
def test_calls_grouped_a_few_requests_at_a_time_are_the_whole_tables(max_tiles, monkeypatch):
    from fcp_compiler.format import call_plan
    from fcp_compiler.format.call_plan import calls_in_parts, stacked_calls, step_table
    from fcp_compiler.format.memory import stacked_peak_bytes
    from fcp_compiler.format.stacked import stack_programs

    spec = BatchSpec.model_validate({"masks": ["causal", "full", {"kind": "sliding_window", "window": 300}, "causal",
                                              "full", "causal"], "sequences": [3000, 700, 2900, 1500, 260, 64]})
    plan = compile_valid(spec, 4, block_size=256, coalesce=2, layout="user")
    stacked = stack_programs(PlanReader(plan.to_bytes()).ranks())
    table = step_table(stacked)
    whole = _ours(next(iter(calls_in_parts(stacked, table, max_tiles=10 ** 9)))[1])
    parts = list(calls_in_parts(stacked, table, max_tiles=max_tiles))
    assert len(parts) > 3 and len({rank for rank in table.request_rank}) == 4
    joined = []
    for first, calls in parts:
        joined += [(request + first, *rest) for request, *rest in _ours(calls)]
    assert joined == whole
    monkeypatch.setattr(call_plan, "PART_TILES", 10 ** 9)
    peaks = stacked_peak_bytes(stacked)
    monkeypatch.setattr(call_plan, "PART_TILES", max_tiles)
    assert _ours(stacked_calls(stacked, table)) == whole
    assert (stacked_peak_bytes(stacked) == peaks).all()

"""The varlen kernel calls that compute a set of tiles: segment pairs grouped into calls, on plain arrays.

This is the one place the calls are decided; the runtime executes them, and the validator, the simulator and the
memory account read them (:mod:`fcp_compiler.format.call_plan` feeds it a rank's plan).

The rule, per request (one stage's tiles of one pass on one rank): every query segment with visible keys is one
entry whose keys are all of its wholly visible key segments, packed. Under a causal mask a key segment of the same
sequence is either wholly before the query segment (all visible) or the query segment itself; the diagonal goes
last, so flash-attn's bottom-right-aligned causal mask is exactly right for the entry, and entries without a diagonal
run in a second, unmasked call (a full mask has only that one). Under a sliding window a key segment partly out of
reach, or a diagonal longer than the window, is an entry of its own with the window flash-attn applies
(:mod:`fcp_compiler.algorithms.kernel_entries`); entries with the same mask share a call, a query segment at most
once per call (its partial outputs merge one call at a time). A call whose queries are whole local segments also
lists, without keys, the local segments between them when they add at most GAP_LIMIT x its rows, so that its
queries are one run of the rank's rows, read and merged in place. In the requests asked (the backward's), a packed
call larger than MAX_CALL_QUERY_ROWS query rows or MAX_CALL_KEY_ROWS key rows is cut into calls of consecutive
entries (:func:`split_calls`), which bounds the memory one kernel call holds; the forward's calls hold less, and
cutting them would add merges.

Calls come out per request in the order (causal first, then by window, then by repetition); a call's entries in
the order their query segments first appear among the pairs (or in local row order where the gaps are filled);
an entry's keys earlier segments first, the diagonal last.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from fcp_compiler.algorithms.kernel_entries import CAUSAL, WINDOW_DIAGONAL, classify_pairs, sees_any
from fcp_compiler.algorithms.keys import (lexsort_ints, lookup, pack_columns, run_starts, search_sorted,
                                          sorted_unique, stable_argsort)
from fcp_compiler.algorithms.ranges import expand_ranges, group_sums, offsets_within

LOCAL = -1  # source of rows the rank holds in the plan layout; a source >= 0 is a received pull's store
# A call's queries are widened to one run of the rank's rows when the segments it skips add at most this many times
# its own rows: the rows skipped cost the merge a pass over them; reading the queries and merging the outputs by
# index instead costs about three passes over the rows the call has.
GAP_LIMIT = 1.0
# Rows of one packed kernel call, at most about (split_calls): what its packed inputs and outputs hold while it runs.
MAX_CALL_QUERY_ROWS = 4096
MAX_CALL_KEY_ROWS = 32768


@dataclass(frozen=True, slots=True, kw_only=True)
class CallArrays:
    """Kernel calls as flat arrays. Call c has entries call_entry_ptr[c]:call_entry_ptr[c+1]; entry e has key
    pieces entry_key_ptr[e]:entry_key_ptr[e+1]. Rows are counted in the source's store (LOCAL: the rank's plan
    layout; s >= 0: received pull s, its segments in pull order).

    call_request, call_causal (0/1), call_left, call_right: the request the call belongs to and flash-attn's mask
        (window (left, right); -1: unbounded).
    entry_q_source, entry_q_row, entry_q_rows: the entry's query rows (one run of one source).
    key_source, key_row, key_rows: its key pieces, in packing order.
    """

    call_request: np.ndarray
    call_causal: np.ndarray
    call_left: np.ndarray
    call_right: np.ndarray
    call_entry_ptr: np.ndarray
    entry_q_source: np.ndarray
    entry_q_row: np.ndarray
    entry_q_rows: np.ndarray
    entry_key_ptr: np.ndarray
    key_source: np.ndarray
    key_row: np.ndarray
    key_rows: np.ndarray

    @property
    def num_calls(self) -> int:
        return int(self.call_request.size)

    @property
    def entry_call(self) -> np.ndarray:
        """The call of each entry (int64 [E])."""
        return np.repeat(np.arange(self.num_calls), np.diff(self.call_entry_ptr))

    @property
    def key_entry(self) -> np.ndarray:
        """The entry of each key piece (int64 [K])."""
        return np.repeat(np.arange(self.entry_q_rows.size), np.diff(self.entry_key_ptr))

    @property
    def call_q_rows(self) -> np.ndarray:
        """Query rows per call (int64 [C])."""
        return group_sums(self.entry_q_rows, self.call_entry_ptr)

    @property
    def call_k_rows(self) -> np.ndarray:
        """Key rows per call (int64 [C])."""
        return group_sums(self.key_rows, self.entry_key_ptr[self.call_entry_ptr])

    @property
    def entry_k_rows(self) -> np.ndarray:
        """Key rows per entry (int64 [E])."""
        return group_sums(self.key_rows, self.entry_key_ptr)


def plan_calls(request, q_source, q_seg, q_row, q_start, q_end, k_source, k_seg, k_row, k_start, k_end, window,
               local_seg_len, split_requests: np.ndarray | None = None) -> CallArrays:
    """Group segment pairs into kernel calls (the rule in the module docstring).

    Objective: the fewest calls a varlen kernel with one mask per call allows, each query segment's keys packed
    into one entry where the mask allows it. O(P log P) for P pairs (sorts), plus the rows of filled gaps.

    Args:
        request: int [P], the request of each pair (calls come out by request, ascending).
        q_source, q_seg, q_row: int [P], the query segment's source (LOCAL or a pull's store), its segment id
            (ids < 2**31) and its first row in that store; q_start, q_end: its positions in its sequence.
        k_source, k_seg, k_row, k_start, k_end: the same of the key segment (of the query's sequence).
        window: int [P], keys a query sees back, itself included (0: a full mask).
        local_seg_len: int [L], the rank's local segments' lengths in plan-layout row order; a LOCAL segment's
            q_row is the sum of the lengths before it (the gap rule finds segments between by row).
        Pairs come in the order their tiles are computed; keys no query of a pair sees are dropped here.
        split_requests: bool per request id, the requests whose large packed calls are cut (:func:`split_calls`;
            the runtime's backward, whose calls hold the most); None: none.
    Returns:
        the calls.
    """
    columns = [np.asarray(a, dtype=np.int64) for a in (request, q_source, q_seg, q_row, q_start, q_end, k_source,
                                                         k_seg, k_row, k_start, k_end, window)]
    visible = sees_any(columns[4], columns[5], columns[9], columns[10], columns[11])
    (request, q_source, q_seg, q_row, q_start, q_end, k_source, k_seg, k_row, k_start, k_end,
     window) = columns if visible.all() else (c[visible] for c in columns)
    kind, left, q_kept, k_first = classify_pairs(q_start, q_end, k_start, k_end, window)
    entries = _entries(request, q_source, q_seg, q_row, q_end - q_start, kind, left, q_kept)
    entry_sorted, call_ptr = _split_calls(entries)
    local_len = np.asarray(local_seg_len, dtype=np.int64)
    entry, entry_call = _fill_gaps(entries, entry_sorted, call_ptr, local_len)
    return _assemble(entries, entry_sorted, call_ptr, entry, entry_call, local_len,
                     (k_source, k_row + k_first, k_end - k_start - k_first, (kind == CAUSAL).astype(np.int64),
                      k_start), split_requests)


@dataclass(frozen=True, slots=True, kw_only=True)
class _Entries:
    """Entries before they are put in calls: one per (request, query segment) of packed pairs, one per cut pair."""

    request: np.ndarray
    causal: np.ndarray
    left: np.ndarray
    right: np.ndarray
    q_source: np.ndarray
    q_seg: np.ndarray
    q_row: np.ndarray
    q_rows: np.ndarray
    whole: np.ndarray  # the entry's queries are its whole segment
    order: np.ndarray  # within a call: first appearance of the query segment, then pair order
    pair_entry: np.ndarray  # per visible pair, its entry


def _entries(request, q_source, q_seg, q_row, q_len, kind, left, q_kept) -> _Entries:
    num_pairs = request.size
    # A query segment is one (request, source, segment); its first pair orders its entries.
    sources = int(q_source.max(initial=0)) + 2  # LOCAL is -1
    query_key = (request * sources + q_source + 1) * (int(q_seg.max(initial=0)) + 1) + q_seg
    _, query_first, query_of = sorted_unique(query_key, return_index=True, return_inverse=True)
    packed = kind <= CAUSAL
    # Packed pairs share their query segment's entry; each cut pair is an entry of its own.
    num_queries = query_first.size
    packed_queries = np.flatnonzero(np.bincount(query_of[packed], minlength=num_queries))
    slot_of_query = np.full(num_queries, -1, dtype=np.int64)
    slot_of_query[packed_queries] = np.arange(packed_queries.size)
    cut_pairs = np.flatnonzero(~packed)
    pair_entry = np.empty(num_pairs, dtype=np.int64)
    pair_entry[cut_pairs] = packed_queries.size + np.arange(cut_pairs.size)
    # Per entry: a representative pair (a packed entry's first pair; the cut pair itself).
    first_pair = np.concatenate([query_first[packed_queries], cut_pairs]).astype(np.int64)
    packed_slot = slot_of_query[query_of[packed]]
    pair_entry[packed] = packed_slot
    diagonal = np.bincount(packed_slot[kind[packed] == CAUSAL], minlength=packed_queries.size) > 0
    cut_kind = kind[cut_pairs]
    causal = np.concatenate([diagonal, cut_kind == WINDOW_DIAGONAL])
    right = np.concatenate([np.full(packed_queries.size, -1), np.where(cut_kind == WINDOW_DIAGONAL, 0, -1)])
    entry_left = np.concatenate([np.full(packed_queries.size, -1), left[cut_pairs]])
    rows = np.concatenate([q_len[first_pair[:packed_queries.size]], q_kept[cut_pairs]])
    order = query_first[query_of[first_pair]] * (num_pairs + 1) + np.concatenate(
        [np.zeros(packed_queries.size, dtype=np.int64), cut_pairs + 1])
    return _Entries(request=request[first_pair], causal=causal.astype(np.int64), left=entry_left.astype(np.int64),
                    right=right.astype(np.int64), q_source=q_source[first_pair], q_seg=q_seg[first_pair],
                    q_row=q_row[first_pair], q_rows=rows.astype(np.int64), whole=rows == q_len[first_pair],
                    order=order, pair_entry=pair_entry)


def _split_calls(e: _Entries) -> tuple[np.ndarray, np.ndarray]:
    """One call per (request, mask, repetition): a query segment's k-th entry of one mask goes in that mask's k-th
    call, which is how many calls that mask needs.

    Returns:
        (entry_sorted, call_ptr): the entries by (call, order), and each call's bounds in that list.
    """
    mask = _group_key([e.right, e.left, 1 - e.causal, e.request])  # a call's mask, by (request, causal first, ...)
    query = _group_key([e.q_seg, e.q_source, mask])
    by_query = lexsort_ints((e.order, query))
    run_start = np.maximum.accumulate(np.where(run_starts(query[by_query]), np.arange(by_query.size), 0))
    repetition = np.empty(by_query.size, dtype=np.int64)
    repetition[by_query] = np.arange(by_query.size) - run_start
    call = _group_key([repetition, mask])
    entry_sorted = lexsort_ints((e.order, call))
    call_ptr = np.append(np.flatnonzero(run_starts(call[entry_sorted])), entry_sorted.size).astype(np.int64)
    return entry_sorted, call_ptr


def _group_key(columns: list[np.ndarray]) -> np.ndarray:
    """One int64 key per row that orders rows as np.lexsort(columns) does and is equal exactly where every column
    is (the last column primary): the columns packed side by side (:func:`pack_columns`) where they fit, else each
    row's rank among the distinct rows."""
    packed = pack_columns(columns) if columns[0].size else (columns[0].astype(np.int64), 1)
    if packed is not None:
        return packed[0]
    order = np.lexsort(columns)
    ordered = np.stack(columns)[:, order]
    rank = np.empty(order.size, dtype=np.int64)
    rank[order] = np.cumsum(_starts(ordered)) - 1
    return rank


def _starts(columns: np.ndarray) -> np.ndarray:
    """bool per column of a [k, n] array sorted by its rows: whether it differs from the one before."""
    if columns.shape[1] == 0:
        return np.zeros(0, dtype=bool)
    return np.concatenate(([True], (columns[:, 1:] != columns[:, :-1]).any(axis=0)))


def _fill_gaps(e: _Entries, entry_sorted: np.ndarray, call_ptr: np.ndarray,
               local_len: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The final entries: per call, its sorted entries; or, where its queries are all whole local segments and the
    local segments between them add at most GAP_LIMIT x its rows, every local segment from its first to its last,
    in row order.

    Returns:
        (entry, call) per final entry, in final order: the entry's index in `e`, or -2 - p for the gap at local
        position p (its segment's rank in row order); its call.
    """
    num_calls = call_ptr.size - 1
    sizes = np.diff(call_ptr)
    entry_call = np.repeat(np.arange(num_calls), sizes)
    if entry_sorted.size == 0:
        return np.zeros(0, dtype=np.int64), np.zeros(0, dtype=np.int64)
    local_ok = (e.q_source[entry_sorted] == LOCAL) & e.whole[entry_sorted]
    prefix = np.concatenate(([0], np.cumsum(local_len)))
    # Rows of distinct local segments are distinct: a whole local segment's position is its row's rank.
    position = np.where(local_ok, search_sorted(prefix[:-1], e.q_row[entry_sorted]), 0)
    heads = call_ptr[:-1]
    eligible = np.logical_and.reduceat(local_ok, heads)
    low = np.minimum.reduceat(position, heads)
    high = np.maximum.reduceat(position, heads)
    rows = np.add.reduceat(e.q_rows[entry_sorted], heads)
    span_rows = np.where(eligible, prefix[np.minimum(high + 1, local_len.size)] - prefix[np.minimum(
        low, local_len.size)], 0)
    filled = eligible & (span_rows <= (1 + GAP_LIMIT) * rows)
    # A filled call lists every position from low to high: the entry there, or a gap.
    span = np.where(filled, high - low + 1, 0)
    fill_call = np.repeat(np.arange(num_calls), span)
    fill_position = expand_ranges(low, span)
    in_filled = np.flatnonzero(filled[entry_call])
    width = local_len.size + 1
    slot = entry_call[in_filled] * width + position[in_filled]
    order = stable_argsort(slot)
    found = lookup(slot[order], entry_sorted[in_filled[order]], fill_call * width + fill_position, -1)
    fill_entry = np.where(found >= 0, found, -2 - fill_position)
    kept = np.flatnonzero(~filled[entry_call])
    entry = np.concatenate([entry_sorted[kept], fill_entry])
    call = np.concatenate([entry_call[kept], fill_call])
    within = np.concatenate([kept, fill_position])  # kept: sorted order; filled: row order
    final = lexsort_ints((within, call))
    return entry[final], call[final]


def call_parts(num_entries: np.ndarray, q_rows: np.ndarray, k_rows: np.ndarray) -> np.ndarray:
    """How many calls a packed call is split into: enough that each holds about MAX_CALL_QUERY_ROWS query rows and
    MAX_CALL_KEY_ROWS packed key rows at most, and no more than it has entries (a call's packed inputs and outputs
    live together while its kernel runs: on a 256-GPU long-tail plan one backward call of 13K query rows against 78K
    packed key rows held 1.4 GiB). Depends on the totals alone, so the simulator counts the same launches.

    Args:
        num_entries, q_rows, k_rows: int [C], per call its entries with keys, their query rows and key rows.
    Returns:
        int64 [C], at least 1.
    """
    wanted = np.maximum(-(-np.asarray(q_rows, dtype=np.int64) // MAX_CALL_QUERY_ROWS),
                        -(-np.asarray(k_rows, dtype=np.int64) // MAX_CALL_KEY_ROWS))
    return np.maximum(np.minimum(wanted, num_entries), 1).astype(np.int64)


def split_calls(entry_call: np.ndarray, real: np.ndarray, q_rows: np.ndarray, k_rows: np.ndarray,
                splittable: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Each splittable call cut into :func:`call_parts` calls of consecutive entries: entry i of a call's n entries
    with keys goes to part floor(i * parts / n), so every part has one; an entry without keys (a filled gap) stays
    with the entry before it.

    Args:
        entry_call: int [E], each entry's call, non-decreasing; real: bool [E], the entries with keys; q_rows,
            k_rows: int [E], their rows; splittable: bool [C], the calls that may be cut (packed masks).
    Returns:
        (parts per call, each entry's new call).
    """
    num_calls = splittable.size
    count = np.bincount(entry_call[real], minlength=num_calls)
    parts = np.where(splittable, call_parts(count, np.bincount(entry_call[real], weights=q_rows[real],
                                                               minlength=num_calls),
                                            np.bincount(entry_call, weights=k_rows, minlength=num_calls)), 1)
    base = np.cumsum(parts) - parts
    # Entries with keys before each in its call (a call's entries are consecutive).
    index = offsets_within(real.astype(np.int64), np.bincount(entry_call, minlength=num_calls))
    part = index * parts[entry_call] // np.maximum(count[entry_call], 1)
    new_call = np.where(real, base[entry_call] + part, base[entry_call])
    return parts.astype(np.int64), np.maximum.accumulate(new_call) if new_call.size else new_call


def _assemble(e: _Entries, entry_sorted: np.ndarray, call_ptr: np.ndarray, entry: np.ndarray, entry_call: np.ndarray,
              local_len: np.ndarray, keys: tuple[np.ndarray, ...], split_requests: np.ndarray | None) -> CallArrays:
    """The flat arrays: calls' masks, final entries' query runs (gaps from the local layout), and each entry's key
    pieces, earlier segments first, the diagonal last."""
    k_source, k_row, k_rows, k_causal, k_start = keys
    head = entry_sorted[call_ptr[:-1]]
    prefix = np.concatenate(([0], np.cumsum(local_len)))
    gap = entry < 0
    gap_position = np.where(gap, -2 - entry, 0)
    real = np.where(gap, 0, entry)
    q_source = np.where(gap, LOCAL, e.q_source[real] if e.q_source.size else 0)
    q_row = np.where(gap, prefix[gap_position], e.q_row[real] if e.q_row.size else 0)
    q_rows = np.where(gap, local_len[gap_position] if local_len.size else 0, e.q_rows[real] if e.q_rows.size else 0)
    final_of_entry = np.full(e.request.size, -1, dtype=np.int64)
    final_of_entry[entry[~gap]] = np.flatnonzero(~gap)
    pair_final = final_of_entry[e.pair_entry]
    # One int64 key, (entry, diagonal last, position): a stable sort of it is lexsort's order, at a third the cost;
    # positions counted from the part's least take only the bits their range needs, so that the key and each
    # pair's index fit one packed sort (stable_argsort), not argsort.
    assert pair_final.size == 0 or (pair_final.min() >= 0 and pair_final.max() < 2**30 and k_start.max() < 2**32)
    low = int(k_start.min(initial=0))
    position_bits = (int(k_start.max(initial=0)) - low).bit_length()
    key_order = stable_argsort((pair_final * 2 + k_causal) << position_bits | (k_start - low))
    entry_key_ptr = np.concatenate(([0], np.cumsum(np.bincount(pair_final, minlength=entry.size)))).astype(np.int64)
    packed_call = (e.left[head] < 0) & (e.right[head] < 0) & (
        np.asarray(split_requests, dtype=bool)[e.request[head]] if split_requests is not None else False)
    parts, entry_call = split_calls(entry_call, ~gap, q_rows, group_sums(k_rows[key_order], entry_key_ptr),
                                    packed_call)
    head = np.repeat(head, parts)
    return CallArrays(
        call_request=e.request[head], call_causal=e.causal[head], call_left=e.left[head], call_right=e.right[head],
        call_entry_ptr=np.concatenate(([0], np.cumsum(np.bincount(entry_call, minlength=head.size)))).astype(
            np.int64),
        entry_q_source=q_source.astype(np.int64), entry_q_row=q_row.astype(np.int64),
        entry_q_rows=q_rows.astype(np.int64), entry_key_ptr=entry_key_ptr, key_source=k_source[key_order],
        key_row=k_row[key_order], key_rows=k_rows[key_order])

"""The range path: where a rank's received pulls sit in its arenas, and its kernel calls as (query range, key range)
pairs read in place.

Per pass a rank receives its Q pulls into one query arena and its K,V pulls into one key arena (its own rows stay
where they are: the caller's tensors and accumulators). A pull's rows are live from the stage that posts it to the
stage that frees it (the liveness rule of :func:`fcp_compiler.format.liveness.stacked_messages`); its place is
:func:`fcp_compiler.algorithms.arena.place_buffers`'s, pulls of one stage side by side in sequence order, so that
blocks of one sequence that arrive together are one run.

A range call is one launch of a range kernel (FFA's contract: overlapping query ranges merged by log-sum-exp in the
kernel, overlapping key ranges' dK, dV summed), over one query tensor (the rank's rows, or the query arena) and one
key tensor (the rank's rows, or the key arena): a request (one stage of one pass) runs at most four. Its ranges are
the call plan's (:func:`fcp_compiler.format.call_plan.rank_calls`), each entry's key pieces in place, consecutive
pieces merged where they are consecutive rows and the earlier one is unmasked: a causal segment's keys of one
sequence that sit in order are one range, causal bottom-right.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from fcp_compiler.algorithms.arena import place_buffers
from fcp_compiler.algorithms.call_plan import LOCAL, CallArrays
from fcp_compiler.algorithms.keys import stable_argsort
from fcp_compiler.algorithms.ranges import offsets
from fcp_compiler.format.call_plan import Request, rank_calls
from fcp_compiler.format.liveness import stacked_messages
from fcp_compiler.format.plan_format import RankProgram, TransferKind
from fcp_compiler.format.stacked import StackedRanks, stack_programs

PASSES = ("fwd", "bwd")


@dataclass(frozen=True, slots=True, kw_only=True)
class Arenas:
    """One pass of one rank: each received pull's first row in the arena of its kind (int64 per pull_recv row) and
    the rows of each arena."""

    pull_offset: np.ndarray
    q_rows: int
    kv_rows: int


def received_pull_order(stacked: StackedRanks) -> tuple[np.ndarray, np.ndarray]:
    """Each received pull's rows and its place in the arenas' order: within a stage, pulls in sequence order (a
    sequence's blocks that arrive together become one run; ranks apart, only the order within a rank counts).

    Returns:
        (rows, order), both int64 [received pulls].
    """
    tables, a = stacked.tables, stacked.arrays
    segs, counts = a["pull_recv_segs"], a["pull_recv_seg_count"]
    ptr = offsets(counts)
    rows = stacked.pull_tokens("recv")
    first_seg = segs[np.minimum(ptr[:-1], max(segs.size - 1, 0))] if segs.size else np.zeros(0, dtype=np.int64)
    order = np.empty(counts.size, dtype=np.int64)
    order[np.lexsort((tables.seg_start[first_seg], tables.seg_seq[first_seg]))] = np.arange(counts.size)
    return rows, order


def rank_arenas(program: RankProgram) -> dict[str, Arenas]:
    """Where each received pull sits in its arena, per pass ("fwd", "bwd").

    Args:
        program: one rank's slice of the plan.
    Returns:
        pass name -> its arenas.
    """
    stacked = stack_programs([program])
    rows, order = received_pull_order(stacked)
    counts, kinds = stacked.arrays["pull_recv_seg_count"], stacked.arrays["pull_recv_kind"]
    out = {}
    for pass_name in PASSES:
        messages = stacked_messages(stacked, pass_name)
        offset = np.zeros(counts.size, dtype=np.int64)
        extent = {}
        for kind in (TransferKind.Q, TransferKind.KV):
            mine = np.flatnonzero(kinds == kind)
            placed = place_buffers(rows[mine], messages.pull_recv_stage[mine], messages.pull_recv_last[mine],
                                   order[mine])
            offset[mine], extent[kind] = placed.offset, int(placed.arena_rows[0])
        out[pass_name] = Arenas(pull_offset=offset, q_rows=extent[TransferKind.Q], kv_rows=extent[TransferKind.KV])
    return out


@dataclass(frozen=True, slots=True, kw_only=True)
class RangeCalls:
    """Range kernel calls as flat arrays. Call c has ranges call_range_ptr[c]:call_range_ptr[c+1]; its queries are
    rows of the query arena where call_q_arena[c] (else the rank's own rows), its keys rows of the key arena where
    call_kv_arena[c]. Per range: query rows [q_start, q_end), key rows [k_start, k_end), the mask (left, right) as
    flash-attn's window, bottom-right aligned ((-1, -1): full; (-1, 0): causal), and the pull rows its queries and
    keys come from (LOCAL: the rank's own)."""

    call_request: np.ndarray
    call_q_arena: np.ndarray
    call_kv_arena: np.ndarray
    call_range_ptr: np.ndarray
    q_start: np.ndarray
    q_end: np.ndarray
    k_start: np.ndarray
    k_end: np.ndarray
    left: np.ndarray
    right: np.ndarray
    call_pull_ptr: np.ndarray
    call_pull: np.ndarray

    @property
    def num_calls(self) -> int:
        return int(self.call_request.size)


def rank_range_calls(program: RankProgram, requests: list[Request],
                     arenas: dict[str, Arenas] | None = None) -> RangeCalls:
    """The range kernel calls that compute each request's tiles on this rank (call_request indexes `requests`).

    Args:
        program: the rank's slice of the plan.
        requests: what to compute (:func:`fcp_compiler.format.call_plan.step_requests`).
        arenas: :func:`rank_arenas` of the program, if already made.
    Raises:
        PlanFormatError: as :func:`fcp_compiler.format.call_plan.rank_calls`.
    """
    arenas = rank_arenas(program) if arenas is None else arenas
    backward = np.asarray([request.pass_name == "bwd" for request in requests], dtype=bool)
    return range_calls(rank_calls(program, requests), backward, arenas)


def range_calls(calls: CallArrays, request_backward: np.ndarray, arenas: dict[str, Arenas]) -> RangeCalls:
    """A rank's packed calls (:class:`CallArrays`) as range calls over its arenas: each entry's key pieces as
    ranges (consecutive rows merged where the earlier piece is unmasked), grouped per (request, query tensor, key
    tensor) in call-plan order. Entries without keys (the packed path's filled gaps) are dropped."""
    pieces = _KeyPieces.of(calls, request_backward, arenas)
    key_entry, call = calls.key_entry, pieces.call
    q_source = calls.entry_q_source[key_entry]
    q_arena, q_start = _placed(q_source, calls.entry_q_row[key_entry], pieces.backward, arenas)
    q_end = q_start + calls.entry_q_rows[key_entry]
    k_arena = pieces.k_arena
    first = np.flatnonzero(~pieces.join)
    last = np.append(first[1:], key_entry.size) - 1
    request = calls.call_request[call[first]]
    group = (request * 2 + q_arena[first]) * 2 + k_arena[first]
    order = stable_argsort(group)
    first, last, group = first[order], last[order], group[order]
    starts = np.flatnonzero(np.append(True, group[1:] != group[:-1])) if group.size else np.zeros(0, dtype=np.int64)
    # The pulls each call reads: every piece's query and key sources, by the call its range went to.
    piece_call = np.searchsorted(group[starts], (calls.call_request[call] * 2 + q_arena) * 2 + k_arena)
    pull_key = np.unique(np.concatenate([piece_call, piece_call]) * (1 << 32) + np.concatenate(
        [q_source, calls.key_source]) + 1)
    pull_key = pull_key[pull_key % (1 << 32) != 0]  # LOCAL (-1 + 1) is the rank's own
    pull_call = pull_key >> 32
    return RangeCalls(call_request=group[starts] // 4, call_q_arena=(group[starts] // 2 % 2).astype(bool),
                      call_kv_arena=(group[starts] % 2).astype(bool),
                      call_range_ptr=np.append(starts, group.size).astype(np.int64),
                      q_start=q_start[first], q_end=q_end[first], k_start=pieces.k_start[first],
                      k_end=pieces.k_end[last], left=pieces.left[last], right=pieces.right[last],
                      call_pull_ptr=np.searchsorted(pull_call, np.arange(starts.size + 1)).astype(np.int64),
                      call_pull=pull_key % (1 << 32) - 1)


def ranges_per_request(calls: CallArrays, request_backward: np.ndarray, arenas: dict[str, Arenas],
                       num_requests: int) -> np.ndarray:
    """How many ranges :func:`range_calls` makes for each request (int64 [num_requests]), without making them (the
    memory account's index tensors)."""
    pieces = _KeyPieces.of(calls, request_backward, arenas)
    return np.bincount(calls.call_request[pieces.call[~pieces.join]], minlength=num_requests).astype(np.int64)


@dataclass(frozen=True, slots=True, kw_only=True)
class _KeyPieces:
    """Per key piece of a rank's packed calls (calls.key_entry's order): its call, whether its pass is the backward,
    its rows in its tensor (k_arena: in the key arena; [k_start, k_end)), the mask its range would have (left,
    right: flash-attn's window) and whether it joins the piece before it in one range (consecutive rows of one
    tensor, in one entry, the earlier piece unmasked)."""

    call: np.ndarray
    backward: np.ndarray
    k_arena: np.ndarray
    k_start: np.ndarray
    k_end: np.ndarray
    left: np.ndarray
    right: np.ndarray
    join: np.ndarray

    @classmethod
    def of(cls, calls: CallArrays, request_backward: np.ndarray, arenas: dict[str, Arenas]) -> "_KeyPieces":
        key_entry = calls.key_entry
        call = calls.entry_call[key_entry]
        backward = np.asarray(request_backward, dtype=bool)[calls.call_request[call]]
        k_arena, k_start = _placed(calls.key_source, calls.key_row, backward, arenas)
        k_end = k_start + calls.key_rows
        windowed = (calls.call_left[call] >= 0) | (calls.call_right[call] >= 0)
        last_piece = np.append(key_entry[1:] != key_entry[:-1], True) if key_entry.size else np.zeros(0, dtype=bool)
        diagonal = calls.call_causal[call].astype(bool) & last_piece
        left = np.where(windowed, calls.call_left[call], -1)
        right = np.where(windowed, calls.call_right[call], np.where(diagonal, 0, -1))
        full = (left == -1) & (right == -1)
        join = np.zeros(key_entry.size, dtype=bool)
        join[1:] = ((key_entry[1:] == key_entry[:-1]) & (k_arena[1:] == k_arena[:-1]) & (k_start[1:] == k_end[:-1])
                    & full[:-1] & ~windowed[1:])
        return cls(call=call, backward=backward, k_arena=k_arena, k_start=k_start, k_end=k_end, left=left,
                   right=right, join=join)


def _placed(source: np.ndarray, row: np.ndarray, backward: np.ndarray,
            arenas: dict[str, Arenas]) -> tuple[np.ndarray, np.ndarray]:
    """Rows of a store as rows of their tensor: (in an arena, the row there); the rank's own rows stay."""
    arena = source != LOCAL
    pull = np.where(arena, source, 0)
    fwd, bwd = arenas["fwd"].pull_offset, arenas["bwd"].pull_offset
    if fwd.size == 0:
        return arena.astype(np.int64), row
    offset = np.where(backward, bwd[pull], fwd[pull])
    return arena.astype(np.int64), np.where(arena, row + offset, row)

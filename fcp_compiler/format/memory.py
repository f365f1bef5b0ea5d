"""A rank's device memory per pass, in bytes, from its plan and its call plan: every tensor the runtime creates.

The runtime (fcp_runtime.attention) creates, per pass:

- the rank's accumulators: forward O (acc) and LSE; backward dQ and dK, dV (acc), and at the end the outputs in
  the input dtype (forward O; backward dQ, dK, dV) beside them;
- a buffer per received message, from the stage that posts it: a pull until the end of the stage of its last use
  (its last tile, the push back along it, or a relay's send), a push until the end of its stage; a pulled block
  whose results go back gets its accumulators when it arrives (forward Q: O and LSE; backward K,V: dK, dV;
  backward Q: dQ);
- a packed copy of a sent message whose rows are not one run of its store (backward Q pulls always copy their LSE,
  which is heads-first), held until the stage's wait;
- per kernel call, one at a time: the kernel's outputs, with first the packed inputs that are not one run
  (backward LSE always, but where it is a whole store), freed when the kernel returns, then the merges' or index
  adds' temporaries;
- the call plan's index tensors (one int32 buffer, for the whole step): cu_q and cu_k, and positions and rows where a
  call's queries (merges) or, in the backward, its keys (dK, dV adds) of one source are not one run.

`acc` is fp32 for bf16 and fp16 inputs, else the input dtype. Kernel workspaces are not counted (flash-attn's are
small; the exact kernels are a test backend), nor, in the user layout, the reshuffle's buffers (the packed Q, K, V
and what the all-to-all sends and receives); the account is exact in the plan layout.
benchmarks/runtime_traffic.py compares this with the peak a meta-device replay of the runtime records.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

import numpy as np

from fcp_compiler.algorithms.call_plan import LOCAL, CallArrays
from fcp_compiler.algorithms.keys import lookup, stable_argsort
from fcp_compiler.algorithms.ranges import offsets_within
from fcp_compiler.format.arena import rank_arenas, rank_range_calls
from fcp_compiler.format.call_plan import Request, RequestTable, calls_in_parts, step_requests, step_table
from fcp_compiler.format.inputs import AttentionShape
from fcp_compiler.format.liveness import PassMessages, stacked_messages, tile_pull_rows
from fcp_compiler.format.plan_format import PlanHeader, RankProgram, TransferKind
from fcp_compiler.format.stacked import StackedRanks, stack_programs

DTYPE_BYTES = {"bf16": 2, "fp16": 2, "fp32": 4, "fp64": 8}
CHUNK_TILES = 20_000  # tiles of the ranks accounted together (stacked_peak_bytes)
# An account that may stop above a limit goes in groups this many times smaller: it stops sooner where it is over
# (the first group holds the ranks it visits first), and at hundreds of ranks groups of 5,000 tiles are no slower
# (0.51 against 0.56 s for the shipped trace's five accounts at 256 GPUs; at 4096, 2.9 against 2.6 s in full).
STOPPING_GROUPS = 4


@dataclass(frozen=True, slots=True, kw_only=True)
class Sizes:
    """Bytes per token of each tensor kind: a [tokens, heads, head_dim] row in the input dtype or the accumulator
    dtype, and one LSE value per head."""

    q_heads: int
    kv_heads: int
    head_dim: int
    dtype_bytes: int
    acc_bytes: int

    @property
    def q(self) -> int:
        return self.q_heads * self.head_dim * self.dtype_bytes

    @property
    def kv(self) -> int:  # K or V
        return self.kv_heads * self.head_dim * self.dtype_bytes

    @property
    def q_acc(self) -> int:
        return self.q_heads * self.head_dim * self.acc_bytes

    @property
    def kv_acc(self) -> int:
        return self.kv_heads * self.head_dim * self.acc_bytes

    @property
    def lse(self) -> int:
        return self.q_heads * self.acc_bytes

    @classmethod
    def of(cls, header: PlanHeader, dtype: str | None = None) -> "Sizes":
        """The sizes of the plan's attention shape in `dtype` (default: the plan's)."""
        return cls.of_shape(header.shape, dtype)

    @classmethod
    def of_shape(cls, shape: AttentionShape, dtype: str | None = None) -> "Sizes":
        """The sizes of an attention shape in `dtype` (default: the shape's)."""
        dtype = shape.dtype.value if dtype is None else dtype
        dtype_bytes = DTYPE_BYTES[dtype]
        return cls(q_heads=shape.q_heads, kv_heads=shape.kv_heads, head_dim=shape.head_dim, dtype_bytes=dtype_bytes,
                   acc_bytes=4 if dtype_bytes == 2 else dtype_bytes)


def rank_peak_bytes(program: RankProgram, layout: str | None = None, dtype: str | None = None,
                    requests: list[Request] | None = None, calls: CallArrays | None = None) -> dict[str, int]:
    """The peak bytes of the tensors the runtime creates in each pass on this rank (the module docstring).

    Args:
        program: the rank's slice of the plan.
        layout: "plan" or "user" (default: the plan's).
        dtype: the attention inputs' dtype (default: the plan's).
        requests, calls: the step's call plan, when the caller has it (:func:`fcp_compiler.format.call_plan`).
    Returns:
        {"fwd": bytes, "bwd": bytes}.
    """
    stacked = stack_programs([program])
    table = step_table(stacked, layout) if requests is None else RequestTable.of(stacked, [requests])
    parts = calls_in_parts(stacked, table) if calls is None else [(0, calls)]
    peaks = _peaks(stacked, table, parts, Sizes.of(program.header, dtype))
    return {"fwd": int(peaks[0, 0]), "bwd": int(peaks[0, 1])}


def stacked_peak_bytes(stacked: StackedRanks, layout: str | None = None, dtype: str | None = None,
                       stop_above: int | None = None, first: np.ndarray | None = None) -> np.ndarray:
    """:func:`rank_peak_bytes` of every stacked rank, vectorized over ranks and their calls (the call plan of a group
    of ranks, a few requests at a time: :func:`fcp_compiler.format.call_plan.calls_in_parts`).

    Args:
        stop_above: where given, the account stops after the first group of ranks with a peak above it (a caller
            that only asks whether a plan fits a budget need not account the rest).
        first: a priority per stacked rank (a peak it is expected to have): groups are accounted highest first, so
            an account that stops above `stop_above` stops early where the priorities are near the peaks. Changes
            no figure.
    Returns:
        int64 [ranks accounted, 2]: per rank, the forward's and the backward's peak bytes; every stacked rank in
        order, unless the account stopped above `stop_above`: then the ranks of the groups accounted (in the order
        accounted: in rank order without `first`), the last group's peak above it.
    """
    sizes = Sizes.of(stacked.header, dtype)
    groups = _rank_groups(stacked, CHUNK_TILES // STOPPING_GROUPS if stop_above is not None else CHUNK_TILES)
    if first is not None:
        assert first.shape == (stacked.num_ranks,)
        # Each group's highest priority, highest first (ties in rank order).
        order = stable_argsort(-np.maximum.reduceat(first, groups[:-1])) if stacked.num_ranks else groups[:0]
    else:
        order = np.arange(groups.size - 1)
    peaks = []
    for group in order.tolist():
        # Each rank's account is its own: groups of about CHUNK_TILES tiles bound the per-rank arrays a group stacks
        # (the segment pairs are bounded by the call plan's parts) and change no figure.
        chunk = stacked.ranks_between(int(groups[group]), int(groups[group + 1]))
        table = step_table(chunk, layout)
        peaks.append(_peaks(chunk, table, calls_in_parts(chunk, table), sizes))
        if stop_above is not None and peaks[-1].max() > stop_above:
            return np.concatenate(peaks)
    if not peaks:
        return np.zeros((0, 2), dtype=np.int64)
    if first is not None:
        peaks = [peaks[position] for position in np.argsort(order).tolist()]  # back in rank order
    return np.concatenate(peaks)


def _rank_groups(stacked: StackedRanks, group_tiles: int) -> np.ndarray:
    """Bounds of the groups of consecutive ranks accounted together: each about `group_tiles` tiles, at least one
    rank. Returns int64 [groups + 1], from 0 to the number of ranks."""
    tiles = np.cumsum(stacked.count("tile_stage"))
    bounds, low = [0], 0
    while low < stacked.num_ranks:
        low = max(low + 1, int(np.searchsorted(tiles, (tiles[low - 1] if low else 0) + group_tiles, side="right")))
        bounds.append(min(low, stacked.num_ranks))
    return np.asarray(bounds, dtype=np.int64)


def _peaks(stacked: StackedRanks, table: RequestTable, parts: Iterable[tuple[int, CallArrays]],
           sizes: Sizes) -> np.ndarray:
    stores = _Stores.of(stacked)
    figures = _CallFigures.join([_CallFigures.of(stacked, stores, table, first, calls, sizes)
                                 for first, calls in parts])
    index_bytes = 4 * np.bincount(figures.rank, weights=figures.index_ints, minlength=stacked.num_ranks)
    out = np.zeros((stacked.num_ranks, 2), dtype=np.int64)
    tile_pulls = tile_pull_rows(stacked)
    for column, name in enumerate(("fwd", "bwd")):
        stage_of_call = np.where(figures.backward == (name == "bwd"), figures.stage, -1)
        messages = stacked_messages(stacked, name, tile_pulls=tile_pulls)
        out[:, column] = _pass_peak(stacked.num_ranks, messages, stage_of_call, stores, figures, sizes, name)
    out[:, 0] += index_bytes.astype(np.int64)
    return out


@dataclass(frozen=True, slots=True, kw_only=True)
class _Stores:
    """Rows of each store of the accounted ranks: each rank's plan layout, and every pull it receives and sends."""

    plan_tokens: np.ndarray  # per rank
    pull_recv_kind: np.ndarray  # stacked over ranks
    pull_recv_rows: np.ndarray
    pull_send_kind: np.ndarray
    pull_send_rows: np.ndarray
    pull_send_copies: np.ndarray  # whether a sent pull's rows are not one run of the store they are sent from

    @classmethod
    def of(cls, stacked: StackedRanks) -> "_Stores":
        a = stacked.arrays
        return cls(plan_tokens=stacked.plan_tokens(), pull_recv_kind=a["pull_recv_kind"],
                   pull_recv_rows=stacked.pull_tokens("recv"), pull_send_kind=a["pull_send_kind"],
                   pull_send_rows=stacked.pull_tokens("send"), pull_send_copies=_send_copies(stacked))


@dataclass(frozen=True, slots=True, kw_only=True)
class _CallFigures:
    """Per kernel call: its rank (position in the stack), pass and stage, the most bytes it holds at once in its
    pass (:func:`_call_transients`), and the int32 values of its index tensors (:func:`_index_ints`)."""

    rank: np.ndarray
    backward: np.ndarray  # bool
    stage: np.ndarray  # the stage of its request, at least 0
    transient: np.ndarray
    index_ints: np.ndarray

    @classmethod
    def of(cls, stacked: StackedRanks, stores: _Stores, table: RequestTable, first: int, calls: CallArrays,
           sizes: Sizes) -> "_CallFigures":
        """The figures of one part's calls (call_request counted from request `first` of the table)."""
        request = calls.call_request + first
        backward = table.request_backward[request]
        facts = _Facts.of(stacked, stores, table.request_rank[request].astype(np.int64), calls, backward)
        transient = np.where(backward, _call_transients(facts, sizes, False), _call_transients(facts, sizes, True))
        return cls(rank=facts.call_rank, backward=backward, stage=np.maximum(table.request_stage[request], 0),
                   transient=transient, index_ints=_index_ints(calls, facts, backward))

    @classmethod
    def join(cls, parts: list["_CallFigures"]) -> "_CallFigures":
        """The figures of consecutive parts' calls as one."""
        return cls(**{name: np.concatenate([getattr(part, name) for part in parts]) for name in cls.__slots__})


@dataclass(frozen=True, slots=True, kw_only=True)
class _Facts:
    """Per call, how its query and key pieces pack."""

    call_rank: np.ndarray  # per call
    q_runs: np.ndarray  # per call: runs of its packed queries, keys
    kv_runs: np.ndarray
    q_rows: np.ndarray
    kv_rows: np.ndarray
    q_whole_store: np.ndarray  # its queries are one run that is a whole store
    q_indexed: tuple[np.ndarray, np.ndarray]  # per call: rows of sources read and written by index, all and the
    kv_indexed: tuple[np.ndarray, np.ndarray]  # largest source's (keys: the backward's calls only, 0 for others)

    @classmethod
    def of(cls, stacked: StackedRanks, stores: _Stores, call_rank: np.ndarray, calls: CallArrays,
           backward: np.ndarray) -> "_Facts":
        """The facts of `calls`, on the ranks `call_rank` (per call); `backward`: bool per call."""
        recv_rows = stores.pull_recv_rows
        entry_call = calls.entry_call
        key_call = entry_call[calls.key_entry]
        q_pieces = (entry_call, calls.entry_q_source, calls.entry_q_row, calls.entry_q_rows)
        kv_pieces = (key_call, calls.key_source, calls.key_row, calls.key_rows)
        q_runs, q_first = _runs_per_call(*q_pieces, calls.num_calls)
        kv_runs, _ = _runs_per_call(*kv_pieces, calls.num_calls)
        q_rows, kv_rows = calls.call_q_rows, calls.call_k_rows
        head = np.minimum(calls.call_entry_ptr[:-1], max(calls.entry_q_source.size - 1, 0))
        first_source = calls.entry_q_source[head] if calls.entry_q_source.size else np.zeros(0, dtype=np.int64)
        recv_row = np.minimum(stacked.base("pull_recv_round")[call_rank] + first_source, max(recv_rows.size - 1, 0))
        store_rows = np.where(first_source == LOCAL, stores.plan_tokens[call_rank],
                              recv_rows[recv_row] if recv_rows.size else 0)
        whole = (q_runs == 1) & (q_first == 0) & (q_rows == store_rows)
        return cls(call_rank=call_rank, q_runs=q_runs, kv_runs=kv_runs, q_rows=q_rows, kv_rows=kv_rows,
                   q_whole_store=whole, q_indexed=_indexed_rows(*q_pieces, calls.num_calls),
                   kv_indexed=_indexed_rows(*_pieces_of(kv_pieces, backward[key_call]), calls.num_calls))


def _pieces_of(pieces: tuple[np.ndarray, ...], keep: np.ndarray) -> tuple[np.ndarray, ...]:
    """The pieces (columns of call, source, row, rows) where `keep` holds: a call's pieces stay one run, in order."""
    return pieces if keep.all() else tuple(column[keep] for column in pieces)


def _runs_per_call(call, source, row, rows, num_calls) -> tuple[np.ndarray, np.ndarray]:
    """Per call, how many runs of consecutive store rows its pieces (in packing order) make, and its first row."""
    continues = np.zeros(call.size, dtype=bool)
    if call.size:
        continues[1:] = (call[1:] == call[:-1]) & (source[1:] == source[:-1]) & (row[1:] == row[:-1] + rows[:-1])
    runs = np.bincount(call[~continues], minlength=num_calls)
    first = np.zeros(num_calls, dtype=np.int64)
    starts = np.flatnonzero(np.concatenate(([True], call[1:] != call[:-1]))) if call.size else call
    first[call[starts]] = row[starts]
    return runs.astype(np.int64), first


def _indexed_rows(call, source, row, rows, num_calls) -> tuple[np.ndarray, np.ndarray]:
    """Per call, the rows of sources whose pieces are not one run in both the packed tensor and the store (those
    the runtime reads and writes by index, a source at a time): their total, and the largest source's."""
    if call.size == 0:
        return np.zeros(num_calls, dtype=np.int64), np.zeros(num_calls, dtype=np.int64)
    before = np.cumsum(rows) - rows  # packed position, counted over all calls
    starts = np.concatenate(([True], call[1:] != call[:-1]))
    position = before - before[np.maximum.accumulate(np.where(starts, np.arange(call.size), 0))]
    sources = int(source.max()) + 2  # LOCAL is -1
    order = stable_argsort(call * sources + source + 1)  # by (call, source), then piece order
    c, s, r, p, n = call[order], source[order], row[order], position[order], rows[order]
    same = np.zeros(c.size, dtype=bool)
    same[1:] = (c[1:] == c[:-1]) & (s[1:] == s[:-1])
    broken = np.zeros(c.size, dtype=bool)
    broken[1:] = same[1:] & ((r[1:] != r[:-1] + n[:-1]) | (p[1:] != p[:-1] + n[:-1]))
    group = np.cumsum(~same) - 1
    group_rows = np.bincount(group, weights=n)
    group_rows = np.where(np.bincount(group, weights=broken) > 0, group_rows, 0).astype(np.int64)
    group_call = c[~same]
    total = np.bincount(group_call, weights=group_rows, minlength=num_calls).astype(np.int64)
    largest = np.zeros(num_calls, dtype=np.int64)
    np.maximum.at(largest, group_call, group_rows)
    return total, largest


def _send_copies(stacked: StackedRanks) -> np.ndarray:
    """Whether each sent pull's segments (stacked rows) are not one run of the store it is sent from (its rank's
    plan layout, or a received pull's buffer for a relay): the runtime packs those into a copy."""
    return send_runs(stacked) > 1


def send_runs(stacked: StackedRanks) -> np.ndarray:
    """How many runs of consecutive rows each sent pull's segments (stacked rows) make in the store it is sent from
    (its rank's plan layout, or a received pull's buffer for a relay), which is also where what comes back along it
    lands (int64 per stacked pull_send row, at least 1)."""
    a, tables = stacked.arrays, stacked.tables
    seg_len = (tables.seg_end - tables.seg_start).astype(np.int64)
    send_segs, send_count, source = a["pull_send_segs"], a["pull_send_seg_count"], a["pull_send_source"]
    send_of = np.repeat(np.arange(send_count.size), send_count)
    send_rank = stacked.rank_of("pull_send_round")[send_of]
    starts = np.full(send_segs.size, -1, dtype=np.int64)  # each listed segment's first row in its store, -1: absent
    relayed = source[send_of] >= 0
    local, _, local_count = stacked.local_segments()
    local_rank = np.repeat(np.arange(stacked.num_ranks), local_count)
    from_layout = np.flatnonzero(~relayed)
    if np.bincount(local, minlength=seg_len.size).max(initial=0) <= 1:
        # Each segment in one rank's layout at most: its row there, looked up by segment.
        owner, row = np.full(seg_len.size, -1, dtype=np.int64), np.zeros(seg_len.size, dtype=np.int64)
        owner[local], row[local] = local_rank, offsets_within(seg_len[local], local_count)
        segs = send_segs[from_layout]
        starts[from_layout] = np.where(owner[segs] == send_rank[from_layout], row[segs], -1)
    else:  # a block on two ranks (a plan the validator refuses): by (rank, segment)
        keys = local_rank * seg_len.size + local
        order = stable_argsort(keys)
        rows = offsets_within(seg_len[local], local_count)
        starts[from_layout] = lookup(keys[order], rows[order],
                                     send_rank[from_layout] * seg_len.size + send_segs[from_layout], -1)
    if relayed.any():  # from a received pull's buffer: by (received pull row, segment), over the pulls relayed from
        recv_row = stacked.base("pull_recv_round")[send_rank[relayed]] + source[send_of[relayed]]
        recv_count = a["pull_recv_seg_count"]
        recv_of = np.repeat(np.arange(recv_count.size), recv_count)
        used = np.zeros(recv_count.size, dtype=bool)
        used[recv_row[(recv_row >= 0) & (recv_row < recv_count.size)]] = True
        held = np.flatnonzero(used[recv_of])
        recv_segs = a["pull_recv_segs"]
        keys = recv_of[held] * seg_len.size + recv_segs[held]
        rows = offsets_within(seg_len[recv_segs], recv_count)[held]
        order = stable_argsort(keys)
        starts[relayed] = lookup(keys[order], rows[order], recv_row * seg_len.size + send_segs[relayed], -1)
    broken = np.zeros(send_segs.size, dtype=bool)
    if send_segs.size > 1:
        broken[1:] = (send_of[1:] == send_of[:-1]) & (starts[1:] != starts[:-1] + seg_len[send_segs[:-1]])
    return 1 + np.bincount(send_of[broken], minlength=send_count.size).astype(np.int64)


def _index_ints(calls: CallArrays, facts: _Facts, backward: np.ndarray) -> np.ndarray:
    """Per call, the int32 values of its index tensors: cu_q and cu_k, and positions and rows of indexed query
    sources (merges) and, in the backward, key sources (dK, dV adds)."""
    entries = np.diff(calls.call_entry_ptr)
    return 2 * (entries + 1) + 2 * (facts.q_indexed[0] + np.where(backward, facts.kv_indexed[0], 0))


def _own_bytes(tokens: np.ndarray, sizes: Sizes, forward: bool) -> tuple[np.ndarray, np.ndarray]:
    """What a rank's own tokens hold in a pass whatever its schedule: the accumulators, all pass long, and the
    outputs in the input dtype beside them at the end."""
    base = tokens * ((sizes.q_acc + sizes.lse) if forward else (sizes.q_acc + 2 * sizes.kv_acc))
    return base, tokens * (sizes.q if forward else sizes.q + 2 * sizes.kv)


def least_peak_bytes(header: PlanHeader, rank_tokens: np.ndarray, dtype: str | None = None) -> np.ndarray:
    """A lower bound on each rank's peak over both passes, for any schedule: its own tokens' accumulators and outputs
    (a budget under it cannot be met by scheduling).

    Args:
        header: the plan's header (its shape and dtype).
        rank_tokens: int [ranks], the tokens each rank holds in the plan layout.
        dtype: as :func:`rank_peak_bytes`.
    Returns:
        int64 [ranks].
    """
    sizes = Sizes.of(header, dtype)
    tokens = np.asarray(rank_tokens, dtype=np.int64)
    return np.maximum(*(np.add(*_own_bytes(tokens, sizes, forward)) for forward in (True, False))).astype(np.int64)


def _pass_peak(num_ranks: int, messages: PassMessages, stage_of_call: np.ndarray, stores: _Stores,
               calls: _CallFigures, sizes: Sizes, name: str) -> np.ndarray:
    """Each rank's peak in one pass: per stage, what lives while its calls run (its posts, the largest call's
    temporaries) and what lives after its wait (arrivals' accumulators and landed pushes); the outputs at the
    end. Returns int64 [ranks]."""
    forward = name == "fwd"
    tokens = stores.plan_tokens
    base, outputs = _own_bytes(tokens, sizes, forward)
    num_stages = max(messages.num_stages, 1)
    is_kv = stores.pull_recv_kind == TransferKind.KV
    rows = stores.pull_recv_rows
    buffer_row, accumulator_row = _received_row_bytes(sizes, forward)
    buffer = np.where(is_kv, buffer_row[TransferKind.KV], buffer_row[TransferKind.Q]) * rows
    accumulator = np.where(is_kv, accumulator_row[TransferKind.KV], accumulator_row[TransferKind.Q]) * rows
    rank = messages.pull_recv_rank
    first, last = messages.pull_recv_stage, np.maximum(messages.pull_recv_last, messages.pull_recv_stage)
    # Buffers during stage s's calls: posted at or before s, not yet freed; accumulators of those arrived before s.
    during = _interval_sums(rank, first, last, buffer, num_ranks, num_stages) + \
        _interval_sums(rank, first + 1, last, accumulator, num_ranks, num_stages)
    after = during + _interval_sums(rank, first, first, accumulator, num_ranks, num_stages)
    push_bytes = _push_buffer_bytes(stores.pull_send_kind, stores.pull_send_rows, messages, sizes, forward)
    pushes = _per_slot(messages.push_recv_rank, messages.push_recv_stage, push_bytes, num_ranks, num_stages)
    copy = _send_copy_bytes(stores.pull_send_kind, stores.pull_send_copies, stores.pull_send_rows, sizes, forward)
    sends = _per_slot(messages.pull_send_rank, messages.pull_send_stage, copy, num_ranks, num_stages)
    mine = stage_of_call >= 0
    largest = np.zeros(num_ranks * num_stages)
    np.maximum.at(largest, calls.rank[mine] * num_stages + stage_of_call[mine], calls.transient[mine])
    posted = during + pushes + sends
    peak = np.maximum((posted + largest.reshape(num_ranks, num_stages)).max(axis=1),
                      (after + pushes + sends).max(axis=1))
    return (base + np.maximum(peak, outputs)).astype(np.int64)


def _received_row_bytes(sizes: Sizes, forward: bool) -> tuple[dict[int, int], dict[int, int]]:
    """Per kind of received pull, the bytes a row of it holds: (its buffer, from its post; its accumulators, from its
    arrival: forward Q its O and LSE, backward K,V its dK, dV, backward Q its dQ)."""
    if forward:
        return {TransferKind.KV: 2 * sizes.kv, TransferKind.Q: sizes.q}, \
            {TransferKind.KV: 0, TransferKind.Q: sizes.q_acc + sizes.lse}
    return {TransferKind.KV: 2 * sizes.kv, TransferKind.Q: 3 * sizes.q + sizes.lse}, \
        {TransferKind.KV: 2 * sizes.kv_acc, TransferKind.Q: sizes.q_acc}


def _push_buffer_bytes(send_kind: np.ndarray, send_rows: np.ndarray, messages: PassMessages, sizes: Sizes,
                       forward: bool) -> np.ndarray:
    """Per received push, the bytes of its buffer (forward: O and LSE of a Q pull; backward: dK, dV or dQ)."""
    kv = send_kind[messages.push_recv_pull] == TransferKind.KV
    rows = send_rows[messages.push_recv_pull]
    return rows * (np.where(kv, 0, sizes.q_acc + sizes.lse) if forward else
                   np.where(kv, 2 * sizes.kv_acc, sizes.q_acc))


def _send_copy_bytes(send_kind: np.ndarray, copies: np.ndarray, send_rows: np.ndarray, sizes: Sizes,
                     forward: bool) -> np.ndarray:
    """Per sent pull, the bytes of the packed copy the runtime sends (where its rows are not one run; a backward Q
    pull's LSE, always)."""
    kv = send_kind == TransferKind.KV
    if forward:
        return np.where(copies, np.where(kv, 2 * sizes.kv, sizes.q), 0) * send_rows
    return np.where(kv, np.where(copies, 2 * sizes.kv, 0), np.where(copies, 3 * sizes.q, 0) + sizes.lse) * send_rows


def _per_slot(rank: np.ndarray, stage: np.ndarray, values: np.ndarray, num_ranks: int, num_stages: int) -> np.ndarray:
    """Sums of values per (rank, stage): float [num_ranks, num_stages]."""
    return np.bincount(rank * num_stages + stage, weights=values,
                       minlength=num_ranks * num_stages)[:num_ranks * num_stages].reshape(num_ranks, num_stages)


def _interval_sums(rank: np.ndarray, first: np.ndarray, last: np.ndarray, values: np.ndarray, num_ranks: int,
                   num_stages: int) -> np.ndarray:
    """Per (rank, stage), the sum of the rank's values whose interval [first, last] holds the stage (empty intervals
    add nothing): float [num_ranks, num_stages]."""
    keep = first <= last
    width = num_stages + 1
    size = num_ranks * width
    delta = np.bincount(rank[keep] * width + first[keep], weights=values[keep], minlength=size)[:size]
    delta -= np.bincount(rank[keep] * width + last[keep] + 1, weights=values[keep], minlength=size)[:size]
    return np.cumsum(delta.reshape(num_ranks, width), axis=1)[:, :num_stages]


def _call_transients(facts: _Facts, sizes: Sizes, forward: bool) -> np.ndarray:
    """Per call, the most bytes it holds at once: the kernel's outputs beside either its packed inputs that are not
    one run (freed when the kernel returns) or the largest merge's temporaries (index gathers, or four
    [heads, rows] LSE terms in place)."""
    q_rows, kv_rows = facts.q_rows, facts.kv_rows
    q_packed, kv_packed = facts.q_runs > 1, facts.kv_runs > 1
    if forward:
        inputs = np.where(q_packed, sizes.q * q_rows, 0) + np.where(kv_packed, 2 * sizes.kv * kv_rows, 0)
        outputs = q_rows * (sizes.q + sizes.lse)
        merge = np.maximum(4 * sizes.lse * q_rows, facts.q_indexed[1] * (sizes.q_acc + sizes.q + 2 * sizes.lse))
        return outputs + np.maximum(inputs, merge)
    lse_copy = np.where(facts.q_whole_store, 0, sizes.lse * q_rows)
    inputs = np.where(q_packed, 3 * sizes.q * q_rows, 0) + lse_copy + np.where(kv_packed, 2 * sizes.kv * kv_rows, 0)
    outputs = q_rows * sizes.q + 2 * kv_rows * sizes.kv
    adds = np.maximum(facts.q_indexed[1] * (sizes.q + sizes.q_acc), facts.kv_indexed[1] * 2 * (sizes.kv + sizes.kv_acc))
    return outputs + np.maximum(inputs, adds)


def rank_range_peak_bytes(program: RankProgram, layout: str | None = None, dtype: str | None = None) -> dict[str, int]:
    """The peak bytes of the tensors the runtime creates in each pass on this rank when its kernel reads ranges in
    place (a range kernel: :mod:`fcp_compiler.format.arena`): as :func:`rank_peak_bytes`, but the received pulls
    live in one arena per kind, from the stage that posts the kind's first pull to the end of the pass (their
    accumulators in it), the kernels make nothing, a backward Q pull's LSE arrives in a buffer of its own that goes
    when it is copied in place, and a forward Q pull's LSE is copied to be pushed back (its arena rows are not one
    run); the index tensors are the ranges.

    Args:
        program: the rank's slice of the plan.
        layout: "plan" or "user" (default: the plan's).
        dtype: the attention inputs' dtype (default: the plan's).
    Returns:
        {"fwd": bytes, "bwd": bytes}.
    """
    stacked = stack_programs([program])
    sizes = Sizes.of(program.header, dtype)
    a = stacked.arrays
    arenas = rank_arenas(program)
    recv_rows, send_rows = stacked.pull_tokens("recv"), stacked.pull_tokens("send")
    tokens = int(stacked.plan_tokens()[0])
    ranges = rank_range_calls(program, step_requests(program, layout), arenas).q_start.size
    out = {}
    for name in ("fwd", "bwd"):
        messages = stacked_messages(stacked, name)
        out[name] = _range_pass_peak(a, messages, arenas[name], recv_rows, send_rows, _send_copies(stacked), tokens,
                                     sizes, name)
    out["fwd"] += 4 * 6 * ranges  # q_ranges, k_ranges and masks: int32 [ranges, 2] each, for the whole step
    return out


def _range_pass_peak(a: dict, messages: PassMessages, arenas, recv_rows: np.ndarray, send_rows: np.ndarray,
                     send_copies: np.ndarray, tokens: int, sizes: Sizes, name: str) -> int:
    """One pass's peak on the range path (:func:`rank_range_peak_bytes`)."""
    forward = name == "fwd"
    base, outputs = (int(x[0]) for x in _own_bytes(np.asarray([tokens]), sizes, forward))
    num_stages = max(messages.num_stages, 1)
    live = np.zeros(num_stages)
    kinds = a["pull_recv_kind"]
    buffer_row, accumulator_row = _received_row_bytes(sizes, forward)
    extent = {TransferKind.KV: arenas.kv_rows, TransferKind.Q: arenas.q_rows}
    for kind in (TransferKind.KV, TransferKind.Q):
        posted = messages.pull_recv_stage[kinds == kind]
        if posted.size:  # made when the kind's first pull is posted, kept to the pass's end
            live[int(posted.min()):] += (buffer_row[kind] + accumulator_row[kind]) * extent[kind]
    if not forward:  # a Q pull's LSE, received whole, until it is copied into the arena after the stage's wait
        lse = np.where(kinds == TransferKind.Q, sizes.lse * recv_rows, 0)
        live += _per_slot(messages.pull_recv_rank, messages.pull_recv_stage, lse, 1, num_stages)[0]
    push_bytes = _push_buffer_bytes(a["pull_send_kind"], send_rows, messages, sizes, forward)
    live += _per_slot(messages.push_recv_rank, messages.push_recv_stage, push_bytes, 1, num_stages)[0]
    copy = _send_copy_bytes(a["pull_send_kind"], send_copies, send_rows, sizes, forward)
    live += _per_slot(messages.pull_send_rank, messages.pull_send_stage, copy, 1, num_stages)[0]
    if forward and sizes.q_heads > 1:  # a Q pull's results go back from its arena rows: the LSE ([heads, rows]) is
        # copied to be sent (one head's rows are contiguous)
        live += _per_slot(messages.push_send_rank, messages.push_send_stage,
                          sizes.lse * recv_rows[messages.push_send_pull], 1, num_stages)[0]
    return base + int(max(live.max(), outputs))

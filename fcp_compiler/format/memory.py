"""A rank's device memory per pass, in bytes, from its plan and its call plan: every tensor the runtime creates, on
either kernel path; the plan states the larger (an upper bound on both).

The runtime (fcp_runtime) creates, per pass, on the packing path (a varlen kernel, flash-attn's contract):

- the rank's accumulators: forward O (acc) and LSE; backward dQ and dK, dV (acc), and at the end the outputs in
  the input dtype (forward O; backward dQ, dK, dV) beside them (none where `acc` is the input dtype: the
  conversion is the accumulator itself);
- a buffer per received message, from the stage that posts it: a pull until the end of the stage of its last use
  (its last tile, the push back along it, or a relay's send), a push until the end of its stage; a pulled block
  whose results go back gets its accumulators when it arrives (forward Q: O and LSE; backward K,V: dK, dV;
  backward Q: dQ);
- a packed copy of a sent message whose rows are not one run of its store (backward Q pulls copy their LSE, which
  is heads-first, where there is more than one head), held until the stage's wait;
- per kernel call, one at a time: the kernel's outputs, with first the packed inputs that are not one run
  (backward LSE, but where it is a whole store or one head's run), freed when the kernel returns, then the merges'
  or index adds' temporaries (a merge in place: four [heads, rows] LSE terms of its run; a merge by index: the
  gathered accumulator rows, partial rows and both LSEs, and those four);
- after the stage's wait (the sent copies freed), each forward push that lands merges in place: four [heads, rows]
  LSE terms of its largest run in the rows it lands in;
- the call plan's index tensors (one int32 buffer, for the whole step): cu_q and cu_k, and positions and rows where a
  call's queries (merges) or, in the backward, its keys (dK, dV adds) of one source are not one run.

On the range path (a range kernel that reads keys in place, :func:`rank_range_peak_bytes`) the received pulls live
in one arena per kind instead, the kernels make nothing, and the index tensors are the ranges.

In the user layout attention reshuffles (both paths alike): the forward packs Q, K, V [user rows] into one tensor,
sends an index-gathered copy of it and receives the plan layout's rows, and keeps the send, the receive and the
plan-layout Q, K, V to the end of the pass (the all-to-all's work holds them); it sends its output back (a gathered
copy, the received rows and the user-layout output); the backward reshuffles dO in the same way (its plan-layout
copy kept all pass) and at its end packs dQ, dK, dV and sends them back. Their index tensors (int64) are made in the
first forward. In the plan layout none of this runs: Q, K, V, dO and what the forward saves are the caller's.

`acc` is fp32 for bf16 and fp16 inputs, else the input dtype. Kernel workspaces are not counted (flash-attn's are
small; the exact kernels are a test backend). tests/test_memory_bound.py and benchmarks/runtime_traffic.py compare
this with the peak a meta-device replay of the runtime records: the header is at or above it on every path.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable
from dataclasses import dataclass

import numpy as np

from fcp_compiler.algorithms.arena import place_arenas
from fcp_compiler.algorithms.call_plan import LOCAL, CallArrays
from fcp_compiler.algorithms.keys import lookup, stable_argsort
from fcp_compiler.algorithms.ranges import offsets_within
from fcp_compiler.format.arena import Arenas, ranges_per_request, received_pull_order
from fcp_compiler.format.call_plan import Request, RequestTable, calls_in_parts, step_table
from fcp_compiler.format.inputs import AttentionShape
from fcp_compiler.format.liveness import PassMessages, stacked_messages, tile_pull_rows
from fcp_compiler.format.plan_format import PlanHeader, RankProgram, TransferKind
from fcp_compiler.format.stacked import StackedRanks, stack_programs

DTYPE_BYTES = {"bf16": 2, "fp16": 2, "fp32": 4, "fp64": 8}
PASSES = ("fwd", "bwd")
PATHS = ("packing", "ranges")  # the kernel paths the runtime runs (fcp_runtime.kernels): varlen, range
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
                    requests: list[Request] | None = None, calls: CallArrays | None = None,
                    path: str | None = None) -> dict[str, int]:
    """The peak bytes of the tensors the runtime creates in each pass on this rank (the module docstring): on both
    kernel paths, the larger (what the plan's header states), or on one.

    Args:
        program: the rank's slice of the plan.
        layout: "plan" or "user" (default: the plan's).
        dtype: the attention inputs' dtype (default: the plan's).
        requests, calls: the step's call plan, when the caller has it (:func:`fcp_compiler.format.call_plan`).
        path: "packing" or "ranges" (:data:`PATHS`): that kernel path's peak alone; default both, the larger.
    Returns:
        {"fwd": bytes, "bwd": bytes}.
    """
    stacked = stack_programs([program])
    table = step_table(stacked, layout) if requests is None else RequestTable.of(stacked, [requests])
    parts = calls_in_parts(stacked, table) if calls is None else [(0, calls)]
    peaks = _peaks(stacked, table, parts, Sizes.of(program.header, dtype), _is_user(stacked, layout), path)
    return {"fwd": int(peaks[0, 0]), "bwd": int(peaks[0, 1])}


def rank_range_peak_bytes(program: RankProgram, layout: str | None = None, dtype: str | None = None) -> dict[str, int]:
    """The peak bytes of the tensors the runtime creates in each pass on this rank when its kernel reads ranges in
    place (a range kernel: :mod:`fcp_compiler.format.arena`): as the packing path's, but the received pulls live in
    one arena per kind, from the stage that posts the kind's first pull to the end of the pass (their accumulators
    in it), the kernels make nothing, a backward Q pull's LSE arrives in a buffer of its own that goes when it is
    copied in place, and a forward Q pull's LSE is copied to be pushed back (its arena rows are not one run); the
    index tensors are the ranges. :func:`rank_peak_bytes` with path "ranges".

    Args:
        program: the rank's slice of the plan.
        layout: "plan" or "user" (default: the plan's).
        dtype: the attention inputs' dtype (default: the plan's).
    Returns:
        {"fwd": bytes, "bwd": bytes}.
    """
    return rank_peak_bytes(program, layout, dtype, path="ranges")


def stacked_peak_bytes(stacked: StackedRanks, layout: str | None = None, dtype: str | None = None,
                       stop_above: int | None = None, first: np.ndarray | None = None,
                       path: str | None = None) -> np.ndarray:
    """:func:`rank_peak_bytes` of every stacked rank, vectorized over ranks and their calls (the call plan of a group
    of ranks, a few requests at a time: :func:`fcp_compiler.format.call_plan.calls_in_parts`).

    Args:
        stop_above: where given, the account stops after the first group of ranks with a peak above it (a caller
            that only asks whether a plan fits a budget need not account the rest).
        first: a priority per stacked rank (a peak it is expected to have): groups are accounted highest first, so
            an account that stops above `stop_above` stops early where the priorities are near the peaks. Changes
            no figure.
        path: as :func:`rank_peak_bytes` (default both kernel paths, the larger).
    Returns:
        int64 [ranks accounted, 2]: per rank, the forward's and the backward's peak bytes; every stacked rank in
        order, unless the account stopped above `stop_above`: then the ranks of the groups accounted (in the order
        accounted: in rank order without `first`), the last group's peak above it.
    """
    sizes = Sizes.of(stacked.header, dtype)
    user = _is_user(stacked, layout)
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
        peaks.append(_peaks(chunk, table, calls_in_parts(chunk, table), sizes, user, path))
        if stop_above is not None and peaks[-1].max() > stop_above:
            return np.concatenate(peaks)
    if not peaks:
        return np.zeros((0, 2), dtype=np.int64)
    if first is not None:
        peaks = [peaks[position] for position in np.argsort(order).tolist()]  # back in rank order
    return np.concatenate(peaks)


def _is_user(stacked: StackedRanks, layout: str | None) -> bool:
    """Whether the account is of the user layout (the given one, else the plan's)."""
    return (stacked.header.layout.value if layout is None else layout) == "user"


def _rank_groups(stacked: StackedRanks, group_tiles: int) -> np.ndarray:
    """Bounds of the groups of consecutive ranks accounted together: each about `group_tiles` tiles, at least one
    rank. Returns int64 [groups + 1], from 0 to the number of ranks."""
    tiles = np.cumsum(stacked.count("tile_stage"))
    bounds, low = [0], 0
    while low < stacked.num_ranks:
        low = max(low + 1, int(np.searchsorted(tiles, (tiles[low - 1] if low else 0) + group_tiles, side="right")))
        bounds.append(min(low, stacked.num_ranks))
    return np.asarray(bounds, dtype=np.int64)


def _peaks(stacked: StackedRanks, table: RequestTable, parts: Iterable[tuple[int, CallArrays]], sizes: Sizes,
           user: bool, path: str | None = None) -> np.ndarray:
    """Each stacked rank's (forward, backward) peak: on `path`, or on both paths, the larger (int64 [ranks, 2])."""
    paths = PATHS if path is None else (path,)
    assert set(paths) <= set(PATHS), path
    num_ranks = stacked.num_ranks
    stores = _Stores.of(stacked, user)
    tile_pulls = tile_pull_rows(stacked)
    messages = {name: stacked_messages(stacked, name, tile_pulls=tile_pulls) for name in PASSES}
    arenas = _stacked_arenas(stacked, messages) if "ranges" in paths else None
    figures, ranges = [], np.zeros(num_ranks, dtype=np.int64)
    for first, calls in parts:
        if "packing" in paths:
            figures.append(_CallFigures.of(stacked, stores, table, first, calls, sizes))
        if arenas is not None:
            ranges += _ranges_per_rank(stacked, table, first, calls, arenas)
    # Index tensors, made before the forward's first stage and kept for the step: the packing path's call plan
    # (int32), the range path's ranges (q_ranges, k_ranges and masks: int32 [ranges, 2] each).
    index = {"ranges": 4 * 6 * ranges}
    if figures:
        joined = _CallFigures.join(figures)
        index["packing"] = 4 * np.bincount(joined.rank, weights=joined.index_ints, minlength=num_ranks).astype(np.int64)
    own = _OwnBytes.of(stacked, stores, sizes, user)
    out = np.zeros((num_ranks, 2), dtype=np.int64)
    for column, name in enumerate(PASSES):
        forward = name == "fwd"
        totals = []
        for kernels in paths:
            if kernels == "packing":
                stage_of_call = np.where(joined.backward == (not forward), joined.stage, -2)
                above = _pass_peak(num_ranks, messages[name], stage_of_call, stores, joined, sizes, name)
            else:
                above = _range_pass_peak(num_ranks, messages[name], stores, arenas[name], sizes, name)
            totals.append(own.total(name, above) + (index[kernels] if forward else 0))
        out[:, column] = np.max(totals, axis=0)
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
    pull_send_largest_run: np.ndarray  # the rows of its largest run there (where what comes back lands)
    pull_send_whole: np.ndarray  # its rows are the whole store (one run)
    pull_send_relayed_row: np.ndarray  # the stacked pull_recv row it is relayed from (-1: the rank's own rows)
    # Sent from the rank's Q, K, V, views of the user layout's packed rows: not contiguous (but for a single row).
    pull_send_strided: np.ndarray

    @classmethod
    def of(cls, stacked: StackedRanks, user: bool = False) -> "_Stores":
        a = stacked.arrays
        runs, largest = _send_runs(stacked)
        plan_tokens, recv_rows = stacked.plan_tokens(), stacked.pull_tokens("recv")
        send_rows = stacked.pull_tokens("send")
        source, rank = a["pull_send_source"], stacked.rank_of("pull_send_round")
        relayed = np.minimum(stacked.base("pull_recv_round")[rank] + source, max(recv_rows.size - 1, 0))
        store_rows = np.where(source < 0, plan_tokens[rank], recv_rows[relayed] if recv_rows.size else 0)
        return cls(plan_tokens=plan_tokens, pull_recv_kind=a["pull_recv_kind"], pull_recv_rows=recv_rows,
                   pull_send_kind=a["pull_send_kind"], pull_send_rows=send_rows, pull_send_copies=runs > 1,
                   pull_send_largest_run=largest, pull_send_whole=(runs == 1) & (send_rows == store_rows),
                   pull_send_relayed_row=np.where(source < 0, -1, relayed),
                   pull_send_strided=(source < 0) & (send_rows > 1) & user)


@dataclass(frozen=True, slots=True, kw_only=True)
class _OwnBytes:
    """Per pass and stacked rank, what the rank holds whatever its kernel path and stages (int64 [ranks] each):
    its accumulators all pass long (`base`); its outputs in the input dtype at the end; in the user layout the
    reshuffles' tensors: what is kept all pass (`held`: forward the all-to-all's sent and received rows and the
    plan-layout Q, K, V; backward the plan-layout dO), what the end adds beside the outputs (`end`: the output's
    reshuffle back), what the pass holds before its accumulators are made (`before`) and the reshuffle's index
    tensors (`index`, forward)."""

    base: dict[str, np.ndarray]
    outputs: dict[str, np.ndarray]
    held: dict[str, np.ndarray]
    end: dict[str, np.ndarray]
    before: dict[str, np.ndarray]
    index: dict[str, np.ndarray]

    @classmethod
    def of(cls, stacked: StackedRanks, stores: _Stores, sizes: Sizes, user: bool) -> "_OwnBytes":
        tokens = stores.plan_tokens
        fields = {name: {} for name in ("base", "outputs", "held", "end", "before", "index")}
        for name in PASSES:
            fields["base"][name], fields["outputs"][name] = _own_bytes(tokens, sizes, name == "fwd")
            for field in ("held", "end", "before", "index"):
                fields[field][name] = np.zeros_like(tokens)
        if user:
            plan, mine = tokens, _user_tokens(stacked)
            own = _self_tokens(stacked)
            qkv = sizes.q + 2 * sizes.kv  # a row of Q, K, V packed side by side
            # A blocking reshuffle makes its receive buffer, then the index-gathered copy it sends (freed when the
            # all-to-all returns), then the rows in the other layout that it places the received rows in.
            to_plan, to_user = plan + np.maximum(mine, plan), mine + np.maximum(plan, mine)
            # Forward: Q, K, V packed [user rows]; the all-to-all's receive and send (an index-gathered copy), and
            # the plan-layout rows they fill, the rows that stay copied in by index; then all but the packed input
            # kept all pass (the work holds what it moves, the finishing closure the work and the receive); at the
            # end the output goes back.
            fields["before"]["fwd"] = (2 * mine + 2 * plan + own) * qkv
            fields["held"]["fwd"] = (mine + 2 * plan) * qkv
            if stacked.header.num_ranks == 1:  # the exchange is a copy, done when made: its send is not held
                fields["before"]["fwd"] = (mine + plan + np.maximum(mine, plan + own)) * qkv
                fields["held"]["fwd"] = 2 * plan * qkv
            fields["end"]["fwd"] = to_user * sizes.q
            fields["index"]["fwd"] = 8 * (mine + plan + 2 * own)  # int64 gather, scatter and the rows that stay
            # Backward: dO comes in (its plan-layout rows kept all pass); at the end dQ, dK, dV packed side by side
            # [plan rows] go back.
            fields["before"]["bwd"] = to_plan * sizes.q
            fields["held"]["bwd"] = plan * sizes.q
            fields["end"]["bwd"] = (plan + to_user) * qkv
        return cls(**fields)

    def total(self, name: str, above: np.ndarray) -> np.ndarray:
        """A pass's peak, given the most its stages hold above its accumulators (`above`, per rank)."""
        ends = self.outputs[name] + self.end[name]
        during = self.base[name] + self.held[name] + np.maximum(np.asarray(above, dtype=np.int64), ends)
        return self.index[name] + np.maximum(self.before[name], during)


def _user_tokens(stacked: StackedRanks) -> np.ndarray:
    """Tokens each stacked rank holds in the user layout: rows [floor(r T / N), floor((r + 1) T / N))."""
    header = stacked.header
    ranks = stacked.ranks.astype(np.int64)
    return (ranks + 1) * header.total_tokens // header.num_ranks - ranks * header.total_tokens // header.num_ranks


def _self_tokens(stacked: StackedRanks) -> np.ndarray:
    """Tokens each stacked rank's reshuffle sends to itself (rows that stay on it)."""
    a = stacked.arrays
    position = stacked.rank_of("reshuffle_send_peer")
    mine = a["reshuffle_send_peer"] == stacked.ranks[position]
    return np.bincount(position[mine], weights=a["reshuffle_send_length"][mine],
                       minlength=stacked.num_ranks).astype(np.int64)


@dataclass(frozen=True, slots=True, kw_only=True)
class _CallFigures:
    """Per kernel call: its rank (position in the stack), pass and stage, the most bytes it holds at once in its
    pass (:func:`_call_transients`), and the int32 values of its index tensors (:func:`_index_ints`)."""

    rank: np.ndarray
    backward: np.ndarray  # bool
    stage: np.ndarray  # the stage of its request (-1: the forward's tiles that run during the user layout's reshuffle)
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
        return cls(rank=facts.call_rank, backward=backward, stage=table.request_stage[request],
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
    # Per call: rows of sources read and written by index, all and the largest source's, and the largest source's
    # rows of those that are one run (in place); keys: the backward's calls only, 0 for others.
    q_indexed: tuple[np.ndarray, np.ndarray, np.ndarray]
    kv_indexed: tuple[np.ndarray, np.ndarray, np.ndarray]

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


def _indexed_rows(call, source, row, rows, num_calls) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Per call, the rows of sources whose pieces are not one run in both the packed tensor and the store (those
    the runtime reads and writes by index, a source at a time): their total, and the largest source's; and the
    largest source's rows among the others (one run: read and written in place)."""
    if call.size == 0:
        return tuple(np.zeros(num_calls, dtype=np.int64) for _ in range(3))
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
    all_rows = np.bincount(group, weights=n).astype(np.int64)
    indexed = np.bincount(group, weights=broken) > 0
    group_rows = np.where(indexed, all_rows, 0)
    group_call = c[~same]
    total = np.bincount(group_call, weights=group_rows, minlength=num_calls).astype(np.int64)
    largest = np.zeros(num_calls, dtype=np.int64)
    np.maximum.at(largest, group_call, group_rows)
    span = np.zeros(num_calls, dtype=np.int64)
    np.maximum.at(span, group_call, np.where(indexed, 0, all_rows))
    return total, largest, span


def _send_copies(stacked: StackedRanks) -> np.ndarray:
    """Whether each sent pull's segments (stacked rows) are not one run of the store it is sent from (its rank's
    plan layout, or a received pull's buffer for a relay): the runtime packs those into a copy."""
    return send_runs(stacked) > 1


def send_runs(stacked: StackedRanks) -> np.ndarray:
    """How many runs of consecutive rows each sent pull's segments (stacked rows) make in the store it is sent from
    (its rank's plan layout, or a received pull's buffer for a relay), which is also where what comes back along it
    lands (int64 per stacked pull_send row, at least 1)."""
    return _send_runs(stacked)[0]


def _send_runs(stacked: StackedRanks) -> tuple[np.ndarray, np.ndarray]:
    """:func:`send_runs`, and the rows of each sent pull's largest run (int64 per stacked pull_send row)."""
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
    runs = 1 + np.bincount(send_of[broken], minlength=send_count.size).astype(np.int64)
    new_run = broken.copy()
    new_run[:1] = True
    if send_segs.size > 1:
        new_run[1:] |= send_of[1:] != send_of[:-1]
    run = np.cumsum(new_run) - 1
    run_rows = np.bincount(run, weights=seg_len[send_segs]).astype(np.int64) if send_segs.size else run
    largest = np.zeros(send_count.size, dtype=np.int64)
    if send_segs.size:
        np.maximum.at(largest, send_of[new_run], run_rows)
    return runs, largest


def _index_ints(calls: CallArrays, facts: _Facts, backward: np.ndarray) -> np.ndarray:
    """Per call, the int32 values of its index tensors: cu_q and cu_k, and positions and rows of indexed query
    sources (merges) and, in the backward, key sources (dK, dV adds)."""
    entries = np.diff(calls.call_entry_ptr)
    return 2 * (entries + 1) + 2 * (facts.q_indexed[0] + np.where(backward, facts.kv_indexed[0], 0))


def _own_bytes(tokens: np.ndarray, sizes: Sizes, forward: bool) -> tuple[np.ndarray, np.ndarray]:
    """What a rank's own tokens hold in a pass whatever its schedule: the accumulators, all pass long, and the
    outputs in the input dtype beside them at the end (none where the accumulators are in the input dtype: the
    conversion is then the accumulator itself)."""
    base = tokens * ((sizes.q_acc + sizes.lse) if forward else (sizes.q_acc + 2 * sizes.kv_acc))
    converted = sizes.acc_bytes != sizes.dtype_bytes
    return base, tokens * ((sizes.q if forward else sizes.q + 2 * sizes.kv) if converted else 0)


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
    """The packing path: each rank's most bytes above its accumulators in one pass's stages: per stage, what lives
    while its calls run (its posts, the largest call's temporaries) and what lives after its wait (the sent copies
    freed; arrivals' accumulators, landed pushes and their merges); before them, the temporaries of the calls that
    run during the user layout's reshuffle. `stage_of_call`: per call its stage in this pass (-1: before the
    stages; -2: the other pass's). Returns int64 [ranks]."""
    forward = name == "fwd"
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
    pushes, sends, landing = _message_bytes(num_ranks, num_stages, messages, stores, sizes, forward)
    mine = stage_of_call >= 0
    largest = np.zeros(num_ranks * num_stages)
    np.maximum.at(largest, calls.rank[mine] * num_stages + stage_of_call[mine], calls.transient[mine])
    early = np.zeros(num_ranks)
    np.maximum.at(early, calls.rank[stage_of_call == -1], calls.transient[stage_of_call == -1])
    peak = np.maximum((during + pushes + sends + largest.reshape(num_ranks, num_stages)).max(axis=1),
                      (after + pushes + landing).max(axis=1))
    return np.maximum(peak, early).astype(np.int64)


def _message_bytes(num_ranks: int, num_stages: int, messages: PassMessages, stores: _Stores, sizes: Sizes,
                   forward: bool, whole: np.ndarray | None = None) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Per (rank, stage), float [num_ranks, num_stages] each: the buffers of the pushes it receives (posted with the
    stage, kept to its end), the copies it sends (until the stage's wait), and the largest merge of a forward push
    landing after the wait (four [heads, rows] LSE terms of its largest run where it lands). `whole`: per sent pull,
    whether its LSE is a whole tensor's (default: whether it is its whole store)."""
    push_bytes = _push_buffer_bytes(stores.pull_send_kind, stores.pull_send_rows, messages, sizes, forward)
    pushes = _per_slot(messages.push_recv_rank, messages.push_recv_stage, push_bytes, num_ranks, num_stages)
    copy = _send_copy_bytes(stores, sizes, forward, stores.pull_send_whole if whole is None else whole)
    sends = _per_slot(messages.pull_send_rank, messages.pull_send_stage, copy, num_ranks, num_stages)
    landing = np.zeros(num_ranks * num_stages)
    if forward:
        merge = 4 * sizes.lse * stores.pull_send_largest_run[messages.push_recv_pull]
        merge = np.where(stores.pull_send_kind[messages.push_recv_pull] == TransferKind.Q, merge, 0)
        np.maximum.at(landing, messages.push_recv_rank * num_stages + messages.push_recv_stage, merge)
    return pushes, sends, landing.reshape(num_ranks, num_stages)


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


def _send_copy_bytes(stores: _Stores, sizes: Sizes, forward: bool, whole: np.ndarray) -> np.ndarray:
    """Per sent pull, the bytes of the packed copy the runtime sends: its tensors where its rows are not one run,
    and Q, K, V where they are views of the user layout's packed rows (strided, but for a single row); a backward Q
    pull's LSE (heads-first) where there is more than one head, unless it is a whole tensor's (`whole`)."""
    kv = stores.pull_send_kind == TransferKind.KV
    copies = stores.pull_send_copies
    qkv = copies | stores.pull_send_strided
    rows = stores.pull_send_rows
    if forward:
        return np.where(qkv, np.where(kv, 2 * sizes.kv, sizes.q), 0) * rows
    lse = np.where(copies | ((sizes.q_heads > 1) & ~whole), sizes.lse, 0)
    return np.where(kv, np.where(qkv, 2 * sizes.kv, 0),
                    np.where(qkv, sizes.q, 0) + np.where(copies, 2 * sizes.q, 0) + lse) * rows


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
    one run (freed when the kernel returns) or the largest merge's temporaries (in place: four [heads, rows] LSE
    terms of its source's rows; by index: the gathered accumulator and partial rows, both LSEs, and those four)."""
    q_rows, kv_rows = facts.q_rows, facts.kv_rows
    q_packed, kv_packed = facts.q_runs > 1, facts.kv_runs > 1
    if forward:
        inputs = np.where(q_packed, sizes.q * q_rows, 0) + np.where(kv_packed, 2 * sizes.kv * kv_rows, 0)
        outputs = q_rows * (sizes.q + sizes.lse)
        merge = np.maximum(4 * sizes.lse * facts.q_indexed[2],
                           facts.q_indexed[1] * (sizes.q_acc + sizes.q + 6 * sizes.lse))
        return outputs + np.maximum(inputs, merge)
    # The LSE is gathered heads-first: a copy unless it is a whole store, or one run of a single head's rows.
    lse_copy = np.where(facts.q_whole_store | ((facts.q_runs == 1) & (sizes.q_heads == 1)), 0, sizes.lse * q_rows)
    inputs = np.where(q_packed, 3 * sizes.q * q_rows, 0) + lse_copy + np.where(kv_packed, 2 * sizes.kv * kv_rows, 0)
    outputs = q_rows * sizes.q + 2 * kv_rows * sizes.kv
    # An add by index gathers the results' rows, converted to the accumulators' dtype (a copy where it differs).
    converted = sizes.acc_bytes != sizes.dtype_bytes
    adds = np.maximum(facts.q_indexed[1] * (sizes.q + converted * sizes.q_acc),
                      facts.kv_indexed[1] * 2 * (sizes.kv + converted * sizes.kv_acc))
    return outputs + np.maximum(inputs, adds)


@dataclass(frozen=True, slots=True, kw_only=True)
class _StackedArenas:
    """One pass's arenas of every stacked rank (:func:`fcp_compiler.format.arena.rank_arenas`, rank by rank): each
    received pull's first row in its kind's arena (int64 per stacked pull_recv row) and each rank's arena rows per
    kind (int64 [ranks])."""

    pull_offset: np.ndarray
    rows: dict[int, np.ndarray]


def _stacked_arenas(stacked: StackedRanks, messages: dict[str, PassMessages]) -> dict[str, _StackedArenas]:
    """Every stacked rank's arenas per pass, placed as :func:`fcp_compiler.format.arena.rank_arenas` places them
    (the same placement, every arena at once: :func:`fcp_compiler.algorithms.arena.place_arenas`)."""
    rows, order = received_pull_order(stacked)
    arena = stacked.rank_of("pull_recv_kind") * 2 + stacked.arrays["pull_recv_kind"]  # one arena per (rank, kind)
    out = {}
    for name in PASSES:
        placed = place_arenas(arena, rows, messages[name].pull_recv_stage, messages[name].pull_recv_last, order,
                              2 * stacked.num_ranks)
        extent = placed.arena_rows.reshape(stacked.num_ranks, 2)
        out[name] = _StackedArenas(pull_offset=placed.offset, rows={kind: extent[:, kind] for kind in TransferKind})
    return out


def _ranges_per_rank(stacked: StackedRanks, table: RequestTable, first: int, calls: CallArrays,
                     arenas: dict[str, _StackedArenas]) -> np.ndarray:
    """The range path's ranges per stacked rank of one part's calls (call_request counted from request `first`):
    the ranges :func:`fcp_compiler.format.arena.range_calls` makes of them over each rank's arenas
    (:func:`~fcp_compiler.format.arena.ranges_per_request`). int64 [ranks]."""
    call_rank = table.request_rank[calls.call_request + first]
    key_rank = call_rank[calls.entry_call[calls.key_entry]]
    # Received pulls as stacked rows, so that one placement (the stacked offsets) serves every rank's calls.
    key_source = calls.key_source
    stacked_calls = dataclasses.replace(calls, key_source=np.where(
        key_source == LOCAL, LOCAL, key_source + stacked.base("pull_recv_round")[key_rank]))
    placed = {name: Arenas(pull_offset=arena.pull_offset, q_rows=0, kv_rows=0) for name, arena in arenas.items()}
    request_backward = table.request_backward[first:]
    ranges = ranges_per_request(stacked_calls, request_backward, placed, request_backward.size)
    return np.bincount(table.request_rank[first:], weights=ranges, minlength=stacked.num_ranks).astype(np.int64)


def _range_pass_peak(num_ranks: int, messages: PassMessages, stores: _Stores, arenas: _StackedArenas, sizes: Sizes,
                     name: str) -> np.ndarray:
    """The range path: each rank's most bytes above its accumulators in one pass's stages (:func:`_pass_peak`'s
    figure): the arenas, each from the stage that posts its kind's first pull to the end of the pass (their
    accumulators in it), a backward Q pull's LSE in a buffer of its own until it is copied in place after the
    stage's wait, the pushes and sent copies as on the packing path, and a forward Q pull's LSE copied to be pushed
    back (its arena rows are not one run where there is more than one head, unless they are the whole arena).
    Returns int64 [ranks]."""
    forward = name == "fwd"
    num_stages = max(messages.num_stages, 1)
    kinds = stores.pull_recv_kind
    recv_rows = stores.pull_recv_rows
    buffer_row, accumulator_row = _received_row_bytes(sizes, forward)
    held = np.zeros((num_ranks, num_stages))
    everyone = np.arange(num_ranks)
    for kind in (TransferKind.KV, TransferKind.Q):
        mine = kinds == kind
        posted = np.full(num_ranks, num_stages, dtype=np.int64)  # made when the kind's first pull is posted
        np.minimum.at(posted, messages.pull_recv_rank[mine], messages.pull_recv_stage[mine])
        held += _interval_sums(everyone, posted, np.full(num_ranks, num_stages - 1),
                               (buffer_row[kind] + accumulator_row[kind]) * arenas.rows[kind], num_ranks, num_stages)
    # A relay sends from its arena rows: a whole tensor only where they are the whole arena.
    source = stores.pull_send_relayed_row
    relays = source >= 0
    whole = stores.pull_send_whole.copy()
    whole[relays] &= recv_rows[source[relays]] == arenas.rows[TransferKind.Q][messages.pull_send_rank[relays]]
    pushes, sends, landing = _message_bytes(num_ranks, num_stages, messages, stores, sizes, forward, whole)
    during = held + pushes + sends
    if not forward:  # a Q pull's LSE, received whole
        lse = np.where(kinds == TransferKind.Q, sizes.lse * recv_rows, 0)
        during += _per_slot(messages.pull_recv_rank, messages.pull_recv_stage, lse, num_ranks, num_stages)
    elif sizes.q_heads > 1:  # a contiguous copy of the LSE's arena rows, unless they are the whole arena
        rows = recv_rows[messages.push_send_pull]
        copied = np.where(rows < arenas.rows[TransferKind.Q][messages.push_send_rank], sizes.lse * rows, 0)
        during += _per_slot(messages.push_send_rank, messages.push_send_stage, copied, num_ranks, num_stages)
    return np.maximum(during.max(axis=1), (held + pushes + landing).max(axis=1)).astype(np.int64)

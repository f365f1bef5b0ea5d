"""The plan validator: checks every invariant of docs/DESIGN.md section 4 from the per-rank programs alone.

It shares no code with the passes: it reads what each rank will execute (blocks, pulls, tiles, pushes, reshuffle
runs) and rebuilds every global property from that. The first broken invariant raises PlanInvalidError naming the
invariant and where it breaks.
"""

from __future__ import annotations

import multiprocessing
import os
import sys
from dataclasses import dataclass

import numpy as np

from fcp_compiler.algorithms.fan_out import class_degrees, nvlink_lanes
from fcp_compiler.algorithms.keys import (lexsort_ints, search_sorted, sorted_unique, sorted_unique_counts,
                                          stable_argsort)
from fcp_compiler.algorithms.limits import MAX_SEGMENT_PAIRS
from fcp_compiler.algorithms.limits import segment_pairs as count_segment_pairs
from fcp_compiler.algorithms.liveness import peak_live_tokens
from fcp_compiler.algorithms.pages import base_pages
from fcp_compiler.errors import PlanFormatError
from fcp_compiler.format.memory import stacked_peak_bytes
from fcp_compiler.format.plan_format import PlanReader, TransferKind, expand_ranges
from fcp_compiler.format.stacked import StackedRanks, stack_reader

# Coverage is checked by enumerating every (query segment, key segment) pair of a sequence: past this many the
# validator refuses rather than exhaust memory (only a ring over hundreds of GPUs comes near it).
MAX_VALIDATED_PAIRS = MAX_SEGMENT_PAIRS  # the compiler refuses larger plans (algorithms/limits.py)

INVARIANTS = {
    0: "well-formed blocks",
    1: "coverage",
    2: "data before use",
    3: "congestion freedom",
    4: "memory",
    5: "reshuffle bijection",
    7: "one layout for every layer kind",  # of a plan of layer kinds (format/validate_kinds.py)
}


class PlanInvalidError(PlanFormatError):
    """A plan breaks an invariant; `invariant` is its number in docs/DESIGN.md section 4 (0: the blocks themselves)."""

    def __init__(self, invariant: int, message: str):
        super().__init__(f"invariant {invariant} ({INVARIANTS[invariant]}) broken: {message}")
        self.invariant, self.message = invariant, message

    def __reduce__(self):  # a worker process's refusal reaches its parent intact (pickled by its arguments)
        return PlanInvalidError, (self.invariant, self.message)


@dataclass(frozen=True, slots=True, kw_only=True)
class ValidationReport:
    """What the validator counted on a valid plan."""

    num_ranks: int
    num_blocks: int
    num_tiles: int
    num_pulls: int
    num_rounds: int
    max_degree: int
    nvlink_degree: int
    nic_degree: int
    num_pushes_fwd: int
    num_pushes_bwd: int
    max_buffer_tokens: int
    max_buffer_bytes_fwd: int  # the busiest rank's, as the header states and the memory account gives
    max_buffer_bytes_bwd: int


def _fail(invariant: int, message: str) -> None:
    raise PlanInvalidError(invariant, message)


@base_pages()
def validate_plan(source: str | bytes | PlanReader, background: bool = False,
                  memory_account: bool = True) -> ValidationReport:
    """Check every invariant of a plan; return counts, or raise naming the first broken invariant.

    Every reader first checks the file's integrity (sha256 of the header and of each section) and its structure
    (:mod:`fcp_compiler.format.plan_structure`: sizes agree, every index, round and stage within the header's counts).
    This function then checks what the plan means, one function per invariant of docs/DESIGN.md section 4, in its order:

    0. :func:`_check_blocks`: segments tile every sequence once, no block over the block size, one owner a block.
    1. :func:`_check_coverage`: every block pair with a visible (query, key) pair is one tile, run exactly once.
    2. :func:`_check_data_before_use`: every pull is received as it is sent (block, kind, segments, rounds) from
       the block's owner or a relay that holds it; every tile's data arrives in an earlier stage of its pass; every
       result is pushed after its last tile; a relay re-sends only after it receives, and pushes after the
       gradients it sums.
    3. :func:`_check_congestion_freedom`: every round of each pass is congestion-free per link class (NVLink inside
       a node, nvlink_lanes matchings a round; the NIC across, one) over pulls and pushes; the header's per-class
       Delta, round and stage counts are the ones the plan has.
    4. :func:`_check_memory`: the token cap, the per-stage receive bound and the live buffers (equal to the header's
       max_buffer_tokens, by the liveness rule the runtime uses) hold; :func:`_check_memory_bytes`: each rank's
       peak bytes per pass are the header's max_buffer_bytes_fwd/_bwd, by the memory account of the tensors the
       runtime creates, and within memory_budget_bytes.
    5. :func:`_check_reshuffle`: the reshuffle maps user-layout tokens one to one onto the plan layout, as both sides
       pack them.

    What the runtime reads (fcp_runtime/plan.py, attention.py), and which check covers it (S: the structural
    checks every reader runs first, plan_structure.py and PlanHeader's bounds; a number: the invariant above):

    - header num_ranks, coalesce, bwd_coalesce, layout, shape: S (ranges); the group size against the plan is checked
      by the runtime itself (`check_plan`). num_fwd_stages, num_bwd_stages, num_rounds: S (bounded by ranks x blocks
      and by the rank sections' bytes), 3 (the ones the plan has). max_buffer_tokens, max_buffer_bytes_fwd/_bwd,
      memory_budget_bytes: 4.
    - seq_lengths, seq_window, seg_block, seg_seq, seg_start, seg_end: S (every block has a segment, in order; every
      segment inside its sequence; no block over the block size; tokens add up), 0 (segments tile every sequence).
    - blocks: S (in range, no block listed twice on a rank), 0 (one owner a block: plan-layout rows are each token
      once).
    - tile_q_block, tile_kv_block, tile_stage, tile_bwd_stage: S (ranges), 1 (each visible pair once), 2 (data
      before use).
    - pull_{send,recv}_{round,bwd_round,kind,block,peer,seg_count,segs}, pull_send_source: S (ranges, segment counts
      add up), 2 (each pull received as sent, from a holder other than the receiver, no segment listed twice), 3
      (rounds congestion-free, both ends in the same round). Two messages of one pair may share a round (NVLink
      lanes); the runtime posts a pair's messages in an order both ends derive from what they agree on (round,
      pull or push, kind, block), never from their own row numbers, so posting-order matching holds whatever
      order each end lists its rows in.
    - {fwd,bwd}_push_{send,recv}_{round,pull}: S (ranges, stage within the pass), 2 (pushed after the last tile,
      received along its pull), 3.
    - reshuffle_{send,recv}_{peer,offset,length}: S (runs within the rank's user chunk or plan layout, grouped by
      peer in ascending order, as `all_to_all_single` and `dispatch()` pack them), 5 (a bijection, both ends of a
      pair packing the same tokens in the same order).

    Invariant 6 (determinism) is a property of the compiler, not of one plan: the tests compile twice and compare.
    Not checked, because nothing a reader does depends on them: the inputs digest (a hash of the compile's inputs,
    which the plan does not carry), the profile's and shape's figures (they only feed the simulator), the order of
    tiles inside a stage (any order gives the same sums up to floating-point rounding), and whether the schedule is
    a good one.

    Args:
        source: a plan file's path, its bytes, or a PlanReader.
        background: where the plan has BACKGROUND_TILES tiles or more, compute the memory account (the longest
            check) in a forked child process while this one checks the rest, where the platform forks (Linux) and
            this process may run on more than one CPU: the same checks in the same order, the same report and the
            same first error. For a process of our own (`fcp validate`); a library caller in a process with threads
            of its own (a training job) keeps the default, one process.
        memory_account: False skips the memory account (two thirds of the time): each rank's peak bytes are not
            recomputed, and the report gives the header's as stated. Every check whose breach would compute
            attention wrong still runs; for the runtime's reader, which allocates what a plan needs whatever its
            header states.
    Raises:
        PlanFormatError: the file cannot be read, or it is too large to enumerate its segment pairs.
        PlanInvalidError: an invariant is broken (its number, name and where).
    """
    plan = _read(source if isinstance(source, PlanReader) else PlanReader(source))
    account = _Account(plan.stack, background) if memory_account else None
    try:
        return _check_in_order(plan, account)
    finally:
        if account is not None:
            account.close()


def _check_in_order(plan: _Plan, account: "_Account | None") -> ValidationReport:
    """validate_plan's checks, in their order, the memory account's peaks taken from `account` (None: the header's,
    unchecked)."""
    blocks = _check_blocks(plan)
    tiles = _check_coverage(plan, blocks)
    pulls = _stack_pulls(plan)
    passes = _check_data_before_use(plan, blocks, tiles, pulls)
    max_degree = _check_congestion_freedom(plan, blocks, pulls, passes)
    max_buffer = _check_memory(plan, blocks, pulls, passes)
    peak_bytes = _check_memory_bytes(plan, account.peaks()) if account is not None else \
        np.column_stack([plan.header.max_buffer_bytes_fwd, plan.header.max_buffer_bytes_bwd]).astype(np.int64)
    _check_reshuffle(plan)
    return ValidationReport(num_ranks=plan.header.num_ranks, num_blocks=blocks.num_blocks,
                            num_tiles=int(tiles.q.size), num_pulls=int(pulls.kind.size),
                            num_rounds=plan.header.num_rounds, max_degree=max_degree,
                            nvlink_degree=plan.header.nvlink_degree, nic_degree=plan.header.nic_degree,
                            num_pushes_fwd=int(passes[0].push.round.size),
                            num_pushes_bwd=int(passes[1].push.round.size), max_buffer_tokens=max_buffer,
                            max_buffer_bytes_fwd=int(peak_bytes[:, 0].max()),
                            max_buffer_bytes_bwd=int(peak_bytes[:, 1].max()))


@dataclass(frozen=True, slots=True, kw_only=True)
class _Plan:
    """What the validator reads: the header, the global tables, and every rank's arrays stacked once, each pull's
    segments listed."""

    header: object
    tables: object
    stack: StackedRanks

    @property
    def num_ranks(self) -> int:
        return self.header.num_ranks

    def stacked(self, name: str) -> tuple[np.ndarray, np.ndarray]:
        """One per-rank array over every rank, and the rank of each row."""
        return self.stack.arrays[name], self.stack.rank_of(name)

    def row_base(self, name: str) -> np.ndarray:
        """Per rank, the first stacked row of its `name` table (and the end)."""
        return self.stack.bounds[name]


def segment_pairs(reader: PlanReader) -> int:
    """How many (segment, segment) pairs of the same sequence the validator enumerates for this plan; past
    MAX_VALIDATED_PAIRS it refuses the plan (a ring over hundreds of GPUs), so callers that score many plans can
    say which ones were too large to validate instead of failing."""
    return count_segment_pairs(reader.tables.seg_seq, reader.header.num_sequences)


def validate_unless_too_large(source) -> bool:
    """Validate a plan (bytes, path or reader) unless it has more segment pairs than the validator enumerates (a
    ring over hundreds of GPUs): for callers that score many plans and must say which ones went unvalidated.

    Returns:
        whether the plan was validated.
    Raises:
        PlanInvalidError, PlanFormatError: as :func:`validate_plan`, for a plan small enough to validate.
    """
    reader = source if isinstance(source, PlanReader) else PlanReader(source)
    if segment_pairs(reader) > MAX_VALIDATED_PAIRS:
        return False
    validate_plan(reader)
    return True


def _read(reader: PlanReader) -> _Plan:
    """Decode every rank, refusing a plan too large to enumerate its segment pairs."""
    header, tables = reader.header, reader.tables
    num_pairs = segment_pairs(reader)
    if num_pairs > MAX_VALIDATED_PAIRS:
        raise PlanFormatError(f"the plan cuts its sequences into {num_pairs:,} segment pairs, more than the "
                              f"{MAX_VALIDATED_PAIRS:,} the validator enumerates (the compiler refuses such "
                              f"plans too; a ring baseline over hundreds of GPUs is scored unvalidated)")
    # Read end to end (whole-block pulls are listed once, over the stack), no rank decoded on its own.
    return _Plan(header=header, tables=tables, stack=stack_reader(reader))


@dataclass(frozen=True, slots=True, kw_only=True)
class _Blocks:
    """The blocks as the plan states them: tokens and owner of each, and each rank's held blocks."""

    num_blocks: int
    block_tokens: np.ndarray
    owner: np.ndarray
    held: np.ndarray  # stacked `blocks` rows ...
    held_rank: np.ndarray  # ... and the rank holding each


def _check_segments_tile_sequences(plan: _Plan) -> None:
    """0. Segments tile every sequence exactly once, in order, and the lengths agree with the header."""
    header, tables = plan.header, plan.tables
    lengths = tables.seq_lengths
    if lengths.size != header.num_sequences or int(lengths.sum()) != header.total_tokens or (lengths < 1).any():
        _fail(0, f"sequence lengths ({lengths.size} sequences, {int(lengths.sum())} tokens) disagree with the "
                 f"header ({header.num_sequences}, {header.total_tokens})")
    seg_block, seg_seq, seg_start, seg_end = tables.seg_block, tables.seg_seq, tables.seg_start, tables.seg_end
    if (seg_end <= seg_start).any() or (seg_seq < 0).any() or (seg_seq >= lengths.size).any():
        bad = int(np.flatnonzero((seg_end <= seg_start) | (seg_seq < 0) | (seg_seq >= lengths.size))[0])
        _fail(0, f"segment {bad} is empty or names no sequence")
    if (np.diff(seg_block) < 0).any() or seg_block[0] != 0:
        _fail(0, "segments are not sorted by block")
    by_seq = lexsort_ints((seg_start, seg_seq))
    s_seq, s_start, s_end = seg_seq[by_seq], seg_start[by_seq], seg_end[by_seq]
    first = np.ones(seg_block.size, dtype=bool)
    first[1:] = s_seq[1:] != s_seq[:-1]
    last = np.ones(seg_block.size, dtype=bool)
    last[:-1] = s_seq[1:] != s_seq[:-1]
    gaps = (first & (s_start != 0)) | (~first & (s_start != np.concatenate(([0], s_end[:-1]))))
    if gaps.any() or (s_end[last] != lengths[s_seq[last]]).any() or np.unique(s_seq).size != lengths.size:
        where = int(s_seq[np.flatnonzero(gaps)[0]]) if gaps.any() else -1
        _fail(0, f"segments do not cover every sequence exactly once (sequence {where})")


def _check_blocks(plan: _Plan) -> _Blocks:
    """0. Well-formed blocks: segments tile the sequences, no block over the block size, one owner a block."""
    _check_segments_tile_sequences(plan)
    tables, block_size = plan.tables, plan.header.block_size
    num_blocks = int(tables.seg_block[-1]) + 1
    block_tokens = np.bincount(tables.seg_block, weights=tables.seg_end - tables.seg_start,
                               minlength=num_blocks).astype(np.int64)
    if block_tokens.max() > block_size:
        bad = int(np.argmax(block_tokens))
        _fail(0, f"block {bad} holds {int(block_tokens[bad])} tokens, more than the block size {block_size}")
    held, held_rank = plan.stacked("blocks")
    counts = np.bincount(held, minlength=num_blocks) if held.size else np.zeros(num_blocks, dtype=np.int64)
    if (counts != 1).any():
        bad = int(np.flatnonzero(counts != 1)[0])
        _fail(0, f"block {bad} is held by {int(counts[bad])} ranks")
    owner = np.empty(num_blocks, dtype=np.int64)
    owner[held] = held_rank
    return _Blocks(num_blocks=num_blocks, block_tokens=block_tokens, owner=owner, held=held, held_rank=held_rank)


def _in_sorted(values: np.ndarray, members: np.ndarray) -> np.ndarray:
    """np.isin(values, members) for sorted unique int members, by binary search: no unique of millions of values
    (numpy's is hash-based and many times slower on them)."""
    if members.size == 0:
        return np.zeros(values.shape, dtype=bool)
    pos = np.minimum(np.searchsorted(members, values), members.size - 1)
    return members[pos] == values


def _visible_segment_pairs(tables) -> tuple[np.ndarray, np.ndarray]:
    """Every (query segment, key segment) pair of one sequence with a visible token pair, enumerated directly (in no
    particular order: :func:`_pair_rank` orders them where a message must name the first).

    Sequence s's window w (seq_window) lets query q see key k when 0 <= q - k < w, or always when w is 0 (full).
    The differences q - k of two segments cover [q_start - k_end + 1, q_end - 1 - k_start]: a pair is visible when
    that range meets [0, w - 1], that is when k_start <= q_end - 1 and k_end >= q_start - w + 2. Segments tile
    their sequence (invariant 0, checked first), so in start order both their starts and their ends rise, and the
    keys a query segment sees are one run of them, found by binary search: O(S log S + P) for S segments and P
    visible pairs, never the pairs a mask hides."""
    seg_seq, seg_start, seg_end = tables.seg_seq, tables.seg_start, tables.seg_end
    order = lexsort_ints((seg_start, seg_seq))
    span = int(seg_end.max(initial=0)) + 2  # above every position: a sequence's keys stay below the next's
    base = seg_seq[order] * span
    start_key, end_key = base + seg_start[order], base + seg_end[order]
    window = tables.seq_window[seg_seq[order]]
    group_low = np.searchsorted(start_key, base, side="left")
    group_high = np.searchsorted(start_key, base + span, side="left")
    high = np.where(window == 0, group_high, np.searchsorted(start_key, end_key - 1, side="right"))
    reach = np.clip(seg_start[order] - window + 2, 0, span)  # the least key end a windowed query sees
    low = np.where(window == 0, group_low, np.searchsorted(end_key, base + reach, side="left"))
    count = np.maximum(high - low, 0)
    return np.repeat(order, count), order[expand_ranges(low, count)]


def _pair_rank(tables, q_seg: np.ndarray, k_seg: np.ndarray) -> np.ndarray:
    """Each segment pair's place in the order that names a failure: by query, then key, each segment by (sequence,
    index)."""
    position = np.empty(tables.seg_seq.size, dtype=np.int64)
    position[stable_argsort(tables.seg_seq)] = np.arange(tables.seg_seq.size)
    return position[q_seg] * tables.seg_seq.size + position[k_seg]


def _check_coverage(plan: _Plan, blocks: _Blocks) -> _Tiles:
    """1. Coverage: every block pair with a visible (query, key) pair is one tile, run exactly once."""
    num_blocks, seg_block = blocks.num_blocks, plan.tables.seg_block
    q_seg, k_seg = _visible_segment_pairs(plan.tables)
    required = sorted_unique(seg_block[q_seg] * num_blocks + seg_block[k_seg])
    tile_q, tile_rank = plan.stacked("tile_q_block")
    tile_kv, _ = plan.stacked("tile_kv_block")
    tile_key = tile_q * num_blocks + tile_kv
    keys, key_count = sorted_unique_counts(tile_key)
    if (key_count > 1).any():
        dup = int(keys[np.argmax(key_count > 1)])
        _fail(1, f"tile (q block {dup // num_blocks}, kv block {dup % num_blocks}) runs "
                 f"{int(key_count.max())} times")
    missing = np.setdiff1d(required, keys, assume_unique=True)
    if missing.size:
        _fail(1, f"tile (q block {int(missing[0]) // num_blocks}, kv block {int(missing[0]) % num_blocks}) "
                 f"has visible pairs but runs nowhere ({missing.size} such tiles)")
    extra = np.setdiff1d(keys, required, assume_unique=True)
    if extra.size:
        _fail(1, f"tile (q block {int(extra[0]) // num_blocks}, kv block {int(extra[0]) % num_blocks}) has no "
                 f"visible pair (an empty tile)")
    return _Tiles(q=tile_q, kv=tile_kv, rank=tile_rank, q_seg=q_seg, k_seg=k_seg, key=tile_key)


@dataclass(frozen=True, slots=True, kw_only=True)
class _Pulls:
    """Every pull row as its receiver states it, and as its sender does, each stacked over ranks."""

    kind: np.ndarray
    block: np.ndarray
    me: np.ndarray
    peer: np.ndarray
    count: np.ndarray
    seg_first: np.ndarray  # where each row's segments start in `segs`
    segs: np.ndarray
    tokens: np.ndarray
    send_me: np.ndarray
    send_kind: np.ndarray
    send_block: np.ndarray
    send_peer: np.ndarray
    send_count: np.ndarray
    send_seg_first: np.ndarray
    send_segs: np.ndarray
    send_source: np.ndarray  # per sent row, the received row (stacked) it relays, -1 for the sender's own block

    @property
    def send_order(self) -> np.ndarray:
        """Sent rows in (sender, receiver, kind, block) order; recv_order lists the received rows the same way."""
        return lexsort_ints((self.send_block, self.send_kind, self.send_peer, self.send_me))

    @property
    def recv_order(self) -> np.ndarray:
        return lexsort_ints((self.block, self.kind, self.me, self.peer))


@dataclass(frozen=True, slots=True, kw_only=True)
class _Tiles:
    """Every tile row stacked over ranks, and the visible segment pairs of the batch."""

    q: np.ndarray
    kv: np.ndarray
    rank: np.ndarray
    q_seg: np.ndarray
    k_seg: np.ndarray
    key: np.ndarray


@dataclass(frozen=True, slots=True, kw_only=True)
class _PassProgram:
    """One pass's rounds and stages, as the ranks state them."""

    label: str
    recv_round: np.ndarray
    send_round: np.ndarray
    tile_stage: np.ndarray
    push_kinds: tuple[int, ...]
    num_rounds: int
    num_stages: int
    coalesce: int  # rounds per stage of this pass


@dataclass(frozen=True, slots=True, kw_only=True)
class _PassFacts:
    """What invariant 2 established about one pass, which invariants 3 and 4 read."""

    program: _PassProgram
    last_use: np.ndarray  # per received pull row, the last stage a tile reads it
    push: _Pushes
    relay_last: np.ndarray  # per received pull row, the last stage it serves a relay (-1: none)


def _stack_pulls(plan: _Plan) -> _Pulls:
    """Both ends' pull tables, stacked over ranks (no checks: invariant 2 compares them)."""
    sides = {}
    for side in ("send", "recv"):
        sides[side] = {name: plan.stacked(f"pull_{side}_{name}")[0]
                       for name in ("kind", "block", "peer", "seg_count", "segs")}
        sides[side]["me"] = plan.stacked(f"pull_{side}_round")[1]
        count = sides[side]["seg_count"]
        sides[side]["seg_first"] = np.concatenate(([0], np.cumsum(count)[:-1])).astype(np.int64)
    send, recv = sides["send"], sides["recv"]
    source, _ = plan.stacked("pull_send_source")
    send_source = np.where(source >= 0, source + plan.row_base("pull_recv_round")[send["me"]], -1)
    return _Pulls(kind=recv["kind"], block=recv["block"], me=recv["me"], peer=recv["peer"], count=recv["seg_count"],
                  seg_first=recv["seg_first"], segs=recv["segs"],
                  tokens=plan.stack.pull_tokens("recv"), send_me=send["me"],
                  send_kind=send["kind"], send_block=send["block"], send_peer=send["peer"],
                  send_count=send["seg_count"], send_seg_first=send["seg_first"], send_segs=send["segs"],
                  send_source=send_source)


def _pass_programs(plan: _Plan) -> tuple[_PassProgram, _PassProgram]:
    """The forward and the backward program, with the rounds a stage the header states for each."""
    header = plan.header
    programs = []
    for label, recv_name, send_name, stage_name, kinds, num_rounds, num_stages, coalesce in (
            ("fwd", "pull_recv_round", "pull_send_round", "tile_stage", (TransferKind.Q,), header.num_fwd_rounds,
             header.num_fwd_stages, header.coalesce),
            ("bwd", "pull_recv_bwd_round", "pull_send_bwd_round", "tile_bwd_stage", (TransferKind.Q, TransferKind.KV),
             header.num_bwd_rounds, header.num_bwd_stages, header.bwd_coalesce)):
        programs.append(_PassProgram(label=label, recv_round=plan.stacked(recv_name)[0],
                                     send_round=plan.stacked(send_name)[0], tile_stage=plan.stacked(stage_name)[0],
                                     push_kinds=kinds, num_rounds=num_rounds, num_stages=num_stages,
                                     coalesce=coalesce))
    return programs[0], programs[1]


def _check_pulls_agree(plan: _Plan, blocks: _Blocks, pulls: _Pulls) -> None:
    """2. Each pull is received as it is sent: the same endpoints, kind, block, forward round and segments; the
    sender owns the block or names the pull it received it by; a rank pulls a block of a kind at most once."""
    num_pulls = pulls.send_me.size
    if pulls.me.size != num_pulls:
        _fail(2, f"{num_pulls} pulls are sent but {pulls.me.size} are received")
    fwd_send_round, fwd_recv_round = plan.stacked("pull_send_round")[0], plan.stacked("pull_recv_round")[0]
    s_key = lexsort_ints((pulls.send_block, pulls.send_kind, pulls.send_peer, pulls.send_me, fwd_send_round))
    r_key = lexsort_ints((pulls.block, pulls.kind, pulls.me, pulls.peer, fwd_recv_round))
    send_columns = (fwd_send_round, pulls.send_me, pulls.send_peer, pulls.send_kind, pulls.send_block,
                    pulls.send_count)
    recv_columns = (fwd_recv_round, pulls.peer, pulls.me, pulls.kind, pulls.block, pulls.count)
    # Column by column (a million rows each at thousands of ranks); the rows are stacked only to name a mismatch.
    if not all(np.array_equal(sent[s_key], received[r_key]) for sent, received in zip(send_columns, recv_columns)):
        send_rows, recv_rows = np.stack(send_columns)[:, s_key], np.stack(recv_columns)[:, r_key]
        bad = int(np.flatnonzero((send_rows != recv_rows).any(axis=0))[0])
        _fail(2, f"the pull sent in round {int(send_rows[0, bad])} from rank {int(send_rows[1, bad])} to rank "
                 f"{int(send_rows[2, bad])} (block {int(send_rows[4, bad])}) is not received as sent")
    sent_segs = pulls.send_segs[expand_ranges(pulls.send_seg_first[s_key], pulls.send_count[s_key])]
    received_segs = pulls.segs[expand_ranges(pulls.seg_first[r_key], pulls.count[r_key])]
    if not np.array_equal(sent_segs, received_segs):
        _fail(2, "a pull's segments differ between its sender and its receiver")
    owner, from_owner = blocks.owner, pulls.send_source < 0
    if (owner[pulls.send_block[from_owner]] != pulls.send_me[from_owner]).any():
        bad = int(np.flatnonzero(from_owner & (owner[pulls.send_block] != pulls.send_me))[0])
        _fail(2, f"rank {int(pulls.send_me[bad])} sends block {int(pulls.send_block[bad])}, which rank "
                 f"{int(owner[pulls.send_block[bad]])} holds, and names no pull it received the block by")
    if pulls.segs.size and (plan.tables.seg_block[pulls.segs] != np.repeat(pulls.block, pulls.count)).any():
        _fail(2, "a pull carries a segment of another block")
    # A segment listed twice would be sent twice and land twice: the message's rows would not be the block's.
    row_of = np.repeat(np.arange(pulls.count.size, dtype=np.int64), pulls.count)
    # Lists in rising order (as plans write them) have no segment twice: one pass; any other is counted.
    rising = (row_of[1:] != row_of[:-1]) | (pulls.segs[1:] > pulls.segs[:-1])
    keys, listed = sorted_unique_counts(row_of * plan.tables.seg_block.size + pulls.segs) if not rising.all() \
        else (np.zeros(0, dtype=np.int64), np.zeros(0, dtype=np.int64))
    if (listed > 1).any():
        row = int(keys[np.argmax(listed > 1)]) // plan.tables.seg_block.size
        _fail(2, f"rank {int(pulls.me[row])}'s pull of block {int(pulls.block[row])} from rank "
                 f"{int(pulls.peer[row])} lists a segment twice")
    if (pulls.peer == pulls.me).any():
        row = int(np.flatnonzero(pulls.peer == pulls.me)[0])
        _fail(2, f"rank {int(pulls.me[row])} pulls block {int(pulls.block[row])} from itself")
    unknown = np.isin(pulls.kind, (TransferKind.KV, TransferKind.Q), invert=True)
    if unknown.any():
        _fail(2, f"a pull has unknown kind {int(pulls.kind[unknown][0])}")
    pull_key = (pulls.kind * blocks.num_blocks + pulls.block) * plan.num_ranks + pulls.me
    if sorted_unique(pull_key).size != pull_key.size:
        _fail(2, "a rank pulls the same block twice")
    _check_relay_data(pulls)


def _check_data_before_use(plan: _Plan, blocks: _Blocks, tiles: _Tiles, pulls: _Pulls) -> tuple[_PassFacts, ...]:
    """2. Data before use: pulls agree between their ends; in each pass every tile's data arrives in an earlier
    stage, every result leaves after its last tile, and relays re-send and push in order.

    Returns:
        what each pass's check found (forward, backward), for invariants 3 and 4.
    """
    _check_pulls_agree(plan, blocks, pulls)
    facts = []
    send_order, recv_order = pulls.send_order, pulls.recv_order  # sorts of millions of rows: once for both passes
    reads = _check_tiles_pulled(plan, blocks, pulls, tiles)
    for program in _pass_programs(plan):
        # The sender and the receiver of each pull agree on its round in this pass.
        if not np.array_equal(program.send_round[send_order], program.recv_round[recv_order]):
            _fail(2, f"{program.label}: a pull's sender and receiver disagree on its round")
        last_use = _check_tiles_after_data(pulls, tiles, reads, program)
        push = _check_pushes(plan, pulls, program, last_use)
        facts.append(_PassFacts(program=program, last_use=last_use, push=push,
                                relay_last=_check_relay_order(pulls, program, push)))
    return tuple(facts)


def _check_congestion_freedom(plan: _Plan, blocks: _Blocks, pulls: _Pulls, passes: tuple[_PassFacts, ...]) -> int:
    """3. Congestion freedom, per link class (NVLink inside a node, the NIC across; nodes are runs of the profile's
    gpus_per_node ranks): in every round of each pass a rank sends and receives at most one NIC message and at most
    nvlink_lanes NVLink messages, pulls (fan-out and relays included) and pushes together; the header's Delta of
    each class's forward pulls, and its round and stage counts, are the ones the plan has. Returns the larger
    Delta."""
    header, num_ranks = plan.header, plan.num_ranks
    if header.bwd_coalesce % 2 or header.bwd_coalesce > 2 * header.coalesce:
        _fail(3, f"the backward pass has {header.bwd_coalesce} rounds a stage; its pulls take every other round, so "
                 f"it must be even and at most twice the forward's {header.coalesce}")
    gpus_per_node, profile = header.profile.gpus_per_node, header.profile
    most_lanes = nvlink_lanes(profile.nvlink_gbps, profile.network_gbps)
    if header.nvlink_lanes > most_lanes:
        _fail(3, f"the header lets a GPU carry {header.nvlink_lanes} NVLink messages a round; NVLink at "
                 f"{profile.nvlink_gbps} GB/s against a {profile.network_gbps} GB/s NIC allows at most {most_lanes}")
    link = (pulls.peer // gpus_per_node != pulls.me // gpus_per_node).astype(np.int64)
    for name, degree in zip(("nvlink", "nic"), class_degrees(pulls.peer, pulls.me, link, num_ranks)):
        if getattr(header, f"{name}_degree") != degree:
            _fail(3, f"the header states {name}_degree {getattr(header, f'{name}_degree')}, the forward pulls "
                     f"over {name} have {degree}")
    used = int(passes[0].program.recv_round.max(initial=-1)) + 1
    if header.num_rounds != used:
        _fail(3, f"the header states num_rounds {header.num_rounds}, the forward pulls use {used}")
    for facts in passes:
        _check_pass_matchings(facts, pulls, gpus_per_node, header.nvlink_lanes)
    return max(header.nvlink_degree, header.nic_degree)


def _check_pass_matchings(facts: _PassFacts, pulls: _Pulls, gpus_per_node: int, lanes: int) -> None:
    """3, for one pass: messages within its rounds; in every round a GPU sends and receives at most one NIC message
    and at most `lanes` NVLink messages; the stated counts the used ones."""
    program, push = facts.program, facts.push
    label, coalesce = program.label, program.coalesce
    for rounds, what in ((program.recv_round, "pull"), (program.send_round, "pull"), (push.round, "push")):
        if rounds.size and (rounds.min() < 0 or rounds.max() >= program.num_rounds):
            bad = int(rounds.min() if rounds.min() < 0 else rounds.max())
            _fail(3, f"{label}: a {what} is in round {bad}, outside the pass's {program.num_rounds} rounds")
    # A pull row is received by `me` from `peer` (invariant 2 checked that both ends agree).
    senders = np.concatenate((pulls.peer, push.sender))
    receivers = np.concatenate((pulls.me, push.receiver))
    rounds = np.concatenate((program.recv_round, push.round))
    link = (senders // gpus_per_node != receivers // gpus_per_node).astype(np.int64)
    if rounds.size:
        width = program.num_rounds
        for side, who in (("receives", receivers), ("sends", senders)):
            # Per (end, class, round): memory by the messages the file holds, not by the rounds its header claims.
            key = (who * 2 + link) * width + rounds
            if not any(_over_slots(key[link == cls], slots) for cls, slots in ((0, lanes), (1, 1))):
                continue
            key, per_round = sorted_unique_counts(key)  # over somewhere: which end and round, counted
            over = per_round - np.where(key // width % 2 == 0, lanes, 1)
            if over.max() > 0:
                bad = int(np.argmax(over))
                end, rnd = divmod(int(key[bad]), width)
                _fail(3, f"{label}: in round {rnd} rank {end // 2} {side} {int(per_round[bad])} "
                         f"{('NVLink', 'NIC')[end % 2]} messages (pulls and pushes together; at most "
                         f"{(lanes, 1)[end % 2]})")
        if int(rounds.max()) + 1 != program.num_rounds:
            _fail(3, f"{label}: the header states {program.num_rounds} rounds, the messages use "
                     f"{int(rounds.max()) + 1}")
    used = max(int(rounds.max(initial=-1)) // coalesce, int(program.tile_stage.max(initial=0))) + 1
    if used != program.num_stages:
        _fail(3, f"{label}: the header states {program.num_stages} stages, the tiles and messages use {used}")


def _over_slots(keys: np.ndarray, slots: int) -> bool:
    """Whether some key occurs more than `slots` times: in sorted keys, a run that long has equal keys `slots`
    apart (one sort, no counts)."""
    if keys.size <= max(slots, 0):
        return False
    if slots < 1:
        return True
    ordered = np.sort(keys)
    return bool((ordered[slots:] == ordered[:-slots]).any())


def _check_memory(plan: _Plan, blocks: _Blocks, pulls: _Pulls, passes: tuple[_PassFacts, ...]) -> int:
    """4. Memory: no rank over the token cap; the forward's per-stage receive bound and every pass's live buffers
    (under the liveness rule the runtime uses) equal what the header states. Returns the peak live buffer tokens."""
    header, num_ranks = plan.header, plan.num_ranks
    rank_tokens = np.bincount(blocks.held_rank, weights=blocks.block_tokens[blocks.held], minlength=num_ranks)
    if rank_tokens.max() > header.token_cap:
        bad = int(np.argmax(rank_tokens))
        _fail(4, f"rank {bad} holds {int(rank_tokens[bad])} tokens, over the token cap {header.token_cap}")
    forward = passes[0].program
    if pulls.me.size:
        stage_of_pull = forward.recv_round // forward.coalesce
        num_stages = int(stage_of_pull.max()) + 1
        per_stage = np.bincount(pulls.me * num_stages + stage_of_pull, weights=pulls.tokens)
        if per_stage.max() != header.recv_buffer_tokens:
            bad = int(np.argmax(per_stage))
            _fail(4, f"rank {bad // num_stages} receives {int(per_stage[bad])} tokens in stage "
                     f"{bad % num_stages}, the most any rank does, but the header states {header.recv_buffer_tokens}")
    # A stage's rounds each bring at most one NIC pull and nvlink_lanes NVLink pulls.
    most = (1 + header.nvlink_lanes) * header.coalesce * header.block_size
    if header.recv_buffer_tokens > most:
        _fail(4, f"the stated receive bound {header.recv_buffer_tokens} exceeds (1 + nvlink_lanes) x coalesce x "
                 f"block size ({most})")
    worst = max(_pass_peak_buffer(facts, pulls, num_ranks) for facts in passes)
    if worst != header.max_buffer_tokens:
        _fail(4, f"the busiest rank holds {worst} tokens of live buffers, but the header's max_buffer_tokens states "
                 f"{header.max_buffer_tokens}")
    return worst


def _check_memory_bytes(plan: _Plan, peaks: np.ndarray) -> np.ndarray:
    """4. Memory in bytes: each rank's peak per pass (`peaks`, by the memory account of every tensor the runtime
    creates: :mod:`fcp_compiler.format.memory`) is what the header states, and within the budget the plan was
    compiled for. Returns the peaks (int64 [ranks, 2])."""
    header = plan.header
    for column, name in enumerate(("fwd", "bwd")):
        stated = np.asarray(getattr(header, f"max_buffer_bytes_{name}"), dtype=np.int64)
        wrong = np.flatnonzero(stated != peaks[:, column])
        if wrong.size:
            rank = int(wrong[0])
            _fail(4, f"rank {rank}'s {name} peaks at {int(peaks[rank, column])} bytes by the memory account, but the "
                     f"header's max_buffer_bytes_{name} states {int(stated[rank])}")
    budget = header.memory_budget_bytes
    if budget is not None and peaks.max() > budget:
        rank, column = (int(i) for i in np.unravel_index(np.argmax(peaks), peaks.shape))
        _fail(4, f"rank {rank}'s {('fwd', 'bwd')[column]} peaks at {int(peaks[rank, column])} bytes, over the "
                 f"plan's memory budget of {budget} bytes")
    return peaks


# Plans from which validate_plan(background=True) forks the memory account (at 4096 GPUs, 1.2M tiles, it is 2.7 of
# 6 s; a fork and its pages cost milliseconds, more than the account of a plan of thousands of tiles).
BACKGROUND_TILES = 200_000
CHILD_EXIT_SECONDS = 10.0  # how long a child that has sent its result is given to exit before it is stopped


class _Account:
    """The memory account of the stacked ranks (:func:`stacked_peak_bytes`), in a forked child while the caller
    checks the rest, or here when it is asked for. A child that dies or cannot send its result (killed, out of
    memory) leaves the account to this process: the result and any error are the same either way."""

    def __init__(self, stacked: StackedRanks, background: bool):
        self.stacked, self.process, self.connection = stacked, None, None
        if background and _may_fork() and int(stacked.count("tile_stage").sum()) >= BACKGROUND_TILES:
            context = multiprocessing.get_context("fork")
            self.connection, sender = context.Pipe(duplex=False)
            # Forked: the child shares the stacked arrays (nothing is pickled but its result).
            self.process = context.Process(target=_account_child, args=(stacked, sender), daemon=True)
            self.process.start()
            sender.close()

    def peaks(self) -> np.ndarray:
        """The peaks (int64 [ranks, 2]); raises what the account raises."""
        result = None
        if self.connection is not None:
            try:
                result = self.connection.recv()
            except (EOFError, OSError):  # the child is gone without a word: account here
                result = None
            self.process.join(CHILD_EXIT_SECONDS)  # it exits once it has sent its result
            self.close()
        if result is None:
            return stacked_peak_bytes(self.stacked)
        if isinstance(result, BaseException):
            raise result
        return result

    def close(self) -> None:
        """Stop the child, if any (a check that failed first leaves its account unread)."""
        if self.process is not None:
            if self.process.is_alive():
                self.process.terminate()
            self.process.join()
            self.connection.close()
            self.process = self.connection = None


def _account_child(stacked: StackedRanks, sender) -> None:
    """The forked child's work: the account, or the error it raised, sent back."""
    try:
        result = stacked_peak_bytes(stacked)
    except Exception as error:  # noqa: BLE001 -- sent to the parent, which raises it in order
        result = error
    sender.send(result)
    sender.close()


def _may_fork() -> bool:
    """Whether a child may be forked here to use another CPU: Linux (fork is safe for this child, which runs
    numpy alone) where this process may run on more than one CPU."""
    return sys.platform == "linux" and len(os.sched_getaffinity(0)) > 1


def _pass_peak_buffer(facts: _PassFacts, pulls: _Pulls, num_ranks: int) -> int:
    """Live buffers of one pass under the liveness rule: each pull from its stage to its last use, push or relay,
    each push landing for its stage; the busiest rank's peak."""
    program, push, coalesce = facts.program, facts.push, facts.program.coalesce
    arrival = program.recv_round // coalesce
    last = np.maximum(np.maximum(np.maximum(facts.last_use, arrival), push.last_stage), facts.relay_last)
    peak = peak_live_tokens(np.concatenate((pulls.me, push.receiver)),
                            np.concatenate((arrival, push.round // coalesce)),
                            np.concatenate((last, push.round // coalesce)),
                            np.concatenate((pulls.tokens, push.tokens)), num_ranks)
    return int(peak.max(initial=0))


@dataclass(frozen=True, slots=True, kw_only=True)
class _TileReads:
    """Per kind of data a tile reads (Q, then K,V): its name, the tiles reading it remotely, and the received pull
    row each of those reads (the same in both passes)."""

    kind: int
    what: str
    block: np.ndarray  # per tile, the block it reads this kind of
    remote: np.ndarray  # bool per tile
    rows: np.ndarray  # per remote tile, its pull's row in the stacked pull_recv table


def _check_tiles_pulled(plan: _Plan, blocks: _Blocks, pulls: _Pulls, tiles: _Tiles) -> tuple[_TileReads, ...]:
    """2. Every tile's remote Q and K,V is pulled by its rank, with the segments it reads (which pull a tile reads is
    the same in both passes: found once).

    Returns:
        per kind, the pull each remote tile reads.
    """
    num_blocks, num_ranks, num_segments = blocks.num_blocks, plan.num_ranks, plan.tables.seg_block.size
    owner, seg_block = blocks.owner, plan.tables.seg_block
    num_pulls = pulls.kind.size
    pull_key = pulls.kind * num_blocks * num_ranks + pulls.block * num_ranks + pulls.me
    pull_order = stable_argsort(pull_key)
    sorted_key = pull_key[pull_order]
    block_segments = np.bincount(seg_block, minlength=num_blocks)
    # The tiles by key, and what the pulls of part of a block carry: built once, when a tile reads such a pull.
    tile_sorted, carried = None, None
    reads = []
    for kind, what, tile_block, needed_seg in ((TransferKind.Q, "Q", tiles.q, tiles.q_seg),
                                               (TransferKind.KV, "K,V", tiles.kv, tiles.k_seg)):
        remote = owner[tile_block] != tiles.rank
        key = kind * num_blocks * num_ranks + tile_block * num_ranks + tiles.rank
        pos = np.minimum(search_sorted(sorted_key, key), max(num_pulls - 1, 0))
        found = (sorted_key[pos] == key) if num_pulls else np.zeros(key.size, dtype=bool)
        missing = remote & ~found
        if missing.any():
            t = int(np.flatnonzero(missing)[0])
            _fail(2, f"rank {int(tiles.rank[t])} runs tile (q {int(tiles.q[t])}, kv {int(tiles.kv[t])}) without "
                     f"pulling the {what} of block {int(tile_block[t])}")
        rows = pull_order[pos] if num_pulls else pos
        # Every segment a remote tile reads must be among those its pull carries. A pull of every segment of its
        # block (none twice, none of another block: checked above; one pull a block and rank) brings all a tile
        # reads of it, so only the pairs of tiles whose pull carries part of a block are checked, against what
        # such pulls carry.
        partial = remote & (pulls.count[rows] != block_segments[tile_block]) if num_pulls else remote
        if partial.any():
            if tile_sorted is None:
                tile_sorted = stable_argsort(tiles.key)
                part = np.flatnonzero(pulls.count != block_segments[pulls.block])
                carried = sorted_unique(np.repeat(pulls.kind[part], pulls.count[part]) * num_segments * num_ranks
                                        + pulls.segs[expand_ranges(pulls.seg_first[part], pulls.count[part])]
                                        * num_ranks + np.repeat(pulls.me[part], pulls.count[part]))
            partly_pulled = np.zeros(num_blocks, dtype=bool)
            partly_pulled[tile_block[partial]] = True
            pairs = np.flatnonzero(partly_pulled[seg_block[needed_seg]])
            # (pairs come by query segment, their keys nearly in order: a plain search is fastest)
            pair_tile = tile_sorted[np.searchsorted(tiles.key[tile_sorted], seg_block[tiles.q_seg[pairs]] * num_blocks
                                                    + seg_block[tiles.k_seg[pairs]])]
            checked = partial[pair_tile]
            pairs, pair_rank = pairs[checked], tiles.rank[pair_tile[checked]]
            needed = kind * num_segments * num_ranks + needed_seg[pairs] * num_ranks + pair_rank
            lacking = np.flatnonzero(~_in_sorted(needed, carried))
            if lacking.size:
                first = lacking[np.argmin(_pair_rank(plan.tables, tiles.q_seg[pairs[lacking]],
                                                     tiles.k_seg[pairs[lacking]]))]
                bad = int(pairs[first])
                _fail(2, f"rank {int(pair_rank[first])} reads segment {int(needed_seg[bad])} of block "
                         f"{int(seg_block[needed_seg[bad]])} but no pull brings it")
        reads.append(_TileReads(kind=kind, what=what, block=tile_block, remote=remote, rows=rows[remote]))
    return tuple(reads)


def _check_tiles_after_data(pulls: _Pulls, tiles: _Tiles, reads: tuple[_TileReads, ...],
                            program: _PassProgram) -> np.ndarray:
    """2. Every tile's remote Q and K,V arrive in an earlier stage of the pass.

    Returns:
        per received pull row, the last stage a tile uses it.
    """
    num_pulls = pulls.kind.size
    last_use = np.full(num_pulls, -1, dtype=np.int64)
    for read in reads:
        remote, rows = read.remote, read.rows
        arrival = program.recv_round[rows] // program.coalesce
        late = arrival >= program.tile_stage[remote]
        if late.any():
            t = int(np.flatnonzero(remote)[np.argmax(late)])
            _fail(2, f"{program.label}: rank {int(tiles.rank[t])} runs tile (q {int(tiles.q[t])}, kv "
                     f"{int(tiles.kv[t])}) in stage {int(program.tile_stage[t])}, but the {read.what} of block "
                     f"{int(read.block[t])} arrives in stage {int(arrival[np.argmax(late)])}")
        np.maximum.at(last_use, rows, program.tile_stage[remote])
    # A pull no tile reads must be re-sent (a forwarder of node fan-out).
    forwarded = np.zeros(num_pulls, dtype=bool)
    forwarded[pulls.send_source[pulls.send_source >= 0]] = True
    unused = (last_use < 0) & ~forwarded
    if unused.any():
        bad = int(np.argmax(unused))
        _fail(2, f"rank {int(pulls.me[bad])} pulls block {int(pulls.block[bad])} but no tile there uses it and it "
                 f"re-sends it to no one")
    return last_use


@dataclass(frozen=True, slots=True, kw_only=True)
class _Pushes:
    sender: np.ndarray
    receiver: np.ndarray
    round: np.ndarray
    tokens: np.ndarray
    last_stage: np.ndarray  # per received pull row: the stage its result leaves in (-1: none)
    arrive_send_row: np.ndarray  # per push, the sent pull row (stacked) it returns along ...
    arrive_round: np.ndarray  # ... and the round it arrives in


def _check_pushes(plan: _Plan, pulls: _Pulls, program: _PassProgram, last_use: np.ndarray) -> _Pushes:
    """2. Partial outputs (forward) and gradients (backward) return along their pull after its last tile."""
    prefix = program.label
    num_pulls = pulls.kind.size
    send_round, sender = plan.stacked(f"{prefix}_push_send_round")
    send_pull, _ = plan.stacked(f"{prefix}_push_send_pull")
    recv_round, receiver = plan.stacked(f"{prefix}_push_recv_round")
    recv_pull, _ = plan.stacked(f"{prefix}_push_recv_pull")
    recv_base, send_base = plan.row_base("pull_recv_round"), plan.row_base("pull_send_round")
    if send_round.size != recv_round.size:
        _fail(2, f"{prefix}: {send_round.size} pushes leave but {recv_round.size} arrive")
    # The pull a push returns along, as (kind, block, puller, owner), and its round.
    g_recv = send_pull + recv_base[sender]  # row in the stacked pull_recv table
    sent = [pulls.kind[g_recv], pulls.block[g_recv], pulls.me[g_recv], pulls.peer[g_recv], send_round]
    g_send = recv_pull + send_base[receiver]
    arrived = [pulls.send_kind[g_send], pulls.send_block[g_send], pulls.send_peer[g_send], pulls.send_me[g_send],
               recv_round]
    # Each side's rows in (kind, block, puller, owner, round) order, compared row by row.
    sent_order, arrived_order = lexsort_ints(sent[::-1]), lexsort_ints(arrived[::-1])
    if not all(np.array_equal(one[sent_order], other[arrived_order]) for one, other in zip(sent, arrived)):
        _fail(2, f"{prefix}: a push leaves and arrives differently")
    # Each pull of these kinds returns exactly once, after the last tile that used it.
    returned = np.bincount(g_recv, minlength=num_pulls) if num_pulls else np.zeros(0, dtype=np.int64)
    expects = np.isin(pulls.kind, program.push_kinds)
    wrong = returned != expects.astype(np.int64)
    if wrong.any():
        bad = int(np.argmax(wrong))
        what = {TransferKind.Q: "partial output" if prefix == "fwd" else "dQ partial",
                TransferKind.KV: "dK, dV partial"}
        _fail(2, f"{prefix}: rank {int(pulls.me[bad])} pushes the {what[int(pulls.kind[bad])]} of block "
                 f"{int(pulls.block[bad])} back {int(returned[bad])} times (expected {int(expects[bad])})")
    send_stage = send_round // program.coalesce
    early = send_stage <= last_use[g_recv]
    if early.any():
        bad = int(np.argmax(early))
        _fail(2, f"{prefix}: rank {int(sender[bad])} pushes the result for block {int(pulls.block[g_recv[bad]])} in "
                 f"stage {int(send_stage[bad])}, not after its last tile in stage {int(last_use[g_recv[bad]])}")
    last_stage = np.full(num_pulls, -1, dtype=np.int64)
    last_stage[g_recv] = send_stage
    return _Pushes(sender=sender, receiver=pulls.peer[g_recv], round=send_round, tokens=pulls.tokens[g_recv],
                   last_stage=last_stage, arrive_send_row=g_send, arrive_round=recv_round)


def _merge_runs(key: np.ndarray, start: np.ndarray, length: np.ndarray) -> tuple[np.ndarray, ...]:
    """Runs in their order, with each run that continues the previous one of the same key merged into it."""
    if key.size == 0:
        return key, start, length
    new = np.ones(key.size, dtype=bool)
    new[1:] = (key[1:] != key[:-1]) | (start[1:] != start[:-1] + length[:-1])
    group = np.cumsum(new) - 1
    return key[new], start[new], np.bincount(group, weights=length).astype(np.int64)


def _runs_tile_ranks(rank: np.ndarray, start: np.ndarray, length: np.ndarray, totals: np.ndarray) -> np.ndarray:
    """Per rank, whether its ranges [start, start + length) (rows of `rank`, ascending) cover [0, totals[rank])
    exactly once: bool [ranks]."""
    num_ranks = totals.size
    order = lexsort_ints((start, rank))  # each rank's ranges by start
    rank, start = rank[order], start[order]
    end = start + length[order]
    count = np.bincount(rank, minlength=num_ranks)
    ok = count == 0
    ok &= totals == 0
    if rank.size:
        first, last = np.cumsum(count) - count, np.cumsum(count) - 1
        has = count > 0
        ends_right = np.zeros(num_ranks, dtype=bool)
        ends_right[has] = (start[first[has]] == 0) & (end[last[has]] == totals[has])
        gap = (rank[1:] == rank[:-1]) & (start[1:] != end[:-1])
        ends_right &= np.bincount(rank[1:][gap], minlength=num_ranks) == 0
        ok |= has & ends_right
    return ok


def _first_reshuffle_fault(send_bad: np.ndarray, recv_outside: np.ndarray, recv_tiles: np.ndarray, chunk: np.ndarray,
                           plan_tokens: np.ndarray) -> None:
    """Fail on the first rank with a bad run, naming what a rank-by-rank check finds first: a run outside its user
    chunk, one outside its plan layout, or a plan layout the runs do not tile."""
    bad = send_bad | recv_outside | ~recv_tiles
    if not bad.any():
        return
    rank = int(np.flatnonzero(bad)[0])
    if send_bad[rank]:
        _fail(5, f"rank {rank} sends a reshuffle run outside its {int(chunk[rank])}-token user chunk")
    if recv_outside[rank]:
        _fail(5, f"rank {rank} receives a reshuffle run outside its {int(plan_tokens[rank])}-token plan layout")
    _fail(5, f"rank {rank}'s plan layout is not filled exactly once by the reshuffle")


def _check_reshuffle(plan: _Plan) -> None:
    """5. Reshuffle bijection: the runs map user-layout tokens one to one onto plan-layout tokens, as both sides
    pack them.

    Checked on ranges, never token by token, every rank at once: O(runs + segments) after sorting."""
    stack, total_tokens, num_ranks, tables = plan.stack, plan.header.total_tokens, plan.num_ranks, plan.tables
    a = stack.arrays
    bounds = (np.arange(num_ranks + 1, dtype=np.int64) * total_tokens) // num_ranks
    seq_offset = np.concatenate(([0], np.cumsum(tables.seq_lengths))).astype(np.int64)
    # User side: each run is a token range of its rank's user-layout chunk.
    send_rank, peer = stack.rank_of("reshuffle_send_peer"), a["reshuffle_send_peer"]
    length, offset, chunk = a["reshuffle_send_length"], a["reshuffle_send_offset"], np.diff(bounds)
    send_bad = np.bincount(send_rank[(length <= 0) | (offset < 0) | (offset + length > chunk[send_rank])],
                           minlength=num_ranks) > 0
    # Plan side: every rank's segments in layout order, end to end; a rank's plan-layout position p is base + p.
    local, _, local_count = stack.local_segments()
    edges = np.concatenate(([0], np.cumsum(tables.seg_end[local] - tables.seg_start[local]))).astype(np.int64)
    base = edges[np.concatenate(([0], np.cumsum(local_count))).astype(np.int64)]
    plan_tokens = np.diff(base)
    recv_rank, recv_offset, recv_length = (stack.rank_of("reshuffle_recv_offset"), a["reshuffle_recv_offset"],
                                           a["reshuffle_recv_length"])
    recv_outside = np.bincount(recv_rank[recv_offset + recv_length > plan_tokens[recv_rank]], minlength=num_ranks) > 0
    _first_reshuffle_fault(send_bad, recv_outside, _runs_tile_ranks(recv_rank, recv_offset, recv_length, plan_tokens),
                           chunk, plan_tokens)
    if not _tiles_exactly(bounds[send_rank] + offset, length, total_tokens):
        _fail(5, "the user layout's tokens are not each sent exactly once")
    # The receiver's runs as global token ranges, each cut where its rank's segments end.
    low_position = base[recv_rank] + recv_offset
    high_position = low_position + recv_length
    first = np.searchsorted(edges, low_position, side="right") - 1
    pieces = np.searchsorted(edges, high_position, side="left") - first
    piece_seg, piece_run = expand_ranges(first, pieces), np.repeat(np.arange(recv_offset.size), pieces)
    low = np.maximum(low_position[piece_run], edges[piece_seg])
    high = np.minimum(high_position[piece_run], edges[piece_seg + 1])
    segs = local[piece_seg]
    received = (recv_rank[piece_run] * num_ranks + a["reshuffle_recv_peer"][piece_run],
                seq_offset[tables.seg_seq[segs]] + tables.seg_start[segs] + (low - edges[piece_seg]), high - low)
    sent = (peer * num_ranks + send_rank, bounds[send_rank] + offset, length)
    # Both sides pack a (user rank, plan rank) pair's runs in the same order: compare the token ranges pair by pair.
    sides = []
    for key, start, length in (sent, received):
        order = stable_argsort(key)
        sides.append(np.stack(_merge_runs(key[order], start[order], length[order])))
    if sides[0].shape != sides[1].shape or not np.array_equal(*sides):
        common = min(sides[0].shape[1], sides[1].shape[1])
        differ = np.flatnonzero((sides[0][:, :common] != sides[1][:, :common]).any(axis=0))
        bad = int(differ[0]) if differ.size else max(common - 1, 0)
        key = int(sides[0][0, bad]) if sides[0].shape[1] else 0
        _fail(5, f"tokens sent from user rank {key % num_ranks} to plan rank {key // num_ranks} do not land "
                 f"where the plan layout puts them")


def _tiles_exactly(start: np.ndarray, length: np.ndarray, total: int) -> bool:
    """Whether the ranges [start, start + length) cover [0, total) exactly once."""
    order = stable_argsort(start)
    start, end = start[order], start[order] + length[order]
    return bool(start.size == 0 and total == 0 or start.size and start[0] == 0 and end[-1] == total
                and (start[1:] == end[:-1]).all())


def _check_relay_data(pulls: _Pulls) -> None:
    """2. A relay re-sends K,V it received: the same block, and every segment it re-sends among those it got."""
    relayed = np.flatnonzero(pulls.send_source >= 0)
    if relayed.size == 0:
        return
    source = pulls.send_source[relayed]
    wrong = (pulls.block[source] != pulls.send_block[relayed]) | (pulls.kind[source] != TransferKind.KV) \
        | (pulls.send_kind[relayed] != TransferKind.KV) | (pulls.me[source] != pulls.send_me[relayed])
    if wrong.any():
        bad = relayed[int(np.argmax(wrong))]
        _fail(2, f"rank {int(pulls.send_me[bad])} relays block {int(pulls.send_block[bad])} from a pull of another "
                 f"block or kind (only K,V pulls are relayed)")
    sent = np.repeat(relayed, pulls.send_count[relayed])
    sent_segs = pulls.send_segs[expand_ranges(pulls.send_seg_first[relayed], pulls.send_count[relayed])]
    held = np.repeat(relayed, pulls.count[source])
    held_segs = pulls.segs[expand_ranges(pulls.seg_first[source], pulls.count[source])]
    width = max(int(pulls.send_segs.max(initial=0)), int(pulls.segs.max(initial=0))) + 1
    lacking = ~np.isin(sent * width + sent_segs, held * width + held_segs)
    if lacking.any():
        bad = int(sent[np.argmax(lacking)])
        _fail(2, f"rank {int(pulls.send_me[bad])} relays segment {int(sent_segs[np.argmax(lacking)])} of block "
                 f"{int(pulls.send_block[bad])}, which the pull it relays from does not carry")


def _check_relay_order(pulls: _Pulls, program: _PassProgram, push: _Pushes) -> np.ndarray:
    """2. A relay re-sends a block in a later stage than it arrives, and (backward) pushes its own gradient in a
    later stage than every gradient pushed to it along the pulls it re-sent.

    Returns:
        per received pull row, the last stage its buffer serves a relay (-1: none).
    """
    label, coalesce = program.label, program.coalesce
    last = np.full(pulls.kind.size, -1, dtype=np.int64)
    relayed = np.flatnonzero(pulls.send_source >= 0)
    source = pulls.send_source[relayed]
    send_stage = program.send_round[relayed] // coalesce
    arrival = program.recv_round[source] // coalesce
    early = send_stage <= arrival
    if early.any():
        bad = int(np.argmax(early))
        _fail(2, f"{label}: rank {int(pulls.send_me[relayed[bad]])} relays block {int(pulls.send_block[relayed[bad]])}"
                 f" in stage {int(send_stage[bad])}, but receives it in stage {int(arrival[bad])}")
    np.maximum.at(last, source, send_stage)
    back = pulls.send_source[push.arrive_send_row] >= 0
    if back.any():
        into = pulls.send_source[push.arrive_send_row[back]]
        landed = push.arrive_round[back] // coalesce
        np.maximum.at(last, into, landed)
        own = push.last_stage[into]
        premature = (own >= 0) & (own <= landed)
        if premature.any():
            bad = int(np.argmax(premature))
            _fail(2, f"{label}: rank {int(pulls.me[into[bad]])} pushes its gradient of block "
                     f"{int(pulls.block[into[bad]])} in stage {int(own[bad])}, before the gradient of a pull it "
                     f"relayed lands in stage {int(landed[bad])}")
    return last

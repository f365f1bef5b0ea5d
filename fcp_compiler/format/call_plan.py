"""A rank's kernel calls, read from its plan: the pairs its tiles compute, grouped by
:func:`fcp_compiler.algorithms.call_plan.plan_calls`.

The calls are derived from the plan file, not stored in it: every reader (the runtime, the validator, the memory
account, the simulator's checks) gets the same calls from this one function, for the cost of vectorized passes
over the rank's segment pairs, a few requests at a time (benchmarks/runtime_traffic.py reports it).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator
from dataclasses import dataclass

import numpy as np

from fcp_compiler.algorithms.call_plan import LOCAL, CallArrays, plan_calls
from fcp_compiler.algorithms.kernel_entries import sees_any
from fcp_compiler.algorithms.keys import lookup, sorted_unique, stable_argsort
from fcp_compiler.algorithms.ranges import expand_ranges, group_sums, offsets, offsets_within
from fcp_compiler.errors import PlanFormatError
from fcp_compiler.format.plan_format import Layout, RankProgram, TransferKind
from fcp_compiler.format.stacked import StackedRanks, stack_programs

PART_TILES = 20_000  # tiles of the requests whose calls are grouped together (calls_in_parts)


@dataclass(frozen=True, slots=True, kw_only=True)
class Request:
    """The tiles one stage of one pass computes together (rows of the rank's tile arrays, in pipeline order);
    stage -1: the forward's tiles that run while the user layout's reshuffle is in flight."""

    pass_name: str
    stage: int
    tiles: tuple[int, ...]


@dataclass(frozen=True, slots=True, kw_only=True)
class RequestTable:
    """The requests of several stacked ranks (:class:`StackedRanks`), in the order each rank runs them, ranks one
    after another: per request its rank (position in the stack), pass and stage; and the tiles each computes, as
    stacked tile rows grouped by request, in order."""

    request_rank: np.ndarray
    request_backward: np.ndarray  # bool
    request_stage: np.ndarray  # -1: the forward's tiles that run during the user layout's reshuffle
    tile: np.ndarray
    tile_request: np.ndarray

    @classmethod
    def of(cls, stacked: StackedRanks, requests: list[list[Request]]) -> "RequestTable":
        """The table of explicit requests, per stacked rank (rows of that rank's tile arrays)."""
        flat = [(rank, request) for rank, rank_requests in enumerate(requests) for request in rank_requests]
        rank = np.asarray([r for r, _ in flat], dtype=np.int64)
        sizes = [len(request.tiles) for _, request in flat]
        tiles = np.fromiter((t for _, request in flat for t in request.tiles), dtype=np.int64, count=sum(sizes))
        tile_request = np.repeat(np.arange(len(flat)), sizes)
        return cls(request_rank=rank, request_backward=np.asarray([r.pass_name == "bwd" for _, r in flat], bool),
                   request_stage=np.asarray([r.stage for _, r in flat], dtype=np.int64),
                   tile=tiles + stacked.base("tile_stage")[rank[tile_request]] if tiles.size else tiles,
                   tile_request=tile_request)

    def requests_between(self, low: int, high: int, tile_bounds: np.ndarray) -> "RequestTable":
        """Requests low..high-1 as a table of their own (request ids from 0); tile_bounds: each request's first row
        of `tile`, and the end."""
        first, last = int(tile_bounds[low]), int(tile_bounds[high])
        return RequestTable(request_rank=self.request_rank[low:high], request_backward=self.request_backward[low:high],
                            request_stage=self.request_stage[low:high], tile=self.tile[first:last],
                            tile_request=self.tile_request[first:last] - low)


def step_table(stacked: StackedRanks, layout: str | None = None) -> RequestTable:
    """Every request one step of each stacked rank runs (:func:`step_requests`), for all ranks at once.

    Args:
        stacked: the ranks.
        layout: "plan" or "user" (default: the layout the plan was compiled for).
    """
    a, header = stacked.arrays, stacked.header
    layout = header.layout.value if layout is None else layout
    num_fwd, num_bwd = header.num_fwd_stages, header.num_bwd_stages
    tile_rank = stacked.rank_of("tile_stage")
    early = stacked_tiles_during_reshuffle(stacked) if layout == Layout.USER.value else \
        np.zeros(tile_rank.size, dtype=bool)
    has_early = (np.bincount(tile_rank[early], minlength=stacked.num_ranks) > 0).astype(np.int64)
    per_rank = has_early + num_fwd + num_bwd
    first = np.cumsum(per_rank) - per_rank
    own = first[tile_rank] + has_early[tile_rank]
    forward = np.where(early, first[tile_rank], own + a["tile_stage"])
    backward = own + num_fwd + a["tile_bwd_stage"]
    request = np.concatenate([forward, backward])
    order = stable_argsort(request)  # within a request, tiles in row order
    rows = np.arange(tile_rank.size)
    request_rank = np.repeat(np.arange(stacked.num_ranks), per_rank)
    position = np.arange(request_rank.size) - first[request_rank] - has_early[request_rank]
    return RequestTable(request_rank=request_rank, request_backward=position >= num_fwd,
                        request_stage=np.where(position < num_fwd, position, position - num_fwd),
                        tile=np.concatenate([rows, rows])[order], tile_request=request[order])


def step_requests(program: RankProgram, layout: str | None = None) -> list[Request]:
    """Every request one step of this rank runs, in the order it runs them: in the user layout the stage-0 tiles
    that run during the reshuffle first, then each forward stage's other tiles, then each backward stage's.

    Args:
        program: the rank's slice of the plan.
        layout: "plan" or "user" (default: the layout the plan was compiled for).
    """
    table = step_table(stack_programs([program]), layout)
    bounds = np.searchsorted(table.tile_request, np.arange(table.request_rank.size + 1))
    tiles = table.tile.tolist()
    return [Request(pass_name="bwd" if backward else "fwd", stage=stage, tiles=tuple(tiles[low:high]))
            for backward, stage, low, high in zip(table.request_backward.tolist(), table.request_stage.tolist(),
                                                  bounds[:-1].tolist(), bounds[1:].tolist())]


def tiles_during_reshuffle(program: RankProgram) -> np.ndarray:
    """Which of a rank's tiles may run while the input reshuffle is in flight: stage-0 tiles whose query and key
    blocks the rank holds and whose tokens all stay on it (a run from the rank to itself). Bool per tile row; all
    False in the plan layout, which has no reshuffle."""
    if program.header.layout is Layout.PLAN:
        return np.zeros(program.arrays["tile_stage"].size, dtype=bool)
    return stacked_tiles_during_reshuffle(stack_programs([program]))


def stacked_tiles_during_reshuffle(stacked: StackedRanks) -> np.ndarray:
    """:func:`tiles_during_reshuffle` of every stacked rank at once."""
    a, tables = stacked.arrays, stacked.tables
    num_blocks = stacked.header.num_blocks
    if stacked.header.layout is Layout.PLAN:
        return np.zeros(a["tile_stage"].size, dtype=bool)
    block_tokens = np.bincount(tables.seg_block, weights=tables.seg_end - tables.seg_start,
                               minlength=num_blocks).astype(np.int64)
    held, held_rank = a["blocks"], stacked.rank_of("blocks")
    held_tokens = block_tokens[held]
    held_start = np.cumsum(held_tokens) - held_tokens  # every rank's layout end to end
    local_base = np.concatenate(([0], np.cumsum(np.bincount(held_rank, weights=held_tokens,
                                                            minlength=stacked.num_ranks))))[:-1].astype(np.int64)
    run_rank = stacked.rank_of("reshuffle_recv_peer")
    mine = a["reshuffle_recv_peer"] == stacked.ranks[run_rank]
    stays = np.zeros(int(held_tokens.sum()), dtype=bool)
    stays[expand_ranges(local_base[run_rank[mine]] + a["reshuffle_recv_offset"][mine],
                        a["reshuffle_recv_length"][mine])] = True
    held_stays = np.logical_and.reduceat(stays, held_start) if held.size else np.zeros(0, dtype=bool)
    held_key = held_rank * num_blocks + held
    order = stable_argsort(held_key)
    tile_rank = stacked.rank_of("tile_stage")

    def stays_of(blocks):
        found = lookup(held_key[order], held_stays[order].astype(np.int64), tile_rank * num_blocks + blocks, 0)
        return found.astype(bool)
    return (a["tile_stage"] == 0) & stays_of(a["tile_q_block"]) & stays_of(a["tile_kv_block"])


@dataclass(frozen=True, slots=True, kw_only=True)
class _Units:
    """Where each tile's segments are read from, as one CSR over units: per stacked rank, its held blocks (in layout
    order), then its received pulls; per unit entry its segment, its first row in the store (local rows counted over
    its rank), and the store (LOCAL, or the pull's row within its rank)."""

    ptr: np.ndarray
    seg: np.ndarray
    row: np.ndarray
    source: np.ndarray
    unit_key: np.ndarray  # sorted (rank, kind, block) keys of the units a tile can read, and their units
    unit_of_key: np.ndarray
    local_len: np.ndarray  # every rank's local segments' lengths, in layout order, ranks one after another
    local_base: np.ndarray  # per rank: its first row among them
    num_blocks: int
    # Per entry, its segment's sequence, positions in it, and the sequence's window (gathered once, read per pair).
    seq: np.ndarray
    start: np.ndarray
    end: np.ndarray
    window: np.ndarray
    # The entries of each unit grouped by sequence: by_seq lists them by (unit, sequence), in entry order within a
    # group; group g is (unit, sequence) key group_key[g] (sorted), entries by_seq[group_low[g]:][:group_size[g]].
    by_seq: np.ndarray
    group_key: np.ndarray
    group_low: np.ndarray
    group_size: np.ndarray
    num_seqs: int

    def unit_of(self, rank: np.ndarray, kind: int, blocks: np.ndarray) -> np.ndarray:
        """The unit a tile of `rank` reads a block of `kind` from (a held block serves both kinds); -1 where there
        is none."""
        return lookup(self.unit_key, self.unit_of_key, (rank * 2 + kind) * self.num_blocks + blocks, -1)


def _units(stacked: StackedRanks) -> _Units:
    tables, a = stacked.tables, stacked.arrays
    num_blocks = stacked.header.num_blocks
    seg_len = (tables.seg_end - tables.seg_start).astype(np.int64)
    held, held_rank = a["blocks"], stacked.rank_of("blocks")
    pull_rank = stacked.rank_of("pull_recv_block")
    local_segs, held_count, local_count = stacked.local_segments()
    pull_count = a["pull_recv_seg_count"]
    per_rank = stacked.count("blocks") + stacked.count("pull_recv_block")
    unit_base = np.cumsum(per_rank) - per_rank
    held_unit = unit_base[held_rank] + stacked.within("blocks")
    pull_unit = unit_base[pull_rank] + stacked.count("blocks")[pull_rank] + stacked.within("pull_recv_block")
    unit_count = np.empty(held.size + pull_count.size, dtype=np.int64)
    unit_count[held_unit], unit_count[pull_unit] = held_count, pull_count
    ptr = offsets(unit_count)
    seg, row, source = (np.empty(int(ptr[-1]), dtype=np.int64) for _ in range(3))
    local_len = seg_len[local_segs]
    held_at = expand_ranges(ptr[held_unit], held_count)
    seg[held_at], row[held_at], source[held_at] = local_segs, offsets_within(local_len, local_count), LOCAL
    pull_at = expand_ranges(ptr[pull_unit], pull_count)
    pull_segs = a["pull_recv_segs"]
    seg[pull_at], row[pull_at] = pull_segs, offsets_within(seg_len[pull_segs], pull_count)
    source[pull_at] = np.repeat(stacked.within("pull_recv_block"), pull_count)
    keys = np.concatenate([(held_rank * 2 + TransferKind.Q) * num_blocks + held,
                           (held_rank * 2 + TransferKind.KV) * num_blocks + held,
                           (pull_rank * 2 + a["pull_recv_kind"]) * num_blocks + a["pull_recv_block"]])
    units = np.concatenate([held_unit, held_unit, pull_unit])
    order = stable_argsort(keys)
    local_rows = group_sums(local_len, offsets(local_count))
    num_seqs = int(tables.seq_lengths.size)
    entry_seq = tables.seg_seq[seg].astype(np.int64)
    entry_key = np.repeat(np.arange(unit_count.size), unit_count) * num_seqs + entry_seq
    by_seq = stable_argsort(entry_key)
    group_key, group_low = sorted_unique(entry_key[by_seq], return_index=True)
    return _Units(ptr=ptr, seg=seg, row=row, source=source, unit_key=keys[order], unit_of_key=units[order],
                  local_len=local_len, local_base=(np.cumsum(local_rows) - local_rows).astype(np.int64),
                  num_blocks=num_blocks, seq=entry_seq, start=tables.seg_start[seg].astype(np.int64),
                  end=tables.seg_end[seg].astype(np.int64), window=tables.seq_window[entry_seq].astype(np.int64),
                  by_seq=by_seq, group_key=group_key, group_low=group_low,
                  group_size=np.diff(np.append(group_low, by_seq.size)), num_seqs=num_seqs)


def rank_calls(program: RankProgram, requests: list[Request]) -> CallArrays:
    """The kernel calls that compute each request's tiles on this rank (call_request indexes `requests`).

    Raises:
        PlanFormatError: a tile reads a block the rank neither holds nor receives (an invalid plan: fcp validate).
    """
    return ranks_calls([program], [requests])


def ranks_calls(programs: list[RankProgram], requests: list[list[Request]]) -> CallArrays:
    """The kernel calls of several ranks at once (one grouping over all their pairs): call_request indexes the
    requests of all ranks in order (rank 0's, then rank 1's, ...); each call's rows are its own rank's.

    Raises:
        PlanFormatError: as :func:`rank_calls`.
    """
    stacked = stack_programs(programs)
    return stacked_calls(stacked, RequestTable.of(stacked, requests))


def stacked_calls(stacked: StackedRanks, table: RequestTable) -> CallArrays:
    """The kernel calls of every stacked rank's requests (call_request indexes the table's requests), grouped over
    all their segment pairs; each call's rows are its own rank's.

    Raises:
        PlanFormatError: as :func:`rank_calls`.
    """
    firsts, parts = zip(*calls_in_parts(stacked, table))
    return parts[0] if len(parts) == 1 else concatenate_calls(list(parts), list(firsts))


def calls_in_parts(stacked: StackedRanks, table: RequestTable,
                   max_tiles: int | None = None) -> Iterator[tuple[int, CallArrays]]:
    """:func:`stacked_calls`, a run of consecutive requests of about `max_tiles` (default PART_TILES) tiles at a
    time (at least one request). Calls never span requests, so each part's calls are the whole table's calls of its
    requests, in order. The parts bound the temporaries: one pass over a rank's millions of segment pairs (64-token
    blocks) spent more time faulting in fresh pages than computing.

    Yields:
        (the part's first request, its calls), call_request counted from that request.
    Raises:
        PlanFormatError: as :func:`rank_calls`, for the first part with a tile that reads a block it does not have.
    """
    max_tiles = PART_TILES if max_tiles is None else max_tiles
    units = _units(stacked)
    # Every stacked tile's rank and the units it reads, looked up once (a tile is in a forward and a backward part).
    tile_rank, a = stacked.rank_of("tile_stage"), stacked.arrays
    tile_units = (units.unit_of(tile_rank, TransferKind.Q, a["tile_q_block"]),
                  units.unit_of(tile_rank, TransferKind.KV, a["tile_kv_block"]))
    num_requests = table.request_rank.size
    tile_bounds = np.searchsorted(table.tile_request, np.arange(num_requests + 1))
    low = 0
    while True:  # once at least, for a table without requests
        high = int(np.searchsorted(tile_bounds, tile_bounds[low] + max_tiles, side="right")) - 1
        high = min(max(high, low + 1), num_requests)
        part = table if (low, high) == (0, num_requests) else table.requests_between(low, high, tile_bounds)
        calls = plan_calls(*_pairs(stacked, part, units, tile_rank, tile_units), units.local_len,
                           split_requests=part.request_backward)
        entry_rank = part.request_rank[calls.call_request][calls.entry_call]
        rows = np.where(calls.entry_q_source == LOCAL, calls.entry_q_row - units.local_base[entry_rank],
                        calls.entry_q_row)
        yield low, dataclasses.replace(calls, entry_q_row=rows)
        if high >= num_requests:
            return
        low = high


def concatenate_calls(parts: list[CallArrays], first_requests: list[int] | None = None) -> CallArrays:
    """Calls of consecutive parts as one CallArrays (each part's pointers shifted past the parts before it; its
    call_request by its first request, where given)."""
    firsts = first_requests or [0] * len(parts)
    joined = {}
    for name in ("call_causal", "call_left", "call_right", "entry_q_source", "entry_q_row", "entry_q_rows",
                 "key_source", "key_row", "key_rows"):
        joined[name] = np.concatenate([getattr(calls, name) for calls in parts])
    joined["call_request"] = np.concatenate([calls.call_request + first for calls, first in zip(parts, firsts)])
    for name, items in (("call_entry_ptr", "entry_q_rows"), ("entry_key_ptr", "key_rows")):
        shifts = np.cumsum([0] + [getattr(calls, items).size for calls in parts[:-1]])
        joined[name] = np.concatenate([[0]] + [getattr(calls, name)[1:] + shift
                                               for calls, shift in zip(parts, shifts)]).astype(np.int64)
    return CallArrays(**joined)


def _pairs(stacked: StackedRanks, table: RequestTable, units: _Units, rank_of_tile: np.ndarray,
           units_of_tile: tuple[np.ndarray, np.ndarray]) -> list[np.ndarray]:
    """The requests' segment pairs as :func:`plan_calls` takes them (request, q_source, q_seg, q_row, q_start, q_end,
    k_source, k_seg, k_row, k_start, k_end, window), in request, tile, then segment order, the keys no query of a
    pair sees left out; rank_of_tile: each stacked tile's rank (its position in the stack); units_of_tile: the
    units each stacked tile reads its queries and its keys from (-1: none)."""
    tiles = table.tile
    tile_rank = rank_of_tile[tiles]
    q_unit, k_unit = units_of_tile[0][tiles], units_of_tile[1][tiles]
    if (q_unit < 0).any() or (k_unit < 0).any():
        bad = int(np.flatnonzero((q_unit < 0) | (k_unit < 0))[0])
        rank = int(tile_rank[bad])
        tile = int(tiles[bad] - stacked.base("tile_stage")[rank])
        raise PlanFormatError(f"rank {int(stacked.ranks[rank])}'s tile {tile} reads a block it neither holds nor "
                              f"receives: the plan is invalid (fcp validate names the invariant)")
    # Every query segment of a tile against the key segments of its own sequence, in tile, then segment order.
    q_count = units.ptr[q_unit + 1] - units.ptr[q_unit]
    q_entry = expand_ranges(units.ptr[q_unit], q_count)
    q_tile = np.repeat(np.arange(tiles.size), q_count)
    group = lookup(units.group_key, np.arange(units.group_key.size), k_unit[q_tile] * units.num_seqs +
                   units.seq[q_entry], -1)
    matches = np.where(group >= 0, units.group_size[group], 0)
    q_pick = np.repeat(q_entry, matches)
    k_pick = units.by_seq[expand_ranges(units.group_low[group[matches > 0]], matches[matches > 0])]
    pair_tile = np.repeat(q_tile, matches)
    # Pairs whose keys no query sees are dropped here, before their columns are gathered (plan_calls would drop
    # them too): about half of a causal zig-zag sequence's pairs.
    window = units.window[q_pick]
    visible = sees_any(units.start[q_pick], units.end[q_pick], units.start[k_pick], units.end[k_pick], window)
    if not visible.all():
        q_pick, k_pick, pair_tile, window = (column[visible] for column in (q_pick, k_pick, pair_tile, window))
    # The gap rule finds local segments by row: local query rows are counted over every rank's layout end to end.
    q_source = units.source[q_pick]
    q_row = units.row[q_pick] + np.where(q_source == LOCAL, units.local_base[tile_rank[pair_tile]], 0)
    pairs = [table.tile_request[pair_tile], q_source, units.seg[q_pick], q_row, units.start[q_pick],
             units.end[q_pick], units.source[k_pick], units.seg[k_pick], units.row[k_pick], units.start[k_pick],
             units.end[k_pick], window]
    return [np.asarray(column, dtype=np.int64) for column in pairs]

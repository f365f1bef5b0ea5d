"""A rank's kernel calls, read from its plan: the pairs its tiles compute, grouped by
:func:`fcp_compiler.algorithms.call_plan.plan_calls`.

The calls are derived from the plan file, not stored in it: every reader (the runtime, the validator, the memory
account, the simulator's checks) gets the same calls from this one function, for the cost of one vectorized pass
over the rank's segment pairs (benchmarks/runtime_traffic.py reports it).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import numpy as np

from fcp_compiler.algorithms.call_plan import LOCAL, CallArrays, plan_calls
from fcp_compiler.algorithms.keys import lookup
from fcp_compiler.algorithms.ranges import expand_ranges, offsets_within
from fcp_compiler.errors import PlanFormatError
from fcp_compiler.format.plan_format import Layout, RankProgram, TransferKind, tiles_during_reshuffle


@dataclass(frozen=True, slots=True, kw_only=True)
class Request:
    """The tiles one stage of one pass computes together (rows of the rank's tile arrays, in pipeline order);
    stage -1: the forward's tiles that run while the user layout's reshuffle is in flight."""

    pass_name: str
    stage: int
    tiles: tuple[int, ...]


def step_requests(program: RankProgram, layout: str | None = None) -> list[Request]:
    """Every request one step of this rank runs, in the order it runs them: in the user layout the stage-0 tiles
    that run during the reshuffle first, then each forward stage's other tiles, then each backward stage's.

    Args:
        program: the rank's slice of the plan.
        layout: "plan" or "user" (default: the layout the plan was compiled for).
    """
    a = program.arrays
    layout = program.header.layout.value if layout is None else layout
    early = tiles_during_reshuffle(program) if layout == Layout.USER.value else np.zeros(a["tile_stage"].size, bool)
    requests = [Request(pass_name="fwd", stage=-1, tiles=tuple(np.flatnonzero(early).tolist()))] if early.any() else []
    for name, stages, count in (("fwd", a["tile_stage"], program.header.num_fwd_stages),
                                ("bwd", a["tile_bwd_stage"], program.header.num_bwd_stages)):
        skip = early if name == "fwd" else np.zeros(stages.size, dtype=bool)
        order = np.argsort(stages, kind="stable")
        bounds = np.searchsorted(stages[order], np.arange(count + 1))
        for stage in range(count):
            rows = order[bounds[stage]:bounds[stage + 1]]
            requests.append(Request(pass_name=name, stage=stage, tiles=tuple(rows[~skip[rows]].tolist())))
    return requests


@dataclass(frozen=True, slots=True, kw_only=True)
class _Units:
    """Where each tile's segments are read from, as one CSR over units: unit i < H is the rank's i-th held block (in
    layout order), unit H + r is received pull r; per unit entry its segment, its first row in the store, and the
    store. Sized by the rank's own blocks and pulls, not by the batch."""

    ptr: np.ndarray
    seg: np.ndarray
    row: np.ndarray
    source: np.ndarray
    unit_key: np.ndarray  # sorted (kind, block) keys of the units a tile can read, and their units
    unit_of_key: np.ndarray
    num_blocks: int

    def unit_of(self, kind: int, blocks: np.ndarray) -> np.ndarray:
        """The unit a tile reads a block of `kind` from (a held block serves both kinds); -1 where there is none."""
        return lookup(self.unit_key, self.unit_of_key, kind * self.num_blocks + np.asarray(blocks, dtype=np.int64),
                      -1)


def block_seg_ptr(program: RankProgram) -> np.ndarray:
    """Each block's first segment (num_blocks + 1 entries): segments are stored by block."""
    return np.searchsorted(program.tables.seg_block, np.arange(program.header.num_blocks + 1))


def local_segments(program: RankProgram, seg_ptr: np.ndarray) -> np.ndarray:
    """The rank's segments in plan-layout row order (its held blocks' segments, block by block); seg_ptr:
    :func:`block_seg_ptr`."""
    held = program.arrays["blocks"].astype(np.int64)
    return expand_ranges(seg_ptr[held], seg_ptr[held + 1] - seg_ptr[held])


def _units(program: RankProgram, seg_ptr: np.ndarray) -> _Units:
    tables, a = program.tables, program.arrays
    num_blocks = program.header.num_blocks
    seg_len = tables.seg_end - tables.seg_start
    held = a["blocks"].astype(np.int64)
    held_count = seg_ptr[held + 1] - seg_ptr[held]
    local_segs = local_segments(program, seg_ptr)
    local_rows = (np.cumsum(seg_len[local_segs]) - seg_len[local_segs]).astype(np.int64)  # [] where it holds none
    pull_count = a["pull_recv_seg_count"].astype(np.int64)
    pull_segs = a["pull_recv_segs"].astype(np.int64)
    pull_rows = offsets_within(seg_len[pull_segs], pull_count)
    counts = np.concatenate([held_count, pull_count])
    ptr = np.concatenate(([0], np.cumsum(counts))).astype(np.int64)
    source = np.concatenate([np.full(local_segs.size, LOCAL), np.repeat(np.arange(pull_count.size), pull_count)])
    held_units = np.arange(held.size)
    pull_units = held.size + np.arange(pull_count.size)
    keys = np.concatenate([TransferKind.Q * num_blocks + held, TransferKind.KV * num_blocks + held,
                           a["pull_recv_kind"].astype(np.int64) * num_blocks + a["pull_recv_block"]])
    units = np.concatenate([held_units, held_units, pull_units])
    order = np.argsort(keys, kind="stable")
    return _Units(ptr=ptr, seg=np.concatenate([local_segs, pull_segs]), row=np.concatenate([local_rows, pull_rows]),
                  source=source.astype(np.int64), unit_key=keys[order], unit_of_key=units[order],
                  num_blocks=num_blocks)


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
    parts, local_lengths, request_rank = [], [], []
    request_base = local_base = 0
    local_bases = []
    seg_ptr = block_seg_ptr(programs[0]) if programs else np.zeros(1, dtype=np.int64)  # the batch's, shared
    for index, (program, rank_requests) in enumerate(zip(programs, requests)):
        pairs, local_len = _rank_pairs(program, rank_requests, seg_ptr)
        pairs[0] = pairs[0] + request_base
        # The gap rule finds local segments by row: rows of all ranks' layouts, one after another.
        pairs[3] = np.where(pairs[1] == LOCAL, pairs[3] + local_base, pairs[3])
        parts.append(pairs)
        local_lengths.append(local_len)
        local_bases.append(local_base)
        request_rank += [index] * len(rank_requests)
        request_base += len(rank_requests)
        local_base += int(local_len.sum())
    columns = [np.concatenate([part[i] for part in parts]) if parts else np.zeros(0, dtype=np.int64)
               for i in range(12)]
    calls = plan_calls(*columns, np.concatenate(local_lengths) if local_lengths else np.zeros(0, dtype=np.int64))
    entry_rank = np.asarray(request_rank, dtype=np.int64)[calls.call_request][calls.entry_call]
    local = calls.entry_q_source == LOCAL
    rows = np.where(local, calls.entry_q_row - np.asarray(local_bases, dtype=np.int64)[entry_rank]
                    if entry_rank.size else calls.entry_q_row, calls.entry_q_row)
    return dataclasses.replace(calls, entry_q_row=rows)


def _rank_pairs(program: RankProgram, requests: list[Request],
                seg_ptr: np.ndarray) -> tuple[list[np.ndarray], np.ndarray]:
    """One rank's segment pairs as :func:`plan_calls` takes them (request, q_source, q_seg, q_row, q_start, q_end,
    k_source, k_seg, k_row, k_start, k_end, window), and its local segments' lengths in layout order."""
    a, tables = program.arrays, program.tables
    units = _units(program, seg_ptr)
    tiles = np.asarray([t for request in requests for t in request.tiles], dtype=np.int64)
    request_of_tile = np.repeat(np.arange(len(requests)), [len(request.tiles) for request in requests])
    q_unit = units.unit_of(TransferKind.Q, a["tile_q_block"][tiles])
    k_unit = units.unit_of(TransferKind.KV, a["tile_kv_block"][tiles])
    if (q_unit < 0).any() or (k_unit < 0).any():
        bad = int(tiles[np.flatnonzero((q_unit < 0) | (k_unit < 0))[0]])
        raise PlanFormatError(f"rank {program.rank}'s tile {bad} reads a block it neither holds nor receives: the plan "
                              f"is invalid (fcp validate names the invariant)")
    # Every query segment of a tile against the key segments of its own sequence, in tile, then segment order.
    q_count = units.ptr[q_unit + 1] - units.ptr[q_unit]
    q_entry = expand_ranges(units.ptr[q_unit], q_count)
    q_tile = np.repeat(np.arange(tiles.size), q_count)
    k_count = units.ptr[k_unit + 1] - units.ptr[k_unit]
    k_entry = expand_ranges(units.ptr[k_unit], k_count)
    k_tile = np.repeat(np.arange(tiles.size), k_count)
    num_seqs = tables.seq_lengths.size
    q_key = q_tile * num_seqs + tables.seg_seq[units.seg[q_entry]]
    k_key = k_tile * num_seqs + tables.seg_seq[units.seg[k_entry]]
    k_order = np.argsort(k_key, kind="stable")
    low = np.searchsorted(k_key[k_order], q_key, side="left")
    high = np.searchsorted(k_key[k_order], q_key, side="right")
    matches = high - low
    q_pick = np.repeat(q_entry, matches)
    k_pick = k_entry[k_order[expand_ranges(low, matches)]]
    pair_tile = np.repeat(q_tile, matches)
    q_seg, k_seg = units.seg[q_pick], units.seg[k_pick]
    seq = tables.seg_seq[q_seg]
    local_len = (tables.seg_end - tables.seg_start)[units.seg[units.source == LOCAL]]  # in layout order
    pairs = [request_of_tile[pair_tile], units.source[q_pick], q_seg, units.row[q_pick], tables.seg_start[q_seg],
             tables.seg_end[q_seg], units.source[k_pick], k_seg, units.row[k_pick], tables.seg_start[k_seg],
             tables.seg_end[k_seg], tables.seq_window[seq]]
    return [np.asarray(column, dtype=np.int64) for column in pairs], local_len.astype(np.int64)

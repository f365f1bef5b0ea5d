"""Pass 8: serialise the plan, one section per rank."""

from __future__ import annotations

import numpy as np

from fcp_compiler.algorithms.keys import lexsort_ints
from fcp_compiler.algorithms.ranges import expand_ranges
from fcp_compiler.core.ir import Reshuffle
from fcp_compiler.errors import InfeasibleError
from fcp_compiler.format.plan_format import (RANK_ARRAYS, assemble_sections, encode_section, int32_bytes,
                                             rank_stages_excess)


class _RankSlicer:
    """Named arrays, each sorted by rank, cut into per-rank byte slices without per-rank copies."""

    def __init__(self, num_ranks: int):
        self.num_ranks = num_ranks
        self.columns: dict[str, tuple[memoryview, np.ndarray]] = {}

    def add(self, names: tuple[str, ...], rank_of_row: np.ndarray, *columns: np.ndarray) -> None:
        """Add columns whose rows belong to rank_of_row (sorted)."""
        self.add_counted(names, np.bincount(rank_of_row, minlength=self.num_ranks), *columns)

    def add_counted(self, names: tuple[str, ...], rows_per_rank: np.ndarray, *columns: np.ndarray) -> None:
        """Add columns whose first rows_per_rank[0] rows belong to rank 0, the next ones to rank 1, and so on."""
        bounds = np.concatenate(([0], np.cumsum(rows_per_rank))) * 4
        for name, column in zip(names, columns):
            self.columns[name] = (int32_bytes(column), bounds)

    @classmethod
    def of_columns(cls, num_ranks: int, columns: dict[str, tuple[np.ndarray, np.ndarray]]) -> "_RankSlicer":
        """The slicer of :func:`rank_columns`' columns (their int32 values are sliced in place)."""
        out = cls(num_ranks)
        for name, (values, bounds) in columns.items():
            out.columns[name] = (int32_bytes(values), bounds * 4)
        return out

    def rank(self, rank: int) -> dict[str, memoryview]:
        return {name: data[bounds[rank]:bounds[rank + 1]] for name, (data, bounds) in self.columns.items()}


def _add_pulls(out: _RankSlicer, transfers, forward, backward, num_ranks: int) -> dict[str, np.ndarray]:
    """The pull rows of both sides, each rank's by forward round; returns each edge's row on each side.

    A pull that carries every segment of its block is written with seg_count 0 and no segment list (the readers
    expand it), which keeps plans with many-segment blocks small."""
    num_edges = transfers.num_edges
    edge_ids = np.arange(num_edges)
    seg_count = np.diff(transfers.edge_seg_offsets)
    block_segs = np.diff(transfers.assignment.tiles.sharding.block_seg_offsets)
    written = np.where(seg_count == block_segs[transfers.edge_block], 0, seg_count)
    sides = (("send", transfers.edge_src, transfers.edge_dst), ("recv", transfers.edge_dst, transfers.edge_src))
    side_order = {side: lexsort_ints((edge_ids, forward.edge_round, me)) for side, me, _ in sides}
    row_of_edge = {}
    for side, me, _ in sides:
        order = side_order[side]
        rank_first = np.searchsorted(me[order], np.arange(num_ranks))
        row = np.empty(num_edges, dtype=np.int64)
        row[order] = np.arange(num_edges) - rank_first[me[order]]
        row_of_edge[side] = row
    parent = transfers.edge_parent
    source = np.where(parent >= 0, row_of_edge["recv"][parent], -1)  # the relay's pull_recv row of the block
    for side, me, peer in sides:
        order = side_order[side]
        out.add(tuple(f"pull_{side}_{name}" for name in ("round", "bwd_round", "kind", "block", "peer", "seg_count")),
                me[order], forward.edge_round[order], backward.edge_round[order], transfers.edge_kind[order],
                transfers.edge_block[order], peer[order], written[order])
        counts = written[order]
        segs = transfers.edge_segs[expand_ranges(transfers.edge_seg_offsets[order], counts)]
        out.add((f"pull_{side}_segs",), np.repeat(me[order], counts), segs)
        if side == "send":
            out.add(("pull_send_source",), me[order], source[order])
    return row_of_edge


def _add_pushes(out: _RankSlicer, transfers, forward, backward, row_of_edge: dict[str, np.ndarray]) -> None:
    """The push rows: a push returns along its pull, leaving the pull's receiver (pointing at its pull_recv row) and
    arriving at the pull's sender (pointing at its pull_send row)."""
    for prefix, program in (("fwd", forward), ("bwd", backward)):
        push_edge, push_round = program.push_edge, program.push_round
        sender = transfers.edge_dst[push_edge]
        receiver = transfers.edge_src[push_edge]
        by_sender = lexsort_ints((row_of_edge["recv"][push_edge], push_round, sender))
        out.add((f"{prefix}_push_send_round", f"{prefix}_push_send_pull"), sender[by_sender], push_round[by_sender],
                row_of_edge["recv"][push_edge[by_sender]])
        by_receiver = lexsort_ints((row_of_edge["send"][push_edge], push_round, receiver))
        out.add((f"{prefix}_push_recv_round", f"{prefix}_push_recv_pull"), receiver[by_receiver],
                push_round[by_receiver], row_of_edge["send"][push_edge[by_receiver]])


def rank_columns(plan: Reshuffle, tile_rows: bool = True) -> dict[str, tuple[np.ndarray, np.ndarray]]:
    """Every per-rank array of the plan file, all ranks end to end: per RANK_ARRAYS name, its int32 values and each
    rank's bounds in them (num_ranks + 1 entries). Rows of each rank are in execution order: pulls by forward round,
    tiles in forward pipeline order, pushes by round; a pull that carries its whole block has seg_count 0 and no
    segment list.

    Args:
        plan: the last IR object (it holds all the earlier ones).
        tile_rows: False: the tile arrays have no rows, as if no rank ran a tile (for a reader that takes the tiles
            from the IR: millions of rows at small blocks).
    Returns:
        the columns (what :func:`encode` cuts into rank sections).
    """
    return {name: (np.frombuffer(data, dtype=np.int32), bounds // 4)
            for name, (data, bounds) in _slicer(plan, tile_rows).columns.items()}


def _slicer(plan: Reshuffle, tile_rows: bool = True) -> _RankSlicer:
    schedule, transfers, assignment, tiles, sharding = plan.schedule, plan.transfers, plan.assignment, plan.tiles, \
        plan.sharding
    forward, backward, num_ranks = schedule.forward, schedule.backward, plan.num_ranks
    out = _RankSlicer(num_ranks)
    block_order = lexsort_ints((np.arange(assignment.block_rank.size), assignment.block_rank))
    out.add(("blocks",), assignment.block_rank[block_order], block_order)
    # Runs are sorted by (user rank, plan rank, start): the user side's order. The plan side sorts by user rank.
    out.add(("reshuffle_send_peer", "reshuffle_send_offset", "reshuffle_send_length"), plan.run_user_rank,
            plan.run_plan_rank, plan.run_user_offset, plan.run_length)
    recv_runs = lexsort_ints((plan.run_global_start, plan.run_user_rank, plan.run_plan_rank))
    out.add(("reshuffle_recv_peer", "reshuffle_recv_offset", "reshuffle_recv_length"), plan.run_plan_rank[recv_runs],
            plan.run_user_rank[recv_runs], plan.run_plan_offset[recv_runs], plan.run_length[recv_runs])
    row_of_edge = _add_pulls(out, transfers, forward, backward, num_ranks)
    tile_order = schedule.tile_order
    # Millions of tiles at small blocks: each column narrowed to int32 before it is gathered into pipeline order
    # (stages and blocks count from 0 up to the header's int32 counts, so no column needs scanning for its range).
    assert max(sharding.num_blocks, forward.num_stages, backward.num_stages) < 2**31
    tile_names = ("tile_stage", "tile_bwd_stage", "tile_q_block", "tile_kv_block")
    if tile_rows:
        out.add_counted(tile_names, np.bincount(assignment.tile_rank, minlength=num_ranks),  # tile_order: by rank first
                        *_in_order((forward.tile_stage, backward.tile_stage, tiles.tile_q_block, tiles.tile_kv_block),
                                   tile_order))
    else:
        out.add_counted(tile_names, np.zeros(num_ranks, dtype=np.int64),
                        *(np.zeros(0, dtype=np.int32) for _ in tile_names))
    _add_pushes(out, transfers, forward, backward, row_of_edge)
    assert set(out.columns) == set(RANK_ARRAYS)
    return out


# Tiles gathered at a time into the int32 tile columns (_in_order): the int64 rows of a part are a few MB.
PART_TILES = 1 << 20


def _in_order(columns: tuple[np.ndarray, ...], order: np.ndarray) -> np.ndarray:
    """Each column gathered in `order`, as int32 rows of one array: no int64 or unordered copy of a column is made
    (millions of tiles at small blocks), and the rows' memory, one allocation, goes back whole once they are
    dropped (columns of tens of MB apart stay in the allocator's heap)."""
    rows = np.empty((len(columns), order.size), dtype=np.int32)
    for row, column in zip(rows, columns):
        for low in range(0, order.size, PART_TILES):
            row[low:low + PART_TILES] = column[order[low:low + PART_TILES]]
    return rows


def global_columns(plan: Reshuffle) -> dict[str, np.ndarray]:
    """The batch-wide arrays of the plan file (GLOBAL_ARRAYS)."""
    sharding = plan.sharding
    return {"seq_lengths": sharding.batch.lengths, "seq_window": sharding.batch.windows,
            "seg_block": sharding.seg_block, "seg_seq": sharding.seg_seq, "seg_start": sharding.seg_start,
            "seg_end": sharding.seg_end}


def encode(plan: Reshuffle, header_fields: dict,
           columns: dict[str, tuple[np.ndarray, np.ndarray]] | None = None) -> bytes:
    """Write the plan file bytes: header, batch-wide tables, then each rank's program (:func:`rank_columns`).

    Args:
        plan: the last IR object (it holds all the earlier ones).
        header_fields: every PlanHeader field but the section table.
        columns: rank_columns(plan), when the caller has them (the memory account reads them too).
    Returns:
        the plan file's bytes (deterministic for the same IR and header).
    Raises:
        InfeasibleError: more ranks x stages than a reader takes (MAX_RANK_STAGES).
    """
    # What every reader refuses (the header's bound), refused before it is written.
    excess = rank_stages_excess(plan.num_ranks, header_fields["num_fwd_stages"] + header_fields["num_bwd_stages"])
    if excess is not None:
        raise InfeasibleError(f"{excess}: give a larger --block-size or --coalesce")
    out = _slicer(plan) if columns is None else _RankSlicer.of_columns(plan.num_ranks, columns)
    del columns
    sections = [encode_section(out.rank(rank)) for rank in range(plan.num_ranks)]
    del out  # the int32 columns (millions of tile rows at small blocks) go before the file's bytes are joined
    return assemble_sections(header_fields, encode_section(global_columns(plan)), sections)

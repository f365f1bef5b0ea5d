"""A plan's tiles as the simulator reads them, without a column of millions of rows per pass and per figure: in the
tile set's order each tile's rank, stage in either pass and whether it runs during the input reshuffle; in plan
order (each rank's rows in turn, as the encoder lays them out) which tile each row runs. Read from the compiler's
IR where the simulator holds it (a compiled plan, a floor candidate), else from a plan's stacked ranks (a file).
The sums the timing model takes over the tiles (:class:`TileWork`) are taken a few ranks at a time, in plan order.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

import numpy as np

from fcp_compiler.algorithms.keys import search_sorted, stable_order
from fcp_compiler.algorithms.ranges import offsets
from fcp_compiler.algorithms.timeline import TileWork
from fcp_compiler.core.ir import Reshuffle, TileSet
from fcp_compiler.format.call_plan import stacked_tiles_during_reshuffle
from fcp_compiler.format.inputs import Layout
from fcp_compiler.format.stacked import StackedRanks

# Plan rows summed at a time (PlanTiles.rank_parts): a few MB a column.
TILE_PART = 1 << 18


@dataclass(frozen=True, slots=True, kw_only=True)
class PlanTiles:
    """rank, fwd_stage, bwd_stage: per tile of the TileSet (its order), the rank running it (its position among the
    stacked ranks) and its stage in each pass; early: bool per tile, run during the input reshuffle (None: none is);
    row_tile: per plan row, the tile it runs; rank_rows: each rank's first row (num_ranks + 1 entries)."""

    rank: np.ndarray
    fwd_stage: np.ndarray
    bwd_stage: np.ndarray
    early: np.ndarray | None
    row_tile: np.ndarray
    rank_rows: np.ndarray

    def fwd_launch(self, num_stages: int) -> np.ndarray:
        """Each tile's forward launch: its stage, or `num_stages` for a tile run during the input reshuffle."""
        return self.fwd_stage if self.early is None else np.where(self.early, num_stages, self.fwd_stage)

    def rank_parts(self, most: int = TILE_PART) -> Iterator[tuple[int, int, np.ndarray]]:
        """Consecutive ranks, about `most` plan rows at a time (a rank's rows all in one): (first rank, end rank,
        the tile of each of their rows, in plan order)."""
        bounds, num_ranks, low = self.rank_rows, self.rank_rows.size - 1, 0
        while low < num_ranks:
            high = int(np.searchsorted(bounds, bounds[low] + most, side="right")) - 1
            high = min(max(high, low + 1), num_ranks)
            yield low, high, self.row_tile[bounds[low]:bounds[high]].astype(np.int64)
            low = high

    def work(self, stage: np.ndarray, seconds: np.ndarray, num_stages: int, scale: float = 1.0, early: bool = False,
             tile_seconds: np.ndarray | None = None) -> tuple[TileWork, np.ndarray | None]:
        """One pass's TileWork, its tiles at each one's stage (`stage`, per tile) and `seconds` x `scale` (per tile;
        `early`: those run during the input reshuffle counted apart, the forward), and each rank's tiles at
        `tile_seconds` where given (the plan's planned compute, else None): each sum over its tiles in plan order."""
        num_ranks = self.rank_rows.size - 1
        work, planned = TileWork.zeros(num_stages, num_ranks), None if tile_seconds is None else np.zeros(num_ranks)
        for low, high, tile in self.rank_parts():
            rank = self.rank[tile]
            part_seconds = seconds[tile] * scale if scale != 1.0 else seconds[tile]
            work.add(low, high, rank, stage[tile], part_seconds,
                     self.early[tile] if early and self.early is not None else None)
            if planned is not None:
                planned[low:high] = np.bincount(rank - low, weights=tile_seconds[tile], minlength=high - low)
        return work, planned

    def in_plan_order(self) -> tuple[np.ndarray, ...]:
        """(tile, rank, forward stage, backward stage, run during the input reshuffle) of every plan row: a column
        of millions of rows each at small blocks (for recording a trace)."""
        tile = self.row_tile.astype(np.int64)
        early = self.early[tile] if self.early is not None else np.zeros(tile.size, dtype=bool)
        return tile, self.rank[tile], self.fwd_stage[tile], self.bwd_stage[tile], early


def plan_tiles(stacked: StackedRanks, tiles: TileSet, final: Reshuffle | None = None) -> PlanTiles:
    """The plan's tiles from its IR (`final`, whose tile set `tiles` is) where given, else from its stacked ranks'
    tile rows; in the user layout, which run during the input reshuffle, from the stacked ranks' tile rows (they
    must then have them)."""
    if final is not None:
        assert final.tiles is tiles
        schedule = final.schedule
        counts = np.bincount(final.assignment.tile_rank, minlength=final.num_ranks)
        # The encoder lays each rank's tiles out in pipeline order (schedule.tile_order, by rank first).
        found = PlanTiles(rank=final.assignment.tile_rank, fwd_stage=schedule.forward.tile_stage,
                          bwd_stage=schedule.backward.tile_stage, early=None, row_tile=schedule.tile_order,
                          rank_rows=offsets(counts))
    else:
        found = _stacked(stacked, tiles)
    if stacked.header.layout is not Layout.USER:
        return found
    early = stacked_tiles_during_reshuffle(stacked)
    if not early.any():
        return found
    early_of = np.zeros(tiles.num_tiles, dtype=bool)
    early_of[found.row_tile] = early
    return PlanTiles(rank=found.rank, fwd_stage=found.fwd_stage, bwd_stage=found.bwd_stage, early=early_of,
                     row_tile=found.row_tile, rank_rows=found.rank_rows)


def _stacked(stacked: StackedRanks, tiles: TileSet) -> PlanTiles:
    """The plan's tiles from its stacked ranks' tile rows: each row's tile found by its (query block, key block)."""
    a = stacked.arrays
    num_blocks = tiles.sharding.num_blocks
    keys = tiles.tile_q_block * num_blocks + tiles.tile_kv_block  # sorted
    wanted = a["tile_q_block"] * num_blocks + a["tile_kv_block"]
    tile_idx = None
    if wanted.size == keys.size and (wanted.size == 0 or (wanted.min() >= 0 and wanted.max() < num_blocks ** 2)):
        # A plan runs every tile once: its keys sorted by radix are the TileSet's (millions of tiles at small
        # blocks, where a search per tile took seconds); any other plan is searched tile by tile.
        order = stable_order(wanted, num_blocks ** 2)
        if np.array_equal(wanted[order], keys):
            tile_idx = np.empty(wanted.size, dtype=np.int64)
            tile_idx[order] = np.arange(wanted.size)
        del order
    if tile_idx is None:
        tile_idx = search_sorted(keys, wanted)
    del wanted, keys
    # Ranks and stages count up to the plan's int32 fields.
    rank, fwd_stage, bwd_stage = (np.zeros(tiles.num_tiles, dtype=np.int32) for _ in range(3))
    rank[tile_idx] = stacked.rank_of("tile_q_block")
    fwd_stage[tile_idx], bwd_stage[tile_idx] = a["tile_stage"], a["tile_bwd_stage"]
    return PlanTiles(rank=rank, fwd_stage=fwd_stage, bwd_stage=bwd_stage, early=None, row_tile=tile_idx,
                     rank_rows=stacked.bounds["tile_stage"])

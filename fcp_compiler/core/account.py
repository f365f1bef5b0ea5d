"""The memory account of a plan the compiler holds, as :func:`fcp_compiler.core.plan_memory.plan_peak_bytes` takes it
(the same figures), without every rank's tile rows stacked at once.

The account reads its ranks a group at a time (:func:`fcp_compiler.format.memory.stacked_peak_bytes`, through
StackedRanks.ranks_between), so a group's tile rows are gathered from the plan's IR when it is read, as the encoder
lays them out (each rank's tiles in pipeline order): at 64-token blocks a plan has millions of tile rows, and four
columns of them stacked are hundreds of MB.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from fcp_compiler.algorithms.ranges import offsets
from fcp_compiler.core.ir import Reshuffle
from fcp_compiler.core.passes.encode import rank_columns
from fcp_compiler.core.plan_memory import stack_plan
from fcp_compiler.format.memory import stacked_peak_bytes
from fcp_compiler.format.stacked import StackedRanks

TILE_ARRAYS = ("tile_stage", "tile_bwd_stage", "tile_q_block", "tile_kv_block")


@dataclass(frozen=True, slots=True, kw_only=True)
class _TileRowsByGroup(StackedRanks):
    """Stacked ranks whose tile rows are gathered from the plan's IR (`final`) when a group of ranks is read: its own
    tile arrays are empty (their bounds are the plan's); ranks_between gives a group's rows, int64, as stacked ranks
    hold them."""

    final: Reshuffle

    def ranks_between(self, low: int, high: int) -> StackedRanks:
        part = StackedRanks.ranks_between(self, low, high)
        bounds = self.bounds["tile_stage"]
        schedule, tiles = self.final.schedule, self.final.tiles
        tile = schedule.tile_order[int(bounds[low]):int(bounds[high])]
        rows = (schedule.forward.tile_stage, schedule.backward.tile_stage, tiles.tile_q_block, tiles.tile_kv_block)
        arrays = {**part.arrays, **{name: column[tile].astype(np.int64, copy=False)
                                    for name, column in zip(TILE_ARRAYS, rows)}}
        return StackedRanks(header=part.header, tables=part.tables, ranks=part.ranks, arrays=arrays,
                            bounds=part.bounds)


def plan_peak_bytes(final: Reshuffle, header_fields: dict, stop_above: int | None = None,
                    first: np.ndarray | None = None) -> np.ndarray:
    """Each rank's peak bytes in the forward and the backward (core.plan_memory.plan_peak_bytes: the same figures of
    the same arguments), every array but the tile rows stacked whole, those a group of ranks at a time.

    Returns:
        int64 [num_ranks, 2], or fewer rows where the account stopped above `stop_above`.
    """
    stacked = stack_plan(final, header_fields, rank_columns(final, tile_rows=False))
    tile_bounds = offsets(np.bincount(final.assignment.tile_rank, minlength=final.num_ranks))
    lazy = _TileRowsByGroup(header=stacked.header, tables=stacked.tables, ranks=stacked.ranks, arrays=stacked.arrays,
                            bounds={**stacked.bounds, **{name: tile_bounds for name in TILE_ARRAYS}}, final=final)
    del stacked
    return stacked_peak_bytes(lazy, stop_above=stop_above, first=first)

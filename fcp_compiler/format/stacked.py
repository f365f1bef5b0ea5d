"""Several ranks' programs as one set of arrays: each per-rank array concatenated in rank order, with every rank's
bounds in it, so that what reads all ranks (the memory account, every rank's call plan) is one vectorized pass, not
one per rank.

Row indices a program keeps within its rank (a push's pull row, a relay's source row, a call's store) stay within
their rank here; :meth:`StackedRanks.base` gives each rank's first row of an array.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from fcp_compiler.algorithms.ranges import expand_ranges, group_sums, offsets
from fcp_compiler.format.plan_format import (RANK_ARRAYS, GlobalTables, PlanHeader, PlanReader, RankProgram,
                                             expand_whole_blocks)


@dataclass(frozen=True, slots=True, kw_only=True)
class StackedRanks:
    """Ranks' arrays end to end (RANK_ARRAYS names, int64), with each array's bounds per rank (num_ranks + 1
    entries); `ranks` holds the rank ids, in order."""

    header: PlanHeader
    tables: GlobalTables
    ranks: np.ndarray
    arrays: dict[str, np.ndarray]
    bounds: dict[str, np.ndarray]

    @property
    def num_ranks(self) -> int:
        return int(self.ranks.size)

    def count(self, name: str) -> np.ndarray:
        """Rows of array `name` per rank (int64 [num_ranks])."""
        return np.diff(self.bounds[name])

    def base(self, name: str) -> np.ndarray:
        """Each rank's first row of array `name` (int64 [num_ranks])."""
        return self.bounds[name][:-1]

    def rank_of(self, name: str) -> np.ndarray:
        """The position (in `ranks`) of the rank each row of array `name` belongs to (int64 [rows])."""
        return np.repeat(np.arange(self.num_ranks), self.count(name))

    def ranks_between(self, low: int, high: int) -> "StackedRanks":
        """The stacked ranks at positions low..high-1 (views of these arrays)."""
        arrays = {name: values[self.bounds[name][low]:self.bounds[name][high]] for name, values in self.arrays.items()}
        bounds = {name: bounds[low:high + 1] - bounds[low] for name, bounds in self.bounds.items()}
        return StackedRanks(header=self.header, tables=self.tables, ranks=self.ranks[low:high], arrays=arrays,
                            bounds=bounds)

    def local_segments(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Every rank's segments in plan-layout row order (its held blocks' segments, block by block), ranks one
        after another: (the segments, each held block's segment count, each rank's segment count)."""
        seg_ptr = self.tables.block_seg_offsets
        held = self.arrays["blocks"]
        held_count = seg_ptr[held + 1] - seg_ptr[held]
        per_rank = np.bincount(self.rank_of("blocks"), weights=held_count, minlength=self.num_ranks)
        return expand_ranges(seg_ptr[held], held_count), held_count, per_rank.astype(np.int64)

    def pull_tokens(self, side: str) -> np.ndarray:
        """Tokens each stacked pull of `side` ("send" or "recv") carries (int64 per row)."""
        seg_len = (self.tables.seg_end - self.tables.seg_start).astype(np.int64)
        return group_sums(seg_len[self.arrays[f"pull_{side}_segs"]], offsets(self.arrays[f"pull_{side}_seg_count"]))

    def plan_tokens(self) -> np.ndarray:
        """Tokens each stacked rank holds in the plan layout (int64 [num_ranks])."""
        seg_len = (self.tables.seg_end - self.tables.seg_start).astype(np.int64)
        local, _, local_count = self.local_segments()
        return group_sums(seg_len[local], offsets(local_count)).astype(np.int64)

    def within(self, name: str) -> np.ndarray:
        """Each row's index within its rank's rows of array `name` (int64 [rows])."""
        rows = self.arrays[name].size
        return np.arange(rows) - np.repeat(self.base(name), self.count(name))


def stack_programs(programs: list[RankProgram]) -> StackedRanks:
    """Stack decoded rank programs of one plan, in the order given (at least one); pulls a program stores as
    seg_count 0 (unexpanded: a whole block) get their segment lists."""
    assert programs, "no ranks to stack"
    arrays = {name: np.concatenate([p.arrays[name] for p in programs]).astype(np.int64) for name in RANK_ARRAYS}
    bounds = {name: offsets([p.arrays[name].size for p in programs]) for name in RANK_ARRAYS}
    return _expanded(programs[0].header, programs[0].tables, np.asarray([p.rank for p in programs], dtype=np.int64),
                     arrays, bounds)


def stack_reader(reader: PlanReader) -> StackedRanks:
    """Every rank of a plan stacked as stack_programs(reader.ranks(expand=False)) stacks them, read in one pass
    (:meth:`PlanReader.joined_ranks`: the same checks, no program decoded rank by rank).

    Raises:
        PlanFormatError: a corrupt section, or an index out of range.
    """
    arrays, bounds = reader.joined_ranks()
    return _expanded(reader.header, reader.tables, np.arange(reader.header.num_ranks, dtype=np.int64), arrays, bounds)


def _expanded(header: PlanHeader, tables: GlobalTables, ranks: np.ndarray, arrays: dict[str, np.ndarray],
              bounds: dict[str, np.ndarray]) -> StackedRanks:
    """The stacked ranks with every whole-block pull's segment list written out (and its bounds)."""
    block_seg_offsets = tables.block_seg_offsets
    for side in ("send", "recv"):
        if (arrays[f"pull_{side}_seg_count"] == 0).any():
            expand_whole_blocks(arrays, side, block_seg_offsets, np.diff(block_seg_offsets))
            bounds[f"pull_{side}_segs"] = offsets(group_sums(arrays[f"pull_{side}_seg_count"],
                                                             bounds[f"pull_{side}_seg_count"]))
    return StackedRanks(header=header, tables=tables, ranks=ranks, arrays=arrays, bounds=bounds)


def stack_columns(header: PlanHeader, tables: GlobalTables, columns: dict[str, tuple[np.ndarray, np.ndarray]],
                  ) -> StackedRanks:
    """Stack every rank of a plan from its columns as the encoder lays them out: per RANK_ARRAYS name, the values of
    all ranks end to end and their bounds; pulls stored as seg_count 0 (a whole block) get their segment lists, as
    a reader's expanded programs do."""
    arrays = {name: np.asarray(columns[name][0], dtype=np.int64) for name in RANK_ARRAYS}
    bounds = {name: np.asarray(columns[name][1], dtype=np.int64) for name in RANK_ARRAYS}
    return _expanded(header, tables, np.arange(bounds["blocks"].size - 1, dtype=np.int64), arrays, bounds)

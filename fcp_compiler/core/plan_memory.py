"""A compiled plan's device memory, before its bytes leave the compiler: each rank's peak bytes per pass, by the
memory account the runtime's tensors follow (:mod:`fcp_compiler.format.memory`), read from the encoder's columns of
every rank at once (no rank section is decoded)."""

from __future__ import annotations

import numpy as np

from fcp_compiler.core.ir import Reshuffle
from fcp_compiler.core.passes.encode import global_columns, rank_columns
from fcp_compiler.format.memory import stacked_peak_bytes
from fcp_compiler.format.plan_format import GlobalTables, PlanHeader
from fcp_compiler.format.stacked import StackedRanks, stack_columns


def stack_plan(final: Reshuffle, header: PlanHeader | dict,
               columns: dict[str, tuple[np.ndarray, np.ndarray]] | None = None) -> StackedRanks:
    """Every rank of the plan stacked from the encoder's columns, as a reader of its file would stack them (no
    section is encoded or decoded).

    Args:
        final: the plan's last IR object.
        header: its header, or its header fields (compile_plan's, before the sections are laid out).
        columns: rank_columns(final), when the caller has them.
    Returns:
        the StackedRanks.
    """
    if not isinstance(header, PlanHeader):
        header = PlanHeader.model_construct(**header)  # the fields compile_plan has just made, not a file's
    tables = GlobalTables(**{name: np.asarray(values, dtype=np.int64)
                             for name, values in global_columns(final).items()})
    return stack_columns(header, tables, rank_columns(final) if columns is None else columns)


def plan_peak_bytes(final: Reshuffle, header_fields: dict,
                    columns: dict[str, tuple[np.ndarray, np.ndarray]] | None = None,
                    stop_above: int | None = None, first: np.ndarray | None = None) -> np.ndarray:
    """Each rank's peak bytes in the forward and the backward, in the plan's dtype and layout, on either kernel path
    (the larger: :func:`fcp_compiler.format.memory.stacked_peak_bytes`).

    Args:
        final: the plan's last IR object.
        header_fields: its header fields (shape, layout, stages: what the account reads).
        columns: rank_columns(final), when the caller has them.
        stop_above: stop at the first group of ranks with a peak above it (:func:`stacked_peak_bytes`).
        first: a priority per rank: groups of ranks are accounted highest first (:func:`stacked_peak_bytes`).
    Returns:
        int64 [num_ranks, 2], or fewer rows where the account stopped above `stop_above`.
    """
    return stacked_peak_bytes(stack_plan(final, header_fields, columns), stop_above=stop_above, first=first)

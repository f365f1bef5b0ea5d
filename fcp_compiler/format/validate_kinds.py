"""The validator of a plan of layer kinds (one plan for each kind, fcp_compiler.format.kinds).

Each kind's plan is checked as any plan is (:func:`fcp_compiler.format.validate.validate_plan`: invariants 0-5),
and the kinds together keep invariant 7 of docs/DESIGN.md section 4: one layout for every kind (the same batch, the
same blocks on the same ranks, the same reshuffle runs, so one dispatch serves all), and each kind's documents have
its mask. Like the plan validator it reads the per-rank programs only.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from fcp_compiler.format.kinds import PlanKinds
from fcp_compiler.format.validate import PlanInvalidError, ValidationReport, validate_plan

LAYOUT_INVARIANT = 7
# Every kind's header agrees on the batch, its blocks, where tokens live and the attention shape: PlanKinds refuses
# a file whose kinds' headers differ there (fcp_compiler.format.kinds.SHARED_HEADER), as the runtime reads it.
_SHARED_TABLES = ("seq_lengths", "seg_block", "seg_seq", "seg_start", "seg_end")
_SHARED_RANK = ("blocks", "reshuffle_send_peer", "reshuffle_send_offset", "reshuffle_send_length",
                "reshuffle_recv_peer", "reshuffle_recv_offset", "reshuffle_recv_length")


def validate_kinds(source: str | Path | bytes | PlanKinds, background: bool = False,
                   memory_account: bool = True) -> dict[str | None, ValidationReport]:
    """Check every kind's plan (invariants 0-5) and that the kinds share one layout with each kind's mask
    (invariant 7); a plan of one kind is checked alone.

    Args:
        source: a plan file's path or its bytes (a kinds file or not), or its PlanKinds.
        background, memory_account: as validate_plan's.
    Returns:
        each kind's ValidationReport by name (None: a plan of one kind).
    Raises:
        PlanFormatError: a file that cannot be read, or kinds whose headers differ in a field they share
            (fcp_compiler.format.kinds.SHARED_HEADER: the batch, the layout, the attention shape), named with
            both values.
        PlanInvalidError: an invariant broken (naming the kind).
    """
    kinds = source if isinstance(source, PlanKinds) else PlanKinds(source)
    reports = {}
    for kind in kinds.kinds:
        try:
            reports[kind.name] = validate_plan(kind.reader, background=background, memory_account=memory_account)
        except PlanInvalidError as error:
            if kind.name is None:
                raise
            raise PlanInvalidError(error.invariant, f"layer kind {kind.name!r}: {error.message}") from None
    if kinds.kinds_file:
        _check_one_layout(kinds)
    return reports


def _fail(message: str) -> None:
    raise PlanInvalidError(LAYOUT_INVARIANT, message)


def _check_one_layout(kinds: PlanKinds) -> None:
    """Invariant 7: the kinds' batch tables and every rank's blocks and reshuffle runs are one (their headers' shared
    fields PlanKinds has checked); each kind's windows are its mask's."""
    first = kinds.kinds[0]
    first_tables = first.reader.tables
    for kind in kinds.kinds:
        tables = kind.reader.tables
        for name in _SHARED_TABLES:
            if not np.array_equal(getattr(tables, name), getattr(first_tables, name)):
                _fail(f"kind {kind.name!r}'s {name} differs from kind {first.name!r}'s: the kinds cut one batch alike")
        expected = np.array([kind.mask.window_for(int(length)) for length in tables.seq_lengths], dtype=np.int64)
        wrong = np.flatnonzero(expected != tables.seq_window)
        if wrong.size:
            seq = int(wrong[0])
            _fail(f"kind {kind.name!r} has mask {kind.mask.model_dump(mode='json')} but its plan gives sequence {seq} "
                  f"window {int(tables.seq_window[seq])}, not {int(expected[seq])}")
    for rank in range(first.reader.header.num_ranks):
        mine = first.reader.rank(rank, expand=False).arrays
        for kind in kinds.kinds[1:]:
            theirs = kind.reader.rank(rank, expand=False).arrays
            for name in _SHARED_RANK:
                if not np.array_equal(mine[name], theirs[name]):
                    _fail(f"rank {rank}'s {name} differs between kinds {first.name!r} and {kind.name!r}: one "
                          f"layout (one dispatch) serves every kind")

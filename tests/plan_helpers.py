"""Plan helpers shared by test modules: the masked-plan batch and the token pairs its tiles need (tests/test_call_plan.py,
tests/test_arena.py), and a plan edited to break an invariant and the validator's verdict on it
(tests/test_validate.py, tests/test_relay.py)."""

from __future__ import annotations

import numpy as np
import pytest

from conftest import compile_valid
from fcp_compiler.algorithms.call_plan import LOCAL
from fcp_compiler.format.inputs import BatchSpec
from fcp_compiler.format.plan_format import PlanReader, rebuild_plan
from fcp_compiler.format.validate import PlanInvalidError, validate_plan

MASKS = {"causal": "causal", "full": "full", "window": {"kind": "sliding_window", "window": 300},
         "mixed": [{"kind": "sliding_window", "window": 300}, "full", "causal",
                   {"kind": "sliding_window", "window": 1000}, {"kind": "sliding_window", "window": 40}, "full"]}


def masked_plan(mask: str, layout: str):
    """Six sequences, long and short, on 4 ranks in blocks of 128, under one of MASKS."""
    lengths = [1500, 700, 90, 900, 260, 600]
    masks = MASKS[mask]
    batch = BatchSpec.model_validate({"sequences": lengths, "masks": masks if isinstance(masks, list)
                                      else [masks] * len(lengths)})
    return compile_valid(batch, 4, block_size=128, coalesce=2, layout=layout)


def store_tokens(program):
    """Global token of each row of each store: LOCAL (the plan layout) and every received pull."""
    tables, a = program.tables, program.arrays
    seq_offset = np.concatenate(([0], np.cumsum(tables.seq_lengths)))
    ptr = np.searchsorted(tables.seg_block, np.arange(program.header.num_blocks + 1))

    def tokens(segs):
        segs = np.asarray(segs, dtype=np.int64)
        if segs.size == 0:
            return np.zeros(0, dtype=np.int64)
        return np.concatenate([seq_offset[tables.seg_seq[s]] + np.arange(tables.seg_start[s], tables.seg_end[s])
                               for s in segs])
    stores = {LOCAL: tokens([s for b in a["blocks"].tolist() for s in range(ptr[b], ptr[b + 1])])}
    offsets = program.seg_offsets("recv")
    for row in range(a["pull_recv_block"].size):
        stores[row] = tokens(a["pull_recv_segs"][offsets[row]:offsets[row + 1]])
    return stores


def needed_pairs(program, tiles):
    """Every (query token, key token) pair the tiles compute (same sequence, visible under the sequence's mask), as
    codes query * total tokens + key."""
    tables, a = program.tables, program.arrays
    seq_offset = np.concatenate(([0], np.cumsum(tables.seq_lengths)))
    total = int(seq_offset[-1])
    ptr = np.searchsorted(tables.seg_block, np.arange(program.header.num_blocks + 1))
    needed = [np.zeros(0, dtype=np.int64)]
    for tile in tiles:
        for qs in range(ptr[a["tile_q_block"][tile]], ptr[a["tile_q_block"][tile] + 1]):
            for ks in range(ptr[a["tile_kv_block"][tile]], ptr[a["tile_kv_block"][tile] + 1]):
                seq = tables.seg_seq[qs]
                if tables.seg_seq[ks] != seq:
                    continue
                q = np.arange(tables.seg_start[qs], tables.seg_end[qs])[:, None]
                k = np.arange(tables.seg_start[ks], tables.seg_end[ks])[None, :]
                w = tables.seq_window[seq]
                visible = np.ones((q.size, k.size), bool) if w == 0 else (k <= q) & (q - k < w)
                qq, kk = np.nonzero(visible)
                needed.append((seq_offset[seq] + q[qq, 0]) * total + seq_offset[seq] + k[0, kk])
    return np.concatenate(needed)


def edited(data, edit, **header_changes):
    """The plan `data` with edit(arrays) applied to a copy of every rank's arrays, and the header changes."""
    reader = PlanReader(data)
    arrays = [{name: values.copy() for name, values in program.arrays.items()} for program in reader.ranks()]
    edit(arrays)
    return rebuild_plan(reader, arrays, **header_changes)


def expect(data, invariant, match=None):
    """The validator refuses `data`, naming `invariant` (and a message matching `match`)."""
    with pytest.raises(PlanInvalidError, match=match) as caught:
        validate_plan(data)
    assert caught.value.invariant == invariant, str(caught.value)

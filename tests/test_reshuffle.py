"""reshuffle: its runs move every user-layout token to where the plan layout puts it, checked token by token."""

import numpy as np

from conftest import compile_valid
from fcp_compiler.core.passes.reshuffle import reshuffle


def plan_layout_tokens(final) -> list[np.ndarray]:
    """Per rank, the global token ids of its plan layout: its blocks by id, each block's segments in order."""
    sharding, assignment = final.sharding, final.assignment
    offsets = sharding.batch.seq_offsets
    layout = []
    for rank in range(final.num_ranks):
        segs = [seg for block in np.flatnonzero(assignment.block_rank == rank)
                for seg in range(sharding.block_seg_offsets[block], sharding.block_seg_offsets[block + 1])]
        layout.append(np.concatenate([np.arange(offsets[sharding.seg_seq[s]] + sharding.seg_start[s],
                                                offsets[sharding.seg_seq[s]] + sharding.seg_end[s]) for s in segs]
                                     or [np.zeros(0, dtype=np.int64)]))
    return layout


def test_runs_move_every_token_to_its_plan_position():
    for layout in ("plan", "user"):
        plan = compile_valid([5000, 300, 70000, 12, 4096, 8192, 20000, 999], 4, block_size=1024, layout=layout)
        final = reshuffle(plan.ir.schedule)  # the pass alone, on the schedule it was given
        total, n = final.batch.total_tokens, final.num_ranks
        bounds = (np.arange(n + 1) * total) // n
        assert np.array_equal(final.user_bounds, bounds)
        expected = plan_layout_tokens(final)
        moved = [np.full(tokens.size, -1, dtype=np.int64) for tokens in expected]
        sent = np.zeros(total, dtype=np.int64)
        for run in range(final.run_length.size):
            user, target = int(final.run_user_rank[run]), int(final.run_plan_rank[run])
            start, length = int(final.run_global_start[run]), int(final.run_length[run])
            assert bounds[user] + final.run_user_offset[run] == start  # the user side reads its own chunk there
            assert bounds[user] <= start and start + length <= bounds[user + 1]
            tokens = np.arange(start, start + length)
            sent[tokens] += 1
            offset = int(final.run_plan_offset[run])
            assert (moved[target][offset:offset + length] == -1).all()
            moved[target][offset:offset + length] = tokens
        assert (sent == 1).all()
        for rank in range(n):
            np.testing.assert_array_equal(moved[rank], expected[rank])
        # Sorted by (user rank, plan rank, start), the order both sides pack them in.
        order = np.lexsort((final.run_global_start, final.run_plan_rank, final.run_user_rank))
        assert np.array_equal(order, np.arange(order.size))

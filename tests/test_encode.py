"""encode: each rank's pull rows hold exactly the IR's pulls, in forward-round order; a pull of a whole block is
stored as seg_count 0 and read back as its block's full segment list."""

import msgpack
import numpy as np

from conftest import compile_valid
from fcp_compiler.format.plan_format import PlanReader


def test_pull_rows_round_trip_and_whole_blocks_are_stored_compactly():
    plan = compile_valid([5000, 300, 70000, 12, 4096, 8192, 20000, 999], 4, block_size=1024, coalesce=4)
    transfers, forward, sharding = plan.ir.transfers, plan.ir.schedule.forward, plan.ir.sharding
    block_segs = np.diff(sharding.block_seg_offsets)
    reader = PlanReader(plan.to_bytes())
    stored_whole = 0
    for rank in range(4):
        program = reader.rank(rank)
        edges = np.flatnonzero(transfers.edge_dst == rank)
        edges = edges[np.lexsort((edges, forward.edge_round[edges]))]
        assert program.pull_recv_block.tolist() == transfers.edge_block[edges].tolist()
        want = [transfers.edge_segs[transfers.edge_seg_offsets[e]:transfers.edge_seg_offsets[e + 1]].tolist()
                for e in edges]
        offsets = program.seg_offsets("recv")
        got = [program.pull_recv_segs[offsets[i]:offsets[i + 1]].tolist() for i in range(edges.size)]
        assert got == want
        # The raw section: whole-block pulls carry no list.
        offset, length = reader.header.rank_sections[rank]
        raw = msgpack.unpackb(plan.to_bytes()[reader._body + offset:reader._body + offset + length])
        counts = np.frombuffer(raw["pull_recv_seg_count"], dtype="<i4")
        whole = np.diff(transfers.edge_seg_offsets)[edges] == block_segs[transfers.edge_block[edges]]
        assert (counts[whole] == 0).all() and (counts[~whole] > 0).all()
        stored_whole += int(whole.sum())
    assert stored_whole > 0

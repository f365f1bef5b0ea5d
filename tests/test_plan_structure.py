"""Structural checks every plan reader runs (fcp_compiler/format/plan_structure.py and the header's bounds).

Each case is a compiled plan edited and re-sealed with valid sha256s, so only these checks stand between it and
the reader: the validator and `load_rank_plan` must refuse it with PlanFormatError, within bounded memory.
"""

import tracemalloc

import numpy as np
import pytest

from fcp_compiler import PlanFormatError, compile_plan
from fcp_compiler.format.plan_format import GLOBAL_ARRAYS, PlanReader, assemble, load_rank_program
from fcp_compiler.format.validate import validate_plan

LENGTHS = [700, 90, 1500, 33, 260, 1200, 64, 3000]


def _sealed(source: bytes, header=None, tables=None, rank_edits=None) -> bytes:
    """The plan with header fields, global arrays or rank arrays replaced, re-sealed."""
    reader = PlanReader(source)
    fields = reader.header.model_dump(exclude={"global_section", "rank_sections", "global_sha256", "rank_sha256"})
    fields.update(header or {})
    global_arrays = {name: getattr(reader.tables, name) for name in GLOBAL_ARRAYS}
    global_arrays.update(tables or {})
    ranks = [dict(program.arrays) for program in reader.ranks()]
    for rank, arrays in (rank_edits or {}).items():
        ranks[rank].update(arrays)
    return assemble(fields, global_arrays, ranks)


def _refused_by_every_reader(data: bytes, rank: int, match: str) -> float:
    """Assert validate, load_rank_program and load_rank_plan refuse; return the readers' peak traced MB."""
    from fcp_runtime.plan import load_rank_plan

    tracemalloc.start()
    try:
        for read in (validate_plan, lambda d: load_rank_program(d, rank), lambda d: load_rank_plan(d, rank)):
            with pytest.raises(PlanFormatError, match=match):
                read(data)
        return tracemalloc.get_traced_memory()[1] / 2**20
    finally:
        tracemalloc.stop()


def _by_peer_reversed(peers: np.ndarray, *columns: np.ndarray) -> list[np.ndarray]:
    """The runs regrouped with the peers in descending order, each peer's runs in their own order."""
    order = np.lexsort((np.arange(peers.size), -peers))
    return [column[order] for column in (peers, *columns)]


@pytest.mark.parametrize("layout", ["plan", "user"])
@pytest.mark.parametrize("side", ["send", "recv"])
def test_reshuffle_runs_out_of_peer_order_are_refused_on_every_rank(layout, side):
    pytest.importorskip("torch")
    source = compile_plan(LENGTHS, 4, block_size=256, layout=layout).to_bytes()
    reader = PlanReader(source)
    mutated = 0
    for program in reader.ranks():
        a = program.arrays
        names = [f"reshuffle_{side}_{name}" for name in ("peer", "offset", "length")]
        if np.unique(a[names[0]]).size < 2:
            continue
        edit = dict(zip(names, _by_peer_reversed(*(a[name] for name in names))))
        _refused_by_every_reader(_sealed(source, rank_edits={program.rank: edit}), program.rank,
                                 f"reshuffle_{side} runs are not grouped by peer in ascending order")
        mutated += 1
    assert mutated >= 3


def test_a_block_repeated_20000_times_is_refused_without_amplifying():
    pytest.importorskip("torch")
    source = compile_plan(LENGTHS, 8, block_size=256).to_bytes()
    blocks = PlanReader(source).rank(0).arrays["blocks"]
    data = _sealed(source, rank_edits={0: {"blocks": np.concatenate([blocks, np.repeat(blocks[:1], 20_000)])}})
    assert len(data) < 200_000
    peak = _refused_by_every_reader(data, 0, "blocks lists a block more than once")
    assert peak < 200, f"{peak:.0f} MB traced while refusing a {len(data)}-byte plan"


def test_a_block_count_the_segments_do_not_reach_is_refused():
    pytest.importorskip("torch")
    source = compile_plan(LENGTHS, 8, block_size=256).to_bytes()
    seg_block = PlanReader(source).tables.seg_block.copy()
    seg_block[-1] = sum(LENGTHS) - 1  # the last segment claims a far block id, and the header's count follows it
    data = _sealed(source, header={"num_blocks": sum(LENGTHS)}, tables={"seg_block": seg_block})
    peak = _refused_by_every_reader(data, 0, "seg_block does not run through every block")
    assert peak < 200


def test_stage_counts_are_bounded_by_the_rank_sections_bytes_and_a_reader_stays_small_at_the_bound():
    pytest.importorskip("torch")
    from fcp_runtime.plan import load_rank_plan

    source = compile_plan(LENGTHS * 4, 8, block_size=64, coalesce=1).to_bytes()
    empty = {name: np.zeros(0, dtype=np.int32) for name in PlanReader(source).rank(0).arrays if name != "blocks"}
    ranks = {rank: {**empty, "blocks": PlanReader(source).rank(rank).arrays["blocks"]} for rank in range(8)}
    sections = sum(length for _, length in PlanReader(_sealed(source, header={"num_rounds": 0},
                                                              rank_edits=ranks)).header.rank_sections)
    bwd_coalesce = PlanReader(source).header.bwd_coalesce
    messages = sections // 4  # each message has an int32 round at both ends
    assert messages < 4 * 8 * PlanReader(source).header.num_blocks  # so the sections bind, not ranks x blocks

    def counts(extra: int) -> dict:
        fwd, bwd = 2 * messages + 4 + extra, 2 * messages + 4 * bwd_coalesce + extra  # forward c = 1
        return {"num_rounds": 0, "num_fwd_rounds": fwd, "num_bwd_rounds": bwd, "num_fwd_stages": fwd + 2,
                "num_bwd_stages": bwd // bwd_coalesce + 2}

    with pytest.raises(ValueError, match="num_fwd_rounds .* exceed what"):
        _sealed(source, header=counts(1), rank_edits=ranks)
    data = _sealed(source, header=counts(0), rank_edits=ranks)
    tracemalloc.start()
    try:
        plan = load_rank_plan(data, 0, validate=False)  # the reader's own bound (validation refuses it, below)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert plan.forward.num_stages == counts(0)["num_fwd_stages"]
    assert peak < 100 * len(data), f"{peak} bytes traced for a {len(data)}-byte plan"
    with pytest.raises(PlanFormatError):
        validate_plan(data)  # the header's counts are not the ones the plan has


def _structure_error(check) -> str | None:
    try:
        check()
    except PlanFormatError as error:
        return str(error)
    return None


@pytest.mark.parametrize("layout", ["plan", "user"])
def test_all_ranks_checked_at_once_refuse_as_rank_by_rank(layout):
    """PlanReader.ranks checks every rank's arrays in one pass (check_ranks_arrays), and so does a read end to end
    (check_joined_arrays): over random edits of random arrays (values off by a few, out of range, rows added or
    dropped), each must refuse exactly what the rank-by-rank checks refuse, with the first bad rank's message, and
    pass what they pass."""
    from fcp_compiler.format.plan_format import RANK_ARRAYS
    from fcp_compiler.format.plan_structure import check_joined_arrays, check_rank_arrays, check_ranks_arrays

    reader = PlanReader(compile_plan(LENGTHS, 4, block_size=256, layout=layout).to_bytes())
    tables = reader.tables
    header, sizes = reader.header, (tables.seg_block.size, reader._block_tokens, reader._block_num_segments)
    rng = np.random.default_rng(7)
    outcomes = {"refused": 0, "passed": 0}
    for _ in range(300):
        ranks = [reader._decode_rank(rank) for rank in range(reader.header.num_ranks)]
        for _ in range(int(rng.integers(1, 3))):
            rank, name = int(rng.integers(len(ranks))), RANK_ARRAYS[int(rng.integers(len(RANK_ARRAYS)))]
            values, edit = ranks[rank][name].copy(), int(rng.integers(4))
            if edit == 0 and values.size:
                values[rng.integers(values.size)] += int(rng.integers(-3, 4))
            elif edit == 1 and values.size:
                values[rng.integers(values.size)] = int(rng.integers(-2, 400))
            elif edit == 2:
                values = np.append(values, int(rng.integers(0, 10)))
            elif values.size:
                values = values[:-1]
            ranks[rank][name] = values

        def one_by_one():
            for rank, arrays in enumerate(ranks):
                check_rank_arrays(f"rank {rank}", header, arrays, *sizes, rank)

        expected = _structure_error(one_by_one)
        assert _structure_error(lambda: check_ranks_arrays(lambda rank: f"rank {rank}", header, ranks,
                                                           *sizes)) == expected
        # Read end to end (PlanReader.joined_ranks): the same verdict and message.
        arrays = {name: np.concatenate([rank_arrays[name] for rank_arrays in ranks]) for name in RANK_ARRAYS}
        bounds = {name: np.concatenate(([0], np.cumsum([rank_arrays[name].size for rank_arrays in ranks])))
                  for name in RANK_ARRAYS}
        assert _structure_error(lambda: check_joined_arrays(lambda rank: f"rank {rank}", header, arrays, bounds,
                                                            *sizes)) == expected
        outcomes["passed" if expected is None else "refused"] += 1
    assert min(outcomes.values()) > 50  # both outcomes were exercised


def test_a_plan_from_elsewhere_passes_the_all_ranks_check_without_falling_back():
    """A valid plan passes the all-ranks check itself (not only after the rank-by-rank fallback, which would cost
    what the check is there to save)."""
    from fcp_compiler.format.plan_structure import _Joined, _ranks_pass

    reader = PlanReader(compile_plan(LENGTHS, 4, block_size=256).to_bytes())
    ranks = [reader._decode_rank(rank) for rank in range(reader.header.num_ranks)]
    assert _ranks_pass(reader.header, _Joined(ranks), reader.tables.seg_block.size, reader._block_tokens,
                       reader._block_num_segments)


@pytest.mark.parametrize("layout", ["plan", "user"])
def test_a_plan_read_end_to_end_stacks_as_its_programs_do(layout):
    """stack_reader (the validator's, the simulator's and fcp diff's read) gives every array and bound that stacking
    the decoded programs gives, and refuses a corrupt section with the same message."""
    from fcp_compiler.format.stacked import stack_programs, stack_reader

    data = compile_plan(LENGTHS, 4, block_size=256, layout=layout).to_bytes()
    expected, got = stack_programs(PlanReader(data).ranks(expand=False)), stack_reader(PlanReader(data))
    assert set(got.arrays) == set(expected.arrays) and set(got.bounds) == set(expected.bounds)
    for name, values in expected.arrays.items():
        assert got.arrays[name].dtype == values.dtype and np.array_equal(got.arrays[name], values), name
        assert np.array_equal(got.bounds[name], expected.bounds[name]), name
    assert np.array_equal(got.ranks, expected.ranks)
    reader = PlanReader(data)
    offset, length = reader.header.rank_sections[2]
    corrupt = bytearray(data)
    corrupt[reader.body_offset + offset + length // 2] ^= 0xFF
    messages = []
    for read in (lambda source: source.ranks(expand=False), stack_reader):
        with pytest.raises(PlanFormatError) as error:
            read(PlanReader(bytes(corrupt)))
        messages.append(str(error.value))
    assert messages[0] == messages[1] and "rank 2's section does not match its sha256" in messages[0]


@pytest.mark.parametrize("edit", ["tile deleted", "pull from another rank"])
def test_a_plan_edited_and_sealed_again_is_refused_by_the_runtimes_reader(edit):
    """The sha256s are checksums: a plan edited and sealed again reads as intact, and replayed it would train silently
    wrong (a deleted tile drops its keys from attention). load_rank_plan validates the whole plan first."""
    pytest.importorskip("torch")
    from fcp_runtime.plan import load_rank_plan

    data = compile_plan(LENGTHS, 4, block_size=256, model="none").to_bytes()
    arrays = PlanReader(data).rank(0).arrays
    if edit == "tile deleted":
        names = ("tile_stage", "tile_bwd_stage", "tile_q_block", "tile_kv_block")
        edits = {name: np.delete(arrays[name], 0) for name in names}
    else:
        peers = arrays["pull_recv_peer"].copy()
        peers[0] = 3 if peers[0] != 3 else 2  # the block is received from a rank that does not send it
        edits = {"pull_recv_peer": peers}
    edited = _sealed(data, rank_edits={0: edits})
    load_rank_plan(edited, 1, validate=False)  # the checksums hold: only validation tells
    for rank in range(4):  # every rank refuses, not only the one whose slice was edited
        with pytest.raises(PlanFormatError, match="broken"):
            load_rank_plan(edited, rank)
    load_rank_plan(data, 0)  # the plan as compiled loads

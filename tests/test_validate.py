"""The validator passes real plans and names the invariant a plan edited to break it breaks."""

import multiprocessing
import os
import sys

import numpy as np
import pytest

from conftest import compile_own
from fcp_compiler.errors import PlanFormatError
from fcp_compiler.format.plan_format import PlanReader, rebuild_plan
from fcp_compiler.format.validate import PlanInvalidError, validate_plan
from plan_helpers import edited, expect


@pytest.fixture(scope="module")
def plan_bytes():
    # Causal long sequences over 8 ranks in 4 nodes: remote pulls of both link classes, node fan-out, several rounds
    # and stages.
    return compile_own([20000, 9000, 3000, 700, 5000, 12000, 300, 64], 8, block_size=1024,
                         coalesce=2, gpus_per_node=2).to_bytes()


PER_NODE = 2


@pytest.fixture(scope="module")
def offload_bytes():
    return compile_own([32768], 16, block_size=4096, mask="full", coalesce=2).to_bytes()


def rank_with(arrays, name):
    return next(rank for rank, a in enumerate(arrays) if a[name].size)


def test_real_plans_pass(plan_bytes, offload_bytes):
    assert validate_plan(plan_bytes).num_pulls > 0
    assert validate_plan(offload_bytes).num_pushes_fwd > 0


def test_a_dropped_tile_breaks_coverage(plan_bytes):
    def drop(arrays):
        a = arrays[0]
        for name in ("tile_stage", "tile_bwd_stage", "tile_q_block", "tile_kv_block"):
            a[name] = a[name][1:]
    expect(edited(plan_bytes, drop), 1, "runs nowhere")


def test_a_duplicated_tile_breaks_coverage(plan_bytes):
    def duplicate(arrays):
        for name in ("tile_stage", "tile_bwd_stage", "tile_q_block", "tile_kv_block"):
            arrays[1][name] = np.append(arrays[1][name], arrays[0][name][0])
    expect(edited(plan_bytes, duplicate), 1, "runs 2 times")


def test_a_segment_no_pull_brings_breaks_data_before_use(plan_bytes):
    """A pull of two segments that both its ends list with one fewer: a tile of the receiver reads the dropped one
    (the validator enumerates the visible segment pairs by binary search, and names the first lacking pair)."""
    found = {}

    def drop_segment(arrays):
        for rank, a in enumerate(arrays):
            starts = np.concatenate(([0], np.cumsum(a["pull_recv_seg_count"])))
            for row in np.flatnonzero(a["pull_recv_seg_count"] == 2).tolist():
                if (a["pull_send_source"] == row).any():  # relayed on: its child would lack the segment too
                    continue
                peer, block, kind = (int(a[f"pull_recv_{name}"][row]) for name in ("peer", "block", "kind"))
                sender = arrays[peer]
                match = np.flatnonzero((sender["pull_send_peer"] == rank) & (sender["pull_send_block"] == block)
                                       & (sender["pull_send_kind"] == kind))
                send_starts = np.concatenate(([0], np.cumsum(sender["pull_send_seg_count"])))
                dropped = int(a["pull_recv_segs"][starts[row] + 1])
                a["pull_recv_segs"] = np.delete(a["pull_recv_segs"], starts[row] + 1)
                a["pull_recv_seg_count"][row] = 1
                sent = int(match[0])
                assert sender["pull_send_segs"][send_starts[sent] + 1] == dropped
                sender["pull_send_segs"] = np.delete(sender["pull_send_segs"], send_starts[sent] + 1)
                sender["pull_send_seg_count"][sent] = 1
                found.update(rank=rank, segment=dropped)
                return

    data = edited(plan_bytes, drop_segment)
    expect(data, 2, f"rank {found['rank']} reads segment {found['segment']} of block .* but no pull brings it")


def test_a_tile_before_its_data_breaks_data_before_use(plan_bytes):
    def too_early(arrays):
        for a in arrays:
            remote = np.flatnonzero(~np.isin(a["tile_kv_block"], a["blocks"]))
            if remote.size:
                a["tile_stage"][remote[0]] = 0
                return
    expect(edited(plan_bytes, too_early), 2, "arrives in stage")


def test_a_partial_output_pushed_before_its_tile_breaks_data_before_use(offload_bytes):
    def push_early(arrays):
        a = arrays[rank_with(arrays, "fwd_push_send_round")]
        a["fwd_push_send_round"][0] = 0
    expect(edited(offload_bytes, push_early), 2)


def _same_round(arrays, nic: bool, count: int) -> bool:
    """Move `count` forward pulls one rank sends over one link class into the round of its first (both ends of
    each edited); False if no rank sends that many."""
    for sender, a in enumerate(arrays):
        # Pulls of its own blocks, moved earlier (to the first's round): data still arrives before use, only
        # congestion changes (and memory, checked after it).
        rows = np.flatnonzero(((a["pull_send_peer"] // PER_NODE != sender // PER_NODE) == nic)
                              & (a["pull_send_source"] < 0))
        if rows.size < count:
            continue
        rows = rows[np.argsort(a["pull_send_round"][rows], kind="stable")]
        target = a["pull_send_round"][rows[0]]
        for row in rows[1:count].tolist():
            peer, block, kind = a["pull_send_peer"][row], a["pull_send_block"][row], a["pull_send_kind"][row]
            r = arrays[peer]
            recv = np.flatnonzero((r["pull_recv_peer"] == sender) & (r["pull_recv_block"] == block)
                                  & (r["pull_recv_kind"] == kind))[0]
            a["pull_send_round"][row] = r["pull_recv_round"][recv] = target
        return True
    return False


def _moved(nic: bool, count: int):
    def edit(arrays):
        assert _same_round(arrays, nic, count)
    return edit


def test_a_rank_sending_two_nic_messages_in_a_round_breaks_congestion_freedom(plan_bytes):
    expect(edited(plan_bytes, _moved(True, 2)), 3, r"(sends|receives) 2 NIC messages")


def test_nvlink_messages_beyond_the_lanes_of_a_round_break_congestion_freedom(plan_bytes):
    lanes = PlanReader(plan_bytes).header.nvlink_lanes
    assert lanes == 2  # h100: NVLink 9x the NIC, capped
    expect(edited(plan_bytes, _moved(False, lanes + 1)), 3, rf"(sends|receives) {lanes + 1} NVLink messages")


def test_one_message_of_each_class_in_a_round_is_congestion_free():
    # Two ranks on two nodes and two on one: rank 0 sends to a rank of its node and to one of the other node in the
    # same round, which is congestion-free per class (and was not under one class).
    plan = compile_own([20000, 9000, 3000, 700, 5000, 12000, 300, 64], 8, block_size=1024, coalesce=2,
                         gpus_per_node=2)
    stats = plan.stats
    both = 0
    for rank in range(8):
        a = plan.rank(rank).arrays
        nic = a["pull_send_peer"] // PER_NODE != rank // PER_NODE
        both += np.intersect1d(a["pull_send_round"][nic], a["pull_send_round"][~nic]).size
    assert both > 0 and stats["nic_degree"] > 0 and stats["nvlink_degree"] > 0


def _move_message_into_a_busy_round(arrays, prefix, coalesce):
    """Move one push across nodes, within its stage or later, so that its receiver also receives a NIC pull in that
    round (both ends of the push edited)."""
    for sender, a in enumerate(arrays):
        for row in range(a[f"{prefix}_push_send_round"].size):
            pull = a[f"{prefix}_push_send_pull"][row]
            owner, block, kind = a["pull_recv_peer"][pull], a["pull_recv_block"][pull], a["pull_recv_kind"][pull]
            if owner // PER_NODE == sender // PER_NODE:
                continue
            o = arrays[owner]
            nic = o["pull_recv_peer"] // PER_NODE != owner // PER_NODE
            busy = o["pull_recv_bwd_round" if prefix == "bwd" else "pull_recv_round"][nic]
            current = a[f"{prefix}_push_send_round"][row]
            busy = busy[busy >= current // coalesce * coalesce]
            if not busy.size:
                continue
            target = busy.min()
            a[f"{prefix}_push_send_round"][row] = target
            back = np.flatnonzero((o["pull_send_peer"] == sender) & (o["pull_send_block"] == block)
                                  & (o["pull_send_kind"] == kind))[0]
            recv_row = np.flatnonzero(o[f"{prefix}_push_recv_pull"] == back)[0]
            o[f"{prefix}_push_recv_round"][recv_row] = target
            return


def test_a_push_into_a_rank_receiving_a_pull_in_the_same_round_breaks_congestion_freedom(plan_bytes):
    coalesce = PlanReader(plan_bytes).header.coalesce
    expect(edited(plan_bytes, lambda arrays: _move_message_into_a_busy_round(arrays, "bwd", coalesce)), 3,
           "receives 2 NIC messages")


def test_a_header_that_understates_live_buffers_breaks_memory(plan_bytes):
    stated = PlanReader(plan_bytes).header.max_buffer_tokens
    assert validate_plan(plan_bytes).max_buffer_tokens == stated
    expect(edited(plan_bytes, lambda arrays: None, max_buffer_tokens=stated - 1), 4, "max_buffer_tokens")


def expect_structure_error(data, match):
    """Out-of-range fields are refused by every reader, before the validator looks at meaning."""
    with pytest.raises(PlanFormatError, match=match):
        validate_plan(data)
    with pytest.raises(PlanFormatError, match=match):
        PlanReader(data).ranks()


@pytest.mark.parametrize("name, value", [("tile_stage", 99), ("tile_stage", -1), ("tile_bwd_stage", 99)])
def test_a_tile_outside_the_stages_is_caught(plan_bytes, name, value):
    def far(arrays):
        arrays[0][name][-1] = value
    expect_structure_error(edited(plan_bytes, far), f"{name} holds {value}, outside")


def test_a_push_past_the_last_stage_is_caught(plan_bytes):
    header = PlanReader(plan_bytes).header

    def late(arrays):
        a = arrays[rank_with(arrays, "bwd_push_send_round")]
        a["bwd_push_send_round"][-1] = header.num_bwd_stages * header.bwd_coalesce
    expect_structure_error(edited(plan_bytes, late), "bwd_push_send_round")


def test_a_header_with_fewer_stages_than_the_tiles_use_is_caught(plan_bytes):
    expect_structure_error(edited(plan_bytes, lambda arrays: None, num_fwd_stages=1), "outside")


def test_a_rank_over_the_token_cap_breaks_memory(plan_bytes):
    reader = PlanReader(plan_bytes)
    tokens = max(int((reader.tables.seg_end - reader.tables.seg_start)[np.isin(reader.tables.seg_block,
                                                                              p.blocks)].sum())
                 for p in reader.ranks())
    expect(edited(plan_bytes, lambda arrays: None, token_cap=tokens - 1), 4, "over the token cap")


def test_a_reshuffle_that_is_not_a_bijection_is_caught(plan_bytes):
    def shift(arrays):
        # Move the later of two runs onto the start of the earlier: still within the rank's tokens (it starts
        # earlier), but two runs now send the same tokens and some are sent by none.
        offsets = arrays[0]["reshuffle_send_offset"]
        first, later = np.argsort(offsets, kind="stable")[:2]
        offsets[later] = offsets[first]
    expect(edited(plan_bytes, shift), 5)


def test_backward_rounds_per_stage_must_be_twice_the_forward(plan_bytes):
    coalesce = PlanReader(plan_bytes).header.coalesce
    assert PlanReader(plan_bytes).header.bwd_coalesce == 2 * coalesce
    # Read as c rounds a stage, the backward's messages would lie past its stages (refused by every reader), and
    # its tiles would run before their data arrives.
    expect_structure_error(edited(plan_bytes, lambda arrays: None, bwd_coalesce=coalesce), "stage holds")


def test_stated_rounds_and_degrees_must_be_the_plans(plan_bytes):
    header = PlanReader(plan_bytes).header
    expect(edited(plan_bytes, lambda arrays: None, num_rounds=header.num_rounds + 1,
                  num_fwd_rounds=header.num_fwd_rounds + 1), 3, "forward pulls use")
    for name in ("nic_degree", "nvlink_degree"):
        expect(edited(plan_bytes, lambda arrays: None, **{name: getattr(header, name) + 1}), 3, name)
    # More NVLink lanes than the profile's bandwidth ratio allows.
    expect(edited(plan_bytes, lambda arrays: None, nvlink_lanes=10), 3, "allows at most")
    expect_structure_error(edited(plan_bytes, lambda arrays: None, num_rounds=header.num_rounds - 1),
                           "pull_(send|recv)_round holds")


def test_corrupt_files_are_format_errors(plan_bytes, tmp_path):
    with pytest.raises(PlanFormatError, match="not an fcp plan"):
        validate_plan(b"hello world, not a plan")
    with pytest.raises(PlanFormatError, match="sections do not match"):
        validate_plan(plan_bytes[:-10])
    with pytest.raises(PlanFormatError, match="does not exist"):
        validate_plan(str(tmp_path / "missing.fcp"))


def test_one_flipped_bit_anywhere_fails_every_reader_of_what_it_touches(plan_bytes):
    load_rank_plan = pytest.importorskip("fcp_runtime.plan").load_rank_plan  # the runtime's reader too

    reader = PlanReader(plan_bytes)
    body = len(plan_bytes) - sum(length for _, length in reader.header.rank_sections) \
        - reader.header.global_section[1]
    rng = np.random.default_rng(0)
    # Every byte of the fixed prefix and a sample of the header and of every section.
    positions = sorted(set(range(44)) | set(rng.integers(44, body, 60).tolist())
                       | set(rng.integers(body, len(plan_bytes), 200).tolist()))
    rank_starts = np.array([body + offset for offset, _ in reader.header.rank_sections])
    for position in positions:
        corrupt = bytearray(plan_bytes)
        corrupt[position] ^= 1 << int(rng.integers(8))
        corrupt = bytes(corrupt)
        with pytest.raises(PlanFormatError):
            validate_plan(corrupt)
        # The rank whose section (or the header, or the global tables) holds the bit cannot be loaded either.
        rank = int(np.searchsorted(rank_starts, position, side="right")) - 1 if position >= rank_starts[0] else 0
        with pytest.raises(PlanFormatError):
            load_rank_plan(corrupt, rank)


def test_reshuffle_runs_that_cover_everything_but_swap_places_are_caught(plan_bytes):
    def swap(arrays):
        for a in arrays:
            length, peer = a["reshuffle_recv_length"], a["reshuffle_recv_peer"]
            for i in range(length.size):
                same = np.flatnonzero((length == length[i]) & (peer != peer[i]))
                if same.size:
                    j = int(same[0])
                    a["reshuffle_recv_offset"][[i, j]] = a["reshuffle_recv_offset"][[j, i]]
                    return
        raise AssertionError("no two runs of equal length from different peers")
    expect(edited(plan_bytes, swap), 5, "do not land")


def test_a_plan_with_more_segment_pairs_than_the_validator_enumerates_is_refused(plan_bytes, monkeypatch):
    import fcp_compiler.format.validate as validate

    monkeypatch.setattr(validate, "MAX_VALIDATED_PAIRS", 10)
    with pytest.raises(PlanFormatError, match="segment pairs, more than the 10"):
        validate_plan(plan_bytes)


def test_whole_block_rows_that_would_expand_past_what_a_rank_can_receive_are_refused(plan_bytes):
    def flood(arrays):
        a = arrays[0]
        extra = 2 * int(PlanReader(plan_bytes).tables.seg_block.size) + 1
        for name in ("round", "bwd_round", "kind", "block", "peer"):
            a[f"pull_recv_{name}"] = np.concatenate((a[f"pull_recv_{name}"], np.full(extra, a[f"pull_recv_{name}"][0])))
        a["pull_recv_seg_count"] = np.concatenate((a["pull_recv_seg_count"], np.zeros(extra, dtype=np.int64)))
    expect_structure_error(edited(plan_bytes, flood), "more than the")


def test_a_plan_too_large_to_enumerate_is_scored_unvalidated_and_said_so(plan_bytes, monkeypatch):
    import fcp_compiler.format.validate as validate

    assert validate.validate_unless_too_large(plan_bytes)
    monkeypatch.setattr(validate, "MAX_VALIDATED_PAIRS", 1)
    assert not validate.validate_unless_too_large(plan_bytes)
    with pytest.raises(PlanFormatError, match="segment pairs"):
        validate_plan(plan_bytes)
    # A small enough plan that breaks an invariant is still refused.
    monkeypatch.undo()
    with pytest.raises(PlanInvalidError):
        validate.validate_unless_too_large(rebuild_plan(PlanReader(plan_bytes), token_cap=100))


def _fuzz_helpers():
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
    import fuzz_plans

    return fuzz_plans


def test_a_segment_listed_twice_in_a_pull_at_both_ends_is_refused():
    # Whole blocks of a sequence split across blocks list their segments explicitly where a pull carries part of
    # a block: a zigzag pair pulled for one of its chunks.
    data = compile_own([5000, 3000, 700, 64], 4, block_size=1024, coalesce=2, mask="sliding_window:600").to_bytes()
    helpers = _fuzz_helpers()
    arrays = [dict(program.arrays) for program in PlanReader(data).ranks()]
    listed = [(rank, int(row)) for rank, a in enumerate(arrays) for row in np.flatnonzero(a["pull_send_seg_count"])]
    assert listed, "the plan has no pull that lists its segments"
    validate_plan(data)

    def twice(ranks):
        assert helpers.duplicate_segment(ranks, *listed[0])
    expect(edited(data, twice), 2, "lists a segment twice")


def test_a_rank_pulling_its_own_block_is_refused(plan_bytes):
    def self_pull(arrays):
        rank = rank_with(arrays, "blocks")
        a = arrays[rank]
        block = int(a["blocks"][0])
        for side in ("send", "recv"):
            for name, value in (("round", 0), ("bwd_round", 0), ("kind", 0), ("block", block), ("peer", rank),
                                ("seg_count", 0)):
                a[f"pull_{side}_{name}"] = np.append(a[f"pull_{side}_{name}"], value)
        a["pull_send_source"] = np.append(a["pull_send_source"], -1)
    expect(edited(plan_bytes, self_pull), 2, "pulls block .* from itself")


def test_received_pulls_listed_in_another_order_validate(plan_bytes):
    """The same plan, one rank listing its received pulls in reverse: valid (the runtime's posting order does not
    follow row numbers: tests/test_runtime_exact.py replays such a plan with posting-order matching)."""
    helpers = _fuzz_helpers()

    def reverse(arrays):
        rank = rank_with(arrays, "pull_recv_round")
        helpers.permute_received_pulls(arrays[rank], np.arange(arrays[rank]["pull_recv_round"].size)[::-1])
    validate_plan(edited(plan_bytes, reverse))


def test_a_coalesce_beyond_what_the_compiler_writes_is_refused(plan_bytes):
    """A header's rounds a stage size per-round tables; the format refuses more than the compiler may write."""
    import hashlib
    import struct

    import msgpack

    from fcp_compiler.format.plan_format import MAGIC, MAX_COALESCE

    header_length = struct.unpack("<I", plan_bytes[len(MAGIC):len(MAGIC) + 4])[0]
    start = len(MAGIC) + 4 + 32
    fields = msgpack.unpackb(plan_bytes[start:start + header_length])
    fields.update(coalesce=MAX_COALESCE + 1, bwd_coalesce=2 * MAX_COALESCE + 2)
    header = msgpack.packb(fields, use_bin_type=True)
    forged = b"".join([MAGIC, struct.pack("<I", len(header)), hashlib.sha256(header).digest(), header,
                       plan_bytes[start + header_length:]])
    with pytest.raises(PlanFormatError, match="coalesce"):
        validate_plan(forged)


def test_a_refusal_crosses_a_process_boundary_intact():
    """Workers (benchmarks, bulk compile) send a PlanInvalidError to their parent by pickling it."""
    import pickle

    error = PlanInvalidError(3, "in round 7 rank 2 receives 2 NIC messages")
    copy = pickle.loads(pickle.dumps(error))
    assert copy.invariant == 3 and str(copy) == str(error)


@pytest.fixture
def forked_account(monkeypatch):
    """validate_plan(background=True) forks its memory account for every plan, on any machine that forks."""
    import fcp_compiler.format.validate as validate_module

    if not hasattr(os, "fork") or sys.platform != "linux":
        pytest.skip("the background account forks on Linux only")
    monkeypatch.setattr(validate_module, "BACKGROUND_TILES", 0)
    monkeypatch.setattr(validate_module, "_may_fork", lambda: True)
    return validate_module


def test_the_forked_account_gives_the_same_report_and_the_same_first_error(plan_bytes, forked_account):
    started = []
    real_start = multiprocessing.process.BaseProcess.start

    def start(process):
        started.append(process)
        real_start(process)

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(multiprocessing.process.BaseProcess, "start", start)
        assert validate_plan(plan_bytes, background=True) == validate_plan(plan_bytes)
    assert len(started) == 1 and started[0].exitcode == 0  # the child did the account and was joined
    reader = PlanReader(plan_bytes)
    stated = list(reader.header.max_buffer_bytes_bwd)
    stated[2] += 1
    wrong = rebuild_plan(reader, max_buffer_bytes_bwd=stated)
    for background in (True, False):
        expect_message = "rank 2's bwd peaks at .* header's max_buffer_bytes_bwd states"
        with pytest.raises(PlanInvalidError, match=expect_message) as refusal:
            validate_plan(wrong, background=background)
        assert refusal.value.invariant == 4

    def drop(arrays):  # an earlier invariant breaks first: the child's account is never read, and it is stopped
        for name in ("tile_stage", "tile_bwd_stage", "tile_q_block", "tile_kv_block"):
            arrays[0][name] = arrays[0][name][1:]
    with pytest.MonkeyPatch.context() as patch:
        started.clear()
        patch.setattr(multiprocessing.process.BaseProcess, "start", start)
        with pytest.raises(PlanInvalidError, match="runs nowhere"):
            validate_plan(edited(plan_bytes, drop), background=True)
    assert len(started) == 1 and not started[0].is_alive()


def test_a_forked_account_that_dies_is_done_in_process(plan_bytes, forked_account, monkeypatch):
    monkeypatch.setattr(forked_account, "_account_child", lambda stacked, sender: os._exit(3))
    assert validate_plan(plan_bytes, background=True) == validate_plan(plan_bytes)


def test_without_the_memory_account_every_other_invariant_is_still_checked(plan_bytes):
    """The runtime's reader skips the memory account (its peak bytes only state memory; attention allocates what it
    needs): a header stating other peaks passes, and the report gives them as stated; a broken coverage does not."""
    reader = PlanReader(plan_bytes)
    stated = list(reader.header.max_buffer_bytes_bwd)
    stated[2] += 1
    wrong = rebuild_plan(reader, max_buffer_bytes_bwd=stated)
    with pytest.raises(PlanInvalidError, match="header's max_buffer_bytes_bwd states"):
        validate_plan(wrong)
    assert validate_plan(wrong, memory_account=False).max_buffer_bytes_bwd == max(stated)
    checked = validate_plan(plan_bytes)
    assert validate_plan(plan_bytes, memory_account=False) == checked

    def drop(arrays):
        for name in ("tile_stage", "tile_bwd_stage", "tile_q_block", "tile_kv_block"):
            arrays[0][name] = arrays[0][name][1:]
    with pytest.raises(PlanInvalidError, match="runs nowhere"):
        validate_plan(edited(plan_bytes, drop), memory_account=False)

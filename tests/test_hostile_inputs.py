"""Hostile but fair inputs (issue 12): each gets one line on stderr, exit 2, and leaves no file behind."""

import json
import os
import stat
from pathlib import Path

import pytest

from conftest import run_cli as run

ROOT = Path(__file__).resolve().parents[1]
SMALL = ROOT / "traces" / "small_8gpu.json"


def expect_one_line(capsys, args, match, code=2):
    got, _, err = run(capsys, *args)
    assert got == code, err
    assert err.count("\n") == 1 and "Traceback" not in err, err
    assert match in err, err


def _write(path: Path, data) -> Path:
    path.write_bytes(data if isinstance(data, bytes) else data.encode())
    return path


BAD_BATCHES = [
    ("int64 overflow", f"[{2**63}]", "more than 2147483647"),
    ("one sequence of 2**40 tokens", f"[{2**40}]", "more than 2147483647"),
    ("JSON nested 100,000 deep", "[" * 100_000 + "]" * 100_000, "nested deeper"),
    ("a 5000-digit number", "[" + "9" * 5000 + "]", "5000 characters"),
    ("NaN", "[NaN]", "NaN is not a number"),
    ("not UTF-8", b"[\xff]", "not UTF-8"),
]


@pytest.mark.parametrize("name, content, match", BAD_BATCHES, ids=[b[0] for b in BAD_BATCHES])
def test_bad_batch_files(tmp_path, capsys, name, content, match):
    batch = _write(tmp_path / "batch.json", content)
    expect_one_line(capsys, ["compile", batch, "--gpus", 4, "-o", tmp_path / "p.fcp"], match)
    assert not (tmp_path / "p.fcp").exists()


@pytest.mark.parametrize("flags, match", [
    (["--gpus", 2**70], "from 1 to 65536"),
    (["--gpus", 1_000_000], "from 1 to 65536"),
    (["--gpus", 4, "--block-size", 2**70], "multiple of 64 from 64"),
    (["--gpus", 4, "--token-cap", "1e30"], "--token-cap"),
    (["--gpus", 4, "--coalesce", 2**40], "--coalesce"),
    (["--gpus", 4, "--planner", "ring", "--block-size", 2048], "does not apply to --planner ring"),
])
def test_bad_compile_options(tmp_path, capsys, flags, match):
    expect_one_line(capsys, ["compile", SMALL, *flags, "-o", tmp_path / "p.fcp"], match)
    assert not (tmp_path / "p.fcp").exists()


def test_fifos_and_devices_are_refused_as_inputs_without_blocking(tmp_path, capsys):
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    expect_one_line(capsys, ["compile", fifo, "--gpus", 4, "-o", tmp_path / "p.fcp"], "not a regular file")
    expect_one_line(capsys, ["compile", "/dev/zero", "--gpus", 4, "-o", tmp_path / "p.fcp"], "not a regular file")
    expect_one_line(capsys, ["validate", fifo], "not a regular file")
    expect_one_line(capsys, ["simulate", fifo], "not a regular file")
    expect_one_line(capsys, ["inspect", fifo], "not a regular file")


def test_profiles_and_traces_must_be_finite(tmp_path, capsys):
    profile = {"name": "x", "peak_tflops": 1e400, "network_gbps": 50, "nvlink_gbps": 450,
               "efficiency_curve": [{"tokens": 128, "efficiency": 0.5}]}
    path = _write(tmp_path / "profile.json", json.dumps(profile).replace("Infinity", "1e400"))
    expect_one_line(capsys, ["compile", SMALL, "--gpus", 8, "--profile", path, "-o", tmp_path / "p.fcp"],
                    "not finite")
    expect_one_line(capsys, ["trace", "lognormal", "--median", "nan", "--gpus", 4, "-o", tmp_path / "t.json"],
                    "'--median': 'nan' is not a finite decimal number")
    assert not (tmp_path / "p.fcp").exists() and not (tmp_path / "t.json").exists()


def test_diff_tolerance_must_be_finite(tmp_path, capsys):
    plan = tmp_path / "p.fcp"
    assert run(capsys, "compile", SMALL, "--gpus", 8, "-o", plan, "-q")[0] == 0
    for value in ("nan", "inf", "-1"):
        expect_one_line(capsys, ["diff", plan, plan, "--fail-on", "regression", "--tolerance", value],
                        "--tolerance")


def test_outputs_that_are_not_regular_files_are_refused_before_compiling(tmp_path, capsys):
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    folder = tmp_path / "folder"
    folder.mkdir()
    for target in (fifo, folder):
        expect_one_line(capsys, ["compile", SMALL, "--gpus", 8, "-o", target], "cannot write")
    assert stat.S_ISFIFO(os.stat(fifo).st_mode) and folder.is_dir() and not any(folder.iterdir())


def test_a_character_device_as_output_is_left_intact(tmp_path, capsys):
    device = tmp_path / "null"
    try:
        os.mknod(device, stat.S_IFCHR | 0o666, os.makedev(1, 3))
    except (PermissionError, OSError):
        pytest.skip("making a device node needs CAP_MKNOD")
    expect_one_line(capsys, ["compile", SMALL, "--gpus", 8, "-o", device], "not a regular file")
    assert stat.S_ISCHR(os.stat(device).st_mode)


def test_plan_and_stats_land_together_or_not_at_all(tmp_path, capsys):
    blocker = _write(tmp_path / "file", "x")  # a file where the stats' folder should be
    plan = tmp_path / "p.fcp"
    expect_one_line(capsys, ["compile", SMALL, "--gpus", 8, "-o", plan, "--stats", blocker / "s.json"],
                    "cannot write")
    expect_one_line(capsys, ["compile", SMALL, "--gpus", 8, "-o", plan, "--stats", tmp_path], "a folder")
    assert not plan.exists() and sorted(p.name for p in tmp_path.iterdir()) == ["file"]


def test_a_plan_of_an_older_format_is_named(tmp_path, capsys):
    old = _write(tmp_path / "old.fcp", b"FCPPLAN\0" + b"\0" * 64)
    expect_one_line(capsys, ["validate", old], "older fcp")
    expect_one_line(capsys, ["simulate", old], "older fcp")  # a plan, though not this format's: not "a batch"


@pytest.mark.parametrize("content, match", [(b"garbage", "neither an fcp plan nor a batch JSON"),
                                            (b"", "neither an fcp plan nor a batch JSON"),
                                            (b"  [4096, 512]", "is a batch, not a plan: give --gpus")])
def test_simulate_says_what_a_file_that_is_not_a_plan_is(tmp_path, capsys, content, match):
    expect_one_line(capsys, ["simulate", _write(tmp_path / "input", content)], match)


def test_simulate_diff_and_inspect_on_a_plan_the_validator_rejects(tmp_path, capsys):
    import numpy as np

    from fcp_compiler.format.plan_format import PlanReader, rebuild_plan

    plan = tmp_path / "p.fcp"
    assert run(capsys, "compile", SMALL, "--gpus", 8, "-o", plan, "-q")[0] == 0
    reader = PlanReader(str(plan))
    arrays = [{name: values.copy() for name, values in program.arrays.items()} for program in reader.ranks()]
    remote = next((rank, np.flatnonzero(~np.isin(a["tile_kv_block"], a["blocks"]))) for rank, a in enumerate(arrays)
                  if (~np.isin(a["tile_kv_block"], a["blocks"])).any())
    arrays[remote[0]]["tile_stage"][remote[1][0]] = 0  # a tile before its data: sealed, structurally sound
    bad = _write(tmp_path / "bad.fcp", rebuild_plan(reader, arrays))
    for args in (["validate", bad], ["simulate", bad], ["diff", bad, plan]):
        expect_one_line(capsys, args, "invalid plan", code=1)
    # B that stopped validating is the diff's answer: a regression, exit 1 under --fail-on regression.
    code, out, _ = run(capsys, "diff", plan, bad, "--fail-on", "regression")
    assert code == 1 and out.splitlines()[-1].startswith("regression: B does not validate: ")
    code, _, err = run(capsys, "inspect", bad)
    assert code == 0 and err == ""  # inspect shows what is there, valid or not
    for args in (["inspect", bad, "--rank", remote[0]], ["inspect", bad, "--memory"]):
        code, out, err = run(capsys, *args)
        assert code == 0 and err == "" and "GiB" in out
    # A tile reading a block its rank neither holds nor receives has no kernel call to make: one line, exit 2.
    rank, a = remote[0], arrays[remote[0]]
    held = set(a["blocks"].tolist()) | set(a["pull_recv_block"].tolist())
    a["tile_kv_block"][0] = next(b for b in range(reader.header.num_blocks) if b not in held)
    unread = _write(tmp_path / "unread.fcp", rebuild_plan(reader, arrays))
    expect_one_line(capsys, ["inspect", unread, "--rank", rank], "neither holds nor receives", code=2)


def test_an_internal_error_is_one_line_with_its_own_exit_code(monkeypatch, capsys):
    import fcp_compiler.format.validate_kinds as validate_kinds

    def broken(*args, **kwargs):
        raise RuntimeError("a bug")
    monkeypatch.setattr(validate_kinds, "validate_plan", broken)  # what `fcp validate` runs on each kind's plan
    expect_one_line(capsys, ["validate", ROOT / "tests" / "golden" / "small_8gpu.fcp"], "internal error", code=3)


def test_a_bulk_line_that_is_not_utf8_is_named(tmp_path, capsys):
    steps = _write(tmp_path / "steps.jsonl", b"[100, 200]\n[\xff]\n")
    expect_one_line(capsys, ["compile", steps, "--gpus", 2, "-o", tmp_path / "plans"], "steps.jsonl:2")
    assert not (tmp_path / "plans").exists()


# Issue 24: outputs that would destroy inputs, unchecked numbers, silent ambiguity. One test a row: exit 2, one
# line naming the value or path, the input untouched and no output written.

GOLDEN = ROOT / "tests" / "golden" / "small_8gpu.fcp"


def _copy(source: Path, target: Path) -> Path:
    target.write_bytes(source.read_bytes())
    return target


@pytest.mark.parametrize("case", ["compile -o input", "compile --stats = -o", "simulate --json input",
                                  "simulate --trace = --json", "diff --json a", "trace -o lengths file"])
def test_an_output_that_is_an_input_or_another_output_is_refused(tmp_path, capsys, case):
    batch, plan, other = _copy(SMALL, tmp_path / "b.json"), _copy(GOLDEN, tmp_path / "p.fcp"), tmp_path / "o.json"
    args, kept, match = {
        "compile -o input": (["compile", batch, "--gpus", 8, "-o", batch], batch, "is the input BATCH"),
        "compile --stats = -o": (["compile", batch, "--gpus", 8, "--stats", other, "-o", other], batch,
                                 "are the same file"),
        "simulate --json input": (["simulate", plan, "--json", plan], plan, "is the input SOURCE"),
        "simulate --trace = --json": (["simulate", plan, "--json", other, "--trace", other], plan,
                                      "are the same file"),
        "diff --json a": (["diff", plan, GOLDEN, "--json", plan], plan, "is the input A"),
        "trace -o lengths file": (["trace", "file", batch, "--gpus", 1, "-o", batch], batch,
                                  "is the input LENGTHS_FILE"),
    }[case]
    before = kept.read_bytes()
    expect_one_line(capsys, args, match)
    assert kept.read_bytes() == before and not other.exists()


@pytest.mark.parametrize("args, match", [
    (["compile", SMALL, "--gpus", 8, "--block-size", "4096.0"], "'4096.0' is not an integer"),
    (["compile", SMALL, "--gpus", "８"], "'８' is not an integer"),
    (["compile", SMALL, "--gpus", 8, "--mask", "sliding_window:²"], "the window must be a positive integer"),
    (["compile", SMALL, "--gpus", 8, "--mask", "sliding_window:٣"], "the window must be a positive integer"),
    (["trace", "lognormal", "--gpus", 2, "--seed", -1], "--seed -1 must be >= 0"),
    (["trace", "lognormal", "--gpus", 2, "--tokens-per-gpu", 2**62], "must be a batch fcp compile takes"),
    (["trace", "lognormal", "--gpus", 65536, "--tokens-per-gpu", 32768], "at most 2147483647 tokens"),
    (["trace", "file", SMALL, "--gpus", 2, "--max-len", 0], "max length 0 must be >= 1"),
    (["trace", "file", SMALL, "--gpus", 2, "--max-len", -5], "max length -5 must be >= 1"),
    (["compare", "--trace-spec", "lognormal:4096:1.8:65536:-1", "--gpus", 2], "seed -1 must be an integer"),
])
def test_numeric_options_are_ascii_in_range_and_what_compile_takes(tmp_path, capsys, args, match):
    out = tmp_path / "out.json"
    expect_one_line(capsys, [*args, "-o", out] if args[0] != "compare" else args, match)
    assert not out.exists()


def test_efficiency_and_bandwidth_have_positive_floors_in_profiles_and_plan_headers(tmp_path, capsys):
    from fcp_compiler.format.plan_format import GLOBAL_ARRAYS, PlanReader, assemble

    profile = {"name": "x", "peak_tflops": 989, "network_gbps": 50, "nvlink_gbps": 450,
               "efficiency_curve": [{"tokens": 128, "efficiency": 1e-300}]}
    path = _write(tmp_path / "profile.json", json.dumps(profile))
    expect_one_line(capsys, ["compile", SMALL, "--gpus", 8, "--profile", path, "-o", tmp_path / "p.fcp"],
                    "greater than or equal to 0.001")
    path = _write(tmp_path / "slow.json", json.dumps({**profile, "network_gbps": 1e-300,
                                                      "efficiency_curve": [{"tokens": 128, "efficiency": 0.5}]}))
    expect_one_line(capsys, ["compile", SMALL, "--gpus", 8, "--profile", path, "-o", tmp_path / "p.fcp"],
                    "network_gbps")
    assert not (tmp_path / "p.fcp").exists()
    reader = PlanReader(GOLDEN)
    fields = reader.header.model_dump(exclude={"global_section", "rank_sections", "global_sha256", "rank_sha256"})
    fields["profile"]["efficiency_curve"][0]["efficiency"] = 1e-300
    with pytest.raises(ValueError, match="greater than or equal to 0.001"):  # no such plan can even be written
        assemble(fields, {name: getattr(reader.tables, name) for name in GLOBAL_ARRAYS},
                 [program.arrays for program in reader.ranks()])


@pytest.mark.parametrize("content, match", [
    ('{"sequences": [5], "sequences": [7]}', "key 'sequences' appears more than once"),
    ('{"mask": "full", "masks": ["causal"], "sequences": [7]}', "give either 'mask'"),
])
def test_ambiguous_batches_are_refused(tmp_path, capsys, content, match):
    batch = _write(tmp_path / "b.json", content)
    expect_one_line(capsys, ["compile", batch, "--gpus", 1, "--block-size", 64, "-o", tmp_path / "p.fcp"], match)
    assert not (tmp_path / "p.fcp").exists()


def test_flags_a_bulk_compile_would_ignore_are_refused(tmp_path, capsys):
    steps = _write(tmp_path / "steps.jsonl", "[100, 200]\n")
    expect_one_line(capsys, ["compile", steps, "--gpus", 2, "--stats", tmp_path / "s.json"], "--stats")
    expect_one_line(capsys, ["compile", SMALL, "--gpus", 8, "--jobs", 2, "-o", tmp_path / "p.fcp"],
                    "--jobs 2 takes a .jsonl")
    assert not (tmp_path / "s.json").exists() and not (tmp_path / "p.fcp").exists()


def test_a_full_disk_names_the_file(tmp_path, capsys, monkeypatch):
    import errno

    import fcp_compiler.format.safe_io as safe_io

    real = os.fdopen

    def full(handle, mode="r", *args, **kwargs):
        stream = real(handle, mode, *args, **kwargs)
        if "w" in mode:
            def write(data):
                raise OSError(errno.ENOSPC, "No space left on device")
            stream.write = write
        return stream
    monkeypatch.setattr(safe_io.os, "fdopen", full)
    plan = tmp_path / "p.fcp"
    expect_one_line(capsys, ["compile", SMALL, "--gpus", 8, "-o", plan], f"cannot write {str(plan)!r}: No space")
    assert os.listdir(tmp_path) == []


def test_a_bare_fcp_prints_its_help_and_no_empty_error(capsys):
    code, out, err = run(capsys)
    assert code == 2 and "Commands" in out + err and "error" not in err


def test_a_stopped_bulk_compile_says_how_far_it_got(tmp_path, capsys, monkeypatch):
    import fcp_compiler.tools.bulk as bulk

    def stopped(batches, out_dir, options, jobs=None, progress=None):
        progress(3, 5)
        raise KeyboardInterrupt
    monkeypatch.setattr(bulk, "bulk_compile", stopped)
    steps = _write(tmp_path / "steps.jsonl", "[100, 200]\n" * 5)
    code, _, err = run(capsys, "compile", steps, "--gpus", 2, "-o", tmp_path / "plans", "-q")
    assert code == 130 and "stopped with 3 of 5 plans" in err and "the same command resumes" in err


def test_diff_names_the_ranks_whose_programs_changed_when_nothing_else_did(tmp_path, capsys):
    import numpy as np

    from fcp_compiler.format.plan_format import PlanReader, rebuild_plan

    reader = PlanReader(GOLDEN)
    arrays = [{name: values.copy() for name, values in program.arrays.items()} for program in reader.ranks()]
    a = arrays[2]
    first_stage = np.flatnonzero(a["tile_stage"] == a["tile_stage"][0])
    assert first_stage.size >= 2  # two tiles of one stage swap places: the same work, another order
    swap = first_stage[[1, 0]]
    for name in ("tile_stage", "tile_bwd_stage", "tile_q_block", "tile_kv_block"):
        a[name][first_stage[:2]] = a[name][swap]
    changed = _write(tmp_path / "changed.fcp", rebuild_plan(reader, arrays))
    code, out, _ = run(capsys, "diff", GOLDEN, changed, "--fail-on", "change")
    assert code == 1 and "rank programs" in out and "1 of 8 ranks" in out and "rank 2: tile_" in out


def test_a_profile_number_given_as_a_string_is_refused(tmp_path, capsys):
    profile = {"name": "x", "peak_tflops": 989, "network_gbps": 50, "nvlink_gbps": 450, "gpus_per_node": "8",
               "efficiency_curve": [{"tokens": 128, "efficiency": 0.5}]}
    path = _write(tmp_path / "profile.json", json.dumps(profile))
    expect_one_line(capsys, ["compile", SMALL, "--gpus", 8, "--profile", path, "-o", tmp_path / "p.fcp"],
                    "gpus_per_node")
    assert not (tmp_path / "p.fcp").exists()


def test_a_batch_too_large_to_validate_is_refused_at_compile_time_from_its_lengths(tmp_path, capsys):
    """One limit, counted as fcp validate counts it: a plan it would refuse is never written, and a batch that
    shows it from its lengths alone is refused before anything is allocated per block."""
    batch = _write(tmp_path / "b.json", json.dumps([2**31 - 1]))
    expect_one_line(capsys, ["compile", batch, "--gpus", 1, "--block-size", 64, "-o", tmp_path / "p.fcp"],
                    "segment pairs, more than the 64,000,000 fcp validate checks")
    assert not (tmp_path / "p.fcp").exists()


def test_more_sequences_than_a_plan_may_hold_are_refused_before_a_list_of_them_is_built(monkeypatch):
    """A batch of N sequences is at least N segment pairs to validate: past the limit it is refused from its size,
    in the library (a numpy array is not turned into a list first) and in a batch file alike."""
    import numpy as np

    from fcp_compiler import compile_plan
    from fcp_compiler.core import pipeline
    from fcp_compiler.errors import InvalidInputError
    from fcp_compiler.format import inputs

    monkeypatch.setattr(pipeline, "MAX_SEQUENCES", 100)
    monkeypatch.setattr(inputs, "MAX_SEQUENCES", 100)

    class NoList(np.ndarray):
        def tolist(self):
            raise AssertionError("the lengths were listed before the refusal")
    with pytest.raises(InvalidInputError, match="the batch holds 101 sequences, more than the 100"):
        compile_plan(np.ones(101, dtype=np.int64).view(NoList), 8)
    with pytest.raises(InvalidInputError, match="the batch holds 101 sequences"):
        inputs.parse_batch([1] * 101)


def test_simulate_refuses_gpus_for_a_plan_it_would_ignore(tmp_path, capsys):
    plan = tmp_path / "p.fcp"
    assert run(capsys, "compile", SMALL, "--gpus", 8, "-o", plan, "-q")[0] == 0
    expect_one_line(capsys, ["simulate", plan, "--gpus", 16], "--gpus 16 is for a batch; ")
    expect_one_line(capsys, ["simulate", plan, "--gpus", 16], "is a plan for 8 ranks")


def test_a_jsonl_of_batches_refuses_a_plan_file_name_as_its_folder(tmp_path, capsys):
    steps = _write(tmp_path / "steps.jsonl", "[100, 200]\n")
    expect_one_line(capsys, ["compile", steps, "--gpus", 2, "-o", tmp_path / "single.fcp"],
                    "names a plan file, but a .jsonl of batches compiles into a folder")
    assert not (tmp_path / "single.fcp").exists()


def test_a_plan_of_a_newer_or_unknown_format_says_compile_it_again():
    import msgpack

    from fcp_compiler.errors import PlanFormatError
    from fcp_compiler.format.plan_format import _parse_header

    for version in (8, 99):
        with pytest.raises(PlanFormatError, match=f"format_version {version} is not supported .*compile it again"):
            _parse_header(msgpack.packb({"format_version": version}), "p.fcp")


def test_a_plan_over_the_default_memory_budget_warns_in_one_line(tmp_path, capsys):
    """The 64-GPU trace on 8 GPUs: its own tokens need more than 4 GiB; written as scheduled, with a warning."""
    plan = tmp_path / "p.fcp"
    code, _, err = run(capsys, "compile", ROOT / "traces" / "paper_lognormal_64gpu.json", "--gpus", 8, "-o", plan,
                       "-q")
    assert code == 0 and plan.is_file() and err.count("\n") == 1, err
    assert err.startswith("fcp: warning: the plan's busiest rank peaks at ") and "--memory-budget none" in err
    from fcp_compiler.format.plan_format import PlanReader

    header = PlanReader(str(plan)).header
    peak = max(max(header.max_buffer_bytes_fwd), max(header.max_buffer_bytes_bwd))
    assert f"peaks at {peak / 2**30:.2f} GiB, over the 4.00 GiB" in err
    code, _, err = run(capsys, "compile", ROOT / "traces" / "paper_lognormal_64gpu.json", "--gpus", 8, "-o", plan,
                       "-q", "--memory-budget", "none")
    assert code == 0 and err == ""


def test_more_rank_stages_than_a_reader_bounds_are_refused_by_compile_and_by_readers(tmp_path, capsys, monkeypatch):
    """A plan whose ranks x stages pass the bound would make the simulator's and validator's per-stage tables grow
    with it (1,024 ranks x 20,100 stages took 2.9 GB): every reader refuses it from its header, and the compiler
    does not write one."""
    from fcp_compiler.format import plan_format
    from fcp_compiler.format.plan_format import PlanReader

    plan = tmp_path / "p.fcp"
    assert run(capsys, "compile", SMALL, "--gpus", 8, "-o", plan, "-q")[0] == 0
    header = PlanReader(str(plan)).header
    cells = 8 * (header.num_fwd_stages + header.num_bwd_stages)
    monkeypatch.setattr(plan_format, "MAX_RANK_STAGES", cells - 1)
    for command in ("validate", "simulate", "inspect"):
        # The fields named, not pydantic's model-level "header field : Value error, ..." (issue 65, N5).
        expect_one_line(capsys, [command, plan], f"plan file {str(plan)!r}: header fields 'num_ranks', "
                                                 f"'num_fwd_stages', 'num_bwd_stages': 8 ranks x "
                                                 f"{cells // 8} stages (forward and backward) = {cells:,} "
                                                 f"rank-stages, more than the {cells - 1:,}")
    monkeypatch.setattr(plan_format, "MAX_RANK_STAGES", 8)
    expect_one_line(capsys, ["compile", SMALL, "--gpus", 8, "-o", tmp_path / "q.fcp", "--no-floor"],
                    "give a larger --block-size or --coalesce")
    assert not (tmp_path / "q.fcp").exists()


def _forged_header(data: bytes, **changes) -> bytes:
    """A plan's bytes with header fields changed (None: removed) and the header's sha256 made to match: a forged
    header the checksum does not catch."""
    import hashlib
    import struct

    import msgpack

    (length,) = struct.unpack("<I", data[8:12])
    header = msgpack.unpackb(data[44:44 + length], raw=False)
    header.update(changes)
    header = {name: value for name, value in header.items() if value is not None}
    packed = msgpack.packb(header, use_bin_type=True)
    return data[:8] + struct.pack("<I", len(packed)) + hashlib.sha256(packed).digest() + packed + data[44 + length:]


@pytest.mark.parametrize("changes, message", [
    ({"num_ranks": 70000}, "header field 'num_ranks': must be less than or equal to 65536 (got 70000)"),
    ({"block_size": 3}, "header field 'block_size': must be greater than or equal to 64 (got 3)"),
    ({"coalesce": "x"}, "header field 'coalesce': must be a valid integer, unable to parse string as an integer "
                        "(got 'x')"),
    ({"num_ranks": None}, "header field 'num_ranks': missing"),
    ({"num_fwd_stages": 10**6}, "header fields 'num_fwd_rounds', 'num_fwd_stages': num_fwd_rounds "),
    ({"max_buffer_bytes_fwd": [1]}, "header field 'max_buffer_bytes_fwd': max_buffer_bytes_fwd must hold one value"),
    ({"model": "m" * 10_000}, "header field 'model': model '" + "m" * 60 + "'... (10,000 characters) must be one of"),
])
def test_a_forged_header_field_is_named_in_one_clean_line(tmp_path, capsys, changes, message):
    """A header the pydantic model refuses reads as one line naming the field and its value (cut to a sane
    length), without pydantic's "Value error, " or an empty field name (issue 65, N5)."""
    plan = tmp_path / "p.fcp"
    assert run(capsys, "compile", SMALL, "--gpus", 8, "-o", plan, "-q")[0] == 0
    forged = _write(tmp_path / "forged.fcp", _forged_header(plan.read_bytes(), **changes))
    for command in ("validate", "inspect", "simulate"):
        code, _, err = run(capsys, command, forged)
        assert code == 2 and err.count("\n") == 1 and "Traceback" not in err, err
        assert err.startswith(f"fcp: error: plan file {str(forged)!r}: {message}"), err
        assert "Value error" not in err and "field :" not in err and len(err) < 400, err

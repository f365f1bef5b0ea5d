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
                    "median=nan")
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
    for args in (["validate", bad], ["simulate", bad], ["diff", plan, bad]):
        expect_one_line(capsys, args, "invalid plan", code=1)
    code, _, err = run(capsys, "inspect", bad)
    assert code == 0 and err == ""  # inspect shows what is there, valid or not


def test_an_internal_error_is_one_line_with_its_own_exit_code(monkeypatch, capsys):
    import fcp_compiler.format.validate as validate

    def broken(*args, **kwargs):
        raise RuntimeError("a bug")
    monkeypatch.setattr(validate, "validate_plan", broken)
    expect_one_line(capsys, ["validate", ROOT / "tests" / "golden" / "small_8gpu.fcp"], "internal error", code=3)


def test_a_bulk_line_that_is_not_utf8_is_named(tmp_path, capsys):
    steps = _write(tmp_path / "steps.jsonl", b"[100, 200]\n[\xff]\n")
    expect_one_line(capsys, ["compile", steps, "--gpus", 2, "-o", tmp_path / "plans"], "steps.jsonl:2")
    assert not (tmp_path / "plans").exists()

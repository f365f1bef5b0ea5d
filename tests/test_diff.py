"""fcp diff: empty for a plan and itself, changes and regressions named, exit codes for CI."""

import json
import re
from pathlib import Path

import pytest

from cli import main
from fcp_compiler import compile_plan
from fcp_compiler.format.inputs import load_batch

ROOT = Path(__file__).resolve().parents[1]
BATCH = load_batch(ROOT / "traces" / "paper_lognormal_64gpu.json")


@pytest.fixture(scope="module")
def plans(tmp_path_factory):
    folder = tmp_path_factory.mktemp("plans")
    paths = {"base": folder / "base.fcp", "block": folder / "block.fcp", "magi": folder / "magi.fcp",
             "stages": folder / "stages.fcp"}
    compile_plan(BATCH, 64).write(paths["base"])
    compile_plan(BATCH, 64, coalesce=2).write(paths["stages"])  # 8x the stages: more exposed traffic
    compile_plan(BATCH, 64, block_size=2048).write(paths["block"])
    # Point to point, so its traffic stays as concentrated as its placement makes it (no node fan-out).
    compile_plan(BATCH, 64, planner="magi", node_fan_out=False).write(paths["magi"])
    return paths


def test_a_plan_against_itself_is_empty(plans, tmp_path, capsys):
    out = tmp_path / "d.json"
    assert main(["diff", str(plans["base"]), str(plans["base"]), "--fail-on", "change", "--json", str(out)]) == 0
    result = json.loads(out.read_text())
    assert result["identical"] and not result["parameters"] and not result["figures"]
    assert "no semantic difference" in capsys.readouterr().out


def test_another_block_size_is_a_change_naming_parameters_and_figures(plans, tmp_path):
    out = tmp_path / "d.json"
    assert main(["diff", str(plans["base"]), str(plans["block"]), "--fail-on", "change", "--json", str(out)]) == 1
    result = json.loads(out.read_text())
    assert result["parameters"]["block_size"] == {"a": 4096, "b": 2048}
    assert {"num_rounds", "compute_imbalance", "normalized_mfu_fwd"} <= set(result["figures"])
    assert result["inputs"]


def _diff(a, b, out, *extra) -> tuple[int, dict]:
    code = main(["diff", str(a), str(b), "--fail-on", "regression", "--json", str(out), *extra])
    return code, json.loads(out.read_text())


def test_a_regression_is_slower_layer_time_in_exactly_one_direction(plans, tmp_path):
    """4096 against 2048 differ in balance, rounds and bytes both ways; only the slower plan's side regresses."""
    out = tmp_path / "d.json"
    forward_code, forward = _diff(plans["base"], plans["block"], out)
    backward_code, backward = _diff(plans["block"], plans["base"], out)
    assert sorted((forward_code, backward_code)) == [0, 1]
    slower = forward if forward_code else backward
    assert set(slower["regressions"]) <= {"layer_makespan_fwd_s", "layer_makespan_bwd_s"} and slower["regressions"]
    for name, change in slower["regressions"].items():
        assert change["b"] > change["a"] * 1.005
    faster = backward if forward_code else forward
    assert not faster["regressions"]
    # Proxies changed both ways, and neither direction calls them regressions.
    assert {"compute_imbalance", "num_rounds"} <= set(faster["figures"]) & set(slower["figures"])


def test_the_tolerance_is_on_layer_time(plans, tmp_path):
    out = tmp_path / "d.json"
    code, result = _diff(plans["base"], plans["stages"], out)  # 8x the stages: more exposed traffic, slower
    assert code == 1 and set(result["regressions"]) <= {"layer_makespan_fwd_s", "layer_makespan_bwd_s"}
    worst = max(change["relative_change"] for change in result["regressions"].values())
    assert _diff(plans["base"], plans["stages"], out, "--tolerance", str(worst * 1.01))[0] == 0
    assert _diff(plans["base"], plans["stages"], out, "--tolerance", str(worst * 0.99))[0] == 1


def test_no_percentage_from_a_zero_base(plans, tmp_path, capsys):
    """Node fan-out off at 64 GPUs vs on: a figure that was 0 gets no relative change, and none is printed."""
    out = tmp_path / "d.json"
    main(["diff", str(plans["base"]), str(plans["magi"]), "--json", str(out)])
    result = json.loads(out.read_text())
    for name, change in result["figures"].items():
        if isinstance(change["a"], (int, float)) and change["a"] == 0:
            assert "relative_change" not in change, name
        elif isinstance(change["a"], (int, float)) and not isinstance(change["a"], bool):
            assert change["relative_change"] == pytest.approx((change["b"] - change["a"]) / abs(change["a"]))
    printed = capsys.readouterr().out
    assert not re.search(r"\d{6,}\.\d%", printed)  # no absurd percentages anywhere


def test_memory_over_the_budget_and_an_invalid_b_are_regressions(tmp_path):
    from fcp_compiler.tools.diff import _regressions, invalid_after

    figures = {"layer_makespan_fwd_s": 1.0, "layer_makespan_bwd_s": 2.0, "max_buffer_bytes_fwd": 90,
               "max_buffer_bytes_bwd": 100}
    over = figures | {"max_buffer_bytes_bwd": 101}
    assert set(_regressions(figures, over, 100, 0.005)) == {"max_buffer_bytes_bwd"}
    assert not _regressions(figures, over, None, 0.005) and not _regressions(over, over, 100, 0.005)
    assert set(_regressions(figures, figures | {"layer_makespan_bwd_s": 2.011}, None, 0.005)) == {
        "layer_makespan_bwd_s"}
    assert not _regressions(figures, figures | {"layer_makespan_bwd_s": 2.009}, None, 0.005)
    # B that does not validate: the CLI's answer (exit 1), not an error.
    plan = tmp_path / "p.fcp"
    compile_plan([300, 200], 2, block_size=64).write(plan)
    result = invalid_after(ValueError("rank 1's fwd peaks at 9 bytes"))
    assert result["regressed"] and "validation" in result["regressions"]


def test_bad_input_exits_two(plans, tmp_path):
    assert main(["diff", str(plans["base"]), str(tmp_path / "none.fcp")]) == 2
    assert main(["diff", str(plans["base"]), str(plans["base"]), "--fail-on", "maybe"]) == 2


def test_the_diff_ends_with_one_verdict_line(plans, capsys):
    main(["diff", str(plans["base"]), str(plans["stages"])])
    last = capsys.readouterr().out.rstrip("\n").splitlines()[-1]
    # The worst regression by relative change, with its figures, and how many more regressed.
    assert re.fullmatch(r"regression: layer_makespan_(fwd|bwd)_s \S+ -> \S+ \(\+\d+\.\d%\)(, 1 more)?", last), last
    main(["diff", str(plans["base"]), str(plans["base"])])
    assert capsys.readouterr().out.rstrip("\n").splitlines()[-1] == "no change"
    main(["diff", str(plans["base"]), str(plans["stages"]), "--tolerance", "100"])
    last = capsys.readouterr().out.rstrip("\n").splitlines()[-1]
    assert re.fullmatch(r"changed, no regression \(\d+ figures differ; layer time fwd \+\d+\.\d%, bwd \+\d+\.\d%\)",
                        last), last


def test_a_plain_plan_against_a_plan_of_layer_kinds_is_refused_naming_which_is_which(tmp_path, capsys):
    """A plan of one kind has no kind to match by name with a plan of layer kinds: the diff compared nothing,
    printed kind "None" and exited 0 under --fail-on regression (issue 65, N6). Now: one line, exit 2, no --json
    written."""
    from fcp_compiler.format.inputs import BatchSpec

    lengths = [1900, 700, 333, 1200, 64, 90, 517, 250]
    plain, kinds = tmp_path / "plain.fcp", tmp_path / "kinds.fcp"
    compile_plan(lengths, 8, block_size=128).write(plain)
    layers = {"global": "causal", "local": {"kind": "sliding_window", "window": 96}}
    compile_plan(BatchSpec(sequences=lengths, layers=layers, layer_mix={"global": 1, "local": 3}), 8,
                 block_size=128).write(kinds)
    out = tmp_path / "d.json"
    for a, b, which in ((plain, kinds, ("B", "A")), (kinds, plain, ("A", "B"))):
        code = main(["diff", str(a), str(b), "--fail-on", "regression", "--json", str(out)])
        captured = capsys.readouterr()
        assert code == 2 and captured.out == "" and captured.err.count("\n") == 1, captured
        assert f"plan file {str(kinds)!r} ({which[0]}) is a plan of layer kinds global, local and plan file " \
               f"{str(plain)!r} ({which[1]}) a plan of one kind" in captured.err, captured.err
        assert "None" not in captured.err and not out.exists()
    # Two plans of layer kinds, and two plain ones, still diff.
    assert main(["diff", str(kinds), str(kinds), "--fail-on", "change"]) == 0
    assert main(["diff", str(plain), str(plain), "--fail-on", "change"]) == 0

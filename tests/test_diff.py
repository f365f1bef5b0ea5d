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


def test_a_worse_imbalance_is_a_regression(plans, tmp_path):
    out = tmp_path / "d.json"
    assert main(["diff", str(plans["base"]), str(plans["magi"]), "--fail-on", "regression", "--json", str(out)]) == 1
    result = json.loads(out.read_text())
    assert "comm_imbalance" in result["regressions"] and "compute_imbalance" in result["regressions"]
    # The other way round nothing got worse in balance, and a large tolerance accepts the rest.
    assert main(["diff", str(plans["magi"]), str(plans["base"]), "--fail-on", "regression", "--tolerance",
                 "100"]) == 0


def test_a_larger_layer_gap_is_a_regression(plans, tmp_path):
    out = tmp_path / "d.json"
    assert main(["diff", str(plans["base"]), str(plans["stages"]), "--fail-on", "regression", "--json", str(out)]) == 1
    result = json.loads(out.read_text())
    assert {"layer_gap_fwd", "layer_gap_bwd"} <= set(result["regressions"])
    assert result["regressions"]["layer_gap_fwd"]["b"] > result["regressions"]["layer_gap_fwd"]["a"] >= 1.0
    out.unlink()
    # The other way round the gap shrinks (other figures may still regress: the exit code is not the point).
    main(["diff", str(plans["stages"]), str(plans["base"]), "--fail-on", "regression", "--json", str(out)])
    assert not {"layer_gap_fwd", "layer_gap_bwd"} & set(json.loads(out.read_text())["regressions"])


def test_bad_input_exits_two(plans, tmp_path):
    assert main(["diff", str(plans["base"]), str(tmp_path / "none.fcp")]) == 2
    assert main(["diff", str(plans["base"]), str(plans["base"]), "--fail-on", "maybe"]) == 2


def test_the_diff_ends_with_one_verdict_line(plans, capsys):
    main(["diff", str(plans["base"]), str(plans["stages"])])
    last = capsys.readouterr().out.rstrip("\n").splitlines()[-1]
    # The worst regression by relative change, with its figures, and how many more regressed.
    assert re.fullmatch(r"regression: \w+ \S+ -> \S+ \([+-]\d+\.\d%\)(, \d+ more)?", last), last
    main(["diff", str(plans["base"]), str(plans["base"])])
    assert capsys.readouterr().out.rstrip("\n").splitlines()[-1] == "no change"
    main(["diff", str(plans["magi"]), str(plans["base"]), "--tolerance", "100"])
    assert capsys.readouterr().out.rstrip("\n").splitlines()[-1].startswith("changed, no regression")

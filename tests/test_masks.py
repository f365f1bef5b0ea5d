"""Masks in the batch format (issue 14): causal, full, {"kind": "sliding_window", "window": W} and one a sequence;
bad ones get one line, exit 2 and no file; windowed and mixed plans validate, and the validator's own visibility
catches a plan whose windows were edited."""

import json

import numpy as np
import pytest

from conftest import compile_valid, run_cli
from fcp_compiler.format.inputs import BatchSpec
from fcp_compiler.format.plan_format import GLOBAL_ARRAYS, PlanReader, assemble
from fcp_compiler.format.validate import PlanInvalidError, validate_plan

BAD_MASKS = [
    ("window 0", {"mask": {"kind": "sliding_window", "window": 0}}, "window 0 must be an integer from 1"),
    ("negative window", {"mask": {"kind": "sliding_window", "window": -5}}, "window -5 must be an integer from 1"),
    ("fractional window", {"mask": {"kind": "sliding_window", "window": 4.5}}, "valid integer"),
    ("window as a string", {"mask": {"kind": "sliding_window", "window": "4096"}}, "valid integer"),
    ("no window", {"mask": {"kind": "sliding_window"}}, "needs a window"),
    ("window for full", {"mask": {"kind": "full", "window": 4096}}, "is given for a full mask"),
    ("unknown kind", {"mask": "sliding"}, "sliding"),
    ("mixed as input", {"mask": "mixed"}, "only describes a plan"),
    ("masks of the wrong length", {"masks": ["causal"]}, "masks holds 1 masks for 3 sequences"),
    ("bad mask in masks", {"masks": ["causal", {"kind": "sliding_window", "window": 0}, "full"]}, "window 0"),
]


@pytest.mark.parametrize("name, fields, match", BAD_MASKS, ids=[m[0] for m in BAD_MASKS])
def test_bad_masks_get_one_line_exit_2_and_no_file(tmp_path, capsys, name, fields, match):
    batch = tmp_path / "batch.json"
    batch.write_text(json.dumps({"sequences": [5000, 300, 9000], **fields}))
    code, _, err = run_cli(capsys, "compile", batch, "--gpus", 4, "-o", tmp_path / "p.fcp")
    assert code == 2 and err.count("\n") == 1 and "Traceback" not in err and match in err, err
    assert not (tmp_path / "p.fcp").exists()


@pytest.mark.parametrize("flag", ["sliding_window:0", "sliding_window:x", "window:4", "sliding_window"])
def test_bad_mask_flags_get_one_line(tmp_path, capsys, flag):
    code, _, err = run_cli(capsys, "trace", "lognormal", "--gpus", 2, "--mask", flag, "-o", tmp_path / "b.json")
    assert code == 2 and err.count("\n") == 1 and flag in err, err
    assert not (tmp_path / "b.json").exists()


def test_mask_flags_write_and_override_windows(tmp_path, capsys):
    batch = tmp_path / "b.json"
    assert run_cli(capsys, "trace", "lognormal", "--gpus", 2, "--mask", "sliding_window:512", "-o", batch)[0] == 0
    assert json.loads(batch.read_text())["mask"] == {"kind": "sliding_window", "window": 512}
    stats = tmp_path / "s.json"
    assert run_cli(capsys, "compile", batch, "--gpus", 2, "--block-size", 256, "--mask", "sliding_window:100",
                   "-o", tmp_path / "p.fcp", "--stats", stats)[0] == 0
    assert json.loads(stats.read_text())["mask"] == "sliding_window"
    windows = PlanReader(str(tmp_path / "p.fcp")).tables.seq_window
    lengths = PlanReader(str(tmp_path / "p.fcp")).tables.seq_lengths
    assert np.array_equal(windows, np.minimum(lengths, 100))


def _mixed_plan():
    spec = BatchSpec.model_validate({"masks": [{"kind": "sliding_window", "window": 700}, "full", "causal",
                                               {"kind": "sliding_window", "window": 3}],
                                     "sequences": [5000, 900, 3000, 2000]})
    return compile_valid(spec, 4, block_size=512, coalesce=2)


def test_mixed_masks_compile_and_validate_computing_each_sequences_visible_pairs():
    plan = _mixed_plan()  # compile_valid validates it
    assert plan.stats["mask"] == "mixed"
    pairs = (700 * 701 // 2 + 4300 * 700) + 900 * 900 + 3000 * 3001 // 2 + (3 * 4 // 2 + 1997 * 3)
    shape = plan.header.shape
    assert plan.ir.tiles.tile_flops.sum() == 4.0 * pairs * shape.q_heads * shape.head_dim


@pytest.mark.parametrize("windows, match", [
    ([5000, 0, 3000, 2000], "runs nowhere"),  # a wider window: pairs no tile computes
    ([300, 0, 3000, 3], "no visible pair"),  # a narrower one: tiles of pairs it cannot see
])
def test_the_validator_recomputes_visibility_from_the_plans_windows(windows, match):
    reader = PlanReader(_mixed_plan().to_bytes())
    fields = reader.header.model_dump(exclude={"global_section", "rank_sections", "global_sha256", "rank_sha256"})
    tables = {name: getattr(reader.tables, name) for name in GLOBAL_ARRAYS}
    tables["seq_window"] = np.array(windows, dtype=np.int64)
    edited = assemble(fields, tables, [program.arrays for program in reader.ranks()])
    with pytest.raises(PlanInvalidError, match=match) as caught:
        validate_plan(edited)
    assert caught.value.invariant == 1

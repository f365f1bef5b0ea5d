"""Bulk compile (resumable) and the library API data loaders use."""

import json
import subprocess
import sys
from pathlib import Path

from cli import main
from fcp_compiler import compile_plan
from fcp_compiler.traces import lognormal_batch

ROOT = Path(__file__).resolve().parents[1]


def test_bulk_compile_resumes_without_recompiling_finished_plans(tmp_path, capsys):
    steps = tmp_path / "steps.jsonl"
    steps.write_text("\n".join(json.dumps(lognormal_batch(8 * 8192, 4096, 1.8, 64, 65536, seed))
                               for seed in range(6)) + "\n")
    out = tmp_path / "plans"
    assert main(["compile", str(steps), "--gpus", "8", "-o", str(out), "--jobs", "2"]) == 0
    plans = sorted(out.glob("*.fcp"))
    assert len(plans) == 6
    # An interruption: two plans never got written.
    plans[1].unlink()
    plans[4].unlink()
    kept = {p.name: p.stat().st_mtime_ns for p in plans if p.exists()}
    capsys.readouterr()
    assert main(["compile", str(steps), "--gpus", "8", "-o", str(out), "--jobs", "2"]) == 0
    summary = capsys.readouterr().out
    assert " 6 " in summary and " 2 " in summary and " 4 " in summary  # plans, compiled, skipped
    assert {p.name: p.stat().st_mtime_ns for p in out.glob("*.fcp") if p.name in kept} == kept
    assert len(list(out.glob("*.fcp"))) == 6 and not list(out.glob(".*"))
    # Each plan is the one a direct compile gives.
    first = json.loads(steps.read_text().splitlines()[0])
    assert sorted(out.glob("step-000000-*.fcp"))[0].read_bytes() == compile_plan(first, 8).to_bytes()


def test_a_bad_line_is_named(tmp_path, capsys):
    steps = tmp_path / "steps.jsonl"
    steps.write_text("[100, 200]\n[5, -1]\n")
    assert main(["compile", str(steps), "--gpus", "2", "-o", str(tmp_path / "plans")]) == 2
    assert "steps.jsonl:2" in capsys.readouterr().err


def test_library_api_and_no_torch_on_import():
    plan = compile_plan([5000, 300, 9000], gpus=4, block_size=1024)
    assert plan.to_bytes() and plan.rank(3).rank == 3 and plan.stats["gpus"] == 4
    code = ("import sys, fcp_compiler; from fcp_compiler import compile_plan; compile_plan([100, 200], 2); "
            "assert 'torch' not in sys.modules, 'torch imported'")
    subprocess.run([sys.executable, "-c", code], check=True, cwd=ROOT)

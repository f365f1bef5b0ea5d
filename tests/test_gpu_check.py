"""benchmarks/gpu_check.py stays runnable where no GPU is: its --dry-run runs the same checks on the CPU."""

import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

SCRIPT = Path(__file__).resolve().parent.parent / "benchmarks" / "gpu_check.py"


@pytest.mark.long
def test_the_dry_run_passes_and_prints_the_table(tmp_path):
    done = subprocess.run([sys.executable, str(SCRIPT), "--dry-run"], cwd=tmp_path, capture_output=True, text=True,
                          timeout=600)
    assert done.returncode == 0, done.stderr[-2000:]
    lines = done.stdout.splitlines()
    assert any(line.split()[:2] == ["call", "backend"] for line in lines)
    assert sum(" exact-ranges " in line and line.endswith(" ok") for line in lines) >= 2
    assert lines[-2].startswith("training step on cpu") and lines[-2].endswith(" ok")
    assert lines[-1].startswith("gpu_check: PASS")


def test_a_backend_that_differs_fails_the_check():
    spec = importlib.util.spec_from_file_location("gpu_check", SCRIPT)
    gpu_check = importlib.util.module_from_spec(spec)
    sys.modules["gpu_check"] = gpu_check  # its dataclasses look their module up
    spec.loader.exec_module(gpu_check)

    class Off(gpu_check.ExactRangeKernels):
        def forward(self, q, k, v, *args):
            super().forward(q * 1.1, k, v, *args)

    run = gpu_check.setting(True, 1)
    ok, rows = gpu_check.check_kernels(run, {"off": Off()}, repeats=1)
    assert not ok and rows and rows[0].endswith("DIFFERS")

"""The layer contracts in pyproject.toml hold, and they would catch an import that breaks one."""

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
LINT = shutil.which("lint-imports") or str(Path(sys.executable).parent / "lint-imports")


def lint(root: Path) -> subprocess.CompletedProcess:
    """lint-imports over the packages under `root`, with the contracts of `root`/pyproject.toml."""
    env = {"PATH": str(Path(sys.executable).parent), "PYTHONPATH": str(root), "HOME": str(root)}
    return subprocess.run([LINT, "--no-cache"], cwd=root, env=env, capture_output=True, text=True, timeout=120)


def test_every_contract_is_kept():
    result = lint(ROOT)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "0 broken" in result.stdout


# (module of the copy, a line appended to it, the contract it must break)
@pytest.mark.parametrize("module, statement, contract", [
    ("fcp_compiler/core/passes/cost.py", "from fcp_compiler.tools import report",
     "Passes import only the IR and the algorithms"),
    ("fcp_compiler/core/passes/assign.py", "from fcp_compiler.core.passes import reshuffle",
     "No pass borrows from another"),
    ("fcp_compiler/algorithms/lpt.py", "from fcp_compiler.errors import FcpError",
     "Algorithms import nothing from the project"),
    ("fcp_compiler/format/validate.py", "from fcp_compiler.core import ir", "Layers"),
    ("fcp_runtime/plan.py", "from fcp_compiler.core.pipeline import compile_plan",
     "The runtime imports only the plan format"),
    ("fcp_compiler/core/stats.py", "import torch", "The compiler never imports torch"),
    ("fcp_compiler/format/inputs.py", "from fcp_compiler.format import plan_format",  # which imports inputs
     "No import cycles"),
])
def test_a_forbidden_import_breaks_its_contract(tmp_path, module, statement, contract):
    for package in ("fcp_compiler", "fcp_runtime"):
        shutil.copytree(ROOT / package, tmp_path / package, ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copy(ROOT / "pyproject.toml", tmp_path / "pyproject.toml")
    assert lint(tmp_path).returncode == 0  # the copy keeps every contract before the probe is added
    target = tmp_path / module
    target.write_text((target.read_text() if target.exists() else "") + f"\n{statement}  # probe\n")
    result = lint(tmp_path)
    assert result.returncode != 0
    broken = [line for line in result.stdout.splitlines() if " BROKEN" in line]
    assert any(line.startswith(contract) for line in broken), result.stdout


def test_no_function_runs_over_eighty_lines():
    """The style rule, kept: a function that grows past 80 lines is split (parameters of a CLI command count)."""
    import ast

    root = Path(__file__).resolve().parents[1]
    too_long = []
    for path in [*root.glob("fcp_compiler/**/*.py"), *root.glob("fcp_runtime/**/*.py"), root / "cli.py"]:
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.end_lineno - node.lineno >= 80:
                too_long.append(f"{path.relative_to(root)}:{node.lineno} {node.name} "
                                f"({node.end_lineno - node.lineno + 1} lines)")
    assert not too_long, too_long


def test_no_core_function_runs_over_sixty_lines():
    """The compiler's core (its passes, pipeline, simulator and stats) reads as the paper's passes: no function
    there runs over 60 lines."""
    import ast

    root = Path(__file__).resolve().parents[1]
    too_long = [f"{path.relative_to(root)}:{node.lineno} {node.name} ({node.end_lineno - node.lineno + 1} lines)"
                for path in root.glob("fcp_compiler/core/**/*.py") for node in ast.walk(ast.parse(path.read_text()))
                if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.end_lineno - node.lineno >= 60]
    assert not too_long, too_long



def test_no_core_module_runs_over_five_hundred_lines():
    """A newcomer reads a core module top to bottom: none in fcp_compiler/core (passes included) is over 500
    lines; one that grows past it is split by idea (as the memory budget's refits were)."""
    root = Path(__file__).resolve().parents[1]
    too_long = {str(path.relative_to(root)): count for path in root.glob("fcp_compiler/core/**/*.py")
                if (count := len(path.read_text().splitlines())) > 500}
    assert not too_long, too_long

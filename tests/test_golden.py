"""Golden plans: compiling the shipped traces must give the same bytes unless a change is intended.

After an intended change: python tests/golden/refresh.py (and commit the new plans with the change).
"""

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent / "golden"))
from refresh import CASES, GOLDEN, compile_case  # noqa: E402

from fcp_compiler.tools.diff import diff_plans  # noqa: E402
from fcp_compiler.format.plan_format import PlanReader  # noqa: E402
from fcp_compiler.format.validate import validate_plan  # noqa: E402


def describe(expected: bytes, actual: bytes) -> str:
    result = diff_plans(PlanReader(expected), PlanReader(actual))
    lines = [f"  {k}: {v['a']} -> {v['b']}" for section in ("parameters", "figures")
             for k, v in result[section].items()]
    if result["inputs"]:
        lines.append(f"  inputs digest: {result['inputs']['a'][:16]} -> {result['inputs']['b'][:16]}")
    if result["blocks"]:
        lines.append(f"  blocks: {result['blocks']}")
    return "\n".join(lines) or "  (same figures; the per-rank programs differ)"


@pytest.mark.parametrize("name", sorted(CASES))
def test_golden_plan_bytes_are_unchanged(name):
    expected = (GOLDEN / f"{name}.fcp").read_bytes()
    actual = compile_case(name)
    assert actual == expected, (f"golden plan {name} changed (fcp diff, golden -> now):\n"
                                f"{describe(expected, actual)}\nIf intended: python tests/golden/refresh.py")


@pytest.mark.parametrize("name", sorted(CASES))
def test_golden_plans_are_valid(name):
    report = validate_plan((GOLDEN / f"{name}.fcp").read_bytes())
    assert report.num_tiles > 0 and report.num_rounds >= report.nic_degree


def test_a_changed_pass_fails_with_the_diff_and_a_refresh_passes_again(monkeypatch, tmp_path):
    import refresh

    from fcp_compiler.core import budget_refit, schedule_search

    # The floor coalesces a forward half first; the memory budget's refits coalesce whole schedules.
    for module, name in ((schedule_search, "coalesce_forward"), (schedule_search, "coalesce"),
                         (budget_refit, "coalesce")):
        original = getattr(module, name)
        monkeypatch.setattr(module, name, lambda rounds, degree, pipelined=True, original=original, **fields:
                            original(rounds, degree, False, **fields))
    expected = (GOLDEN / "small_8gpu.fcp").read_bytes()
    changed = compile_case("small_8gpu")
    with pytest.raises(AssertionError, match="num_fwd_stages"):
        assert changed == expected, describe(expected, changed)
    # Run refresh.py as a developer would after an intended change, into a scratch copy of the golden folder.
    monkeypatch.setattr(refresh, "GOLDEN", tmp_path)
    refresh.main()
    assert sorted(path.name for path in tmp_path.glob("*.fcp")) == sorted(f"{name}.fcp" for name in CASES)
    assert (tmp_path / "small_8gpu.fcp").read_bytes() == changed  # the refreshed plan is what the change compiles
    assert compile_case("small_8gpu") == (tmp_path / "small_8gpu.fcp").read_bytes()  # and it passes again

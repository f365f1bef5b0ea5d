"""Shared helpers: every plan a test makes goes through the validator."""

from __future__ import annotations

import os

import pytest
from hypothesis import settings

from fcp_compiler import compile_plan
from fcp_compiler.format.validate import validate_plan

settings.register_profile("ci", max_examples=40, deadline=None, derandomize=True)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))


def run_cli(capsys, *args):
    """Run the fcp command in process; (exit code, stdout, stderr)."""
    from cli import main

    code = main([str(a) for a in args])
    out, err = capsys.readouterr()
    return code, out, err


def compile_valid(lengths, gpus, **options):
    """Compile and validate; return the plan."""
    plan = compile_plan(lengths, gpus, **options)
    report = validate_plan(plan.to_bytes())
    assert report.num_rounds == report.max_degree == plan.stats["num_rounds"] == plan.stats["max_degree"]
    return plan


@pytest.fixture
def small_plan():
    return compile_valid([5000, 300, 70000, 12, 4096, 8192, 20000, 999], 4, block_size=1024, coalesce=4)

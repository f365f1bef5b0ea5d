"""Shared helpers: every plan a test makes goes through the validator."""

from __future__ import annotations

import os

import pytest
from hypothesis import settings

from fcp_compiler import compile_plan
from fcp_compiler.format.validate import validate_plan

settings.register_profile("ci", max_examples=40, deadline=None, derandomize=True)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))


def cases_by_layout(cases, long=(), layouts=("plan", "user")):
    """(case, layout) parameters of every case in each layout, ids "name-layout"; those named in `long` (as
    "name-layout") run with the long tests (`python -m pytest -m long`, .ci/run's second step): the suite keeps
    one layout of a case where the other adds little of its own."""
    return [pytest.param(case, layout, id=f"{case[0]}-{layout}",
                         marks=pytest.mark.long if f"{case[0]}-{layout}" in long else ())
            for case in cases for layout in layouts]


def run_cli(capsys, *args):
    """Run the fcp command in process; (exit code, stdout, stderr)."""
    from cli import main

    code = main([str(a) for a in args])
    out, err = capsys.readouterr()
    return code, out, err


def compile_own(lengths, gpus, **options):
    """compile_valid with FCP's own placement only (no floor): a test of one mechanism (relays, fan-out, offloads,
    the placement's balance) needs the plan that uses it, not whichever candidate the floor keeps. FCP's with node
    fan-out unless the options say otherwise (alone it goes direct by default), so that the tests that replay,
    validate and relay its plans cover the fan-out's pulls too."""
    fan_out = {"node_fan_out": True} if options.get("planner", "fcp") == "fcp" else {}
    return compile_valid(lengths, gpus, **{"floor": False, **fan_out, **options})


def compile_valid(lengths, gpus, **options):
    """Compile and validate; return the plan."""
    plan = compile_plan(lengths, gpus, **options)
    report = validate_plan(plan.to_bytes())
    stats = plan.stats
    assert report.num_rounds == stats["num_rounds"] and report.max_degree == stats["max_degree"]
    assert (report.nvlink_degree, report.nic_degree) == (stats["nvlink_degree"], stats["nic_degree"])
    assert stats["num_rounds"] >= max(stats["nic_degree"], -(-stats["nvlink_degree"] // stats["nvlink_lanes"]))
    return plan


@pytest.fixture
def small_plan():
    return compile_valid([5000, 300, 70000, 12, 4096, 8192, 20000, 999], 4, block_size=1024, coalesce=4)


def congestion_free(rounds, src, dst, gpus_per_node: int, lanes: int) -> bool:
    """Whether, in every round, each rank sends and receives at most one NIC message (to or from another node) and
    at most `lanes` NVLink messages (inside its node)."""
    import numpy as np

    link = (np.asarray(src) // gpus_per_node != np.asarray(dst) // gpus_per_node).astype(np.int64)
    limit = np.where(link == 1, 1, lanes)
    for who in (src, dst):
        key = (np.asarray(who) * 2 + link) * (int(np.max(rounds, initial=0)) + 1) + np.asarray(rounds)
        _, first, counts = np.unique(key, return_index=True, return_counts=True)
        if (counts > limit[first]).any():
            return False
    return True

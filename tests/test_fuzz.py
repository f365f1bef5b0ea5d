"""A short run of benchmarks/fuzz_plans.py: mutated plans never crash a reader, never hang, and every mutant the
validator accepts is identical in meaning to its source or replays exactly on gloo."""

import sys
import tempfile
from pathlib import Path

import pytest

pytest.importorskip("torch")
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))

from fuzz_plans import fuzz  # noqa: E402


@pytest.mark.parametrize("num_mutants, replay", [(60, 2), pytest.param(300, 6, marks=pytest.mark.long)])
def test_mutated_plans_fail_cleanly_and_accepted_ones_replay_exactly(num_mutants, replay):
    with tempfile.TemporaryDirectory() as folder:
        figures = fuzz(num_mutants=num_mutants, jobs=1, seed=7, timeout=30, replay=replay, folder=folder)
    assert figures["mutants"] == num_mutants
    assert figures["bugs"] == [] and figures["hangs"] == [] and figures["replay_mismatches"] == []
    assert figures["accepted_identical"] + figures["replayed_exactly"] >= 1
    assert figures["replayed_exactly"] == min(figures["accepted_changed"], replay)
    # What the cases allocate, above the memory the forked worker inherits from this test process (whose size
    # depends on the tests that ran before it).
    assert figures["rss_growth_mb"] <= 256

import numpy as np
from hypothesis import given
from hypothesis import strategies as st

from fcp_compiler.passes.coalesce import schedule_pushes


def _within_caps(stage, src, dst, capacity):
    return (np.unique(np.stack((src, stage)), axis=1, return_counts=True)[1].max() <= capacity
            and np.unique(np.stack((dst, stage)), axis=1, return_counts=True)[1].max() <= capacity)


@given(st.integers(1, 4), st.integers(1, 6), st.integers(1, 60), st.integers(0, 10_000))
def test_pushes_meet_both_caps_and_never_leave_early(capacity, num_ranks, num_pushes, seed):
    rng = np.random.default_rng(seed)
    ready = rng.integers(0, 5, size=num_pushes)
    src = rng.integers(0, num_ranks, size=num_pushes)
    dst = rng.integers(0, num_ranks, size=num_pushes)
    stage = schedule_pushes(ready, src, dst, capacity)
    assert (stage >= ready).all()
    assert _within_caps(stage, src, dst, capacity)


def test_pushes_wait_only_for_room():
    # Rank 0 sends three pushes ready in stage 0, one a stage: 0, 1, 2; rank 1's push ready at 1 is unaffected.
    stage = schedule_pushes(np.array([0, 0, 0, 1]), np.array([0, 0, 0, 1]), np.array([1, 2, 3, 0]), 1)
    assert stage.tolist() == [0, 1, 2, 1]
    ready = np.array([0, 0, 1, 1])
    assert schedule_pushes(ready, np.array([0, 1, 0, 1]), np.array([1, 0, 1, 0]), 1).tolist() == [0, 0, 1, 1]

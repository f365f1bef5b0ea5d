"""Live message buffers per rank and stage: the one liveness rule of the plan, on plain arrays.

The rule (docs/DESIGN.md, section 3 and invariant 4), per pass and per rank: a received message's buffer is allocated
when its stage posts it and freed at the end of its last stage of use. A pulled block is used up to its last tile and, when
the pass pushes a result back along it (partial O and LSE, or dK, dV, dQ), up to that push; a pushed result that
arrives is folded in at the end of its stage. Buffers are counted in tokens, one count per message whatever
tensors it carries. The compiler, the validator and the runtime each apply this rule to their own view of a plan.
"""

from __future__ import annotations

import numpy as np


def live_tokens(rank: np.ndarray, first_stage: np.ndarray, last_stage: np.ndarray, tokens: np.ndarray,
                num_ranks: int, num_stages: int) -> np.ndarray:
    """Tokens held by live buffers on each rank in each stage.

    Objective: an exact sum of intervals; O(B + N * S) for B buffers, N ranks, S stages (a difference array).

    Args:
        rank: int [B], the rank holding each buffer.
        first_stage, last_stage: int [B], the buffer is live in stages first..last inclusive (first <= last).
        tokens: int [B], its size.
        num_ranks, num_stages: the matrix shape (every stage index < num_stages).
    Returns:
        int64 [num_ranks, num_stages].
    """
    assert (first_stage <= last_stage).all()
    width = num_stages + 1
    delta = np.bincount(rank * width + first_stage, weights=tokens, minlength=num_ranks * width)
    delta -= np.bincount(rank * width + last_stage + 1, weights=tokens, minlength=num_ranks * width)
    return np.cumsum(delta.reshape(num_ranks, width), axis=1)[:, :num_stages].round().astype(np.int64)


def peak_live_tokens(rank: np.ndarray, first_stage: np.ndarray, last_stage: np.ndarray, tokens: np.ndarray,
                     num_ranks: int) -> np.ndarray:
    """Each rank's largest live-buffer total over the stages (int64 [num_ranks]); see :func:`live_tokens`."""
    if rank.size == 0:
        return np.zeros(num_ranks, dtype=np.int64)
    num_stages = int(last_stage.max()) + 1
    return live_tokens(rank, first_stage, last_stage, tokens, num_ranks, num_stages).max(axis=1)

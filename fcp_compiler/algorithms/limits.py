"""The one size limit every tool counts the same way: segment pairs of one sequence.

The validator enumerates every (query segment, key segment) pair of each sequence to check coverage, and cost lists
the visible ones; both hold a few hundred bytes a pair at their peak. A plan past MAX_SEGMENT_PAIRS is refused at
compile time, so that nothing the compiler writes is refused by its own validator or simulator.
"""

from __future__ import annotations

import numpy as np

MAX_SEGMENT_PAIRS = 64_000_000


def segment_pairs(seg_seq: np.ndarray, num_sequences: int) -> int:
    """Ordered (segment, segment) pairs of one sequence: the sum over sequences of (segments it is cut into)^2.
    O(segments)."""
    per_sequence = np.bincount(seg_seq, minlength=num_sequences).astype(np.int64)
    return int((per_sequence * per_sequence).sum())


def least_segment_pairs(lengths: np.ndarray, block_size: int) -> int:
    """A lower bound on :func:`segment_pairs` of any cut of these sequences into blocks of at most block_size
    tokens (a sequence of L tokens is cut into at least ceil(L / block_size) segments), from the lengths alone:
    what a refusal may cost before sharding allocates anything. O(sequences)."""
    if lengths.size > MAX_SEGMENT_PAIRS:
        return int(lengths.size)  # one segment each at least, and no pass over them all
    pieces = -(-np.asarray(lengths, dtype=np.int64) // block_size)
    return int(min(np.square(pieces, dtype=np.float64).sum(), 2.0**62))  # no int64 overflow, whatever the lengths

"""Visible (query, key) pairs between chunk positions, summed over sequences, in closed form."""

from __future__ import annotations

import numpy as np


def chunk_pair_sums(chunk_tokens: np.ndarray, weights: np.ndarray, causal: bool) -> np.ndarray:
    """M[a, b] = sum over sequences s of weights[s] x the visible pairs between query chunk a and key chunk b of s.

    Every sequence is cut into the same K chunk positions, in order (chunk_tokens[s, k] tokens in chunk k, 0 for
    an empty one). Full mask: c_a x c_b. Causal: c_a x c_b for b < a, c_a (c_a + 1) / 2 for b == a, 0 for b > a.
    Objective: the exact sums (pair counts are integers well under 2^53). O(S K^2) in one matrix product, instead
    of enumerating the S K^2 chunk pairs one by one.

    Args:
        chunk_tokens: float or int [S, K].
        weights: float [S].
        causal: the mask.
    Returns:
        float64 [K, K], rows query chunks, columns key chunks.
    """
    tokens = np.asarray(chunk_tokens, dtype=np.float64)
    weights = np.asarray(weights, dtype=np.float64)
    products = (tokens * weights[:, None]).T @ tokens
    if not causal:
        return products
    sums = np.tril(products, -1)
    np.fill_diagonal(sums, (weights[:, None] * tokens * (tokens + 1) / 2).sum(axis=0))
    return sums

"""One transformer layer around attention: each rank's linear time from its tokens, and the layer's lower bound.

A rank's layer (docs/DESIGN.md section 5, layer time), forward: the Q, K, V projection of its tokens, its attention,
then the O projection and the MLP. A remote tile needs the sender's projection first, so the attention of a rank starts
after its own projection and its pulls after their sender's. Backward runs the other way round: the MLP and O
projection's gradients, the attention backward, then the Q, K, V projection's. A linear layer's backward is twice
its forward (the input's and the weights' gradients); attention's is BACKWARD_WORK times.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from fcp_compiler.algorithms.layer_bound import Machine, PassCosts, layer_lower_bound, pair_efficiency
from fcp_compiler.algorithms.visibility import visible_pairs
from fcp_compiler.core.ir import AttentionShape, Batch, HardwareProfile
from fcp_compiler.format.memory import Sizes
from fcp_compiler.format.models import ModelPreset
from fcp_compiler.format.traffic import own_bytes_per_token

BACKWARD_WORK = 2.5  # backward tile FLOPs relative to forward (docs/DESIGN.md section 3)
BACKWARD_LINEAR_WORK = 2.0  # a linear layer's backward: the input's and the weights' gradients
LSE_BYTES = 4  # one fp32 log-sum-exp per query token and head travels with a partial output or a backward pull
# What a pass's placement weighs a rank's linear time against its forward attention seconds by: the forward and
# backward layer together, (1 + 2) linear against (1 + 2.5) attention.
LINEAR_WEIGHT = (1 + BACKWARD_LINEAR_WORK) / (1 + BACKWARD_WORK)


@dataclass(frozen=True, slots=True, kw_only=True)
class LayerCosts:
    """The linear layers' per-token time of one model on one GPU (all zero without a model)."""

    model: ModelPreset | None
    peak_flops: float

    @classmethod
    def of(cls, model: ModelPreset | None, profile: HardwareProfile) -> LayerCosts:
        return cls(model=model, peak_flops=profile.peak_tflops * 1e12)

    @property
    def linear_seconds_per_token(self) -> float:
        """Forward seconds of one layer's linear parts per token."""
        if self.model is None:
            return 0.0
        return self.model.linear_flops_per_token / (self.peak_flops * self.model.linear_efficiency)

    @property
    def projection_seconds_per_token(self) -> float:
        """Forward seconds of the Q, K, V projection per token (what precedes attention)."""
        if self.model is None:
            return 0.0
        return self.model.projection_flops_per_token / (self.peak_flops * self.model.linear_efficiency)

    @property
    def kv_projection_seconds_per_token(self) -> float:
        """Forward seconds of the K and V projections alone per token (projected before Q, when K,V prefetch)."""
        if self.model is None:
            return 0.0
        return self.model.kv_projection_flops_per_token / (self.peak_flops * self.model.linear_efficiency)

    def phases(self, rank_tokens: np.ndarray) -> dict[str, np.ndarray]:
        """Per rank, seconds of linear work before and after attention in each pass ("fwd_before", "fwd_after",
        "bwd_before", "bwd_after"), and "fwd_kv": the part of "fwd_before" that projects K and V (done first where
        the runtime prefetches K,V, so that the first stage's K,V pulls cross while Q is projected)."""
        tokens = np.asarray(rank_tokens, dtype=np.float64)
        before = tokens * self.projection_seconds_per_token
        after = tokens * (self.linear_seconds_per_token - self.projection_seconds_per_token)
        return {"fwd_before": before, "fwd_after": after, "bwd_before": after * BACKWARD_LINEAR_WORK,
                "bwd_after": before * BACKWARD_LINEAR_WORK, "fwd_kv": tokens * self.kv_projection_seconds_per_token}


@dataclass(frozen=True, slots=True, kw_only=True)
class AttentionCosts:
    """Per sequence, the forward's least seconds for one visible pair and for all of them (:func:`attention_costs`)."""

    pair_seconds: np.ndarray
    attention_seconds: np.ndarray


def attention_costs(lengths: np.ndarray, windows: np.ndarray, shape: AttentionShape, profile: HardwareProfile,
                    max_segment_tokens: np.ndarray | None = None) -> AttentionCosts:
    """Per sequence, the least forward time of one visible pair and of all of them: no kernel call is larger than
    a query segment over the keys it sees (:func:`~fcp_compiler.algorithms.layer_bound.pair_efficiency`), so none
    beats the efficiency cap of that tile.

    Args:
        lengths, windows: per sequence.
        shape, profile: head counts and head size; peak and efficiency curve.
        max_segment_tokens: per sequence, its longest query segment in the plan (default: its length, a bound for
            every plan of the batch).
    Returns:
        the AttentionCosts.
    """
    curve_tokens = np.array([point.tokens for point in profile.efficiency_curve], dtype=np.float64)
    curve_efficiency = np.array([point.efficiency for point in profile.efficiency_curve], dtype=np.float64)
    per_pair = 4.0 * shape.q_heads * shape.head_dim / (profile.peak_tflops * 1e12)
    caps = pair_efficiency(lengths, windows, lengths if max_segment_tokens is None else max_segment_tokens,
                           curve_tokens, curve_efficiency)
    return AttentionCosts(pair_seconds=per_pair / caps.best, attention_seconds=per_pair * caps.weighted_pairs)


def longest_segments(seg_seq: np.ndarray, seg_tokens: np.ndarray, num_sequences: int) -> np.ndarray:
    """Per sequence, the tokens of its longest segment (int64; 1 for a sequence without one)."""
    longest = np.ones(num_sequences, dtype=np.int64)
    np.maximum.at(longest, np.asarray(seg_seq, dtype=np.int64), np.asarray(seg_tokens, dtype=np.int64))
    return longest


def layer_bounds(batch: Batch, shape: AttentionShape, profile: HardwareProfile, model: ModelPreset | None,
                 num_ranks: int, token_cap: int, max_segment_tokens: np.ndarray | None = None) -> dict[str, dict]:
    """Certified lower bounds on the forward and the backward layer makespan of any plan for this batch on
    `num_ranks` ranks with at most `token_cap` tokens each (:func:`~fcp_compiler.algorithms.layer_bound.
    layer_lower_bound` proves each term) and, where `max_segment_tokens` is given (per sequence, its longest query
    segment: :func:`longest_segments` of the plan's), no query segment longer (:func:`attention_costs`).

    Returns:
        {"fwd": terms, "bwd": terms}, each as layer_lower_bound returns it.
    """
    lengths, windows = batch.lengths, batch.windows
    visible = visible_pairs(0, lengths, 0, lengths, windows).astype(np.float64)
    attention = attention_costs(lengths, windows, shape, profile, max_segment_tokens)
    linear = LayerCosts.of(model, profile).linear_seconds_per_token
    # Every token's accumulators are made and its outputs cast by the rank that holds it, on its compute stream,
    # whatever the schedule: per token, like the linear layers (fcp_compiler.format.traffic).
    sizes = Sizes.of_shape(shape)
    own = {forward: sum(own_bytes_per_token(sizes, forward)) / (profile.hbm_gbps * 1e9) for forward in (True, False)}
    machine = Machine(num_ranks=num_ranks, gpus_per_node=profile.gpus_per_node, token_cap=token_cap,
                      nvlink_bytes_per_s=profile.nvlink_gbps * 1e9, nic_bytes_per_s=profile.network_gbps * 1e9)
    q_bytes, kv_bytes = float(shape.q_bytes_per_token), float(shape.kv_bytes_per_token)
    forward = PassCosts(pair_seconds=attention.pair_seconds, attention_seconds=attention.attention_seconds,
                        linear_seconds_per_token=linear + own[True], q_row_bytes=q_bytes, kv_row_bytes=kv_bytes)
    # A backward query row travels with its output, the output's gradient and its log-sum-exp.
    backward = PassCosts(pair_seconds=attention.pair_seconds * BACKWARD_WORK,
                         attention_seconds=attention.attention_seconds * BACKWARD_WORK,
                         linear_seconds_per_token=linear * BACKWARD_LINEAR_WORK + own[False],
                         q_row_bytes=3 * q_bytes + LSE_BYTES * shape.q_heads, kv_row_bytes=kv_bytes)
    return {"fwd": layer_lower_bound(lengths, windows, visible, forward, machine),
            "bwd": layer_lower_bound(lengths, windows, visible, backward, machine)}

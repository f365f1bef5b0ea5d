"""What a Hugging Face model's RoPE allows under fcp: the longest document whose frequencies do not depend on the
call (:func:`rope_length_limit`), which :class:`fcp_runtime.hf.HFPlanningCollate` holds every document to."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True, kw_only=True)
class RopeLimit:
    """The longest document a RoPE keeps its frequencies for: past it transformers picks them from each call's
    longest position (`max(position_ids)+1`), "dynamic" NTK scaling past max_position_embeddings and "longrope"
    (Phi-3's 128K models) past original_max_position_embeddings. Under fcp a call holds one rank's rows, so a longer
    document's tokens would be rotated with different frequencies on different ranks (2 ranks: loss off by 2.8e-6
    and 9.1e-5, gradients by 1.3e-3 and 3.0e-3 against one process)."""

    tokens: int
    rope_type: str
    layer_type: str | None = None

    def check(self, doc_idx: int, num_tokens: int) -> None:
        """Raises: ValueError: a document longer than the limit, named with the rope type."""
        if num_tokens > self.tokens:
            where = f" (layer type {self.layer_type!r})" if self.layer_type is not None else ""
            raise ValueError(f"document {doc_idx} has {num_tokens} tokens, over the {self.tokens} a "
                             f"rope_type={self.rope_type!r}{where} keeps its frequencies for: past them transformers "
                             f"picks them from each call's longest position, which under fcp is each rank's own "
                             f"rows; cut documents to {self.tokens} tokens or use a static RoPE (default, linear, "
                             f"yarn, llama3)")


def rope_length_limit(config) -> RopeLimit | None:
    """The config's :class:`RopeLimit` (the least over its layer types), or None for a static RoPE."""
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    parameters = getattr(text, "rope_parameters", None) or getattr(text, "rope_scaling", None) or {}
    per_layer_type = parameters if parameters and all(isinstance(v, dict) for v in parameters.values()) else \
        {None: parameters}
    limits = []
    for layer_type, rope in per_layer_type.items():
        rope_type = str(rope.get("rope_type", rope.get("type", "default")))
        if "dynamic" in rope_type:
            limits.append(RopeLimit(tokens=int(text.max_position_embeddings), rope_type=rope_type,
                                    layer_type=layer_type))
        elif rope_type == "longrope":
            original = rope.get("original_max_position_embeddings") or \
                getattr(text, "original_max_position_embeddings", None) or text.max_position_embeddings
            limits.append(RopeLimit(tokens=int(original), rope_type=rope_type, layer_type=layer_type))
    return min(limits, key=lambda limit: limit.tokens, default=None)

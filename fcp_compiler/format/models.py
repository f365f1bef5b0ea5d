"""Transformer layer presets: the linear layers around attention, which the placement balances with it per rank
(`--model`) and the simulator runs around each rank's attention."""

from __future__ import annotations

from dataclasses import dataclass

from fcp_compiler.errors import InvalidInputError, shown


@dataclass(frozen=True, slots=True, kw_only=True)
class ModelPreset:
    """One decoder layer's shapes (Llama-style: grouped-query attention, SwiGLU MLP).

    linear_efficiency is the fraction of dense peak the layer's GEMMs reach at these sizes; 0.75 is the usual
    figure for bf16 GEMMs of this size on Hopper (an assumption, not a measurement of ours).
    """

    name: str
    hidden: int
    ffn: int
    q_heads: int
    kv_heads: int
    head_dim: int
    num_layers: int
    linear_efficiency: float = 0.75
    source: str = ""
    # Models whose layers differ in mask: each kind's mask (as --layer-masks takes it) and layer count, by the names
    # transformers' `layer_types` gives them. A batch whose layer kinds have these names takes the counts as its mix.
    layer_masks: tuple[tuple[str, str], ...] = ()
    layer_mix: tuple[tuple[str, int], ...] = ()

    @property
    def projection_flops_per_token(self) -> int:
        """Forward FLOPs of the Q, K and V projections per token: what a rank must finish before others can pull
        its blocks' Q or K,V."""
        return 2 * self.hidden * (self.q_heads + 2 * self.kv_heads) * self.head_dim

    @property
    def kv_projection_flops_per_token(self) -> int:
        """Forward FLOPs of the K and V projections alone per token: what a rank must finish before others can pull
        its blocks' K,V, when it projects them before Q (fcp_runtime.prefetch_kv)."""
        return 2 * self.hidden * 2 * self.kv_heads * self.head_dim

    @property
    def linear_flops_per_token(self) -> int:
        """Forward FLOPs of one layer's linear parts per token: Q, K, V and O projections and the three MLP
        matrices, 2 FLOPs per weight."""
        return self.projection_flops_per_token + 2 * (self.q_heads * self.head_dim * self.hidden
                                                       + 3 * self.hidden * self.ffn)


MODEL_PRESETS: dict[str, ModelPreset] = {
    "llama3-8b": ModelPreset(name="llama3-8b", hidden=4096, ffn=14336, q_heads=32, kv_heads=8, head_dim=128,
                             num_layers=32, source="Meta Llama 3 8B config: hidden 4096, FFN 14336, 32/8 heads"),
    "llama3-70b": ModelPreset(name="llama3-70b", hidden=8192, ffn=28672, q_heads=64, kv_heads=8, head_dim=128,
                              num_layers=80, source="Meta Llama 3 70B config: hidden 8192, FFN 28672, 64/8 heads "
                                                    "(the seed's attention shape)"),
    # Attention sinks and MoE aside (the linear layers count the 4 experts a token is routed to), the layer's shapes.
    "gpt-oss-120b": ModelPreset(name="gpt-oss-120b", hidden=2880, ffn=4 * 2880, q_heads=64, kv_heads=8, head_dim=64,
                                num_layers=36, layer_masks=(("sliding_attention", "sliding_window:128"),
                                                            ("full_attention", "causal")),
                                layer_mix=(("sliding_attention", 18), ("full_attention", 18)),
                                source="openai/gpt-oss-120b config: hidden 2880, 36 layers alternating "
                                       "sliding_attention (window 128) and full_attention, 64/8 heads of 64, 128 "
                                       "experts of 2880 with 4 active a token"),
}


NO_MODEL = "none"  # attention alone: no linear layers around it
DEFAULT_MODEL = "llama3-70b"  # the seed's attention shape


def load_model(name: str) -> ModelPreset | None:
    """A model preset by name; None for "none" (attention alone).

    Raises:
        InvalidInputError: an unknown name (the presets are listed).
    """
    if name == NO_MODEL:
        return None
    if not isinstance(name, str) or name not in MODEL_PRESETS:
        raise InvalidInputError(f"model {shown(name)} must be one of {', '.join(sorted(MODEL_PRESETS))} or {NO_MODEL}")
    return MODEL_PRESETS[name]

"""fcp's pieces inside torchtitan's model and data path (the attention module, the dataloader's collate, the
post-dataloading hook); :mod:`fcp_runtime.torchtitan` says how they fit and adds the trainer. Only these two modules
import torchtitan."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch.utils.data import default_collate
from torchtitan.config import TORCH_DTYPE_MAP
from torchtitan.models.common.attention import GQAttention, VarlenAttention
from torchtitan.protocols.module import Module


from fcp_compiler.format.inputs import AttentionShape
from fcp_runtime.attention import fcp_attn_func
from fcp_runtime.loader import PlanningCollate
from fcp_runtime.mesh import cp_group as mesh_cp_group

_DTYPES = {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32", torch.float64: "fp64"}
# The planned step's field in torchtitan's input_dict, from the collate to the hook (the plan stays a host object).
# The hook takes the rank's rows from the batch itself, at the plan's rows: no copy of them travels beside the plan
# that could go stale (a batch's inputs with another batch's rows).
FCP_PLAN = "fcp_plan"


@dataclass(frozen=True, eq=False)
class FcpMasks:
    """What torchtitan's layers pass their inner attention as ``attention_masks`` under fcp: this rank's plan of the
    step, the context-parallel process group (None: a one-rank plan in a world of one), and the rows' positions
    ``[1, T]`` (the tensor RoPE gets) and labels ``[1, T]``, both checked against the plan's rows on every rank
    before the first message."""

    plan: Any
    group: Any
    positions: torch.Tensor
    labels: torch.Tensor | None = None


class FcpAttention(Module):
    """torchtitan inner attention over fcp's plan: causal attention inside each document of the step, whichever
    ranks hold its blocks.

    Called by torchtitan's ``GQAttention`` as its other inner attentions are: ``(q, k, v [1, T, heads, head_dim],
    attention_masks=FcpMasks, scale=..., enable_gqa=...)``; returns ``[1, T, q_heads, head_dim]``. Grouped-query
    K, V go in with their own heads (the plan knows the group size); ``scale`` None is head_dim ** -0.5, as
    torchtitan's backends take it.
    """

    @dataclass(kw_only=True, slots=True)
    class Config(Module.Config):
        def build(self, **kwargs):
            instance = Module.Config.build(self, **kwargs)
            # torchtitan's Llama 3 sharding (set_gqa_inner_attention_local_map) declares K and V replicated over
            # "cp" at the inner attention, which all-gathers them there; fcp moves the blocks a rank needs itself,
            # so its inner attention keeps every tensor on its rank.
            instance._sharding_config = None
            return instance

    def __init__(self, config: Config):
        super().__init__()

    def forward(self, q_BLNH: torch.Tensor, k_BLNH: torch.Tensor, v_BLNH: torch.Tensor, *,
                attention_masks=None, scale: float | None = None, enable_gqa: bool = False, score_mod=None,
                out_transform=None, **kwargs) -> torch.Tensor:
        """Raises:
            ValueError: no FcpMasks (the batch did not go through :func:`prepare_fcp_input`), a score_mod or an
                out_transform, a batch dimension other than 1, a plan compiled for another dtype; on every rank,
                positions or labels that are not the plan's rows' (a plan from another step).
        """
        if not isinstance(attention_masks, FcpMasks):
            raise ValueError(f"FcpAttention needs the step's plan as attention_masks (FcpMasks, from "
                             f"prepare_fcp_input / FcpTrainer.post_dataloading_process); got "
                             f"{type(attention_masks).__name__}")
        if score_mod is not None or out_transform is not None:
            raise ValueError("FcpAttention has no score_mod and no out_transform (softmax over each document's "
                             "causal keys only)")
        if q_BLNH.shape[0] != 1:
            raise ValueError(f"FcpAttention takes one packed row of this rank's tokens, batch size 1; got "
                             f"{q_BLNH.shape[0]} rows (inputs [1, T] from prepare_fcp_input)")
        plan = attention_masks.plan
        if _DTYPES.get(q_BLNH.dtype) != plan.dtype:
            raise ValueError(f"the plan was compiled for {plan.dtype} attention but the query is {q_BLNH.dtype}: "
                             f"compile it for the dtype attention computes in (TitanPlanningCollate.for_model(..., "
                             f"dtype=); under FSDP, training.mixed_precision_param)")
        out = fcp_attn_func(q_BLNH[0], k_BLNH[0], v_BLNH[0], plan, group=attention_masks.group,
                            softmax_scale=scale, mask=(True, None), position_ids=attention_masks.positions,
                            labels=attention_masks.labels)
        return out.unsqueeze(0)


# The fields a torchtitan attention layer config holds its own sliding window in (None: global attention).
_WINDOW_FIELDS = ("window_size", "sliding_window_size")


def attention_layers(model_config) -> list:
    """The attention configs fcp replaces the inner attention of, one per attention layer, checked.

    Raises:
        ValueError: no layers, a layer whose attention is not torchtitan's GQAttention, or a sliding window (the
            layer's own, or a varlen attention's).
    """
    layers = getattr(model_config, "layers", None)
    if not layers:
        raise ValueError(f"model config {type(model_config).__name__} has no layers; fcp replaces the inner "
                         f"attention of a torchtitan decoder's GQAttention layers")
    found = []
    for index, layer in enumerate(layers):
        attention = getattr(layer, "attention", None)
        if attention is None:
            continue
        if not isinstance(attention, GQAttention.Config):
            raise ValueError(f"layer {index}'s attention is {type(attention).__name__}; fcp replaces the inner "
                             f"attention of torchtitan's GQAttention")
        inner = attention.inner_attention
        if isinstance(inner, VarlenAttention.Config) and tuple(inner.window_size) != (-1, 0):
            raise ValueError(f"layer {index}: varlen window_size={inner.window_size}; FcpAttention is causal "
                             f"inside each document (window_size (-1, 0))")
        # A layer's own sliding window (Muse Glimmer's window_size, gpt-oss's sliding_window_size; flex reads it
        # from the layer, not from the inner attention): fcp would train the layer causal over every earlier key.
        window = next((getattr(attention, name) for name in _WINDOW_FIELDS
                       if getattr(attention, name, None) is not None), None)
        if window is not None:
            raise ValueError(f"layer {index}: a sliding window of {window} tokens ({type(attention).__qualname__}); "
                             f"FcpAttention is causal inside each document over every earlier key, so the layer "
                             f"would train without its window: use a model config without sliding windows")
        found.append(attention)
    if not found:
        raise ValueError(f"model config {type(model_config).__name__} has no attention layer for fcp")
    return found


def use_fcp_attention(model_config):
    """Put :class:`FcpAttention` in every attention layer of a torchtitan decoder config (in place; returns it).

    Raises:
        ValueError: a layer whose attention is not torchtitan's GQAttention (its inner attention is what fcp
            replaces), or a layer with a sliding window, its own or its varlen attention's (fcp replays it causal).
    """
    for attention in attention_layers(model_config):
        attention.inner_attention = FcpAttention.Config()
    return model_config


def attention_shape(model_config, dtype: torch.dtype | str) -> AttentionShape:
    """The attention shape a plan is compiled for, from a torchtitan decoder config: its first attention layer's
    query and KV heads and head size, and the dtype attention computes in (a torch dtype or torchtitan's name).

    Raises:
        ValueError: a config without attention, or a dtype the plan format has no name for.
    """
    attention = getattr(model_config, "first_attention", None)
    if attention is None:
        raise ValueError(f"model config {type(model_config).__name__} has no attention layer to plan for")
    dtype = TORCH_DTYPE_MAP.get(dtype, dtype) if isinstance(dtype, str) else dtype
    if dtype not in _DTYPES:
        raise ValueError(f"dtype {dtype} has no plan dtype; valid: {', '.join(map(str, _DTYPES))}")
    q_heads = int(attention.n_heads)
    kv_heads = int(attention.n_kv_heads or q_heads)
    head_dim = int(attention.head_dim or attention.dim // q_heads)
    return AttentionShape(q_heads=q_heads, kv_heads=kv_heads, head_dim=head_dim, dtype=_DTYPES[dtype])


def row_documents(positions: torch.Tensor, row: int = 0) -> list[int]:
    """The lengths of the documents of one torchtitan row, read from its positions as torchtitan's block-causal
    masks read them: a document starts where the position is 0, and inside it positions count up by one.

    Raises:
        ValueError: a row that does not start at position 0, or positions that do not count 0, 1, 2, ... inside
            each document (RoPE would then see other positions than the plan's rows hold).
    """
    positions = torch.as_tensor(positions).flatten()
    if positions.numel() == 0:
        raise ValueError(f"row {row} is empty")
    starts = torch.nonzero(positions == 0).flatten()
    inside = positions[1:] != 0
    if starts.numel() == 0 or int(starts[0]) != 0 or not bool((positions[1:] == positions[:-1] + 1)[inside].all()):
        raise ValueError(f"row {row}: positions must restart at 0 at each document and count up by one inside it "
                         f"(torchtitan's per-document positions); got {positions[:8].tolist()}...")
    bounds = starts.tolist() + [positions.numel()]
    return [end - start for start, end in zip(bounds[:-1], bounds[1:])]


class TitanPlanningCollate:
    """The ``collate_fn`` of torchtitan's dataloader under fcp: it collates torchtitan's samples as torch's default
    collate does, then compiles the step's plan (here, in the loader's worker) for this context-parallel rank.

    A sample is torchtitan's ``({"input": ids [L], "positions": [L]}, labels [L])``; a batch of them is B rows.
    The documents are every row's pieces between positions restarting at 0 (a row without positions is one
    document), all B rows' in one plan. Returns ``(input_dict, labels)``: torchtitan's batch unchanged (the full
    labels, which torchtitan's train_step counts for the loss; ``positions`` added where the batch had none) plus
    this rank's plan, ``fcp_plan``; :func:`prepare_fcp_input` takes the rank's rows from the batch at the plan's
    rows.

    Args:
        rank, world_size: this rank in the context-parallel group, and the group's size.
        compile_options: forwarded to the compiler (block_size, shape, model, profile, ...); :meth:`for_model`
            fills the attention shape from a model config.
    """

    def __init__(self, rank: int, world_size: int, **compile_options):
        self.planning = PlanningCollate(rank, world_size, layout="plan", **compile_options)

    @classmethod
    def for_model(cls, model_config, rank: int, world_size: int, dtype: torch.dtype | str = torch.float32,
                  **compile_options) -> TitanPlanningCollate:
        """A collate for a torchtitan decoder: its heads and head size, the dtype attention computes in, no K,V
        prefetch (torchtitan's GQAttention projects Q, K and V in one matmul and rotates them before the inner
        attention, so no K,V pull could leave before Q exists), attention-only balance unless `model` is given."""
        options = {"kv_prefetch": False, "model": "none", "shape": attention_shape(model_config, dtype)}
        return cls(rank, world_size, **{**options, **compile_options})

    def __call__(self, samples) -> tuple[dict, torch.Tensor]:
        input_dict, labels = default_collate(samples)
        return self.plan(input_dict, labels)

    def plan(self, input_dict: dict, labels: torch.Tensor) -> tuple[dict, torch.Tensor]:
        """Plan one collated batch (input_dict["input"] and labels [B, L], optional "positions" [B, L]).

        Raises:
            ValueError: inputs that are not [B, L] rows with labels of their shape, positions that do not cut the
                rows into whole documents (:func:`row_documents`), or a step the compiler cannot give every rank a
                token of.
        """
        inputs = torch.as_tensor(input_dict["input"])
        labels = torch.as_tensor(labels)
        positions = input_dict.get("positions")
        if inputs.dim() != 2 or labels.shape != inputs.shape:
            raise ValueError(f"a torchtitan batch is input [B, L] and labels of its shape; got "
                             f"{tuple(inputs.shape)} and {tuple(labels.shape)}")
        if positions is None:  # torchtitan without positions: causal over each row
            positions = torch.arange(inputs.shape[1]).expand_as(inputs)
        positions = torch.as_tensor(positions)
        if positions.shape != inputs.shape:
            raise ValueError(f"positions {tuple(positions.shape)} must be the shape of input {tuple(inputs.shape)}")
        documents = []
        for row in range(inputs.shape[0]):
            pieces = [piece.split(row_documents(positions[row], row))
                      for piece in (inputs[row], labels[row], positions[row])]
            documents += [{"input": ids, "labels": doc_labels, "positions": doc_positions}
                          for ids, doc_labels, doc_positions in zip(*pieces)]
        plan = self.planning(documents)["plan"]
        # The plan's positions are each row's place in its own document, which row_documents checked torchtitan's
        # own positions to be: RoPE rotates each row where one process would.
        return {**input_dict, "positions": positions, FCP_PLAN: plan}, labels


def prepare_fcp_input(inputs: torch.Tensor, labels: torch.Tensor, extra_kwargs: dict, cp_group,
                      planner: TitanPlanningCollate | None = None) -> tuple[torch.Tensor, torch.Tensor, dict]:
    """torchtitan's ``prepare_context_parallel_input`` under fcp: this rank's rows of the step in the plan's layout.

    Args:
        inputs, labels: the data-parallel replica's batch [B, L], as torchtitan's dataloader gives it.
        extra_kwargs: the batch's other fields (``positions`` [B, L], and the step's ``fcp_plan`` from
            :class:`TitanPlanningCollate`); updated in place and returned.
        cp_group: the context-parallel process group (torchtitan's ``parallel_dims.get_mesh("cp").get_group()``),
            or a DeviceMesh with a "cp" dimension, or None for a one-rank plan in a world of one.
        planner: plans the batch here (on the training thread) when the dataloader's collate did not.
    Returns:
        (inputs [1, T_rank], labels [1, T_rank], extra_kwargs with ``positions`` [1, T_rank] and
        ``attention_masks`` an :class:`FcpMasks`), what torchtitan's model and loss take.
    Raises:
        ValueError: no planned step and no planner, a planned step whose token count is not the batch's, or no
            positions of the batch's shape. A plan of another batch with as many tokens is refused by attention,
            on every rank (its rows' positions and labels are not the plan's).
    """
    if FCP_PLAN not in extra_kwargs:
        if planner is None:
            raise ValueError("the batch has no fcp plan: set the dataloader's collate_fn to TitanPlanningCollate "
                             "(FcpTrainer installs it), or pass prepare_fcp_input(..., planner=)")
        fields = {"input": inputs.cpu(), **({"positions": extra_kwargs["positions"].cpu()}
                                            if extra_kwargs.get("positions") is not None else {})}
        planned, _ = planner.plan(fields, labels.cpu())
        extra_kwargs.update(positions=planned["positions"].to(inputs.device), **{FCP_PLAN: planned[FCP_PLAN]})
    plan = extra_kwargs.pop(FCP_PLAN)
    total = int(plan.seq_lengths.sum())
    if inputs.numel() != total:
        raise ValueError(f"the batch has {inputs.numel()} tokens but its fcp plan was compiled for {total}: the "
                         f"plan must come from this batch (TitanPlanningCollate on the same samples)")
    positions = extra_kwargs.get("positions")
    if positions is None or tuple(positions.shape) != tuple(inputs.shape):
        raise ValueError(f"the batch needs positions of its input's shape {tuple(inputs.shape)} (TitanPlanningCollate "
                         f"adds them); got {None if positions is None else tuple(positions.shape)}")
    rows = plan.cached(("titan_rows", inputs.device), lambda: plan.token_index.to(inputs.device))
    inputs, labels, positions = (x.reshape(-1)[rows].reshape(1, -1) for x in (inputs, labels, positions))
    extra_kwargs["positions"] = positions
    group = mesh_cp_group(cp_group, "torchtitan's parallel_dims.get_mesh('cp')")
    extra_kwargs["attention_masks"] = FcpMasks(plan=plan, group=group, positions=positions, labels=labels)
    return inputs, labels, extra_kwargs

"""fcp as torchtitan's context-parallel path (torchtitan 0.3.x, its Llama 3 and other GQAttention decoders).

Only this module and :mod:`fcp_runtime.torchtitan_parts` (the pieces inside torchtitan's model and data path, named
here too) import torchtitan: ``import fcp_runtime`` never does. Three pieces, each where torchtitan keeps its own
context parallelism:

- **The attention module.** :class:`FcpAttention` is an inner attention config beside torchtitan's
  ``FlexAttention`` and ``VarlenAttention`` (``torchtitan/models/common/attention.py``); :func:`use_fcp_attention`
  puts it in every layer of a model config. Its forward takes q, k, v ``[1, T, heads, head_dim]`` (this rank's rows
  in the plan's layout, RoPE already applied at their own positions) and runs :func:`fcp_runtime.fcp_attn_func`
  over the step's plan, which reaches it where torchtitan passes a flex ``BlockMask`` or varlen metadata: as the
  layers' ``attention_masks`` (:class:`FcpMasks`). Its K and V are never all-gathered: the config drops the
  sharding torchtitan's Llama 3 declares for its inner attention (K, V replicated over "cp").
- **The post-dataloading hook.** :func:`prepare_fcp_input` replaces torchtitan's
  ``prepare_context_parallel_input`` (``torchtitan/distributed/context_parallel/api.py``): it returns this rank's
  rows of the step's packed documents in the plan's layout, ``[1, T_rank]`` (input ids, labels and positions) and
  ``attention_masks=FcpMasks(...)``. The plan itself is compiled in the DataLoader worker by
  :class:`TitanPlanningCollate`, the dataloader's ``collate_fn``, from torchtitan's own rows: documents start where
  ``positions`` restart at 0, as torchtitan's block-causal masks read them.
- **The mesh and the trainer.** :class:`FcpTrainer` is torchtitan's ``Trainer`` with fcp: its ``ParallelDims``
  mesh as torchtitan builds it (the "cp" dimension is fcp's group), the collate installed on torchtitan's
  dataloader, and ``post_dataloading_process`` calling :func:`prepare_fcp_input` instead of torchtitan's CP
  sharding. ``FcpTrainer.Config.of(config, block_size=...)`` turns an existing ``Trainer.Config`` into one. On the
  "partial_dtensor" SPMD backend (what ``of`` sets) the model's parallelize_fn runs with ``cp_enabled`` hidden, so
  that it does not wrap the inner attention in torchtitan's own CP; FSDP still shards over dp_shard x cp.

The loss rule is torchtitan's own, unchanged: ``train_step`` counts the labels of the data-parallel replica's whole
batch (the collate keeps the full labels for it) and sums the count over the "batch" mesh; each rank's loss is the
sum of its rows' cross-entropies over that count; FSDP, sharding over dp_shard x cp with gradient division off,
sums the gradients over every rank. Each rank's rows are [1, T_rank]: one packed row of all its documents, the
local batch's rows flattened into one list of documents.

Tested (tests/test_torchtitan.py, CPU, gloo): torchtitan's Llama 3 model, its dataloader and its trainer step on 4
ranks against its model in one process, fp64 to 1e-15 (losses) and 1e-17 (gradients), with DP x CP, activation
checkpointing and per-block torch.compile; FcpTrainer itself (config.build(), FSDP, AdamW, train_step) on 4 gloo
ranks in fp32 with torchtitan's device selection pointed at the CPU. torchtitan's Trainer needs CUDA otherwise
(``benchmarks/gpu_check.py`` runs it on a GPU).
"""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass, field
from typing import Annotated, Any

import torch
import torch.distributed as dist
from torchtitan.components.loss import ChunkedLossWrapper
from torchtitan.trainer import Trainer

import tyro  # torchtitan's command-line parser (a dependency of torchtitan): FcpOptions' fields on its command line

from fcp_runtime.mesh import CP_DIM
from fcp_runtime.torchtitan_parts import (  # noqa: F401  (this module's API; FCP_*: the input_dict's fields)
    FCP_PLAN, FcpAttention, FcpMasks, TitanPlanningCollate, attention_layers,
    attention_shape, prepare_fcp_input, row_documents, use_fcp_attention)

__all__ = ["FcpAttention", "FcpMasks", "FcpOptions", "FcpTrainer", "TitanPlanningCollate", "attention_shape",
           "check_config", "prepare_fcp_input", "row_documents", "use_fcp_attention"]

@dataclass(kw_only=True, slots=True)
class FcpOptions:
    """fcp's options in an :class:`FcpTrainer` config (``--fcp.block_size`` on torchtitan's command line)."""

    block_size: int = 4096
    """Tokens in an fcp block (the compiler halves it, down to 64, for a step too short to give every rank one)."""

    compile_options: Annotated[dict[str, Any], tyro.conf.Suppress] = field(default_factory=dict)
    """Other fcp compiler options (coalesce, model, profile, ...), set in Python."""


def _world_size() -> int:
    if dist.is_initialized():
        return dist.get_world_size()
    return int(os.environ.get("WORLD_SIZE", "1"))


def check_config(config, world_size: int | None = None) -> None:
    """Refuse, in one line naming the option, a torchtitan trainer config fcp cannot train as torchtitan would.

    Raises:
        ValueError: a context-parallel degree that does not divide the world (or 1 in a world of more than one);
            torchtitan's own CP load balancer (``parallelism.context_parallel_load_balancer``, "headtail" by
            default: set it to None) or its PTRR mask key; the "full_dtensor" SPMD backend (it wraps the rows as
            DTensors sharded evenly, which the plan's rows are not); tensor or
            pipeline parallelism; CUDA graphs (fcp's shapes and plans change every step); a chunked loss whose
            chunks need every rank's rows to divide evenly; validation (its loop shards with torchtitan's CP); a
            model whose attention fcp does not replace.
    """
    world = _world_size() if world_size is None else world_size
    parallelism = config.parallelism
    cp = parallelism.context_parallel_degree
    if cp < 1 or world % cp:
        raise ValueError(f"parallelism.context_parallel_degree={cp} does not divide the world of {world} ranks")
    if cp == 1 and world > 1:
        raise ValueError(f"parallelism.context_parallel_degree=1 in a world of {world} ranks: fcp is the "
                         f"context-parallel path; set it to the ranks each plan spans")
    if parallelism.context_parallel_load_balancer is not None:
        raise ValueError(f"parallelism.context_parallel_load_balancer={parallelism.context_parallel_load_balancer!r}:"
                         f" fcp balances each step itself (its plan); set it to None")
    if parallelism.context_parallel_ptrr_mask_key is not None:
        raise ValueError(f"parallelism.context_parallel_ptrr_mask_key={parallelism.context_parallel_ptrr_mask_key!r}"
                         f" is torchtitan's FlexAttention CP balancer; fcp plans the step itself: set it to None")
    if parallelism.spmd_backend == "full_dtensor":
        raise ValueError("parallelism.spmd_backend='full_dtensor' wraps each rank's rows as a DTensor sharded evenly "
                         "over 'cp', which the plan's rows are not; use 'partial_dtensor' or 'spmd_types'")
    for name in ("tensor_parallel_degree", "pipeline_parallel_degree"):
        if getattr(parallelism, name) != 1:
            raise ValueError(f"parallelism.{name}={getattr(parallelism, name)}: fcp's trainer runs data and "
                             f"context parallelism only")
    if not config.training.disable_cuda_graphs:
        raise ValueError("training.disable_cuda_graphs=False: a CUDA graph replays fixed shapes, and fcp's rows and "
                         "plan change every step; set training.disable_cuda_graphs=True")
    loss = config.loss
    if isinstance(loss, ChunkedLossWrapper.Config) and loss.num_chunks != 1:
        raise ValueError(f"loss.num_chunks={loss.num_chunks}: torchtitan's chunked loss needs each rank's rows to "
                         f"divide into equal chunks, and fcp's plan gives ranks uneven rows; set loss.num_chunks=1 "
                         f"or use CrossEntropyLoss")
    if config.validator.enable:
        raise ValueError("validator.enable=True: torchtitan's validation loop shards its batches with torchtitan's "
                         "own CP, which fcp's attention does not take; set validator.enable=False")
    model = getattr(config.model_spec, "model", None)
    if model is None:
        raise ValueError("model_spec: fcp's trainer needs the model's config to plan for")
    attention_layers(model)


class _DimsWithoutTorchtitanCP:
    """torchtitan's ParallelDims as its "partial_dtensor" parallelize_fn sees them under fcp: ``cp_enabled`` False,
    so that it does not wrap the inner attention in torchtitan's own CP (``apply_cp_to_forward``, which fcp replaces
    and which refuses FcpAttention); everything else, every mesh included (FSDP's "fsdp" over dp_shard x cp), is the
    real ParallelDims'."""

    cp_enabled = False

    def __init__(self, parallel_dims):
        self._parallel_dims = parallel_dims

    def __getattr__(self, name):
        return getattr(self._parallel_dims, name)


def _without_torchtitan_cp(parallelize_fn):
    """A model's parallelize_fn (torchtitan's ``parallelize_llama``) under fcp, on the "partial_dtensor" path: called
    with :class:`_DimsWithoutTorchtitanCP`. (Under "spmd_types" torchtitan declares its CP in the sharding configs,
    which :class:`FcpAttention` drops, and FSDP reads ``cp_enabled`` to shard over "cp": no wrapper there.)"""
    if getattr(parallelize_fn, "_fcp_wrapped", False):
        return parallelize_fn

    def parallelize(model, *, parallel_dims, **kwargs):
        return parallelize_fn(model, parallel_dims=_DimsWithoutTorchtitanCP(parallel_dims), **kwargs)

    parallelize._fcp_wrapped = True
    return parallelize


class FcpTrainer(Trainer):
    """torchtitan's ``Trainer`` with fcp as its context parallelism.

    What changes, and nothing else: every attention layer's inner attention is :class:`FcpAttention`; the
    dataloader's ``collate_fn`` is :class:`TitanPlanningCollate` for this rank of the "cp" mesh dimension
    torchtitan builds (``ParallelDims``), compiling in the loader's workers; ``post_dataloading_process`` calls
    :func:`prepare_fcp_input` where torchtitan calls ``prepare_context_parallel_input``. The loss, the label count,
    FSDP over dp_shard x cp, activation checkpointing, the optimizer and checkpoints are torchtitan's.
    :func:`check_config` refuses, before any device or process group is touched, what cannot hold.
    """

    @dataclass(kw_only=True, slots=True)
    class Config(Trainer.Config):
        fcp: FcpOptions = field(default_factory=FcpOptions)

        @classmethod
        def of(cls, config: Trainer.Config, spmd_backend: str = "partial_dtensor", **fcp_options) -> FcpTrainer.Config:
            """An existing ``Trainer.Config`` (a torchtitan config_registry function's) as an FcpTrainer config:
            every field kept, the CP load balancer off and CUDA graphs off (what fcp needs), the SPMD backend
            "partial_dtensor" (the path tested end to end; under torch 2.13 torchtitan 0.3's default "spmd_types"
            fails in torch's fully_shard on a mesh of more than one rank, with or without fcp), fcp's options given
            (block_size, compile_options)."""
            values = {f.name: getattr(config, f.name) for f in dataclasses.fields(Trainer.Config) if f.init}
            values["parallelism"] = dataclasses.replace(config.parallelism, context_parallel_load_balancer=None,
                                                        spmd_backend=spmd_backend)
            values["training"] = dataclasses.replace(config.training, disable_cuda_graphs=True)
            return cls(**values, fcp=FcpOptions(**fcp_options))

    def __init__(self, config: Config):
        check_config(config)
        use_fcp_attention(config.model_spec.model)
        if config.parallelism.spmd_backend == "partial_dtensor":
            config.model_spec = dataclasses.replace(
                config.model_spec, parallelize_fn=_without_torchtitan_cp(config.model_spec.parallelize_fn))
        super().__init__(config)
        self.dataloader.collate_fn = self.planning_collate()

    def planning_collate(self) -> TitanPlanningCollate:
        """The dataloader's collate_fn: this rank of the mesh's "cp" dimension, the model's attention shape, the
        dtype attention computes in (``compile_options["dtype"]``, else training.mixed_precision_param: torchtitan's
        FSDP, applied to every layer whatever the degree, casts the parameters to it) and fcp's options."""
        mesh = self.parallel_dims.get_mesh(CP_DIM) if self.parallel_dims.cp_enabled else None
        cp_rank, cp_size = (mesh.get_local_rank(), mesh.size()) if mesh is not None else (0, 1)
        options = {"block_size": self.config.fcp.block_size, **self.config.fcp.compile_options}
        dtype = options.pop("dtype", self.config.training.mixed_precision_param)
        return TitanPlanningCollate.for_model(self.model_config, cp_rank, cp_size, dtype=dtype, **options)

    @property
    def fcp_group(self):
        """The context-parallel process group fcp runs over: the "cp" dimension of torchtitan's mesh (None in a
        world of one)."""
        if not self.parallel_dims.cp_enabled:
            return None
        return self.parallel_dims.get_mesh(CP_DIM).get_group()

    def post_dataloading_process(self, input_dict: dict[str, torch.Tensor], labels: torch.Tensor):
        """torchtitan's hook, with fcp's rows in place of torchtitan's CP sharding: (inputs [1, T_rank],
        labels [1, T_rank], extra_kwargs with positions and attention_masks)."""
        inputs = input_dict["input"]
        extra_kwargs: dict[str, Any] = {name: value for name, value in input_dict.items() if name != "input"}
        inputs, labels, extra_kwargs = prepare_fcp_input(inputs, labels, extra_kwargs, self.fcp_group)
        self.ntokens_seen += labels.numel()
        if self.config.parallelism.spmd_backend == "spmd_types":
            from torchtitan.distributed.spmd_types import annotate_input_spmd_types

            inputs, labels, extra_kwargs = annotate_input_spmd_types(self.parallel_dims, inputs, labels,
                                                                     extra_kwargs)
        return inputs, labels, extra_kwargs


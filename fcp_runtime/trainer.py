"""fcp under the Hugging Face Trainer: :class:`FcpTrainer`, a ``transformers.Trainer`` whose model runs with
``attn_implementation="fcp"`` on a ("dp", "cp") device mesh.

Only this module (and :mod:`fcp_runtime.sft`, for TRL) imports a trainer: ``import fcp_runtime`` and
``import fcp_runtime.hf`` never do. A script changes in three places::

    import fcp_runtime.hf                                    # registers attn_implementation="fcp"
    from fcp_runtime.trainer import FcpTrainer

    model = AutoModelForCausalLM.from_config(config, attn_implementation="fcp")
    trainer = FcpTrainer(model=model, args=TrainingArguments(..., ddp_backend="gloo"),   # NCCL on GPUs
                         train_dataset=documents, cp_size=2, compile_options={"block_size": 4096})
    trainer.train()                                          # torchrun --nproc-per-node 4 train.py: DP 2 x CP 2

What it changes in the Trainer, and why:

- **Data.** Each data-parallel replica (the mesh's "dp" coordinate) gets its share of the documents, and every
  context-parallel rank of a replica the same documents: the loaders are sharded over the replicas, not over every
  rank. ``per_device_train_batch_size`` counts documents (or packed examples) per replica and micro-step.
- **Collation.** :class:`FcpDataCollator` splits each example into its documents (TRL's packed examples by their
  ``seq_lengths``, or by ``position_ids`` restarting at 0), compiles the step's plan in the loader's worker
  (:class:`~fcp_runtime.hf.HFPlanningCollate`), and returns this rank's rows with labels already shifted inside each
  document (``shift_labels``).
- **Loss.** Nothing new: the Trainer's own rule is fcp's. It counts ``shift_labels`` over this rank's rows of every
  accumulation step and sums the count over every rank (``average_tokens_across_devices``; the trainer counts them
  itself, :meth:`FcpTrainerMixin._get_num_items_in_batch`), so each rank's loss is
  the sum of its tokens' losses over the whole step's label count; it multiplies the loss by the world size, and DDP
  averages the gradients over the world: their sum. The logged loss (each rank's losses averaged over the ranks) is
  the step's loss, as one process computes it (to fp32: the Trainer's running total is fp32).
  :meth:`FcpTrainer.compute_loss` only adds the model call's ``fcp_group``.

Refused, each in one line naming the option (``ValueError``): a context-parallel size that does not divide the
world, a mesh without a "cp" dimension, a model not built with ``attn_implementation="fcp"``, another data collator
(padding, DataCollatorWithFlattening, ...), a padding mask in an example, position ids or ``seq_lengths`` that do not
cut an example into whole documents, ``bf16``/``fp16`` autocast over weights of another dtype, accelerate's own
context/sequence/tensor parallelism (``parallelism_config``), DeepSpeed and FSDP,
``average_tokens_across_devices=False``, a model whose loss takes no ``num_items_in_batch``,
``label_smoothing_factor``, ``compute_loss_func``, ``compute_metrics`` and ``preprocess_logits_for_metrics`` (they
would get labels already shifted, or rows in the plan's order), ``accelerator_config.dispatch_batches``, several
GPUs in one process (``nn.DataParallel``), and an evaluation set that is not a whole number of steps.
"""

from __future__ import annotations

import contextlib
from collections.abc import Mapping

import torch
import torch.distributed as dist
from transformers import Trainer

from fcp_runtime.hf import ATTENTION_NAME, CP_DIM, IGNORE_INDEX, HFPlanningCollate, refuse_padding

DP_DIM = "dp"
# Example fields that say where its documents start: TRL's packed examples carry each document's length.
_SEQ_LENGTHS = "seq_lengths"


def example_documents(example: Mapping, index: int = 0) -> list[dict]:
    """The documents of one Trainer example, as :class:`~fcp_runtime.hf.HFPlanningCollate` takes them: its
    `input_ids` (and `labels`, aligned with them as HF takes them) cut at each document's start, read from
    `seq_lengths` (TRL's packed examples), else from `position_ids` restarting at 0; an example with neither is one
    document.

    Raises:
        ValueError: no `input_ids`; ids or labels that are not one 1-D row of the same length; an `attention_mask`
            with a 0 (padding: fcp packs documents unpadded); `seq_lengths` that do not add up to the example, or
            position ids that do not count 0, 1, 2, ... inside each document.
    """
    if not isinstance(example, Mapping) or "input_ids" not in example:
        raise ValueError(f"example {index} must be a mapping with 'input_ids' (and optional 'labels', "
                         f"'seq_lengths' or 'position_ids'); got {type(example).__name__}")
    ids = torch.as_tensor(example["input_ids"])
    labels = torch.as_tensor(example["labels"]) if example.get("labels") is not None else ids
    if ids.dim() != 1 or labels.shape != ids.shape or ids.numel() == 0:
        raise ValueError(f"example {index}: input_ids must be one non-empty row and labels its shape; got "
                         f"{tuple(ids.shape)} and {tuple(labels.shape)} (a collated batch is not an example)")
    refuse_padding(example.get("attention_mask"), f"example {index}")
    lengths = _document_lengths(example, index, ids.numel())
    return [{"input_ids": piece, "labels": piece_labels}
            for piece, piece_labels in zip(ids.split(lengths), labels.split(lengths))]


def _document_lengths(example: Mapping, index: int, total: int) -> list[int]:
    if example.get(_SEQ_LENGTHS) is not None:
        lengths = [int(n) for n in torch.as_tensor(example[_SEQ_LENGTHS]).flatten().tolist()]
        if sum(lengths) != total or min(lengths, default=0) < 1:
            raise ValueError(f"example {index}: seq_lengths {lengths} must be positive and add up to its {total} "
                             f"tokens")
        return lengths
    if example.get("position_ids") is None:
        return [total]
    positions = torch.as_tensor(example["position_ids"]).flatten()
    if positions.numel() != total:
        raise ValueError(f"example {index}: {positions.numel()} position_ids for {total} tokens")
    starts = torch.nonzero(positions == 0).flatten()
    # Inside each document a position is the one before it plus one: packing without position ids restarting at 0
    # in each document (positions that run on across documents) leaves fcp no document to keep apart.
    steps_ok = bool((positions[1:] == positions[:-1] + 1)[(positions[1:] != 0)].all())
    if starts.numel() == 0 or int(starts[0]) != 0 or not steps_ok:
        raise ValueError(f"example {index}: position_ids must restart at 0 at each document and count up by one "
                         f"inside it (packed documents need their own positions); got {positions[:8].tolist()}...")
    bounds = starts.tolist() + [total]
    return [b - a for a, b in zip(bounds[:-1], bounds[1:])]


class FcpDataCollator:
    """The Trainer's data collator under fcp: a micro-batch of examples -> this rank's rows of their documents, in
    the plan's layout, with the step's plan (compiled here, in the loader's worker).

    The batch holds `input_ids`, `position_ids`, `labels` and `shift_labels` ([1, T], labels shifted inside each
    document), `fcp_plan` and `use_cache`; not `num_items_in_batch`: the Trainer counts the labels itself, over every
    rank and accumulation step.
    """

    def __init__(self, collate: HFPlanningCollate):
        self.collate = collate

    def __call__(self, examples) -> dict:
        documents = [document for index, example in enumerate(examples)
                     for document in example_documents(example, index)]
        batch = self.collate(documents)
        del batch["num_items_in_batch"]
        return batch


def build_mesh(world_size: int, device_type: str, cp_size: int | None = None, mesh=None):
    """The ("dp", "cp") DeviceMesh the trainer runs on: `mesh` as given (checked), else world // cp_size replicas
    of `cp_size` ranks (default: every rank in one context-parallel group). Returns (mesh, dp rank, dp size).

    Raises:
        ValueError: a cp_size that does not divide the world; a mesh without a "cp" dimension, with another
            dimension than "dp" and "cp", of another size than the world, or whose "cp" size is not cp_size.
    """
    if mesh is not None:
        names = tuple(mesh.mesh_dim_names or ())
        if CP_DIM not in names or set(names) - {DP_DIM, CP_DIM}:
            raise ValueError(f"mesh: dimensions {names}; fcp's trainer takes ('dp', 'cp') or ('cp',)")
        if mesh.size() != world_size:
            raise ValueError(f"mesh: {mesh.size()} ranks, the world has {world_size}")
        if cp_size is not None and mesh.size(names.index(CP_DIM)) != cp_size:
            raise ValueError(f"cp_size={cp_size} but the mesh's 'cp' dimension has {mesh.size(names.index(CP_DIM))}")
        if DP_DIM not in names:
            return mesh, 0, 1
        return mesh, mesh.get_local_rank(DP_DIM), mesh.size(names.index(DP_DIM))
    cp = world_size if cp_size is None else cp_size
    if not isinstance(cp, int) or cp < 1 or world_size % cp:
        raise ValueError(f"cp_size={cp_size!r} does not divide the world of {world_size} ranks (the data-parallel "
                         f"degree is world_size / cp_size)")
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh(device_type, (world_size // cp, cp), mesh_dim_names=(DP_DIM, CP_DIM))
    return mesh, mesh.get_local_rank(DP_DIM), world_size // cp


class FcpTrainerMixin:
    """What fcp changes in a ``transformers.Trainer`` (and in subclasses such as TRL's SFTTrainer): put it before
    the trainer class in the bases. Keyword arguments beside the trainer's own:

    Args:
        cp_size: ranks in each context-parallel group (default: the world; the rest is data parallel).
        mesh: a DeviceMesh with a "cp" dimension (and optionally "dp") instead of cp_size.
        compile_options: forwarded to :meth:`~fcp_runtime.hf.HFPlanningCollate.for_model` (block_size, layout,
            dtype, model, profile, ...); the dtype is the model's unless given (under bf16 autocast HF's attention
            still gets fp32 queries: RoPE's fp32 cos and sin promote them; the runtime refuses a plan of another
            dtype in one line).
    """

    def __init__(self, *args, cp_size: int | None = None, mesh=None, compile_options: dict | None = None, **kwargs):
        collator = kwargs.get("data_collator", args[2] if len(args) > 2 else None)
        if collator is not None and not isinstance(collator, FcpDataCollator):
            raise ValueError(f"data_collator: fcp collates the documents itself (FcpDataCollator); got "
                             f"{type(collator).__name__} (drop it: padding and flattening collators do not apply)")
        super().__init__(*args, **kwargs)
        if not dist.is_initialized():
            raise ValueError("FcpTrainer runs each rank under torch.distributed: launch with torchrun "
                             "(ddp_backend='gloo' on CPU, NCCL on GPUs)")
        self._refuse_options()
        self.fcp_mesh, self.fcp_dp_rank, self.fcp_dp_size = build_mesh(
            dist.get_world_size(), self.args.device.type, cp_size, mesh)
        model = self.accelerator.unwrap_model(self.model)
        self.data_collator = collator or FcpDataCollator(
            HFPlanningCollate.for_model(model, self.fcp_mesh, **(compile_options or {})))

    # --- what cannot hold ----------------------------------------------------------------------------------------

    def _refuse_options(self) -> None:
        """One line for each option under which the loss rule or the plan cannot hold."""
        args = self.args
        model = self.accelerator.unwrap_model(self.model)
        implementation = getattr(getattr(model, "config", None), "_attn_implementation", None)
        if implementation != ATTENTION_NAME:
            raise ValueError(f"the model's attn_implementation is {implementation!r}; build it with "
                             f"attn_implementation={ATTENTION_NAME!r} (import fcp_runtime.hf registers it)")
        autocast = torch.bfloat16 if args.bf16 else torch.float16 if args.fp16 else None
        weights = next(model.parameters()).dtype
        if autocast is not None and weights != autocast:
            raise ValueError(f"{'bf16' if args.bf16 else 'fp16'}=True autocasts a {weights} model: HF's attention then "
                             f"gets q and k in {weights} (RoPE's cos and sin promote them) and v in {autocast}, which "
                             f"fcp's attention does not cast; load the model in {autocast}, or train without autocast")
        parallelism = getattr(self.accelerator, "parallelism_config", None) or getattr(args, "parallelism_config",
                                                                                        None)
        for name in ("cp_size", "sp_size", "tp_size"):
            if parallelism is not None and (getattr(parallelism, name, 1) or 1) > 1:
                raise ValueError(f"parallelism_config.{name}={getattr(parallelism, name)}: accelerate's own "
                                 f"parallelism over the sequence or the weights conflicts with fcp's (give cp_size "
                                 f"to the trainer instead)")
        if args.deepspeed or self.is_deepspeed_enabled:
            raise ValueError("deepspeed: fcp's trainer runs under DDP (its sequence parallelism and loss scaling "
                             "are DeepSpeed's own); drop deepspeed")
        if args.fsdp or self.is_fsdp_enabled:
            raise ValueError(f"fsdp={args.fsdp!r}: fcp's trainer is built and tested under DDP only; drop fsdp")
        if getattr(args, "use_liger_kernel", False):  # (transformers refuses it first where Liger is not installed)
            raise ValueError("use_liger_kernel=True: Liger's fused loss shifts labels that fcp has already "
                             "shifted inside each document; drop it")
        if getattr(args, "neftune_noise_alpha", None) is not None:
            raise ValueError(f"neftune_noise_alpha={args.neftune_noise_alpha}: NEFTune scales its noise by the "
                             f"call's sequence length, which under fcp is each rank's own rows (noise about "
                             f"sqrt(cp) times one process's); train without it")
        if args.n_gpu > 1:
            raise ValueError(f"{args.n_gpu} GPUs in one process (nn.DataParallel): run one process a GPU "
                             f"(torchrun --nproc-per-node)")
        if not args.average_tokens_across_devices:
            raise ValueError("average_tokens_across_devices=False: each rank would divide its loss by its own "
                             "label count; fcp's loss rule needs the whole step's (set it True)")
        if not self.model_accepts_loss_kwargs:
            raise ValueError(f"{type(model).__name__}'s forward takes no num_items_in_batch (loss kwargs): its loss "
                             f"would be each rank's mean, not the step's")
        if args.label_smoothing_factor:
            raise ValueError(f"label_smoothing_factor={args.label_smoothing_factor}: the label smoother shifts "
                             f"labels that fcp has already shifted inside each document")
        for name in ("compute_loss_func", "compute_metrics", "preprocess_logits_for_metrics"):
            if getattr(self, name, None) is not None:
                raise ValueError(f"{name}: under fcp each rank holds its rows in the plan's order with labels "
                                 f"already shifted inside each document; compute the loss in the model "
                                 f"(model.loss_function) and drop {name}")
        if getattr(args.accelerator_config, "dispatch_batches", None):
            raise ValueError("accelerator_config.dispatch_batches=True: rank 0 would collate for every rank; each "
                             "rank compiles its own plan from its replica's examples")

    # --- data: every context-parallel rank of a replica gets the replica's examples ----------------------------

    def get_train_dataloader(self):
        with self._loaders_per_replica():
            return super().get_train_dataloader()

    def get_eval_dataloader(self, eval_dataset=None):
        dataset = self.eval_dataset[eval_dataset] if isinstance(eval_dataset, str) else \
            eval_dataset if eval_dataset is not None else self.eval_dataset
        step = self.fcp_dp_size * self.args.per_device_eval_batch_size
        if hasattr(dataset, "__len__") and len(dataset) % step:
            raise ValueError(f"eval_dataset: {len(dataset)} examples are not whole evaluation steps of {step} "
                             f"(data-parallel replicas x per_device_eval_batch_size); the last step would be padded "
                             f"with repeated examples")
        with self._loaders_per_replica():
            return super().get_eval_dataloader(eval_dataset)

    def get_test_dataloader(self, test_dataset):
        with self._loaders_per_replica():
            return super().get_test_dataloader(test_dataset)

    @contextlib.contextmanager
    def _loaders_per_replica(self):
        """The Trainer builds its DataLoader (sampler, workers, removed columns) and hands it to
        ``accelerator.prepare``, which shards it over every process; while this is open it is sharded over the
        data-parallel replicas instead."""
        accelerator = self.accelerator
        accelerator.prepare = self._prepare_replica_loader
        try:
            yield
        finally:
            del accelerator.prepare

    def _prepare_replica_loader(self, loader):
        from accelerate.data_loader import prepare_data_loader

        accelerator = self.accelerator
        prepared = prepare_data_loader(
            loader, accelerator.device, num_processes=self.fcp_dp_size, process_index=self.fcp_dp_rank,
            split_batches=accelerator.split_batches, put_on_device=accelerator.device_placement,
            rng_types=accelerator.rng_types.copy(), dispatch_batches=False, even_batches=accelerator.even_batches,
            use_seedable_sampler=accelerator.use_seedable_sampler, data_seed=accelerator.dataloader_config.data_seed,
            non_blocking=accelerator.non_blocking, use_stateful_dataloader=accelerator.use_stateful_dataloader)
        accelerator._dataloaders.append(prepared)  # as Accelerator.prepare_data_loader keeps it (gradient state)
        return prepared

    def _set_signature_columns_if_needed(self):
        super()._set_signature_columns_if_needed()
        # Packed examples keep the fields that say where their documents start.
        self._signature_columns = list(self._signature_columns) + [
            name for name in (_SEQ_LENGTHS, "position_ids") if name not in self._signature_columns]

    def get_total_train_batch_size(self, args) -> int:
        """Examples per optimizer step: per replica and micro-step, times the accumulation steps and the replicas."""
        return self._train_batch_size * args.gradient_accumulation_steps * self.fcp_dp_size

    # --- the loss rule's denominator ----------------------------------------------------------------------------

    def _get_num_items_in_batch(self, batch_samples, device):
        """The step's label count: ``shift_labels`` over this rank's rows of every accumulation step, summed over
        every rank (each label lies on exactly one rank of one replica). The Trainer's own count agrees where it
        reads ``shift_labels`` (transformers 5.x recent); this one does not depend on it."""
        if not batch_samples:
            return None
        count = sum(batch["shift_labels"].ne(IGNORE_INDEX).sum() for batch in batch_samples).to(device)
        if self.args.world_size > 1:
            count = self.accelerator.gather(count).sum()
        return count

    # --- the model call ------------------------------------------------------------------------------------------

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        """The trainer's own loss, with the step's context-parallel group in the model call (`fcp_plan` comes in
        the batch)."""
        return super().compute_loss(model, {**inputs, "fcp_group": self.fcp_mesh}, return_outputs=return_outputs,
                                    num_items_in_batch=num_items_in_batch)


class FcpTrainer(FcpTrainerMixin, Trainer):
    """``transformers.Trainer`` under fcp (see the module's docstring): ``FcpTrainer(model=..., args=...,
    train_dataset=..., cp_size=..., compile_options={...})``."""

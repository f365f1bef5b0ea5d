"""fcp as a Hugging Face transformers attention backend: ``attn_implementation="fcp"``.

Importing this module registers ``"fcp"`` with transformers' ``AttentionInterface`` (transformers 5.x, the ``hf``
extra). A step then runs as::

    collate = HFPlanningCollate.for_model(model.config, mesh)      # in the DataLoader: plans in its workers
    batch = next(loader)                                            # this rank's rows, [1, T], and its plan
    loss = model(**batch, fcp_group=cp_group(mesh)).loss            # HF's own loss over the batch's label count

The step's plan (``fcp_plan``) and context-parallel group (``fcp_group``: a process group or a DeviceMesh with a
"cp" dimension) reach the attention function through the model call's keyword arguments, as transformers passes
attention kwargs; nothing is kept between calls. Attention reads the rank's plan-layout rows in place: HF's
[1, heads, T, dim] is viewed as [T, heads, dim], and the output [T, heads, dim] is returned as [1, T, heads, dim],
with no copy.

What overlaps: HF's attention modules project Q, K and V and rotate Q and K before they call the attention function,
so no point remains where K,V pulls could leave before Q is projected: this backend posts no K,V prefetch, and
:meth:`HFPlanningCollate.for_model` compiles plans with ``kv_prefetch=False`` so that their simulated time does not
count an overlap that does not happen. Each pass's stages still overlap their messages with their tiles.

The loss rule (one rule, for CP alone and for DP x CP): each rank's loss is the sum of its tokens' losses over the
label count of the whole step (every data-parallel replica's documents), and the gradients are summed over every
rank. :class:`HFPlanningCollate` gives ``num_items_in_batch`` for its replica's documents;
:func:`step_label_count` sums it over the data-parallel ranks. With DDP over all the mesh's ranks (which averages
over them), call backward on ``loss * world_size``; without DDP, :func:`sum_gradients` over the world.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch
import torch.distributed as dist

from fcp_compiler.format.inputs import AttentionShape
from fcp_runtime.attention import fcp_attn_func
from fcp_runtime.loader import PlanningCollate
from fcp_runtime.mesh import CP_DIM, cp_group  # noqa: F401  (cp_group: this module's API too)
from fcp_runtime.rope import RopeLimit, rope_length_limit

ATTENTION_NAME = "fcp"
IGNORE_INDEX = -100  # HF's cross-entropy ignore_index
_DTYPES = {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32", torch.float64: "fp64"}


def register() -> str:
    """Register fcp with transformers' attention interface and its mask interface (idempotent; done on import);
    returns its name.

    The mask function matters: transformers builds no mask for an attention implementation its mask interface does
    not know, and then drops a 2-D ``attention_mask`` (padding) before any attention function sees it. Registered,
    the model's mask construction reaches :func:`fcp_attention_mask`, which refuses such a mask. The causal-LM loss
    is wrapped (:func:`_checked_causal_loss`) so that a call with the plan but without the collate's shifted labels
    or label count is refused, not trained on.
    """
    from transformers import AttentionInterface
    from transformers.loss.loss_utils import LOSS_MAPPING
    from transformers.masking_utils import AttentionMaskInterface

    AttentionInterface.register(ATTENTION_NAME, fcp_attention_forward)
    AttentionMaskInterface.register(ATTENTION_NAME, fcp_attention_mask)
    if not getattr(LOSS_MAPPING[_CAUSAL_LOSS], "checks_fcp_batch", False):
        LOSS_MAPPING[_CAUSAL_LOSS] = _checked_causal_loss(LOSS_MAPPING[_CAUSAL_LOSS])
    return ATTENTION_NAME


_CAUSAL_LOSS = "ForCausalLM"  # transformers' loss type of its causal LMs (LOSS_MAPPING)


def _checked_causal_loss(loss_function):
    """transformers' causal-LM loss, refusing a call under fcp (an `fcp_plan` among its keyword arguments, as the
    model passes them on) without the collate's `shift_labels` or `num_items_in_batch`: without the first it shifts
    the collate's labels, already shifted inside each document, again (every token trained on the one two ahead);
    without the second each rank averages over its own labels. Any other call is the loss as it was."""

    def checked(*args, **kwargs):
        if kwargs.get("fcp_plan") is not None:
            missing = [name for name in ("shift_labels", "num_items_in_batch") if kwargs.get(name) is None]
            if missing:
                harm = {"shift_labels": "shift the shifted labels again",
                        "num_items_in_batch": "average over this rank's labels alone"}
                raise ValueError(f"HF's loss under fcp needs the collate's {' and '.join(missing)}; without "
                                 f"{'them' if len(missing) > 1 else 'it'} it would "
                                 f"{' and '.join(harm[name] for name in missing)}: call model(**batch, ...) with the "
                                 f"collate's whole batch")
        return loss_function(*args, **kwargs)

    checked.checks_fcp_batch = True
    return checked


def fcp_attention_mask(*, attention_mask=None, **kwargs):
    """transformers' mask-interface contract for "fcp": no mask is built (the plan holds the documents and their
    masks), so it returns None; a 2-D mask given to the model (padding, or any other) is refused.

    Raises:
        ValueError: an attention mask was given, naming its shape.
    """
    if attention_mask is not None:
        raise ValueError(f"fcp attention takes its documents from the plan, not from an attention mask; the model got "
                         f"attention_mask of shape {tuple(attention_mask.shape)}: call it without attention_mask "
                         f"(HFPlanningCollate's batches have none: documents are packed, never padded)")
    return None


def fcp_attention_forward(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                          attention_mask, scaling: float | None = None, dropout: float = 0.0, **kwargs):
    """transformers' attention-function contract, over the step's plan.

    Args:
        module: the attention module (its `is_causal` and `sliding_window` are the layer's mask).
        query: [1, q_heads, T, head_dim]; key, value: [1, kv_heads, T, head_dim] (GQA as HF gives it): this rank's
            plan-layout rows.
        attention_mask: must be None: the plan holds the documents (no attention mask is built for "fcp").
        scaling: the softmax scale. dropout: must be 0.
        kwargs: `fcp_plan` (this rank's RankPlan, from the collate) and `fcp_group` (the context-parallel group or
            a DeviceMesh with a "cp" dimension; default the world); `position_ids`, `shift_labels` (the batch's,
            which the model passes on: checked against the plan's with the positions), `sliding_window`, `softcap`
            and `s_aux` as models pass them.
    Returns:
        (out [1, T, q_heads, head_dim], None).
    Raises:
        ValueError: no plan; softcap, attention sinks, dropout or an attention mask; a batch dimension other than
            1; a plan compiled for another dtype; a layer mask the plan's documents do not have; on every rank,
            position ids that are not the plan's rows' (a plan from another step: BatchMismatchError).
    """
    plan = kwargs.get("fcp_plan")
    if plan is None:
        raise ValueError("attn_implementation='fcp' needs the step's plan: call the model with fcp_plan=... (the "
                         "HFPlanningCollate batch holds it) and fcp_group=...")
    _refuse_unsupported(module, attention_mask, dropout, kwargs)
    if query.shape[0] != 1:
        raise ValueError(f"fcp attention takes one packed row of this rank's tokens, batch size 1; got batch size "
                         f"{query.shape[0]} (input_ids [1, T] from HFPlanningCollate)")
    if torch.is_autocast_enabled(query.device.type):  # as sdpa under autocast: Q, K, V in the autocast dtype
        dtype = torch.get_autocast_dtype(query.device.type)  # (RoPE's float32 cos and sin promote Q and K alone)
        query, key, value = (x.to(dtype) for x in (query, key, value))
    if _DTYPES.get(query.dtype) != plan.dtype:
        raise ValueError(f"the plan was compiled for {plan.dtype} attention but the model's query is {query.dtype}: "
                         f"build the collate with HFPlanningCollate.for_model(model) after casting the model, or "
                         f"for_model(..., dtype={query.dtype}) (under autocast)")
    window = kwargs.get("sliding_window", getattr(module, "sliding_window", None))
    mask = (bool(getattr(module, "is_causal", True)), window)
    q, k, v = (x[0].transpose(0, 1) for x in (query, key, value))  # views [T, heads, dim]
    out = fcp_attn_func(q, k, v, plan, group=cp_group(kwargs.get("fcp_group")), softmax_scale=scaling, mask=mask,
                        position_ids=kwargs.get("position_ids"), labels=kwargs.get("shift_labels"))
    return out.unsqueeze(0), None


def _refuse_unsupported(module, attention_mask, dropout: float, kwargs: dict) -> None:
    """One line for each attention feature the plan cannot replay."""
    if kwargs.get("softcap") is not None:
        raise ValueError(f"fcp attention has no logit softcap (the model passes softcap={kwargs['softcap']!r}); "
                         f"use another attn_implementation for this model")
    if kwargs.get("s_aux") is not None or getattr(module, "sinks", None) is not None:
        raise ValueError("fcp attention has no attention sinks (the model's attention has `sinks`); use another "
                         "attn_implementation for this model")
    if dropout:
        raise ValueError(f"fcp attention has no attention dropout (got dropout={dropout!r}); set the config's "
                         f"attention_dropout to 0")
    if attention_mask is not None:
        raise ValueError("fcp attention takes its documents from the plan, not from an attention mask; call the model "
                         "without attention_mask (position_ids restart at 0 in each document)")


def attention_shape(config, dtype: torch.dtype | str | None = None) -> AttentionShape:
    """The attention shape a plan is compiled for, from a model's transformers config: query and KV heads, head
    size, and the dtype of Q, K, V (`dtype`, a torch dtype or its name, else the config's).

    Raises:
        ValueError: a dtype the plan format has no name for.
    """
    config = config.get_text_config() if hasattr(config, "get_text_config") else config
    q_heads = int(config.num_attention_heads)
    kv_heads = int(getattr(config, "num_key_value_heads", None) or q_heads)
    head_dim = int(getattr(config, "head_dim", None) or config.hidden_size // q_heads)
    dtype = dtype or getattr(config, "dtype", None) or torch.float32
    dtype = getattr(torch, dtype, dtype) if isinstance(dtype, str) else dtype
    if dtype not in _DTYPES:
        raise ValueError(f"dtype {dtype} has no plan dtype; valid: {', '.join(map(str, _DTYPES))}")
    return AttentionShape(q_heads=q_heads, kv_heads=kv_heads, head_dim=head_dim, dtype=_DTYPES[dtype])


# transformers' layer types (config.layer_types) that fcp replays.
_LAYER_TYPES = ("full_attention", "sliding_attention")
# Model families whose attention passes the config's sliding_window to every layer, whatever layer_types says (their
# modeling code reads getattr(config, "sliding_window", None) in each attention module): Mistral's window is on
# every layer, and a Mistral config given layer_types still slides on all of them.
_WINDOW_ON_EVERY_LAYER = frozenset({"mistral", "mixtral", "ministral3", "phi3", "starcoder2", "olmoe"})


def _config_window(config) -> int | None:
    """The config's sliding window, None where the model has none or turned it off (Qwen2's use_sliding_window)."""
    window = getattr(config, "sliding_window", None)
    if getattr(config, "use_sliding_window", True) is False or not window:
        return None
    return int(window)


def layer_masks(config) -> list[str]:
    """Each layer's attention mask as transformers' model family means it, spelled as --layer-masks takes it
    ("causal" or "sliding_window:W"):

    - families that give every layer the config's window (Mistral, Mixtral, Phi-3, Starcoder2, ...): every layer
      slides when `sliding_window` is set, whatever `layer_types` says;
    - otherwise `layer_types` where the config has them (Qwen2 derives them from `use_sliding_window` and
      `max_window_layers`; Gemma 2/3 and gpt-oss alternate): `sliding_attention` slides over the config's window
      (causal when the config has none, as the layer then gets no window), `full_attention` is causal;
    - a config with neither: every layer slides when `sliding_window` is set, else causal.

    Raises:
        ValueError: a layer type fcp has no mask for, named.
    """
    config = config.get_text_config() if hasattr(config, "get_text_config") else config
    window = _config_window(config)
    sliding = "causal" if window is None else f"sliding_window:{window}"
    types = list(getattr(config, "layer_types", None) or [])
    if getattr(config, "model_type", None) in _WINDOW_ON_EVERY_LAYER or not types:
        return [sliding] * int(config.num_hidden_layers)
    unknown = sorted(set(types) - set(_LAYER_TYPES))
    if unknown:
        raise ValueError(f"the model's layer_types has {unknown[0]!r}; fcp replays {', '.join(_LAYER_TYPES)} layers")
    return [sliding if layer_type == "sliding_attention" else "causal" for layer_type in types]


def layer_kinds(config) -> tuple[dict[str, str], dict[str, int]] | None:
    """A model's layer kinds where its layers differ in mask: each of its `layer_types` with the mask it gives
    (:func:`layer_masks`), and how many layers each has. None where every layer has one mask (a plan of one kind,
    compiled with that mask: :func:`model_mask`).

    Raises:
        ValueError: a layer type fcp has no mask for (named).
    """
    masks = layer_masks(config)
    if len(set(masks)) == 1:
        return None
    config = config.get_text_config() if hasattr(config, "get_text_config") else config
    types = list(config.layer_types)
    kinds = dict.fromkeys(types)  # in the order the layers first name them
    return ({name: masks[types.index(name)] for name in kinds}, {name: types.count(name) for name in kinds})


def model_mask(config) -> str | None:
    """The one mask of a model whose layers all have the same one, None where they differ (:func:`layer_kinds`)."""
    masks = set(layer_masks(config))
    return masks.pop() if len(masks) == 1 else None


_DOCUMENT_FIELDS = ("input_ids", "labels", "attention_mask", "mask")


def refuse_padding(attention_mask, what: str) -> None:
    """Refuse an attention mask with a 0 (`what`: the document or example it came with, as the message names it):
    fcp packs documents unpadded, and padding would be attended to and trained on.

    Raises:
        ValueError: naming how many positions are padded.
    """
    if attention_mask is not None and not bool(torch.as_tensor(attention_mask).bool().all()):
        zeros = int((torch.as_tensor(attention_mask) == 0).sum())
        raise ValueError(f"{what} has an attention_mask with {zeros} padded positions; fcp packs documents without "
                         f"padding: give them unpadded (attention_mask all ones, or none)")


def _document(item, doc_idx: int) -> dict:
    """One document as the fields the collate takes at its rows: input_ids and labels shifted inside it.

    Raises:
        ValueError: no input_ids; a field the collate would otherwise drop (position_ids or seq_lengths of a packed
            row, say); an attention_mask with a 0 (padding would be attended to and trained on).
    """
    item = item if isinstance(item, Mapping) else {"input_ids": item}
    if "input_ids" not in item:
        raise ValueError(f"document {doc_idx} has fields {sorted(item)}; it needs 'input_ids' (and may give "
                         f"'labels', aligned with input_ids as HF takes them)")
    if unknown := sorted(str(name) for name in item if name not in _DOCUMENT_FIELDS):
        raise ValueError(f"document {doc_idx} has field {unknown[0]!r}, which the collate does not take: a document "
                         f"gives {', '.join(_DOCUMENT_FIELDS)} (a packed row of several documents: cut it with "
                         f"fcp_runtime.trainer.example_documents, by its seq_lengths or position_ids)")
    refuse_padding(item.get("attention_mask"), f"document {doc_idx}")
    ids = torch.as_tensor(item["input_ids"])
    labels = torch.as_tensor(item.get("labels", ids))
    if ids.dim() != 1 or labels.shape != ids.shape or ids.numel() == 0:
        raise ValueError(f"document {doc_idx}: input_ids must be a non-empty 1-D tensor and labels its shape; got "
                         f"{tuple(ids.shape)} and {tuple(labels.shape)}")
    # Token t predicts token t + 1 of its own document; the last token predicts nothing. Shifted here, before the
    # plan permutes the rows, no label crosses a document or a rank.
    shifted = torch.cat([labels[1:], labels.new_full((1,), IGNORE_INDEX)]).to(torch.int64)
    document = {"input_ids": ids.to(torch.int64), "shift_labels": shifted}
    if "mask" in item:
        document["mask"] = item["mask"]
    return document


class HFPlanningCollate:
    """A DataLoader collate_fn for a Hugging Face causal LM under fcp: compiles the step's plan (in the loader's
    worker) and returns exactly the model call's keyword arguments for this rank.

    Args:
        rank, world_size: this rank in the context-parallel group, and the group's size.
        layout: "plan" (default: dispatch once, the model runs on this rank's plan-layout rows and attention
            moves only blocks) or "user" (the model runs on the rank's contiguous chunk of the concatenated batch,
            and attention reshuffles Q, K, V in and the output back; eager only, not under torch.compile).
        compile_options: forwarded to the compiler (block_size, coalesce, shape, model, profile, ...);
            :meth:`for_model` fills the attention shape, dtype and masks from the model.

    Each document is a 1-D tensor of token ids, or a dict with `input_ids`, optional `labels` (aligned with the ids,
    as HF takes them; default the ids), an optional `mask` and an optional `attention_mask` (all ones: a padded
    document is refused); any other field is refused, not dropped. A call returns `input_ids`, `position_ids`, `labels`
    and `shift_labels` as [1, T] in the layout (labels already shifted inside each document, so HF's loss
    does not shift them again), `num_items_in_batch` (0-d int64: the labels of every document of the batch, not
    only this rank's), `fcp_plan` (this rank's plan) and `use_cache` False (training keeps no KV cache).
    """

    def __init__(self, rank: int, world_size: int, layout: str = "plan", **compile_options):
        self.planning = PlanningCollate(rank, world_size, layout=layout, **compile_options)
        self.rope_limit: RopeLimit | None = None  # for_model's, from the model's RoPE

    @classmethod
    def for_model(cls, model_or_config, group_or_mesh=None, rank: int | None = None, world_size: int | None = None,
                  dtype: torch.dtype | str | None = None, **compile_options) -> HFPlanningCollate:
        """A collate for a model (or its config): its attention shape and dtype (`dtype` where attention computes in
        another, as under autocast; else the model's own, or the config's), no K,V prefetch (HF projects Q with K
        and V), attention-only balance unless `model` is given, and its layers' masks (:func:`layer_masks`: one
        sliding window on every layer as Mistral's, or a plan of layer kinds where layers differ, each layer's attention
        picking its kind by its mask); the rank and size from a DeviceMesh's "cp" dimension, a process group, or
        given (rank 0 of 1 in a process without torch.distributed).

        Raises:
            ValueError: a mesh without a "cp" dimension.
        """
        config = model_or_config
        if isinstance(model_or_config, torch.nn.Module):  # the model's parameters say what its attention computes in
            config, dtype = model_or_config.config, dtype or next(model_or_config.parameters()).dtype
        if rank is None or world_size is None:
            group = cp_group(group_or_mesh)
            if group is None and not dist.is_initialized():  # one process, no torch.distributed: world 1
                rank, world_size = 0, 1
            else:
                rank, world_size = dist.get_rank(group), dist.get_world_size(group)
        options = {"kv_prefetch": False, "model": "none", "shape": attention_shape(config, dtype)}
        kinds = layer_kinds(config)
        if kinds is not None:  # one placement, one schedule a layer kind; the layers pick theirs by their mask
            options.update(layer_masks=",".join(f"{name}={mask}" for name, mask in kinds[0].items()),
                           layer_mix=",".join(f"{name}={count}" for name, count in kinds[1].items()))
        elif model_mask(config) != "causal":  # every layer slides (Mistral): the plan's documents have its window
            options["mask"] = model_mask(config)
        collate = cls(rank, world_size, **{**options, **compile_options})
        collate.rope_limit = rope_length_limit(config)
        return collate

    def __call__(self, documents: Sequence) -> dict:
        documents = [_document(item, doc_idx) for doc_idx, item in enumerate(documents)]
        if self.rope_limit is not None:
            for doc_idx, document in enumerate(documents):
                self.rope_limit.check(doc_idx, int(document["input_ids"].numel()))
        batch = self.planning(documents)
        shift_labels = batch["shift_labels"][None]
        # Every rank compiles the whole batch, so every rank knows its label count without a collective.
        num_items = sum(int((document["shift_labels"] != IGNORE_INDEX).sum()) for document in documents)
        return {"input_ids": batch["input_ids"][None], "position_ids": batch["position_ids"][None],
                "labels": shift_labels, "shift_labels": shift_labels,
                "num_items_in_batch": torch.tensor(num_items, dtype=torch.int64), "fcp_plan": batch["plan"],
                # Training keeps no KV cache: HF's sliding-window cache layers would slice each step's keys for
                # nothing (and, compiled, make dynamo convert the model's frame again each step).
                "use_cache": False}


def step_label_count(num_items_in_batch: torch.Tensor, data_parallel_group) -> torch.Tensor:
    """The step's label count over every data-parallel replica (the loss rule's denominator): the replicas' counts
    summed over `data_parallel_group` (the mesh's "dp" group). Returns a new tensor."""
    total = num_items_in_batch.clone()
    dist.all_reduce(total, group=data_parallel_group)
    return total


def sum_gradients(model: torch.nn.Module, group=None) -> None:
    """Sum every gradient over `group` (default the world) with one all-reduce of one flat buffer: the loss rule's
    gradient without DDP."""
    grads = [p.grad for p in model.parameters() if p.grad is not None]
    flat = torch.cat([g.flatten() for g in grads])
    dist.all_reduce(flat, group=group)
    offset = 0
    for grad in grads:
        grad.copy_(flat[offset:offset + grad.numel()].view_as(grad))
        offset += grad.numel()


try:  # registered on import, as other attention backends register themselves
    register()
except ImportError:  # pragma: no cover - the hf extra is not installed; register() says so when called
    pass

"""Data-loader side: compile the next batch's plan inside DataLoader workers, one rank's slice per process.

Compilation is deterministic, so every rank compiles the same plan from the same batch and keeps only its own
slice; no plan needs to be broadcast. In the plan layout every rank also takes its own tokens from the batch it
already holds, so the step starts with no communication at all.
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping, Sequence

import numpy as np
import torch

from fcp_runtime.kernels import default_takes_ranges
from fcp_runtime.plan import LAYOUTS, KindsRankPlan, load_rank_plan
from fcp_runtime.rank_plan import BATCH_CONTENT, BATCH_LABELS
from fcp_runtime.stage_calls import prepare_host

# Keys the collate's output sets itself (and "mask", a document's mask): no per-token field may be called so.
_RESERVED = ("plan", "lengths", "rows", "token_index", "position_ids", "inputs_digest", "mask")
# The fields whose rows a plan records as its labels, the first present (fcp_runtime.binding checks a call's).
_LABEL_FIELDS = ("shift_labels", "labels")
_MIN_BLOCK_SIZE = 64  # the compiler's smallest block (and the step between block sizes)


def _check_like_first(doc_idx: int, name: str, tensor: torch.Tensor, earlier: list[torch.Tensor]) -> None:
    """A field's tensor must have document 0's dtype and per-token shape: concatenating would otherwise promote
    (int64 token ids to floats) or fail inside torch."""
    if not earlier:
        return
    first = earlier[0]
    if tensor.dtype != first.dtype:
        raise ValueError(f"document {doc_idx}'s field {name!r} is {tensor.dtype}; document 0's is {first.dtype} "
                         f"(give every document's {name!r} one dtype)")
    if tensor.shape[1:] != first.shape[1:]:
        raise ValueError(f"document {doc_idx}'s field {name!r} has per-token shape {tuple(tensor.shape[1:])}; "
                         f"document 0's has {tuple(first.shape[1:])}")


def _fields(documents: Sequence) -> tuple[list[int], dict[str, list[torch.Tensor]], list | None]:
    """Each document's length, its per-token tensors by name, and its mask (None when no document gives one)."""
    lengths, fields, masks = [], {}, []
    for doc_idx, document in enumerate(documents):
        item = document if isinstance(document, Mapping) else {"tokens": document}
        odd = [name for name in item if not isinstance(name, str)]
        if odd:
            raise ValueError(f"document {doc_idx} has a field named {odd[0]!r}; field names must be strings")
        if doc_idx == 0:
            names = sorted(name for name in item if name != "mask")
            fields = {name: [] for name in names}
        elif sorted(name for name in item if name != "mask") != list(fields):
            raise ValueError(f"document {doc_idx} has fields {sorted(item)}; document 0 has {list(fields)}")
        for name in fields:
            if name in _RESERVED or not isinstance(item[name], torch.Tensor) or item[name].dim() < 1:
                raise ValueError(f"document field {name!r} must be a per-token tensor and not one of {_RESERVED}")
        rows = {name: int(item[name].shape[0]) for name in fields}
        if len(set(rows.values())) > 1:
            raise ValueError(f"document {doc_idx}'s per-token fields differ in length: {rows}")
        length = next(iter(rows.values()), 0)
        for name in fields:
            _check_like_first(doc_idx, name, item[name], fields[name])
            fields[name].append(item[name])
        lengths.append(length)
        if isinstance(item.get("mask"), torch.Tensor):
            raise ValueError(f"document {doc_idx}'s field 'mask' is a tensor; 'mask' is reserved for the document's "
                             f"attention mask (\"causal\", \"full\" or {{\"kind\": \"sliding_window\", "
                             f"\"window\": W}}): rename the per-token tensor")
        masks.append(item.get("mask"))
    if not fields:
        raise ValueError("a batch needs at least one document with at least one per-token tensor")
    return lengths, fields, (masks if any(mask is not None for mask in masks) else None)


def _content_digest(columns: dict[str, torch.Tensor]) -> str:
    """sha256 of the step's concatenated per-token fields (names, dtypes, shapes and bytes): the documents
    themselves, which a plan's digest (their lengths and masks) does not name."""
    digest = hashlib.sha256()
    for name, column in sorted(columns.items()):
        data = column.detach().cpu().contiguous().reshape(-1)
        digest.update(f"{name}:{data.dtype}:{tuple(column.shape)}:".encode())
        digest.update(data.view(torch.uint8).numpy() if data.numel() else b"")
    return digest.hexdigest()


class PlanningCollate:
    """A DataLoader collate_fn: concatenates documents, compiles their plan, returns this rank's share.

    Args:
        rank, world_size: this process's rank in the context-parallel group and the group's size.
        layout: "plan" (the default, dispatch once: this rank's plan-layout tokens) or "user" (its contiguous
            chunk of the concatenated batch); the plan is compiled for it.
        ranges: build the kernel calls for a range kernel (True) or for a packing one (False); default: as the
            runtime's default kernels on this machine (a range kernel on CPU or with MagiAttention's FFA installed).
        compile_options: forwarded to fcp_compiler.compile_plan (block_size, coalesce, profile, mask, ...).

    Each document is a 1-D-or-more tensor of its tokens, or a dict of per-token tensors of equal length (say
    `tokens`, `labels`, `loss_mask`) with an optional `mask` ("causal", "full" or {"kind": "sliding_window",
    "window": W}; documents without one are causal). Each call returns a dict with every per-token field taken at
    this rank's rows, plus `position_ids` (each row's position inside its own document, for RoPE), `lengths` (all
    documents' lengths), `plan` (this rank's RankPlan), `inputs_digest` (the digest of the batch and options it was
    compiled from), `rows` (the rows' positions in the concatenated batch) and, in the plan layout, `token_index`
    (the same as `rows`). The rows are the plan layout's `token_index`, or in the user layout rows
    [floor(r*T/N), floor((r+1)*T/N)).

    Every rank of the context-parallel group must collate the same documents (the whole step's): the plan records
    their sha256, and attention's first call refuses on every rank where the ranks' differ (ranks that collated
    different documents of the same lengths would hold one plan and attend across each other's batches). It also
    records the rows' `shift_labels` (else `labels`), which attention compares with a call's labels beside its
    position ids (fcp_runtime.binding): a plan is bound to its own step's rows.
    """

    def __init__(self, rank: int, world_size: int, layout: str = "plan", ranges: bool | None = None,
                 **compile_options):
        if layout not in LAYOUTS:
            raise ValueError(f"layout {layout!r} must be one of {', '.join(LAYOUTS)}")
        if not 0 <= rank < world_size:
            raise ValueError(f"rank {rank} must be in [0, {world_size})")
        self.rank, self.world_size, self.layout, self.ranges = rank, world_size, layout, ranges
        self.compile_options = compile_options

    def _compile(self, batch, total: int):
        """The step's plan, with no rank empty: a short step (fewer blocks than ranks, in the plan layout) is
        compiled again at half the block size, down to 64 tokens, until every rank holds a token, since a rank
        without tokens cannot run a model's layers. Every rank takes the same steps, so every rank keeps the same plan.

        Raises:
            ValueError: a rank is still empty at block 64 (a step of a few tiny documents), naming the fix.
        """
        from fcp_compiler.core.pipeline import compile_plan

        options = dict(self.compile_options)
        while True:
            plan = compile_plan(batch, self.world_size, layout=self.layout, **options)
            # Each rank's plan-layout tokens, from the plan's placement (the same on every layer kind).
            rank_tokens = plan.ir.transfers.assignment.rank_tokens
            block_size = plan.header.block_size
            if self.layout == "user" or int(rank_tokens.min()) > 0:
                return plan
            own_block_size = str(getattr(options.get("planner"), "value", options.get("planner") or "fcp")) != "fcp"
            if block_size <= _MIN_BLOCK_SIZE or own_block_size:
                empty = int(np.flatnonzero(rank_tokens == 0)[0])
                raise ValueError(f"a step of {total} tokens leaves rank {empty} of {self.world_size} without a token "
                                 f"in the plan layout at block {block_size}; collate it with layout='user' (every "
                                 f"rank holds a contiguous share) or give the step more tokens")
            options["block_size"] = max(_MIN_BLOCK_SIZE, block_size // 2 // _MIN_BLOCK_SIZE * _MIN_BLOCK_SIZE)

    def __call__(self, documents: Sequence) -> dict:
        # The one runtime module that calls the compiler (pyproject.toml lists it beside the layer contracts);
        # imported in the worker, and the compiler never imports torch.
        from fcp_compiler.format.inputs import BatchSpec

        lengths, fields, masks = _fields(documents)
        total = sum(lengths)
        if total < self.world_size:
            raise ValueError(f"a step of {total} tokens ({len(lengths)} documents) cannot give each of the "
                             f"{self.world_size} ranks a token; drop it (DataLoader(drop_last=True)) or add documents")
        batch = BatchSpec(sequences=lengths, masks=[mask or "causal" for mask in masks]) if masks else lengths
        plan = self._compile(batch, total)
        # A KindsRankPlan where kinds were given; compiled here, so not validated again on the training's path (the
        # compiler's plans are validated in its tests).
        rank_plan = load_rank_plan(plan.to_bytes(), self.rank, validate=False)
        ranges = self.ranges
        if ranges is None:
            device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
            ranges = default_takes_ranges(device, rank_plan.has_windows)
        kind_plans = tuple(rank_plan.kinds.values()) if isinstance(rank_plan, KindsRankPlan) else (rank_plan,)
        for kind_plan in kind_plans:
            prepare_host(kind_plan, self.layout, ranges)  # the step's kernel calls, built here in the worker
        if self.layout == "plan":
            rows, position_ids = rank_plan.token_index, rank_plan.position_ids
        else:
            total = sum(lengths)
            lo, hi = self.rank * total // self.world_size, (self.rank + 1) * total // self.world_size
            starts = np.repeat(np.cumsum([0, *lengths[:-1]]), lengths)
            rows = torch.arange(lo, hi)
            position_ids = torch.from_numpy(np.arange(lo, hi) - starts[lo:hi])
        columns = {name: torch.cat(parts) for name, parts in fields.items()}
        content = _content_digest(columns)
        out = {name: column[rows] for name, column in columns.items()}
        labels = next((out[name] for name in _LABEL_FIELDS if name in out), None)
        for kind_plan in kind_plans:
            kind_plan._device_cache[BATCH_CONTENT] = content
            if labels is not None:
                kind_plan._device_cache[BATCH_LABELS] = labels
        # The digest of the inputs the plan was compiled from (fcp_compiler.core.pipeline.plan_digest), to match
        # against plans compiled elsewhere, e.g. by `fcp compile steps.jsonl`, whose file names carry it.
        out.update(rows=rows, position_ids=position_ids, lengths=lengths, plan=rank_plan,
                   inputs_digest=rank_plan.digest)
        if self.layout == "plan":
            out["token_index"] = rows
        return out

"""Training a tiny random Hugging Face causal LM under fcp on forked gloo ranks, and the same training in one process
with HF's own attention, document by document: what tests/test_hf.py compares."""

from __future__ import annotations

import dataclasses

import numpy as np
import torch
import torch.distributed as dist

transformers = __import__("pytest").importorskip("transformers")

import fcp_runtime.hf as fcp_hf  # noqa: E402  (registers attn_implementation="fcp")

IGNORE = fcp_hf.IGNORE_INDEX


@dataclasses.dataclass(frozen=True, kw_only=True)
class Setup:
    """A model, its data and optimiser: every rank and the reference build the same from it."""

    arch: str = "llama"  # "llama", "qwen2" or "mistral"
    num_layers: int = 4
    dtype: torch.dtype = torch.float64
    steps: int = 5
    tokens_per_step: int = 1536
    block_size: int = 64
    layout: str = "plan"
    lr: float = 1e-3
    checkpointing: bool = False
    # HF's own loss (labels=, num_items_in_batch=), which computes in fp32 whatever the model's dtype; else the same
    # sum of cross-entropies over the label count, in the model's dtype (fp64 parity to 1e-12 needs it).
    hf_loss: bool = False
    # qwen2: layers alternate a sliding window of this many keys with full causal attention (layer_types), as
    # gpt-oss does; mistral: every layer slides over it (Mistral's config has no layer_types); None: every layer full.
    sliding_window: int | None = None
    # Every step's document lengths; None: a long-tail draw of tokens_per_step tokens a step.
    lengths: tuple[int, ...] | None = None

    def config(self, attn_implementation: str):
        common = dict(vocab_size=96, hidden_size=32, intermediate_size=64, num_hidden_layers=self.num_layers,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=4096,
                      attn_implementation=attn_implementation)
        if self.arch == "llama":
            return transformers.LlamaConfig(**common)
        if self.arch == "qwen2":
            if self.sliding_window is None:
                return transformers.Qwen2Config(**common)
            layer_types = ["sliding_attention", "full_attention"] * (self.num_layers // 2)
            return transformers.Qwen2Config(**common, use_sliding_window=True, sliding_window=self.sliding_window,
                                            layer_types=layer_types)
        if self.arch == "mistral":
            return transformers.MistralConfig(**common, sliding_window=self.sliding_window)
        raise ValueError(self.arch)

    def model(self, attn_implementation: str):
        torch.manual_seed(0)
        cls = {"llama": transformers.LlamaForCausalLM, "qwen2": transformers.Qwen2ForCausalLM,
               "mistral": transformers.MistralForCausalLM}[self.arch]
        model = cls(self.config(attn_implementation)).to(self.dtype)
        if self.checkpointing:
            model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
        model.train()
        return model, torch.optim.AdamW(model.parameters(), lr=self.lr, weight_decay=0.01)


def documents(setup: Setup, step: int) -> list[dict]:
    """Step `step`'s long-tail documents (lognormal lengths, one long one among many short), learnable ids."""
    rng = np.random.default_rng(1000 + step)
    lengths, total = list(setup.lengths or []), 0
    while setup.lengths is None and total < setup.tokens_per_step:
        length = int(np.clip(rng.lognormal(np.log(48), 1.3), 2, setup.tokens_per_step - total))
        lengths.append(length)
        total += length
    docs = []
    for length in lengths:
        start, stride = (int(x) for x in rng.integers(0, 96, size=2))
        ids = (start + (stride % 5 + 1) * torch.arange(length)) % 96
        docs.append({"input_ids": ids})
    return docs


def state_of(model) -> dict[str, np.ndarray]:
    return {name: value.detach().cpu().numpy().copy() for name, value in model.state_dict().items()}


def train_fcp(setup: Setup, group_or_mesh=None, data_parallel=None, ddp: bool = False) -> dict:
    """Train on this rank under fcp. `data_parallel` = (dp rank, dp size, dp group): this replica's documents are
    every dp_size-th of the step's, the label count summed over the replicas; with `ddp` the model is wrapped in
    DDP over the world (the loss times the world size), else gradients are summed over the world."""
    model, optimizer = setup.model(fcp_hf.ATTENTION_NAME)
    collate = fcp_hf.HFPlanningCollate.for_model(model.config, group_or_mesh, layout=setup.layout,
                                                 block_size=setup.block_size, dtype=setup.dtype)
    group = fcp_hf.cp_group(group_or_mesh)
    world = dist.get_world_size()
    runner = torch.nn.parallel.DistributedDataParallel(model) if ddp else model
    losses = []
    for step in range(setup.steps):
        docs = documents(setup, step)
        if data_parallel is not None:
            dp_rank, dp_size, dp_group = data_parallel
            docs = docs[dp_rank::dp_size]
        batch = collate(docs)
        if data_parallel is not None:
            batch["num_items_in_batch"] = fcp_hf.step_label_count(batch["num_items_in_batch"], data_parallel[2])
        loss = step_loss(setup, runner, batch, group)
        (loss * world if ddp else loss).backward()
        if not ddp:
            fcp_hf.sum_gradients(model)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        total = loss.detach().clone()
        dist.all_reduce(total)
        losses.append(float(total))
    return {"losses": losses, "state": state_of(model)}


def step_loss(setup: Setup, model, batch: dict, group) -> torch.Tensor:
    """This rank's share of the step's loss: its labels' summed cross-entropy over the step's label count."""
    extra = {} if group is None and "fcp_plan" not in batch else {"fcp_group": group}
    if setup.hf_loss:
        return model(**batch, **extra).loss
    inputs = {name: value for name, value in batch.items() if name not in ("labels", "shift_labels")}
    logits = model(**inputs, **extra).logits[0]
    return torch.nn.functional.cross_entropy(logits, batch["shift_labels"][0], ignore_index=IGNORE,
                                             reduction="sum") / batch["num_items_in_batch"]


def train_reference(setup: Setup, attn_implementation: str = "sdpa") -> dict:
    """The same training in one process with HF's own attention, one document at a time: each document's summed
    loss over the step's label count, gradients accumulated over the documents."""
    model, optimizer = setup.model(attn_implementation)
    losses = []
    for step in range(setup.steps):
        docs = documents(setup, step)
        count = sum(len(doc["input_ids"]) - 1 for doc in docs)
        total = 0.0
        for doc in docs:
            ids = doc["input_ids"][None]
            shifted = torch.cat([ids[:, 1:], torch.full((1, 1), IGNORE)], dim=1)
            batch = {"input_ids": ids, "labels": shifted, "shift_labels": shifted,
                     "num_items_in_batch": torch.tensor(count)}
            loss = step_loss(setup, model, batch, None)
            loss.backward()
            total += float(loss.detach())
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(total)
    return {"losses": losses, "state": state_of(model)}


def readme_reference_losses(dtype: str) -> list[float]:
    """The README training block's model and documents (a 2-layer Llama of vocabulary 256; documents of 1500, 300,
    120, 64 and 40 random ids, the same each of 3 steps) trained in this process with HF's own attention and loss,
    document by document, with `dtype` as torch's default (the model's dtype): each step's summed loss."""
    torch.set_default_dtype(getattr(torch, dtype))
    try:
        config = transformers.LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                          num_attention_heads=4, num_key_value_heads=2, attn_implementation="sdpa")
        torch.manual_seed(0)
        model = transformers.LlamaForCausalLM(config)
        steps = [[torch.randint(256, (n,)) for n in (1500, 300, 120, 64, 40)]] * 3
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
        losses = []
        for docs in steps:
            count = torch.tensor(sum(len(doc) - 1 for doc in docs))
            total = 0.0
            for doc in docs:
                loss = model(input_ids=doc[None], labels=doc[None], num_items_in_batch=count).loss
                loss.backward()
                total += float(loss.detach())
            optimizer.step()
            optimizer.zero_grad()
            losses.append(total)
        return losses
    finally:
        torch.set_default_dtype(torch.float32)

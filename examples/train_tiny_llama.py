"""Train a tiny Llama under fcp: a new long-tail batch, so a new plan, every step; the same losses as one process.

    python examples/train_tiny_llama.py --world 4                 # 4 forked CPU ranks (gloo), plan layout
    python examples/train_tiny_llama.py --world 4 --layout user   # attention reshuffles in and out instead
    python examples/train_tiny_llama.py --world 4 --windows       # every other document has a sliding window
    torchrun --nproc-per-node 8 examples/train_tiny_llama.py      # CUDA and NCCL (flash-attn if installed)

Each run trains with fcp, then trains the same model on the same data in one process without fcp (dense
attention with a per-document mask) and prints both losses step by step.

What a training loop owes fcp (each one is a function below, and tests/test_train_example.py shows that getting any
of the first three wrong changes the losses):

- RoPE at `position_ids`: every token's position inside its own document, in the layout's row order;
- labels (and loss masks) taken at the same rows as the tokens: the collate does it for every per-token field;
- the loss summed over the rank's tokens and divided by the global token count (ranks hold different numbers of
  tokens in the plan layout), with gradients summed over the ranks;
- a process group of its own for context parallelism;
- planning in the DataLoader's workers (`PlanningCollate`), so the step never waits for the compiler.
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import multiprocessing
import os
import socket
import sys
import time
import traceback
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # run from a checkout without installing

from fcp_compiler.tools.traces import empirical_batch, read_lengths_file  # noqa: E402
from fcp_runtime import fcp_attn_func, prefetch_kv  # noqa: E402
from fcp_runtime.hf import sum_gradients  # noqa: E402,F401  (the loss rule's gradient sum, shared)
from fcp_runtime.loader import PlanningCollate  # noqa: E402

IGNORE = -100  # cross-entropy's ignore_index: the last token of a document predicts nothing
REPO = Path(__file__).resolve().parent.parent


@dataclass(frozen=True, kw_only=True)
class Config:
    """The model, the data and the optimiser; every rank and the reference build the same from it."""

    vocab: int = 256
    dim: int = 64
    num_layers: int = 2
    q_heads: int = 4
    kv_heads: int = 2
    ffn_dim: int = 128
    tie_embeddings: bool = False
    tokens_per_step: int = 4096  # the whole batch, all ranks together
    num_steps: int = 3
    lr: float = 1e-3
    seed: int = 0
    block_size: int = 128
    layout: str = "plan"
    windows: bool = False  # every other document attends through a sliding window of `window` tokens
    window: int = 48
    lengths_from: str = str(REPO / "traces" / "paper_lognormal_64gpu.json")
    length_scale: int = 64  # the distribution's lengths are divided by this (a tiny model, tiny documents)
    dtype: str = "float32"
    floor: bool = True  # the compiler keeps the fastest of its candidate plans (False: FCP's own placement only)

    @property
    def head_dim(self) -> int:
        return self.dim // self.q_heads


# ----------------------------------------------------------------------------------------------------- the data


def documents(config: Config, step: int) -> list[dict]:
    """Step `step`'s batch: documents with lengths drawn from the named distribution, each an arithmetic
    progression modulo the vocabulary (learnable from the previous tokens), with next-token labels."""
    values = np.maximum(read_lengths_file(config.lengths_from) // config.length_scale, 1)
    lengths = empirical_batch(values, config.tokens_per_step, seed=config.seed * 1_000_003 + step)
    generator = torch.Generator().manual_seed(config.seed * 1_000_003 + step)
    docs = []
    for doc_idx, length in enumerate(lengths):
        start, stride = torch.randint(config.vocab, (2,), generator=generator).tolist()
        tokens = (start + (stride % 7 + 1) * torch.arange(length)) % config.vocab
        labels = torch.cat([tokens[1:], torch.tensor([IGNORE])])
        windowed = config.windows and doc_idx % 2 == 1
        docs.append({"tokens": tokens, "labels": labels,
                     "mask": {"kind": "sliding_window", "window": config.window} if windowed else "causal"})
    return docs


def windows_of(docs: list[dict]) -> list[int]:
    """Per document, the keys a query sees back, itself included."""
    return [doc["mask"]["window"] if isinstance(doc["mask"], dict) else len(doc["tokens"]) for doc in docs]


class StepBatches(torch.utils.data.Dataset):
    """Item i is step `first_step + i`'s documents; with `PlanningCollate` as collate_fn each item becomes this
    rank's rows and plan, in a worker, while the previous step trains."""

    def __init__(self, config: Config, first_step: int):
        self.config, self.first_step = config, first_step

    def __len__(self) -> int:
        return self.config.num_steps - self.first_step

    def __getitem__(self, idx: int) -> list[dict]:
        return documents(self.config, self.first_step + idx)


# ---------------------------------------------------------------------------------------------------- the model


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float = 1e-6):
        super().__init__()
        self.weight, self.eps = nn.Parameter(torch.ones(dim)), eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * self.weight


def rope(x: torch.Tensor, position_ids: torch.Tensor, theta: float = 10_000.0) -> torch.Tensor:
    """Rotary embedding of x [tokens, heads, head_dim] at each token's position in its own document."""
    half = x.shape[-1] // 2
    freqs = theta ** (-torch.arange(half, dtype=torch.float64) / half)
    angles = (position_ids.to(torch.float64)[:, None] * freqs[None, :])[:, None, :]
    cos, sin = angles.cos().to(x.dtype), angles.sin().to(x.dtype)
    first, second = x[..., :half], x[..., half:]
    return torch.cat([first * cos - second * sin, first * sin + second * cos], dim=-1)


class Block(nn.Module):
    def __init__(self, config: Config):
        super().__init__()
        self.config = config
        dim, head_dim = config.dim, config.head_dim
        self.attn_norm, self.mlp_norm = RMSNorm(dim), RMSNorm(dim)
        self.wq = nn.Linear(dim, config.q_heads * head_dim, bias=False)
        self.wk = nn.Linear(dim, config.kv_heads * head_dim, bias=False)
        self.wv = nn.Linear(dim, config.kv_heads * head_dim, bias=False)
        self.wo = nn.Linear(config.q_heads * head_dim, dim, bias=False)
        self.w_gate = nn.Linear(dim, config.ffn_dim, bias=False)
        self.w_up = nn.Linear(dim, config.ffn_dim, bias=False)
        self.w_down = nn.Linear(config.ffn_dim, dim, bias=False)

    def forward(self, x: torch.Tensor, position_ids: torch.Tensor, attend) -> torch.Tensor:
        num_tokens, head_dim = x.shape[0], self.config.head_dim
        h = self.attn_norm(x)
        # K and V first: fcp's attention can send the blocks its first stage needs while Q is projected.
        k = rope(self.wk(h).view(num_tokens, self.config.kv_heads, head_dim), position_ids)
        v = self.wv(h).view(num_tokens, self.config.kv_heads, head_dim)
        if hasattr(attend, "kv_ready"):
            attend.kv_ready(k, v)
        q = rope(self.wq(h).view(num_tokens, self.config.q_heads, head_dim), position_ids)
        x = x + self.wo(attend(q, k, v).reshape(num_tokens, self.config.q_heads * head_dim))  # 0 rows happen
        h = self.mlp_norm(x)
        out = x + self.w_down(F.silu(self.w_gate(h)) * self.w_up(h))
        return attend.layer_output(out) if hasattr(attend, "layer_output") else out


class TinyLlama(nn.Module):
    """A Llama-style decoder over a flat row of tokens; `attend(q, k, v)` is the attention over the whole batch."""

    def __init__(self, config: Config):
        super().__init__()
        self.embed = nn.Embedding(config.vocab, config.dim)
        self.blocks = nn.ModuleList(Block(config) for _ in range(config.num_layers))
        self.norm = RMSNorm(config.dim)
        self.lm_head = nn.Linear(config.dim, config.vocab, bias=False)
        if config.tie_embeddings:
            self.lm_head.weight = self.embed.weight

    def forward(self, tokens: torch.Tensor, position_ids: torch.Tensor, attend) -> torch.Tensor:
        x = self.embed(tokens)
        for block in self.blocks:
            x = block(x, position_ids, attend)
        return self.lm_head(self.norm(x))


class FcpAttention:
    """fcp's attention over one step's plan, for every layer. In the plan layout each layer's first-stage K,V
    pulls leave early: forward as soon as the layer has projected K and V (prefetch_kv), while it projects Q;
    backward as the layer's backward starts (the layer's output through backward_starts_at), while its MLP and O
    projection run backward."""

    def __init__(self, plan, group, position_ids: torch.Tensor, labels: torch.Tensor, layout: str = "plan"):
        self.plan, self.group, self.layout = plan, group, layout
        # The collate's, beside the plan: attention refuses a plan of other rows, or labels not at the plan's rows.
        self.position_ids, self.labels = position_ids, labels
        self.prefetched = None

    def kv_ready(self, k: torch.Tensor, v: torch.Tensor) -> None:
        if self.layout == "plan":
            self.prefetched = prefetch_kv(k, v, self.plan, self.group)

    def __call__(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        return fcp_attn_func(q, k, v, self.plan, group=self.group, layout=self.layout, prefetched=self.prefetched,
                             position_ids=self.position_ids, labels=self.labels)

    def layer_output(self, out: torch.Tensor) -> torch.Tensor:
        prefetched, self.prefetched = self.prefetched, None
        return prefetched.backward_starts_at(out) if prefetched is not None else out


def build(config: Config, device: torch.device):
    """The model and optimiser every rank and the reference start from (the same seed, so the same weights)."""
    torch.manual_seed(config.seed)
    model = TinyLlama(config).to(device=device, dtype=getattr(torch, config.dtype))
    return model, torch.optim.AdamW(model.parameters(), lr=config.lr, weight_decay=0.01)


# -------------------------------------------------------------------------------------- what the loop owes fcp


def rank_positions(batch: dict) -> torch.Tensor:
    """RoPE positions of this rank's rows: each token's position inside its own document."""
    return batch["position_ids"]


def rank_labels(batch: dict) -> torch.Tensor:
    """Labels of this rank's rows: the collate takes them at the same rows as the tokens."""
    return batch["labels"]


def rank_loss(logits: torch.Tensor, labels: torch.Tensor, num_batch_labels: torch.Tensor, group) -> torch.Tensor:
    """This rank's share of the batch's mean loss: its tokens' summed loss over the whole batch's label count, so
    that the ranks' shares (and their gradients) sum to the single-process loss however many tokens each holds."""
    return F.cross_entropy(logits.float(), labels, ignore_index=IGNORE, reduction="sum") / num_batch_labels


# --------------------------------------------------------------------------------------------- training with fcp


def save_checkpoint(path: Path, step: int, model: nn.Module, optimizer) -> None:
    """Write the step, weights and optimiser state to `path` through a temporary name (never half-written)."""
    tmp = path.with_name(path.name + ".tmp")
    torch.save({"step": step, "model": model.state_dict(), "optimizer": optimizer.state_dict()}, tmp)
    os.replace(tmp, path)


def train_rank(config: Config, save_after: int | None = None, checkpoint: Path | None = None,
               resume: Path | None = None, loader_workers: int = 1) -> dict:
    """Train on this rank of the initialised default process group (its world is the context-parallel group).

    Returns:
        {"losses": the batch loss of every step run, "tokens_per_second": this rank's in each step (the step's
        tokens over its forward, backward and optimiser time), "state": the final weights}.
    """
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", torch.cuda.current_device()) if dist.get_backend() == "nccl" else torch.device("cpu")
    cp_group = dist.new_group(list(range(world)))  # fcp's own; data parallelism would add a group beside it
    model, optimizer = build(config, device)
    first_step = 0
    if resume is not None:
        state = torch.load(resume, map_location=device, weights_only=True)
        model.load_state_dict(state["model"])
        optimizer.load_state_dict(state["optimizer"])
        first_step = state["step"]
    collate = PlanningCollate(rank, world, layout=config.layout, block_size=config.block_size, floor=config.floor)
    loader = torch.utils.data.DataLoader(StepBatches(config, first_step), batch_size=None, collate_fn=collate,
                                         num_workers=loader_workers,
                                         multiprocessing_context="fork" if loader_workers else None)
    losses, tokens_per_second = [], []
    for step, batch in enumerate(loader, start=first_step):
        started = time.perf_counter()
        tokens, labels = batch["tokens"].to(device), rank_labels(batch).to(device)
        plan = batch["plan"]
        positions = rank_positions(batch).to(device)
        logits = model(tokens, positions, FcpAttention(plan, cp_group, positions, labels, config.layout))
        num_batch_labels = (labels != IGNORE).sum().to(torch.float32)
        dist.all_reduce(num_batch_labels, group=cp_group)
        loss = rank_loss(logits, labels, num_batch_labels, cp_group)
        loss.backward()
        sum_gradients(model, None)  # the world: with data parallelism too, the data- and context-parallel ranks
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        batch_loss = loss.detach().clone()
        dist.all_reduce(batch_loss, group=cp_group)
        losses.append(float(batch_loss))
        tokens_per_second.append(tokens.shape[0] / (time.perf_counter() - started))
        if save_after is not None and step + 1 == save_after:
            if rank == 0:
                save_checkpoint(checkpoint, step + 1, model, optimizer)
            dist.barrier()
            break
    # numpy, so that the weights can cross a multiprocessing queue after this process has exited
    state = {name: value.detach().cpu().numpy().copy() for name, value in model.state_dict().items()}
    return {"losses": losses, "tokens_per_second": tokens_per_second, "state": state}


# ------------------------------------------------------------------------------------- the single-process reference


def dense_attention(lengths: list[int], windows: list[int]):
    """Attention over the concatenated batch, document by document, query t seeing keys t - window < s <= t."""

    def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        outs, start = [], 0
        group = q.shape[1] // k.shape[1]
        for length, window in zip(lengths, windows):
            qs, ks, vs = (x[start:start + length].transpose(0, 1) for x in (q, k, v))
            ks, vs = ks.repeat_interleave(group, dim=0), vs.repeat_interleave(group, dim=0)
            back = torch.arange(length)[:, None] - torch.arange(length)[None, :]
            visible = ((back >= 0) & (back < window)).to(q.device)
            outs.append(F.scaled_dot_product_attention(qs, ks, vs, attn_mask=visible).transpose(0, 1))
            start += length
        return torch.cat(outs)

    return attend


def train_reference(config: Config, device: torch.device = torch.device("cpu")) -> dict:
    """The same training in one process without fcp: the whole batch in document order, dense attention."""
    model, optimizer = build(config, device)
    losses = []
    for step in range(config.num_steps):
        docs = documents(config, step)
        lengths = [len(doc["tokens"]) for doc in docs]
        tokens = torch.cat([doc["tokens"] for doc in docs]).to(device)
        labels = torch.cat([doc["labels"] for doc in docs]).to(device)
        position_ids = torch.cat([torch.arange(length) for length in lengths]).to(device)
        logits = model(tokens, position_ids, dense_attention(lengths, windows_of(docs)))
        loss = F.cross_entropy(logits.float(), labels, ignore_index=IGNORE)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(float(loss.detach()))
    return {"losses": losses, "state": {name: value.detach().cpu().numpy().copy()
                                        for name, value in model.state_dict().items()}}


# ------------------------------------------------------------------------------------------------------ launching


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _cpu_rank(rank: int, world: int, port: int, config: Config, queue) -> None:
    torch.set_num_threads(1)
    try:
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
        try:
            result = train_rank(config)
            queue.put((rank, "ok", result if rank == 0 else {k: v for k, v in result.items() if k != "state"}))
        finally:
            dist.destroy_process_group()
    except BaseException:  # the parent reports it instead of waiting for a rank that died
        queue.put((rank, "error", traceback.format_exc()))


def train_on_cpu_ranks(config: Config, world: int) -> list[dict]:
    """Fork `world` gloo ranks on this machine, train on each, return each rank's result (rank 0's with weights)."""
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    context = multiprocessing.get_context("fork")
    queue, port = context.Queue(), _free_port()
    procs = [context.Process(target=_cpu_rank, args=(rank, world, port, config, queue)) for rank in range(world)]
    for proc in procs:
        proc.start()
    results = {}
    for _ in range(world):
        rank, status, payload = queue.get(timeout=600)
        if status != "ok":
            for proc in procs:
                proc.kill()
            raise SystemExit(f"rank {rank} failed:\n{payload}")
        results[rank] = payload
    for proc in procs:
        proc.join()
    return [results[rank] for rank in range(world)]


LOSS_RTOL = 1e-5  # fp32: the same losses as one process up to reduction order (tests/test_train_example.py)


def _print_table(fcp: list[dict], reference: dict | None) -> bool:
    """The per-step table and a verdict line; True when every step's loss matched the reference (or none ran)."""
    print(f"{'step':>4}  {'fcp loss':>12}  {'reference':>12}  {'rel diff':>9}  {'tokens/s/rank':>13}")
    worst = 0.0
    for step, loss in enumerate(fcp[0]["losses"]):
        ref = reference["losses"][step] if reference else math.nan
        if reference:
            worst = max(worst, abs(loss - ref) / abs(ref))
        print(f"{step:>4}  {loss:>12.7f}  {ref:>12.7f}  {abs(loss - ref) / abs(ref):>9.1e}  "
              f"{np.mean([r['tokens_per_second'][step] for r in fcp]):>13.0f}")
    if reference is None:
        print("verdict: no reference run (--no-reference); losses not compared")
        return True
    matched = worst <= LOSS_RTOL
    print(f"verdict: {'MATCH' if matched else 'MISMATCH'}: {len(fcp[0]['losses'])} steps, largest relative loss "
          f"difference {worst:.1e} ({'within' if matched else 'over'} {LOSS_RTOL:.0e}) against one process")
    return matched


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--world", type=int, default=4, help="CPU ranks to fork (ignored under torchrun)")
    parser.add_argument("--layout", choices=("plan", "user"), default="plan")
    parser.add_argument("--windows", action="store_true", help="every other document attends through a window")
    parser.add_argument("--steps", type=int, default=Config.num_steps)
    parser.add_argument("--tokens-per-step", type=int, default=Config.tokens_per_step)
    parser.add_argument("--lengths-from", default=Config.lengths_from,
                        help="a batch JSON or a length file (a JSON list of lengths, or one a line), e.g. DistCA's "
                             "dist_prolong.json")
    parser.add_argument("--no-reference", action="store_true", help="skip the single-process run")
    args = parser.parse_args()
    config = dataclasses.replace(Config(), layout=args.layout, windows=args.windows, num_steps=args.steps,
                                 tokens_per_step=args.tokens_per_step, lengths_from=args.lengths_from)
    if "RANK" in os.environ:  # torchrun: one process per GPU
        torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
        dist.init_process_group("nccl")
        result = train_rank(config)
        if dist.get_rank() == 0:
            for step, (loss, rate) in enumerate(zip(result["losses"], result["tokens_per_second"])):
                print(f"step {step}  loss {loss:.7f}  {rate:.0f} tokens/s on rank 0")
        dist.destroy_process_group()
        return
    fcp = train_on_cpu_ranks(config, args.world)
    reference = None if args.no_reference else train_reference(config)
    if not _print_table(fcp, reference):
        raise SystemExit(1)


if __name__ == "__main__":
    main()

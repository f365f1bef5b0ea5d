"""Data-loader side: compile the next batch's plan inside DataLoader workers, one rank's slice per process.

Compilation is deterministic, so every rank compiles the same plan from the same batch and keeps only its own
slice; no plan needs to be broadcast. In the plan layout every rank also takes its own tokens from the batch it
already holds, so the step starts with no communication at all.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from fcp_runtime.plan import LAYOUTS, RankPlan, load_rank_plan
from fcp_runtime.stage_calls import prepare_host


class PlanningCollate:
    """A DataLoader collate_fn: concatenates documents, compiles their plan, returns this rank's share.

    Args:
        rank, world_size: this process's rank and the context-parallel group size.
        layout: "plan" (the default, dispatch once: this rank's plan-layout tokens) or "user" (its contiguous
            chunk of the concatenated batch); the plan is compiled for it.
        compile_options: forwarded to fcp_compiler.compile_plan (block_size, coalesce, profile, ...).

    Each call returns a dict with `plan` (this rank's RankPlan), `lengths` (all documents' lengths) and `tokens`:
    in the plan layout, the batch's tokens at `token_index` (global positions in the concatenated batch, also
    returned) with their `position_ids` (position inside each token's own document, for RoPE); in the user layout,
    rows [floor(r*T/N), floor((r+1)*T/N)). Labels, loss masks and any other per-token tensor of the batch are taken
    the same way: `global_labels[batch["token_index"]]`.
    """

    def __init__(self, rank: int, world_size: int, layout: str = "plan", **compile_options):
        if layout not in LAYOUTS:
            raise ValueError(f"layout {layout!r} must be one of {', '.join(LAYOUTS)}")
        self.rank, self.world_size, self.layout = rank, world_size, layout
        self.compile_options = compile_options

    def __call__(self, documents: Sequence[torch.Tensor]) -> dict:
        # The one runtime module that calls the compiler (pyproject.toml lists it beside the layer contracts);
        # imported in the worker, and the compiler never imports torch.
        from fcp_compiler.core.pipeline import compile_plan

        lengths = [int(doc.shape[0]) for doc in documents]
        plan = compile_plan(lengths, self.world_size, layout=self.layout, **self.compile_options)
        tokens = torch.cat(list(documents))
        rank_plan: RankPlan = load_rank_plan(plan.to_bytes(), self.rank)
        prepare_host(rank_plan, self.layout)  # the step's kernel calls, built here in the worker
        if self.layout == "plan":
            return {"tokens": tokens[rank_plan.token_index], "token_index": rank_plan.token_index,
                    "position_ids": rank_plan.position_ids, "lengths": lengths, "plan": rank_plan}
        total = tokens.shape[0]
        lo, hi = self.rank * total // self.world_size, (self.rank + 1) * total // self.world_size
        return {"tokens": tokens[lo:hi], "lengths": lengths, "plan": rank_plan}

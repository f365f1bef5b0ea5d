"""Data-loader side: compile the next batch's plan inside DataLoader workers, one rank's slice per process.

Compilation is deterministic, so every rank compiles the same plan from the same batch and keeps only its own
slice; no plan needs to be broadcast.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from fcp_runtime.plan import RankPlan, load_rank_plan


class PlanningCollate:
    """A DataLoader collate_fn: concatenates documents, compiles their plan, returns this rank's share.

    Args:
        rank, world_size: this process's rank and the context-parallel group size.
        compile_options: forwarded to fcp_compiler.compile_plan (block_size, coalesce_degree, profile, ...).

    Each call returns a dict with `tokens` (this rank's slice of the concatenated batch in the user layout:
    rows [floor(r*T/N), floor((r+1)*T/N))), `lengths` (all documents' lengths) and `plan` (this rank's RankPlan).
    """

    def __init__(self, rank: int, world_size: int, **compile_options):
        self.rank, self.world_size, self.compile_options = rank, world_size, compile_options

    def __call__(self, documents: Sequence[torch.Tensor]) -> dict:
        from fcp_compiler import compile_plan  # imported in the worker; never imports torch

        lengths = [int(doc.shape[0]) for doc in documents]
        plan = compile_plan(lengths, self.world_size, **self.compile_options)
        tokens = torch.cat(list(documents))
        total = tokens.shape[0]
        lo, hi = self.rank * total // self.world_size, (self.rank + 1) * total // self.world_size
        rank_plan: RankPlan = load_rank_plan(plan.to_bytes(), self.rank)
        return {"tokens": tokens[lo:hi], "lengths": lengths, "plan": rank_plan}

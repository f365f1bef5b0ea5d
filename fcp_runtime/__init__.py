"""fcp_runtime: replay one rank's fcp plan in torch (flash-attn + NCCL on GPUs, an exact kernel + gloo on CPU)."""

from fcp_runtime.attention import (KVPrefetch, PlanMismatchError, check_plan, dispatch, fcp_attn_func, prefetch_kv,
                                   recording, undispatch)
from fcp_runtime.plan import KindsRankPlan, RankPlan, load_rank_plan

__all__ = ["KVPrefetch", "KindsRankPlan", "PlanMismatchError", "RankPlan", "check_plan", "dispatch", "fcp_attn_func",
           "load_rank_plan", "prefetch_kv", "recording", "undispatch"]

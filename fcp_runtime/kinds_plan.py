"""A plan of layer kinds on one rank: a RankPlan for each kind, all of one layout, and how a call picks its kind."""

from __future__ import annotations

import torch

from fcp_runtime.rank_plan import RankPlan


# What every layer kind of a plan must share on a rank: its rows in both layouts and how they move
# between them (one dispatch for every kind).
_SHARED_LAYOUT = ("rank", "num_ranks", "layout", "user_tokens", "plan_tokens", "token_index", "user_gather",
                  "send_splits", "plan_scatter", "recv_splits")


# What a KindsRankPlan answers for every kind: the layout, the batch, the attention shape and the inputs' digest.
_LAYOUT_ATTRIBUTES = frozenset({*_SHARED_LAYOUT, "position_ids", "sequence_ids", "seq_lengths", "self_user_rows",
                                "self_plan_rows", "digest", "q_heads", "kv_heads", "head_dim", "dtype"})


class KindsRankPlan:
    """One rank's plans for every layer kind of a plan of layer kinds (fcp_compiler.format.kinds): one layout, so the
    batch is dispatched once, and a program a kind. The layout's attributes (`token_index`, `position_ids`,
    `plan_tokens`, ...) are every kind's; :meth:`kind` and :meth:`for_mask` give a kind's RankPlan, which
    ``fcp_attn_func(..., kind=NAME)`` (or its `mask`) picks.

    Raises (on construction):
        fcp_compiler.PlanFormatError: kinds whose layouts differ on this rank.
    """

    def __init__(self, kinds: dict[str, RankPlan], num_layers: dict[str, int], masks: dict[str, tuple],
                 primary: str):
        from fcp_compiler.errors import PlanFormatError

        self.kinds, self.num_layers, self.masks, self.primary = dict(kinds), dict(num_layers), dict(masks), primary
        first = self.kinds[primary]
        for name, plan in self.kinds.items():
            for attribute in _SHARED_LAYOUT:
                mine, theirs = getattr(plan, attribute), getattr(first, attribute)
                same = torch.equal(mine, theirs) if isinstance(mine, torch.Tensor) else mine == theirs
                if not same:
                    raise PlanFormatError(f"layer kind {name!r} has another {attribute} than kind {primary!r} on rank "
                                          f"{first.rank}: a plan's layer kinds share one layout")
        self._by_mask = {mask: name for name, mask in self.masks.items()}

    def __getattr__(self, name: str):
        # The layout and batch every kind shares, read from the primary kind; a schedule's attributes are a kind's.
        if name in _LAYOUT_ATTRIBUTES:
            return getattr(self.kinds[self.primary], name)
        if name.startswith("_") or name in ("kinds", "primary", "num_layers", "masks"):
            raise AttributeError(name)
        raise AttributeError(f"{name!r} belongs to one layer kind's schedule: take plan.kind(NAME).{name} (kinds: "
                             f"{', '.join(self.kinds)})")

    @property
    def has_windows(self) -> bool:
        """Whether any kind has a sliding window (the kernels must take windows)."""
        return any(plan.has_windows for plan in self.kinds.values())

    def kind(self, name: str) -> RankPlan:
        """A kind's plan by name.

        Raises:
            ValueError: naming the kinds the plan has.
        """
        if name not in self.kinds:
            raise ValueError(f"layer kind {name!r} is not in the plan; its kinds: {', '.join(self.kinds)}")
        return self.kinds[name]

    def for_mask(self, causal: bool, window: int | None) -> RankPlan:
        """The kind whose mask is a layer's (causal or not, a sliding window of `window` keys or none).

        Raises:
            ValueError: no kind has it (the kinds' masks are named).
        """
        name = self._by_mask.get((bool(causal), window))
        if name is None:
            have = ", ".join(f"{kind} {_mask_name(*mask)}" for kind, mask in self.masks.items())
            raise ValueError(f"no layer kind of the plan has the layer's mask {_mask_name(causal, window)} (the "
                             f"plan's kinds: {have}); compile the plan with this layer's kind "
                             f"(HFPlanningCollate.for_model(model) reads every layer's; layer_masks=... in Python, "
                             f"--layer-masks on the command line)")
        return self.kinds[name]


def _mask_name(causal: bool, window: int | None) -> str:
    return "full" if not causal else ("causal" if window is None else f"sliding window {window}")


def resolve_kind(plan: RankPlan | KindsRankPlan, kind: str | None = None,
                 mask: tuple[bool, int | None] | None = None) -> RankPlan:
    """The RankPlan a call runs: `plan` itself for a plan of one kind, else the kind named, or the one whose mask is
    the layer's `mask` (causal, window).

    Raises:
        ValueError: a kind named for a plan of one kind, an unknown kind, or a plan of layer kinds and neither a kind
            nor a mask to choose one by.
    """
    if isinstance(plan, KindsRankPlan):
        if kind is not None:
            return plan.kind(kind)
        if mask is not None:
            return plan.for_mask(*mask)
        raise ValueError(f"the plan holds a schedule for each of the layer kinds {', '.join(plan.kinds)}; name the "
                         f"layer's (kind=...) or give its mask")
    if kind is not None:
        raise ValueError(f"kind={kind!r} names a layer kind, but the plan holds one schedule for every layer "
                         f"(compile it with layer_masks=... in Python, --layer-masks on the command line, for kinds)")
    return plan


def layout_plan(plan: RankPlan | KindsRankPlan) -> RankPlan:
    """The RankPlan whose layout a dispatch reads: the plan, or the primary kind of a plan of layer kinds (every kind's
    layout is one)."""
    return plan.kinds[plan.primary] if isinstance(plan, KindsRankPlan) else plan


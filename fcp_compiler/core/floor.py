"""The floor: FCP never emits a plan slower than one of its own simpler candidates.

FCP's placement balances each rank's layer time; whether its traffic hides is known only once the plan is scheduled.
So `compile_plan` schedules a few placements, direct and, where it may pay, with node fan-out, scores every resulting
plan by the timing model (:mod:`fcp_compiler.core.simulate`: the forward plus backward layer makespan, exactly what
`fcp simulate` reports) and keeps the fastest whose live buffers fit the memory budget (MEMORY_BUDGET_STAGES x
coalesce x block size tokens). A candidate over the budget is scheduled again with smaller backward stages and then,
if it is near, smaller stages in both passes; one still over it is out. It is a floor, not the method: the
candidates are the placements FCP would otherwise lose to.

- ``layer``: FCP's own placement (`assign` for each rank's layer time, under the token tolerance), and the same at
  the looser tolerances of LAYER_TOLERANCES (``layer-tokens-5%``, ``layer-tokens-10%``);
- ``attention``: FCP's placement of attention alone (the joint compute/traffic search, tokens under the cap only);
- ``greedy``: a MagiAttention-like equal-chunk greedy (fixed slices of the packed batch, a min-heap on attention
  area, the same number of slices a rank), run through FCP's own transfer passes (node grouping, fan-out, relays);
- ``magi``: the same placement routed as `--planner magi` routes it (each block's owner where its tokens live, no
  node grouping; relays where they fit), direct. Neither route wins everywhere: on the 55 matrix batches the magi
  route was faster on 3 (by up to 1.2%) and slower on 7 (by up to 1.9%) than node grouping.
"""

from __future__ import annotations

import enum
import math
from dataclasses import dataclass

# The floor's work is bounded: it schedules at most this many tiles in all (candidates x the batch's tiles), and
# always FCP's own placement. At the seed's 32K tokens a GPU that is every candidate up to about 256 GPUs (75K
# tiles), three at 1024 and one at 4096 (1.2M tiles), where a schedule takes 15-20 s on one core.
TILE_BUDGET = 1_000_000


def most_scheduled(num_tiles: int) -> int:
    """How many candidates the floor schedules for a batch of `num_tiles` tiles (at least one)."""
    return max(1, TILE_BUDGET // max(num_tiles, 1))


# Live buffer tokens a plan may hold on any rank, in stages' worth of pulls (coalesce x block size): what the
# runtime's memory can give. A candidate over it is kept only when every candidate is over it (then the one with the
# fewest); time does not buy memory.
MEMORY_BUDGET_STAGES = 4


class Placement(str, enum.Enum):
    """Which placement a floor candidate schedules."""

    LAYER = "layer"
    LAYER_TOKENS_5 = "layer-tokens-5%"
    LAYER_TOKENS_10 = "layer-tokens-10%"
    ATTENTION = "attention"
    GREEDY = "greedy"
    MAGI = "magi"


EQUAL_CHUNKS = (Placement.GREEDY, Placement.MAGI)  # the placements of MagiAttention's dispatch, not FCP's assign

# Node fan-out is not scheduled where the busiest receiver of its pulls (NIC entries and the NVLink re-sends) would
# take in more than this many live-buffer budgets of tokens over a pass, when the direct twin of the candidate is
# tried too. An entry holds its block until it has re-sent it, and a rank receives up to a stage's rounds of pulls on
# each link class; a rule measured, not a bound: on the 54 batches of benchmarks/layer_objective.py's matrix (64 and
# 256 GPUs, seeds 0-2) every fan-out candidate that fit the budget took in at most 1.38 budgets on its busiest
# receiver (the winners at most 0.78), and every one above 1.45 came out over it at every stage size the floor
# tries. Leaving out those above 2 changed no plan and made the 256-GPU matrix compile 6% faster (measured with
# benchmarks/compile_matrix.py; the step's record is in the git history of docs/RESULTS.md).
FAN_OUT_MOST_RECEIVED = 2


def fan_out_out_of_reach(most_received_tokens: int, memory_budget_tokens: int) -> bool:
    """Whether a node fan-out candidate whose busiest receiver takes in `most_received_tokens` over a pass is left
    unscheduled: more than FAN_OUT_MOST_RECEIVED budgets of `memory_budget_tokens` live buffer tokens."""
    return most_received_tokens > FAN_OUT_MOST_RECEIVED * memory_budget_tokens


# The layer placement's token tolerance for each of its candidates (None: the options' own). How far ranks may
# hold more tokens than the mean trades linear-layer balance against attention traffic, and no one tolerance is
# best: on 18 real-distribution batches (benchmarks/placement.py's kinds at 64 and 256 GPUs, seed 0, direct pulls)
# 1%, 5% and 10% each gave the least layer time on some, by up to 9% (ProLong + tail at 256 GPUs: 477.7, 447.2 and
# 467.9 ms; WLB-LLM + tail at 64: 487.6, 487.6 and 446.3 ms).
LAYER_TOLERANCES = {Placement.LAYER: None, Placement.LAYER_TOKENS_5: 0.05, Placement.LAYER_TOKENS_10: 0.10}


@dataclass(frozen=True, slots=True, kw_only=True)
class Candidate:
    """One plan the floor compares: a placement, with or without node fan-out."""

    placement: Placement
    fan_out: bool

    @property
    def name(self) -> str:
        """How the stats name it, e.g. "layer+fan-out" or "greedy direct"."""
        return f"{self.placement.value}{'+fan-out' if self.fan_out else ' direct'}"


@dataclass(frozen=True, slots=True, kw_only=True)
class Score:
    """A scheduled candidate's figures: its simulated layer makespans and its peak live buffer tokens."""

    candidate: Candidate
    coalesce: int  # rounds a forward stage it was scheduled with (fewer than asked where memory needed)
    backward_rounds: int  # rounds a backward stage (2 x coalesce unless memory needed fewer)
    layer_makespan_fwd_s: float
    layer_makespan_bwd_s: float
    max_buffer_tokens: int
    relays: bool = True  # False: relays would have held blocks past the budget the schedule met, so none were made
    # Its placement's busiest rank's layer work (no schedule is faster); None for the only candidate (not bounded).
    busy_lower_bound_s: float | None = 0.0
    seconds: float = 0.0  # what placing (where it was the first candidate of its placement) and scheduling it took
    # With layer kinds (core.kinds): the other kinds' forward plus backward makespans on this placement, each
    # weighted by its layers per layer of the kind scheduled here, so that the floor chooses by the model's mix.
    kinds_s: float = 0.0

    @property
    def name(self) -> str:
        """The candidate's name with its stage sizes: rounds a forward stage / a backward stage."""
        return f"{self.candidate.name} c{self.coalesce}/{self.backward_rounds}{'' if self.relays else ' no relays'}"

    @property
    def layer_seconds(self) -> float:
        """What a training step pays for the layer: forward plus backward makespan (with layer kinds, per layer of
        this kind, the others' weighted in)."""
        return self.layer_makespan_fwd_s + self.layer_makespan_bwd_s + self.kinds_s


def candidates(attention_only: bool, fan_out: bool | None, tolerances: bool = True) -> list[Candidate]:
    """The candidates in the order they are tried (ties go to the earlier).

    When both switches are tried (`fan_out` None), only FCP's own placement is tried with node fan-out here; the
    fastest of the others follows with it (:func:`fan_out_follower`). Fan-out holds each entry's block across
    stages, so it is over the memory budget on most batches, and scheduling a plan only to find it over is the
    floor's most expensive outcome. On the 55 batches of benchmarks/layer_objective.py's matrix (before this rule),
    a fan-out candidate won 9; each was FCP's own placement or the fastest direct one, and when FCP's own was over
    the budget with fan-out the others' fan-out won none (it fit on 3 of 29).

    The attention-alone placement (its joint compute/traffic search) is tried only where the looser tolerances are
    not: beside the layer placements at three tolerances it won 1 of the 54 batches of benchmarks/layer_objective.py's
    matrix, by 0.04% (ProLong at 256 GPUs, seed 1), while its search and schedule took 15-26% of the compile time
    (benchmarks/compile_matrix.py); the other 53 plans stay byte-identical without it.

    Args:
        attention_only: no model around attention (the layer placement is then the attention placement).
        fan_out: the user's node fan-out switch; None tries both.
        tolerances: also the layer placement at the looser token tolerances of LAYER_TOLERANCES (not when the user
            gave one, nor without a model or outside the plan layout, where tokens are not the linear layers' load);
            the attention placement is tried only without them.
    Returns:
        the candidates, FCP's own placement first (direct first: its fan-out holds more memory), the magi route
        last and direct only.
    """
    looser = [Placement.LAYER_TOKENS_5, Placement.LAYER_TOKENS_10] if tolerances and not attention_only else []
    attention = [] if attention_only or looser else [Placement.ATTENTION]
    placements = [Placement.LAYER] + looser + attention + [Placement.GREEDY]
    if fan_out is None:
        own = [Candidate(placement=Placement.LAYER, fan_out=False), Candidate(placement=Placement.LAYER, fan_out=True)]
        others = [Candidate(placement=placement, fan_out=False) for placement in placements[1:]]
    else:
        own, others = [], [Candidate(placement=placement, fan_out=fan_out) for placement in placements]
    return own + others + ([Candidate(placement=Placement.MAGI, fan_out=False)] if not fan_out else [])


def fan_out_follower(scores: list[Score], memory_budget_tokens: int) -> Candidate | None:
    """The candidate tried after :func:`candidates` when both switches are: the fastest direct placement with node
    fan-out, when it is not FCP's own and FCP's own fit the memory budget with fan-out (the magi route's placement
    is the greedy one).

    Args:
        scores: the candidates scheduled so far.
        memory_budget_tokens: the most live buffer tokens a rank may hold.
    Returns:
        the candidate, or None.
    """
    own = [score for score in scores if score.candidate == Candidate(placement=Placement.LAYER, fan_out=True)]
    if not own or own[0].max_buffer_tokens > memory_budget_tokens or not math.isfinite(own[0].layer_seconds):
        return None
    direct = [score for score in scores if not score.candidate.fan_out and math.isfinite(score.layer_seconds)
              and score.max_buffer_tokens <= memory_budget_tokens]
    if not direct:
        return None
    fastest = min(direct, key=lambda score: score.layer_seconds).candidate.placement  # the first on a tie
    fastest = Placement.GREEDY if fastest is Placement.MAGI else fastest
    return None if fastest is Placement.LAYER else Candidate(placement=fastest, fan_out=True)


def choose(scores: list[Score], memory_budget_tokens: int) -> int:
    """Index of the winner: the least layer time among the scores within the memory budget, else the least buffer.

    Args:
        scores: the scheduled candidates, in the order tried.
        memory_budget_tokens: the most live buffer tokens a rank may hold.
    Returns:
        the index in `scores` (the first on a tie).
    """
    assert scores
    fitting = [idx for idx, score in enumerate(scores) if score.max_buffer_tokens <= memory_budget_tokens]
    if fitting:
        return min(fitting, key=lambda idx: (scores[idx].layer_seconds, idx))
    return min(range(len(scores)), key=lambda idx: (scores[idx].max_buffer_tokens, scores[idx].layer_seconds, idx))

"""Placement: the first passes, shard, cost and assign, which put a batch's blocks and tiles on ranks.

FCP places its own blocks (:func:`shard_and_cost`, then `assign` for each rank's layer time or attention alone); a
baseline shards and places as its system does (:mod:`fcp_compiler.core.baselines`). The floor
(:mod:`fcp_compiler.core.floor`) compares several placements, named by :class:`Placement`; the passes after these
(transfers, rounds, stages) are :mod:`fcp_compiler.core.schedule_search`'s.
"""

from __future__ import annotations

import enum

import numpy as np

from fcp_compiler.algorithms.limits import MAX_SEGMENT_PAIRS, least_segment_pairs, segment_pairs
from fcp_compiler.core.baselines import BASELINES, Planner
from fcp_compiler.core.ir import Assignment, Batch, TileSet, ZigzagMode
from fcp_compiler.core.layer_model import LINEAR_WEIGHT, LayerCosts
from fcp_compiler.core.options import CompileOptions
from fcp_compiler.core.pass_timer import PassTimer
from fcp_compiler.core.passes.assign import assign
from fcp_compiler.core.passes.cost import cost, ring_cost, ring_in_closed_form
from fcp_compiler.core.passes.shard import pairs_chunks, shard
from fcp_compiler.errors import InfeasibleError
from fcp_compiler.format.inputs import Layout

# A rank may be 2% above the compute lower bound before tiles of heavy blocks are moved off their owner.
BALANCE_TOLERANCE = 0.02


class Placement(str, enum.Enum):
    """Which placement a floor candidate schedules."""

    LAYER = "layer"
    LAYER_TOKENS_1 = "layer-tokens-1%"
    LAYER_TOKENS_10 = "layer-tokens-10%"
    ATTENTION = "attention"
    GREEDY = "greedy"
    MAGI = "magi"


EQUAL_CHUNKS = (Placement.GREEDY, Placement.MAGI)  # the placements of MagiAttention's dispatch, not FCP's assign

# The layer placement's token tolerance for each of its candidates (None: the options' own). How far ranks may
# hold more tokens than the mean trades linear-layer balance against attention traffic, and no one tolerance is
# best: on 18 real-distribution batches (benchmarks/placement.py's kinds at 64 and 256 GPUs, seed 0, direct pulls)
# 1%, 5% and 10% each gave the least layer time on some, by up to 9% (ProLong + tail at 256 GPUs: 477.7, 447.2 and
# 467.9 ms; WLB-LLM + tail at 64: 487.6, 487.6 and 446.3 ms). FCP's own placement is the options' (5% by default:
# options.LAYER_TOKEN_TOLERANCE), the floor's others 1% and 10%.
LAYER_TOLERANCES = {Placement.LAYER: None, Placement.LAYER_TOKENS_1: 0.01, Placement.LAYER_TOKENS_10: 0.10}


def place(timer: PassTimer, batch: Batch, options: CompileOptions, token_cap: int, placement: Placement,
          tiles: TileSet | None = None) -> Assignment:
    """shard, cost and assign (docs/DESIGN.md section 6).

    Args:
        timer: times each pass.
        batch: the batch to place.
        options: the compile options (planner, ranks, block size, model, layout, tolerances).
        token_cap: the most tokens a rank may hold (a baseline's placement may need more: its assignment says so).
        placement: FCP's placement for each rank's layer time (at the tolerance LAYER_TOLERANCES gives) or for
            attention alone, the equal-chunk greedy of the floor, or, for a baseline planner, its own.
        tiles: FCP's tiles where the caller holds them (default: sharded and costed here, :func:`shard_and_cost`).
    Returns:
        the Assignment: each block's and each tile's rank.
    Raises:
        InfeasibleError: a token cap no placement meets, or a plan larger than fcp validate checks.
    """
    planner, num_ranks, block_size = options.planner, options.num_ranks, options.resolved_block_size
    if planner is Planner.FCP and placement not in EQUAL_CHUNKS:
        tiles = tiles if tiles is not None else shard_and_cost(timer, batch, options)
        # The linear layers run on a rank's blocks only in the plan layout; in the user layout they run on the even
        # user chunks whatever the placement, which then weighs attention (and its reshuffle, by home ranks) alone.
        by_layer = placement in LAYER_TOLERANCES and options.model is not None and options.layout is Layout.PLAN
        linear = LayerCosts.of(options.model, options.profile).linear_seconds_per_token * LINEAR_WEIGHT \
            if by_layer else 0.0
        tolerance = options.token_tolerance
        if placement in LAYER_TOLERANCES:
            tolerance = LAYER_TOLERANCES[placement] or options.resolved_token_tolerance
        return timer.run("assign", assign, tiles, num_ranks, token_cap, BALANCE_TOLERANCE, tolerance, linear)
    baseline = Planner.MAGI if placement in EQUAL_CHUNKS else planner
    sharding, block_rank = timer.run("shard", BASELINES[baseline], batch, num_ranks, block_size, token_cap)
    check_validatable(sharding, options)
    if baseline is Planner.RING and ring_in_closed_form(sharding):
        tiles = timer.run("cost", ring_cost, sharding, block_rank, num_ranks, options.shape, options.profile)
    else:
        tiles = timer.run("cost", cost, sharding, options.shape, options.profile)
    rank_tokens = np.bincount(block_rank, weights=sharding.block_tokens, minlength=num_ranks)
    return timer.run("assign", Assignment, tiles=tiles, num_ranks=num_ranks,
                     token_cap=max(token_cap, int(rank_tokens.max())), block_rank=block_rank,
                     tile_rank=block_rank[tiles.tile_q_block])


def shard_and_cost(timer: PassTimer, batch: Batch, options: CompileOptions) -> TileSet:
    """FCP's shard and cost (the layer and attention placements share them: one tile set, costed once).

    Raises:
        InfeasibleError: a sharding larger than fcp validate checks (:func:`check_validatable`).
    """
    block_size = options.resolved_block_size
    # Zigzag gives every block of a sequence the same work and nearly the same traffic, which is what lets the
    # placement balance compute and traffic together (plain blocks carry about a third less traffic, but the
    # heavy last blocks of a long sequence leave it unbalanced: measured in benchmarks/balance.py).
    zigzag_on = options.zigzag is ZigzagMode.ON or (
        options.zigzag is ZigzagMode.AUTO and bool((pairs_chunks(batch) & batch.seq_causal
                                                    & (batch.lengths >= 2 * block_size)).any()))
    sharding = timer.run("shard", shard, batch, block_size, zigzag_on)
    check_validatable(sharding, options)
    return timer.run("cost", cost, sharding, options.shape, options.profile)


def check_least_pairs(batch: Batch, options: CompileOptions) -> None:
    """Refuse, from its lengths alone, a batch FCP's blocks would cut into more segment pairs than fcp validate
    checks (unless options.validatable is off): sequences of L tokens are cut into at least L / B segments each, so
    the refusal comes before sharding allocates per block.

    Raises:
        InfeasibleError: naming the least number of pairs.
    """
    if options.validatable and options.planner is Planner.FCP:
        least = least_segment_pairs(batch.lengths, options.resolved_block_size)
        if least > MAX_SEGMENT_PAIRS:
            raise too_many_pairs(least, options, at_least=True)


def check_validatable(sharding, options: CompileOptions) -> None:
    """Refuse a sharding the validator would refuse (unless options.validatable is off).

    Raises:
        InfeasibleError: naming its segment pairs.
    """
    if options.validatable:
        num_pairs = segment_pairs(sharding.seg_seq, sharding.batch.num_sequences)
        if num_pairs > MAX_SEGMENT_PAIRS:
            raise too_many_pairs(num_pairs, options)


def too_many_pairs(num_pairs: int, options: CompileOptions, at_least: bool = False) -> InfeasibleError:
    """The refusal of a plan of `num_pairs` segment pairs, more than fcp validate checks."""
    return InfeasibleError(
        f"the plan would cut its sequences into {'at least ' if at_least else ''}{num_pairs:,} segment pairs, more "
        f"than the {MAX_SEGMENT_PAIRS:,} fcp validate checks (block size {options.resolved_block_size}); use a larger "
        f"--block-size, or fewer or shorter sequences")


def same_placement(first: Assignment, second: Assignment) -> bool:
    """Whether two placements of one tile set put every block and every tile on the same rank."""
    return first.tiles is second.tiles and np.array_equal(first.block_rank, second.block_rank) and \
        np.array_equal(first.tile_rank, second.tile_rank)

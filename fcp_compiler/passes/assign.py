"""Pass 3: place blocks on ranks (LPT under a token cap, refined) and decide where each tile runs."""

from __future__ import annotations

import numpy as np

from fcp_compiler.algorithms.bounds import makespan_lower_bound
from fcp_compiler.algorithms.comm_balance import balance_two_dimensional
from fcp_compiler.algorithms.lpt import UNPLACED, lpt_with_cap, refine_moves_swaps
from fcp_compiler.algorithms.offload import offload_tiles
from fcp_compiler.errors import InfeasibleError
from fcp_compiler.ir import Assignment, TileSet


# How far above the mean compute and the mean received volume the joint search lets a rank go.
TWO_DIMENSIONAL_SEARCH = dict(compute_tolerance=0.01, received_tolerance=0.07)
TWO_DIMENSIONAL_ROUNDS = 3


def default_token_cap(total_tokens: int, num_ranks: int, block_size: int) -> int:
    """The mean tokens per rank (rounded up) plus one block: always feasible, and memory stays balanced."""
    return -(-total_tokens // num_ranks) + block_size


def _place_blocks(tiles: TileSet, num_ranks: int, token_cap: int) -> np.ndarray:
    """LPT under the cap, then move/swap refinement of compute (steps 1 and 2 of :func:`assign`)."""
    sharding = tiles.sharding
    sizes = sharding.block_tokens
    total = int(sizes.sum())
    if token_cap * num_ranks < total or (sizes.size and token_cap < int(sizes.max())):
        raise InfeasibleError(
            f"token cap {token_cap} cannot hold {total} tokens on {num_ranks} ranks in blocks of up to "
            f"{int(sizes.max())} tokens; it must be at least {max(-(-total // num_ranks), int(sizes.max()))} "
            f"(the default, {default_token_cap(total, num_ranks, sharding.block_size)}, always fits)")
    weights = tiles.block_seconds
    block_rank = lpt_with_cap(weights, sizes, num_ranks, token_cap)
    if (block_rank == UNPLACED).any():
        block = int(np.flatnonzero(block_rank == UNPLACED)[0])
        raise InfeasibleError(
            f"token cap {token_cap}: no rank has room for block {block} ({int(sizes[block])} tokens); use a cap of "
            f"at least {default_token_cap(total, num_ranks, sharding.block_size)}")
    return refine_moves_swaps(weights, sizes, block_rank, num_ranks, token_cap)


def block_needs(tiles: TileSet) -> tuple[np.ndarray, np.ndarray]:
    """Pairs (block b, segment k of another block that b's queries read), unique, sorted by block."""
    seg_block = tiles.sharding.seg_block
    q_block = seg_block[tiles.pair_q_seg]
    foreign = seg_block[tiles.pair_kv_seg] != q_block
    key = np.unique(q_block[foreign] * tiles.sharding.num_segments + tiles.pair_kv_seg[foreign])
    return key // tiles.sharding.num_segments, key % tiles.sharding.num_segments


def assign(tiles: TileSet, num_ranks: int, token_cap: int, balance_tolerance: float = 0.01) -> Assignment:
    """Place every block on a rank within the token cap, balancing modelled compute.

    1. LPT: blocks by decreasing work onto the least-loaded rank with room, O(K log N).
    2. Refinement: moves and swaps off the most loaded rank while they lower it.
    3. Compute and traffic together: moves and swaps off the rank furthest above either mean (1% for compute,
       7% for bytes received), counting each pulled segment once per rank.
    4. Where whole blocks still leave a rank above (1 + balance_tolerance) x the lower bound (a heavy block
       outweighs the mean), some tiles of its heaviest query blocks run on the least-loaded ranks instead.

    Args:
        tiles: the tile set (work per block).
        num_ranks: N.
        token_cap: most tokens a rank may hold.
        balance_tolerance: relative slack over the lower bound before tiles are moved.
    Returns:
        the Assignment.
    Raises:
        InfeasibleError: when no rank has room for some block under the cap.
    """
    sharding = tiles.sharding
    sizes = sharding.block_tokens
    weights = tiles.block_seconds
    block_rank = _place_blocks(tiles, num_ranks, token_cap)
    bound, _ = makespan_lower_bound(float(tiles.tile_seconds.sum()), num_ranks,
                                    float(tiles.tile_seconds.max()) if tiles.num_tiles else 0.0)
    need_block, need_seg = block_needs(tiles)
    for _ in range(TWO_DIMENSIONAL_ROUNDS):
        # Each round balances against the mean volume it starts from; moves shift that mean, so repeat while the
        # traffic is still outside its tolerance.
        moved = balance_two_dimensional(block_rank, weights, sizes, sharding.seg_block, sharding.seg_seq,
                                        sharding.seg_tokens, need_block, need_seg, num_ranks, token_cap,
                                        **TWO_DIMENSIONAL_SEARCH)
        if np.array_equal(moved, block_rank):
            break
        block_rank = moved
    tile_rank = offload_tiles(tiles.tile_q_block, tiles.tile_kv_block, tiles.tile_seconds, block_rank, num_ranks,
                              target=bound * (1.0 + balance_tolerance))
    return Assignment(tiles=tiles, num_ranks=num_ranks, token_cap=token_cap, block_rank=block_rank,
                      tile_rank=tile_rank)

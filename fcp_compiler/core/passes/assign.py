"""Pass 3: place blocks on ranks (LPT under a token cap, refined) and decide where each tile runs."""

from __future__ import annotations

import numpy as np

from fcp_compiler.algorithms.bounds import makespan_lower_bound
from fcp_compiler.algorithms.comm_balance import balance_two_dimensional
from fcp_compiler.algorithms.dense_zigzag import dense_zigzag_needs, num_dense_needs
from fcp_compiler.algorithms.keys import unique_keys
from fcp_compiler.algorithms.lpt import UNPLACED, level_sizes, lpt_with_cap, refine_moves_swaps
from fcp_compiler.algorithms.offload import offload_tiles, split_heavy_blocks
from fcp_compiler.algorithms.ranges import user_layout_bounds
from fcp_compiler.core.ir import Assignment, TileSet
from fcp_compiler.errors import InfeasibleError


# How far above the mean compute and the mean received volume the joint search lets a rank go.
TWO_DIMENSIONAL_SEARCH = dict(compute_tolerance=0.01, received_tolerance=0.045)
TWO_DIMENSIONAL_ROUNDS = 3
# With linear layers in the load the joint search is not run: trading a rank's layer balance for received volume
# made the simulated layer slower (benchmarks/layer_objective.py, 54 batches: 3 rounds against none, max gap 1.330
# against 1.286, 13 against 8 pass-batches slower than attention-alone placement, compile at 256 GPUs twice as long;
# one round sat between).
LAYER_TWO_DIMENSIONAL_ROUNDS = 0
# How far above the mean visible (q, k) pairs the joint search lets a rank go: balance that holds without trusting
# the efficiency curve.
PAIR_TOLERANCE = 0.025
# LPT sends a block to its user-layout rank when that rank is within this fraction of the mean of the least loaded.
HOME_SLACK = 0.0
# Work a heavy block's owner keeps, and the most work per batch of its other tiles, as a share of the mean.
HELPER_PIECE = 0.75
# Tokens of other owners' query blocks the offload lets a helper come to run tiles of (3 blocks of the default 4096
# tokens). Each is a Q pull whose partial outputs stay live until pushed back, and a NIC receive where it crosses
# nodes; in the backward a pulled query row holds about 80 KB (Q, O, dO, LSE, fp32 dQ, llama3-70b) against 12 KB
# for a key/value row, so a helper's blocks crowd the device budget and shrink its stages. Unlimited, the
# least-loaded rank took them all: 18 blocks on one rank of Wikipedia + tail at 64 GPUs, seed 0, 8.6 GiB where the
# budget is 4 (`fcp compile --no-floor --node-fan-out off` at c71c203). FCP's own placement alone (`--no-floor`, 4
# GiB) on the 54 matrix batches against 6 blocks: 0.7% faster (geometric mean; 10 faster by over 0.5%, 4 slower by
# at most 1.2%), its worst against the floor 1.080 (1.198), within 0.5% of the floor on 30 (29) and within 2% on
# 43 (40); the floor's plans the same but three (one 1.8% faster, one 0.2% slower). 2 and 4 blocks did as much
# for FCP alone (0.8% and 0.6%) with floor plans up to 1.2% slower; none keeps helpers from balancing: at 0 the
# floor was 1.0% slower (16 plans by over 0.5%).
HELPED_TOKENS = 12288


def default_token_cap(total_tokens: int, num_ranks: int, block_size: int) -> int:
    """The mean tokens per rank (rounded up) plus one block: always feasible, and memory stays balanced."""
    return -(-total_tokens // num_ranks) + block_size


def _place_items(weights: np.ndarray, sizes: np.ndarray, num_ranks: int, token_cap: int,
                 block_size: int, preferred: np.ndarray | None = None, slack: float = 0.0,
                 token_tolerance: float | None = None) -> tuple[np.ndarray, int]:
    """LPT under the cap, then move/swap refinement of compute (steps 1 and 2 of :func:`assign`).

    With a token tolerance, LPT runs under the tighter cap of (1 + token_tolerance) x the mean tokens (or the
    largest item); items that find no room there go to the rank with the most room, and moves and swaps of sizes
    then bring ranks under the tight cap where whole blocks allow. Returns the placement and the cap it keeps.
    """
    total = int(sizes.sum())
    if token_cap * num_ranks < total or (sizes.size and token_cap < int(sizes.max())):
        raise InfeasibleError(
            f"token cap {token_cap} cannot hold {total} tokens on {num_ranks} ranks in blocks of up to "
            f"{int(sizes.max())} tokens; it must be at least {max(-(-total // num_ranks), int(sizes.max()))} "
            f"(the default, {default_token_cap(total, num_ranks, block_size)}, always fits)")
    tight = token_cap
    if token_tolerance is not None:
        tight = min(token_cap, max(int(np.ceil(total / num_ranks * (1.0 + token_tolerance))), int(sizes.max())))
    item_rank = lpt_with_cap(weights, sizes, num_ranks, tight, preferred, slack)
    unplaced = np.flatnonzero(item_rank == UNPLACED)
    if unplaced.size and tight < token_cap:
        used = np.bincount(item_rank[item_rank >= 0], weights=sizes[item_rank >= 0], minlength=num_ranks)
        for item in unplaced.tolist():
            rank = int(np.argmin(used))
            if used[rank] + sizes[item] <= token_cap:
                item_rank[item] = rank
                used[rank] += sizes[item]
        if (item_rank >= 0).all():
            item_rank = level_sizes(weights, sizes, item_rank, num_ranks, tight)
        else:  # the cap itself is tight: place under it alone, as without a tolerance
            item_rank = lpt_with_cap(weights, sizes, num_ranks, token_cap, preferred, slack)
    if (item_rank == UNPLACED).any():
        block = int(np.flatnonzero(item_rank == UNPLACED)[0])
        raise InfeasibleError(
            f"token cap {token_cap}: no rank has room for block {block} ({int(sizes[block])} tokens); use a cap of "
            f"at least {default_token_cap(total, num_ranks, block_size)}")
    kept = max(tight, int(np.bincount(item_rank, weights=sizes, minlength=num_ranks).max()))
    return refine_moves_swaps(weights, sizes, item_rank, num_ranks, kept), kept


def home_ranks(sharding, num_ranks: int) -> np.ndarray:
    """The user-layout rank holding each block's first token (where most of a block's tokens usually are)."""
    bounds = user_layout_bounds(sharding.batch.total_tokens, num_ranks)
    first = sharding.block_seg_offsets[:-1]
    start = sharding.batch.seq_offsets[sharding.seg_seq[first]] + sharding.seg_start[first]
    return np.searchsorted(bounds, start, side="right") - 1


def block_needs(tiles: TileSet) -> tuple[np.ndarray, np.ndarray]:
    """Pairs (block b, segment k of another block that b's queries read), unique, sorted by block.

    The blocks of dense causal zig-zag sequences (tiles.dense) read what :func:`dense_zigzag_needs` says in closed
    form (their n^2 tiles are millions of segment pairs at small blocks); every other block's needs come from its
    listed pairs.
    """
    sharding = tiles.sharding
    seg_block, num_segments = sharding.seg_block, sharding.num_segments
    first_block, num_dense, first_seg = tiles.dense.first_block, tiles.dense.num_blocks, tiles.dense.first_seg
    q_block = seg_block[tiles.listed_pair_q_seg]
    wanted = seg_block[tiles.listed_pair_kv_seg] != q_block
    # Counting instead of sorting where the (block, segment) space is small enough: millions of pairs at small blocks.
    key = unique_keys(q_block[wanted] * num_segments + tiles.listed_pair_kv_seg[wanted],
                      sharding.num_blocks * num_segments)
    if first_block.size == 0:
        return key // num_segments, key % num_segments
    # A dense sequence's rows are a run of its own blocks, which no other need has: each goes in whole, in order,
    # written in place between the others.
    sizes = num_dense_needs(num_dense)
    dense_before = np.concatenate(([0], np.cumsum(sizes)))
    generic_at = np.arange(key.size) + dense_before[np.searchsorted(first_block * num_segments, key, side="right")]
    need_block = np.empty(key.size + int(dense_before[-1]), dtype=np.int64)
    need_seg = np.empty_like(need_block)
    need_block[generic_at], need_seg[generic_at] = key // num_segments, key % num_segments
    dense_zigzag_needs(first_block, num_dense, first_seg, out=(need_block, need_seg),
                       out_offset=np.searchsorted(key, first_block * num_segments) + dense_before[:-1])
    return need_block, need_seg


def _own_tiles(tile_batch: np.ndarray, *columns: np.ndarray) -> tuple[np.ndarray, ...]:
    """The columns at the tiles left with their query block (tile_batch -1): all of them, uncopied, when no block
    lent tiles to a helper batch (millions of tiles at small blocks)."""
    own = tile_batch < 0
    return columns if own.all() else tuple(column[own] for column in columns)


def _refine_jointly(tiles: TileSet, num_ranks: int, block_rank: np.ndarray, weights: np.ndarray,
                    batch_rank: np.ndarray, batch_seconds: np.ndarray, tile_batch: np.ndarray, token_cap: int,
                    token_tolerance: float | None, pairs_balanced: bool, rounds: int) -> np.ndarray:
    """Step 3 of :func:`assign`: up to `rounds` rounds of moves and swaps of blocks balancing each rank's load
    (`weights`: its tiles and linear layers) and received volume together, tokens under a tolerance, and visible
    pairs when `pairs_balanced`. Returns the new block owners."""
    sharding = tiles.sharding
    batch_compute = np.bincount(batch_rank, weights=batch_seconds, minlength=num_ranks)
    # Visible pairs (FLOPs, free of the efficiency model) balanced beside modelled time.
    block_pairs = np.bincount(*_own_tiles(tile_batch, tiles.tile_q_block, tiles.tile_flops),
                              minlength=sharding.num_blocks)
    if batch_rank.size:
        lent = tile_batch >= 0
        batch_pairs = np.bincount(batch_rank[tile_batch[lent]], weights=tiles.tile_flops[lent], minlength=num_ranks)
    else:
        batch_pairs = np.zeros(num_ranks)
    need_block, need_seg = block_needs(tiles)
    for _ in range(rounds):
        # Each round balances against the mean volume it starts from; moves shift that mean, so repeat while the
        # traffic is still outside its tolerance.
        moved = balance_two_dimensional(block_rank, weights, sharding.block_tokens, sharding.seg_block,
                                        sharding.seg_seq, sharding.seg_tokens, need_block, need_seg, num_ranks,
                                        token_cap, fixed_compute=batch_compute, token_tolerance=token_tolerance,
                                        block_pairs=block_pairs, fixed_pairs=batch_pairs,
                                        pair_tolerance=PAIR_TOLERANCE if pairs_balanced else None,
                                        **TWO_DIMENSIONAL_SEARCH)
        if np.array_equal(moved, block_rank):
            break
        block_rank = moved
    return block_rank


def assign(tiles: TileSet, num_ranks: int, token_cap: int, balance_tolerance: float = 0.01,
           token_tolerance: float | None = None, linear_seconds_per_token: float = 0.0) -> Assignment:
    """Place every block on a rank within the token cap, balancing each rank's modelled layer time: the linear
    layers on the tokens it holds (`linear_seconds_per_token` a token, in the units of tile seconds) plus the tiles
    it runs. With no linear time that is attention compute alone.

    1. LPT: blocks by decreasing work onto the least-loaded rank with room, O(K log N); a block heavier than the
       mean lends tiles in batches placed like blocks of no tokens (:func:`_lend_heavy_tiles`). With a token
       tolerance, LPT runs under a tight token cap and moves and swaps of sizes fix what it overflows.
    2. Refinement: moves and swaps off the most loaded rank while they lower it.
    3. Compute and traffic together (attention alone; not with linear layers, LAYER_TWO_DIMENSIONAL_ROUNDS): moves
       and swaps off the rank furthest above either mean (1% for compute, 4.5% for bytes received, and the token
       tolerance when given), counting each pulled segment once per rank.
    4. Where a rank is still above (1 + balance_tolerance) x the lower bound, some tiles of its heaviest query
       blocks run on the least-loaded ranks instead.

    Args:
        tiles: the tile set (work per block).
        num_ranks: N.
        token_cap: most tokens a rank may hold.
        balance_tolerance: relative slack over the lower bound before tiles are moved.
        token_tolerance: keep ranks within (1 + token_tolerance) x the mean tokens where whole blocks allow (None:
            only the cap); the Assignment's token_cap is then the cap the placement keeps.
        linear_seconds_per_token: the linear layers' weight per token held, beside the tiles' seconds (0: none).
            The visible pairs are balanced beside modelled time only without it: with linear layers, the tokens a
            rank holds are part of its load, and pairs alone would pull against them.
    Returns:
        the Assignment.
    Raises:
        InfeasibleError: when no rank has room for some block under the cap.
    """
    sharding = tiles.sharding
    sizes = sharding.block_tokens
    num_blocks = sharding.num_blocks
    block_linear = sizes * float(linear_seconds_per_token)
    total = float(tiles.tile_seconds.sum()) + float(block_linear.sum())
    bound, _ = makespan_lower_bound(total, num_ranks, float(tiles.tile_seconds.max()) if tiles.num_tiles else 0.0)
    mean = total / num_ranks
    tile_batch, batch_seconds = _lend_heavy_tiles(tiles, mean, linear_seconds_per_token)
    weights = np.bincount(*_own_tiles(tile_batch, tiles.tile_q_block, tiles.tile_seconds),
                          minlength=num_blocks) + block_linear
    # A block prefers the rank that holds most of its tokens in the user layout, when that costs little balance:
    # the reshuffle then moves less, and more tiles run while it is in flight.
    home = np.concatenate((home_ranks(sharding, num_ranks), np.full(batch_seconds.size, -1, dtype=np.int64)))
    item_rank, token_cap = _place_items(np.concatenate((weights, batch_seconds)),
                                        np.concatenate((sizes, np.zeros(batch_seconds.size, dtype=np.int64))),
                                        num_ranks, token_cap, sharding.block_size, home, HOME_SLACK * mean,
                                        token_tolerance)
    block_rank, batch_rank = item_rank[:num_blocks], item_rank[num_blocks:]
    attention_alone = linear_seconds_per_token == 0
    block_rank = _refine_jointly(tiles, num_ranks, block_rank, weights, batch_rank, batch_seconds, tile_batch,
                                 token_cap, token_tolerance, pairs_balanced=attention_alone,
                                 rounds=TWO_DIMENSIONAL_ROUNDS if attention_alone else LAYER_TWO_DIMENSIONAL_ROUNDS)
    tile_rank = np.where(tile_batch >= 0, batch_rank[tile_batch] if batch_rank.size else -1,
                         block_rank[tiles.tile_q_block])
    tile_rank = offload_tiles(tiles.tile_q_block, tiles.tile_kv_block, tiles.tile_seconds, block_rank, num_ranks,
                              target=bound * (1.0 + balance_tolerance), tile_rank=tile_rank, block_tokens=sizes,
                              fixed_load=np.bincount(block_rank, weights=block_linear, minlength=num_ranks),
                              max_helped_tokens=HELPED_TOKENS)
    return Assignment(tiles=tiles, num_ranks=num_ranks, token_cap=token_cap, block_rank=block_rank, tile_rank=tile_rank)


def _lend_heavy_tiles(tiles: TileSet, mean: float, linear_seconds_per_token: float) -> tuple[np.ndarray, np.ndarray]:
    """Step 1 of :func:`assign` for blocks heavier than the mean load, which cannot balance whole: each keeps
    HELPER_PIECE of the mean of its tiles (a full block's linear layers stay with it, so its tiles are measured
    against what the mean leaves them), and the rest go in batches of at most that, placed by LPT like blocks of
    no tokens (the rank a batch lands on runs those tiles for the owner). Large batches, because each costs a pull
    of the block's Q and a push of its partial output, four times a block's K,V with 8:1 grouped-query heads;
    larger still and whole batches no longer balance (benchmarks/placement.py, mean normalized MFU forward with
    batches of a half, three quarters and all of the mean: 0.737, 0.751, 0.745, the last with compute imbalance up
    to 0.060). Returns each tile's batch (-1: it stays with its query block) and each batch's seconds."""
    attention_room = max(mean - tiles.sharding.block_size * float(linear_seconds_per_token), 0.0)
    tile_batch, _, batch_seconds = split_heavy_blocks(
        tiles.tile_q_block, tiles.tile_kv_block, tiles.tile_seconds, tiles.sharding.num_blocks,
        limit=attention_room, piece=attention_room * HELPER_PIECE)
    return tile_batch, batch_seconds

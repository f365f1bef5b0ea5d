"""Running some tiles of heavy query blocks away from their owner, to balance what whole blocks cannot."""

from __future__ import annotations

import numpy as np

from fcp_compiler.algorithms.keys import stable_argsort


def split_heavy_blocks(tile_q_block: np.ndarray, tile_kv_block: np.ndarray, tile_seconds: np.ndarray,
                       num_blocks: int, limit: float, piece: float) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Cut the tiles of every block heavier than `limit` into batches that other ranks can run.

    The owner keeps its tiles up to `piece` of work (its diagonal tile first, then by key/value block); the rest
    go, in key/value block order, into batches of at most `piece` work (at least one tile each). A batch is placed
    like a block of no tokens; the rank it lands on pulls the block's Q and pushes partial outputs back.
    O(T log T) for T tiles.

    Args:
        tile_q_block, tile_kv_block, tile_seconds: per-tile query block, key/value block and work.
        num_blocks: number of blocks.
        limit: blocks with more work than this are cut.
        piece: most work the owner keeps, and most work per batch.
    Returns:
        (tile_batch, batch_block, batch_seconds): the batch of each tile (-1: stays with the owner), and the block
        and work of each batch.
    """
    block_seconds = np.bincount(tile_q_block, weights=tile_seconds, minlength=num_blocks)
    tile_batch = np.full(tile_q_block.size, -1, dtype=np.int64)
    batch_block: list[int] = []
    batch_seconds: list[float] = []
    for block in np.flatnonzero(block_seconds > limit).tolist():
        mine = np.flatnonzero(tile_q_block == block)
        mine = mine[np.lexsort((tile_kv_block[mine], tile_kv_block[mine] != block))]
        filled, current = 0.0, -1
        for tile in mine.tolist():
            seconds = float(tile_seconds[tile])
            if current < 0 and filled + seconds <= piece:
                filled += seconds  # the owner keeps it
                continue
            if current < 0 or batch_seconds[current] + seconds > piece:
                batch_block.append(block)
                batch_seconds.append(0.0)
                current = len(batch_seconds) - 1
            tile_batch[tile] = current
            batch_seconds[current] += seconds
    return tile_batch, np.asarray(batch_block, dtype=np.int64), np.asarray(batch_seconds, dtype=np.float64)


def offload_tiles(tile_q_block: np.ndarray, tile_kv_block: np.ndarray, tile_seconds: np.ndarray,
                  block_rank: np.ndarray, num_ranks: int, target: float,
                  tile_rank: np.ndarray | None = None, fixed_load: np.ndarray | None = None) -> np.ndarray:
    """Move tiles from ranks above `target` to the least-loaded ranks until no rank is above it (if possible).

    Objective: bring the largest per-rank load down to `target` while moving little data. A tile that runs on a
    helper costs a pull of its query block (and a push of the partial output back), plus a pull of its key/value
    block unless the helper already has it; so the tiles of one heavy query block go together to the least-loaded
    rank, those whose key/value block the helper holds or already pulls first, the heaviest first, while the
    helper stays at or under `target`; when no helper can take a whole tile so, a second pass lets helpers pass
    the target while they stay below the overloaded rank (tiles are coarse when the mean is a few tiles). A rank's
    tiles of its own blocks and those it runs for other owners may move alike (a helper overloaded by a batch passes
    some on, or back to the owner). Ranks are visited from the most loaded. O(moves * num_tiles).

    Args:
        tile_q_block, tile_kv_block, tile_seconds: per-tile query block, key/value block and work.
        block_rank: owner of each block.
        num_ranks: N.
        target: the load no rank should exceed (at least the mean load, or it cannot be met).
        tile_rank: where tiles run before this pass (default: on their query block's owner).
        fixed_load: per-rank load that no tile move changes (the linear layers of the tokens a rank holds).
    Returns:
        int64 array, the rank that runs each tile.
    """
    tile_rank = (block_rank[tile_q_block] if tile_rank is None else tile_rank).astype(np.int64)
    loads = np.bincount(tile_rank, weights=tile_seconds, minlength=num_ranks)
    if fixed_load is not None:
        loads = loads + fixed_load
    for overloaded in stable_argsort(-loads).tolist():
        exhausted: set[int] = set()
        past_target = False  # second pass: helpers may pass the target while they stay below this rank
        while loads[overloaded] > target:
            mine = np.flatnonzero(tile_rank == overloaded)  # its own blocks' tiles and those it runs for others
            if mine.size == 0:
                break
            block_load = np.bincount(tile_q_block[mine], weights=tile_seconds[mine])
            heavy_block = int(np.argmax(block_load))
            candidates_tiles = mine[tile_q_block[mine] == heavy_block]
            # A helper takes something only if the smallest candidate tile fits it: the others are skipped at once
            # rather than tried one by one (the choice is the same: the least loaded helper that takes a tile).
            after = loads + float(tile_seconds[candidates_tiles].min())
            takes = (after <= target) | (past_target & (after < loads[overloaded]))
            candidates = np.flatnonzero((loads < (loads[overloaded] if past_target else target)) & takes
                                        & ~np.isin(np.arange(num_ranks), list(exhausted)))
            if candidates.size == 0:
                if past_target:
                    break
                past_target, exhausted = True, set()
                continue
            helper = int(candidates[np.argmin(loads[candidates])])
            need = loads[overloaded] - target
            helper_has = np.zeros(block_rank.size, dtype=bool)
            helper_has[block_rank == helper] = True
            helper_has[tile_kv_block[tile_rank == helper]] = True
            has_kv = helper_has[tile_kv_block[candidates_tiles]]
            order = np.lexsort((candidates_tiles, -tile_seconds[candidates_tiles], ~has_kv))
            chosen = []
            moved = 0.0
            for tile in candidates_tiles[order].tolist():
                seconds = float(tile_seconds[tile])
                # Fill the helper up to the target, or past it while it stays below the overloaded rank's load
                # (the pair's maximum still falls: tiles are coarse when the mean is a few tiles).
                helper_after = loads[helper] + moved + seconds
                if helper_after > target and (not past_target or helper_after >= loads[overloaded] - moved):
                    continue
                chosen.append(tile)
                moved += seconds
                if moved >= need:
                    break
            if not chosen:
                exhausted.add(helper)
                continue
            tile_rank[chosen] = helper
            loads[overloaded] -= moved
            loads[helper] += moved
    return tile_rank

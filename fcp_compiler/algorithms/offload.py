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
                  tile_rank: np.ndarray | None = None, fixed_load: np.ndarray | None = None,
                  block_tokens: np.ndarray | None = None, max_helped_tokens: int | None = None) -> np.ndarray:
    """Move tiles from ranks above `target` to the least-loaded ranks until no rank is above it (if possible).

    Objective: bring the largest per-rank load down to `target` while moving little data. A tile that runs on a
    helper costs a pull of its query block (and a push of the partial output back), plus a pull of its key/value
    block unless the helper already has it; so the tiles of one heavy query block go together to the least-loaded
    rank, those whose key/value block the helper holds or already pulls first, the heaviest first, while the
    helper stays at or under `target`; when no helper can take a whole tile so, a second pass lets helpers pass
    the target while they stay below the overloaded rank (tiles are coarse when the mean is a few tiles). A rank's
    tiles of its own blocks and those it runs for other owners may move alike (a helper overloaded by a batch passes
    some on, or back to the owner). Ranks are visited from the most loaded. With `max_helped_tokens`, a helper takes
    tiles of another owner's query block only while the query blocks it runs for other owners hold at most that many
    tokens (each is a Q pull whose partial outputs stay live until pushed back, and a NIC receive where it crosses
    nodes); blocks it already runs tiles of, and its own, are always open to it. O(moves * num_tiles).

    Args:
        tile_q_block, tile_kv_block, tile_seconds: per-tile query block, key/value block and work.
        block_rank: owner of each block.
        num_ranks: N.
        target: the load no rank should exceed (at least the mean load, or it cannot be met).
        tile_rank: where tiles run before this pass (default: on their query block's owner).
        fixed_load: per-rank load that no tile move changes (the linear layers of the tokens a rank holds).
        block_tokens: tokens of each block (needed with `max_helped_tokens`).
        max_helped_tokens: most tokens of other owners' query blocks a helper may come to run tiles of (None: no
            limit); tiles a rank runs for others on entry count, and may leave it over the limit.
    Returns:
        int64 array, the rank that runs each tile.
    """
    tile_rank = (block_rank[tile_q_block] if tile_rank is None else tile_rank).astype(np.int64)
    loads = np.bincount(tile_rank, weights=tile_seconds, minlength=num_ranks)
    if fixed_load is not None:
        loads = loads + fixed_load
    helped = None if max_helped_tokens is None else _HelpedBlocks.of(tile_q_block, tile_rank, block_rank, num_ranks,
                                                                       block_tokens, max_helped_tokens)
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
            if helped is not None:
                takes &= helped.open_to(heavy_block)
            candidates = np.flatnonzero((loads < (loads[overloaded] if past_target else target)) & takes
                                        & ~np.isin(np.arange(num_ranks), list(exhausted)))
            if candidates.size == 0:
                if past_target:
                    break
                past_target, exhausted = True, set()
                continue
            helper = int(candidates[np.argmin(loads[candidates])])
            chosen, moved = _tiles_for(helper, candidates_tiles, tile_kv_block, tile_seconds, tile_rank, block_rank,
                                       loads, overloaded, target, past_target)
            if not chosen:
                exhausted.add(helper)
                continue
            tile_rank[chosen] = helper
            if helped is not None:
                helped.move(heavy_block, overloaded, helper, len(chosen))
            loads[overloaded] -= moved
            loads[helper] += moved
    return tile_rank


def _tiles_for(helper: int, candidates_tiles: np.ndarray, tile_kv_block: np.ndarray, tile_seconds: np.ndarray,
               tile_rank: np.ndarray, block_rank: np.ndarray, loads: np.ndarray, overloaded: int, target: float,
               past_target: bool) -> tuple[list[int], float]:
    """The tiles of one heavy query block (`candidates_tiles`, on `overloaded`) that :func:`offload_tiles` moves to
    `helper`, and their work: those whose key/value block the helper holds or already pulls first, then the
    heaviest, while the helper stays at or under `target` (or, `past_target`, below the overloaded rank), until the
    overloaded rank is down to the target."""
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
        # Fill the helper up to the target, or past it while it stays below the overloaded rank's load (the pair's
        # maximum still falls: tiles are coarse when the mean is a few tiles).
        helper_after = loads[helper] + moved + seconds
        if helper_after > target and (not past_target or helper_after >= loads[overloaded] - moved):
            continue
        chosen.append(tile)
        moved += seconds
        if moved >= need:
            break
    return chosen, moved


class _HelpedBlocks:
    """Per rank, the query blocks of other owners it runs tiles of (how many tiles of each) and their tokens: what
    :func:`offload_tiles` limits a helper to."""

    def __init__(self, block_rank: np.ndarray, block_tokens: np.ndarray, limit: int, num_ranks: int):
        self.block_rank, self.block_tokens, self.limit = block_rank, block_tokens, limit
        self.tiles: dict[int, dict[int, int]] = {}  # block -> {helper rank: tiles it runs of the block}
        self.tokens = np.zeros(num_ranks, dtype=np.int64)  # per rank, the tokens of the blocks it helps with

    @classmethod
    def of(cls, tile_q_block: np.ndarray, tile_rank: np.ndarray, block_rank: np.ndarray, num_ranks: int,
           block_tokens: np.ndarray, limit: int) -> "_HelpedBlocks":
        """The blocks each rank runs tiles of for other owners before any move."""
        assert block_tokens is not None, "a limit on helped tokens needs each block's tokens"
        helped = cls(block_rank, np.asarray(block_tokens, dtype=np.int64), limit, num_ranks)
        away = np.flatnonzero(tile_rank != block_rank[tile_q_block])
        if away.size:
            pairs, counts = np.unique(np.stack((tile_rank[away], tile_q_block[away])), axis=1, return_counts=True)
            for rank, block, count in zip(pairs[0].tolist(), pairs[1].tolist(), counts.tolist()):
                helped.add(block, rank, count)
        return helped

    def open_to(self, block: int) -> np.ndarray:
        """bool per rank: whether it may run tiles of `block`: its owner, a rank running some already, or one whose
        helped blocks leave room for its tokens."""
        room = self.tokens + int(self.block_tokens[block]) <= self.limit
        room[int(self.block_rank[block])] = True
        room[list(self.tiles.get(block, ()))] = True
        return room

    def add(self, block: int, rank: int, count: int) -> None:
        """`count` more tiles of `block` on `rank` (nothing for its owner)."""
        if rank == int(self.block_rank[block]):
            return
        helpers = self.tiles.setdefault(block, {})
        if rank not in helpers:
            self.tokens[rank] += int(self.block_tokens[block])
        helpers[rank] = helpers.get(rank, 0) + count

    def move(self, block: int, source: int, helper: int, count: int) -> None:
        """`count` tiles of `block` moved from `source` to `helper`."""
        self.add(block, helper, count)
        if source == int(self.block_rank[block]):
            return
        helpers = self.tiles[block]
        helpers[source] -= count
        if helpers[source] == 0:
            del helpers[source]
            self.tokens[source] -= int(self.block_tokens[block])

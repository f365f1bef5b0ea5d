"""Balancing the bytes each rank receives, by swaps and moves that keep compute balanced."""

from __future__ import annotations

import numpy as np


def received_tokens(need_count: np.ndarray, seg_rank: np.ndarray, seg_tokens: np.ndarray) -> np.ndarray:
    """Tokens each rank pulls: the segments its blocks need (count > 0) that another rank holds."""
    needed = need_count > 0
    needed[seg_rank, np.arange(seg_rank.size)] = False
    return needed @ seg_tokens


def balance_received(block_rank: np.ndarray, block_weight: np.ndarray, block_tokens: np.ndarray,
                     seg_block: np.ndarray, seg_tokens: np.ndarray, need_block: np.ndarray, need_seg: np.ndarray,
                     num_ranks: int, token_cap: int, compute_limit: float, target_imbalance: float = 0.04,
                     num_partner_ranks: int = 16, num_exact: int = 8, max_steps: int | None = None) -> np.ndarray:
    """Lower the largest per-rank received volume by moving or swapping blocks, within compute and token limits.

    Objective: minimise max_r received(r), where received(r) is the token count of the distinct segments that r's
    blocks read and r does not hold (a rank pulls a segment once however many of its blocks read it), subject to
    every rank's compute <= compute_limit and tokens <= token_cap. Local search: each step takes the rank A that
    receives most and tries every block x of A against the blocks of the num_partner_ranks ranks that receive
    least (swap) or against those ranks alone (move). A's new volume is computed exactly for all candidates at
    once; the partner's exactly for the num_exact best. The best action is applied if it lowers A below its old
    volume without lifting the partner to it. Stops when (max - mean) / max <= target_imbalance, at a local
    optimum, or after max_steps. Each step is O(k * (P + S)) for k blocks on A, P need pairs of the candidates
    and S segments.

    Args:
        block_rank: owner of each block (a feasible placement).
        block_weight, block_tokens: compute and tokens of each block.
        seg_block, seg_tokens: block and size of each segment.
        need_block, need_seg: pairs (block b reads segment k), k not in b, unique, sorted by block.
        num_ranks, token_cap, compute_limit: the limits to keep.
        target_imbalance: stop once the received imbalance is at most this.
        num_partner_ranks, num_exact: neighbourhood sizes.
        max_steps: step limit (default 4 * num_ranks).
    Returns:
        a new block_rank array whose largest received volume is never above the input's.
    """
    block_rank = np.array(block_rank, dtype=np.int64)
    num_blocks, num_segments = block_rank.size, seg_block.size
    seg_tokens = np.asarray(seg_tokens, dtype=np.int64)
    need_ptr = np.searchsorted(need_block, np.arange(num_blocks + 1))
    seg_ptr = np.searchsorted(seg_block, np.arange(num_blocks + 1))
    need_count = np.zeros((num_ranks, num_segments), dtype=np.int32)
    np.add.at(need_count, (block_rank[need_block], need_seg), 1)
    seg_rank = block_rank[seg_block]
    received = received_tokens(need_count, seg_rank, seg_tokens)
    compute = np.bincount(block_rank, weights=block_weight, minlength=num_ranks)
    tokens = np.bincount(block_rank, weights=block_tokens, minlength=num_ranks).astype(np.int64)
    steps = max_steps if max_steps is not None else 4 * num_ranks

    def needs_of(block: int) -> np.ndarray:
        return need_seg[need_ptr[block]:need_ptr[block + 1]]

    def segs_of(block: int) -> np.ndarray:
        return np.arange(seg_ptr[block], seg_ptr[block + 1])

    def volume_after(rank: int, leaving: int, arriving: int) -> int:
        """Exact received tokens of `rank` after block `leaving` goes (-1: none) and `arriving` comes (-1: none)."""
        count = need_count[rank].copy()
        local = seg_rank == rank
        if leaving >= 0:
            count[needs_of(leaving)] -= 1
            local[segs_of(leaving)] = False
        if arriving >= 0:
            count[needs_of(arriving)] += 1
            local[segs_of(arriving)] = True
        return int(seg_tokens[(count > 0) & ~local].sum())

    for _ in range(steps):
        top = int(np.argmax(received))
        top_volume = received[top]
        if top_volume <= 0 or (top_volume - received.mean()) / top_volume <= target_imbalance:
            break
        partners = np.argsort(received, kind="stable")[:num_partner_ranks]
        partners = partners[partners != top]
        partner_blocks = np.flatnonzero(np.isin(block_rank, partners))
        pb_need_start, pb_need_end = need_ptr[partner_blocks], need_ptr[partner_blocks + 1]
        pb_need_count = pb_need_end - pb_need_start
        pair_owner = np.repeat(np.arange(partner_blocks.size), pb_need_count)
        pair_seg = need_seg[np.repeat(pb_need_start - np.concatenate(([0], np.cumsum(pb_need_count)[:-1])),
                                      pb_need_count) + np.arange(int(pb_need_count.sum()))]
        own_count = seg_ptr[partner_blocks + 1] - seg_ptr[partner_blocks]
        own_owner = np.repeat(np.arange(partner_blocks.size), own_count)
        own_seg = np.repeat(seg_ptr[partner_blocks] - np.concatenate(([0], np.cumsum(own_count)[:-1])),
                            own_count) + np.arange(int(own_count.sum()))
        candidates = []  # (estimated score, x, y or -1, partner rank, new top volume)
        for x in np.flatnonzero(block_rank == top).tolist():
            base = need_count[top].copy()
            base[needs_of(x)] -= 1
            local = seg_rank == top
            local[segs_of(x)] = False
            volume_without_x = int(seg_tokens[(base > 0) & ~local].sum())
            # Moves of x to a partner with room.
            move_ok = ((tokens[partners] + block_tokens[x] <= token_cap)
                       & (compute[partners] + block_weight[x] <= compute_limit))
            for partner in partners[move_ok].tolist():
                candidates.append((max(volume_without_x, received[partner]), x, -1, partner, volume_without_x))
            # Swaps of x with a partner block y: A's new volume for every y at once.
            y_rank = block_rank[partner_blocks]
            swap_ok = ((tokens[top] - block_tokens[x] + block_tokens[partner_blocks] <= token_cap)
                       & (tokens[y_rank] - block_tokens[partner_blocks] + block_tokens[x] <= token_cap)
                       & (compute[top] - block_weight[x] + block_weight[partner_blocks] <= compute_limit)
                       & (compute[y_rank] - block_weight[partner_blocks] + block_weight[x] <= compute_limit))
            if not swap_ok.any():
                continue
            fresh = np.where((base[pair_seg] == 0) & ~local[pair_seg], seg_tokens[pair_seg], 0)
            gained = np.bincount(pair_owner, weights=fresh, minlength=partner_blocks.size)
            now_local = np.where(base[own_seg] > 0, seg_tokens[own_seg], 0)
            freed = np.bincount(own_owner, weights=now_local, minlength=partner_blocks.size)
            new_top = volume_without_x + gained - freed
            for idx in np.flatnonzero(swap_ok & (new_top < top_volume)).tolist():
                y = int(partner_blocks[idx])
                candidates.append((max(new_top[idx], received[y_rank[idx]]), x, y, int(y_rank[idx]),
                                   int(new_top[idx])))
        if not candidates:
            break
        candidates.sort()
        best = None
        for _, x, y, partner, new_top in candidates[:num_exact]:
            if new_top >= top_volume:
                continue
            new_partner = volume_after(partner, y, x)
            score = max(new_top, new_partner)
            if score < top_volume and (best is None or score < best[0]):
                best = (score, x, y, partner, new_top, new_partner)
        if best is None:
            break
        _, x, y, partner, new_top, new_partner = best
        for block, source, target in ((x, top, partner), (y, partner, top)):
            if block < 0:
                continue
            block_rank[block] = target
            np.subtract.at(need_count[source], needs_of(block), 1)
            np.add.at(need_count[target], needs_of(block), 1)
            seg_rank[segs_of(block)] = target
            compute[source] -= block_weight[block]
            compute[target] += block_weight[block]
            tokens[source] -= block_tokens[block]
            tokens[target] += block_tokens[block]
        received[top], received[partner] = new_top, new_partner
    return block_rank

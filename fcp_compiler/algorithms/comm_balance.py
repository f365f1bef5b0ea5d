"""Balancing the bytes each rank receives, by swaps and moves that keep compute balanced."""

from __future__ import annotations

import numpy as np


class RankNeeds:
    """How many of each rank's blocks read each segment, stored sparsely: per rank, the sorted segments its blocks
    read and their counts (> 0). Memory and updates grow with the needs, not with ranks x segments, so that the
    search scales with the batch rather than quadratically."""

    def __init__(self, need_rank: np.ndarray, need_seg: np.ndarray, num_ranks: int, num_segments: int) -> None:
        """need_rank, need_seg: one entry per (reading block, segment) pair, the block's rank and the segment."""
        key, count = np.unique(need_rank * num_segments + need_seg, return_counts=True)
        bounds = np.searchsorted(key, np.arange(num_ranks + 1) * num_segments).tolist()
        self.num_segments = num_segments
        self.segs = [key[bounds[r]:bounds[r + 1]] - r * num_segments for r in range(num_ranks)]
        self.counts = [count[bounds[r]:bounds[r + 1]].astype(np.int64) for r in range(num_ranks)]

    def row(self, rank: int) -> np.ndarray:
        """The segments `rank`'s blocks read, sorted."""
        return self.segs[rank]

    def get(self, rank: int, segs: np.ndarray) -> np.ndarray:
        """How many of `rank`'s blocks read each of `segs` (0 where none)."""
        return _lookup(self.segs[rank], self.counts[rank], segs)

    def table(self, ranks: np.ndarray):
        """A lookup (rank position in `ranks`, segment) -> count over several ranks at once (arrays broadcast)."""
        rank_list = ranks.tolist()
        keys = np.concatenate([self.segs[r] + i * self.num_segments for i, r in enumerate(rank_list)] + [[]])
        counts = np.concatenate([self.counts[r] for r in rank_list] + [[]])
        keys, counts = keys.astype(np.int64), counts.astype(np.int64)
        return lambda rank_idx, segs: _lookup(keys, counts, rank_idx * self.num_segments + segs)

    def matrix(self, ranks: np.ndarray, segs: np.ndarray, scratch: np.ndarray) -> np.ndarray:
        """counts[i, j]: how many of rank ranks[i]'s blocks read segs[j]. `scratch` is an all-zero array of one
        entry per segment, left as it was found (each rank's row is spread into it and gathered from)."""
        out = np.empty((ranks.size, segs.size), dtype=np.int64)
        for i, rank in enumerate(ranks.tolist()):
            scratch[self.segs[rank]] = self.counts[rank]
            out[i] = scratch[segs]
            scratch[self.segs[rank]] = 0
        return out

    def add(self, rank: int, segs: np.ndarray, delta: int) -> None:
        """Count `segs` (distinct, sorted) read by one more (delta 1) or one fewer (delta -1) block of `rank`."""
        row, counts = self.segs[rank], self.counts[rank]
        pos = np.searchsorted(row, segs)
        present = pos < row.size
        present[present] = row[pos[present]] == segs[present]
        counts = counts.copy()
        counts[pos[present]] += delta
        if delta < 0:
            assert present.all() and (counts >= 0).all()
            keep = counts > 0
            self.segs[rank], self.counts[rank] = row[keep], counts[keep]
        else:
            fresh = ~present
            self.segs[rank] = np.insert(row, pos[fresh], segs[fresh])
            self.counts[rank] = np.insert(counts, pos[fresh], 1)

    def received(self, seg_rank: np.ndarray, seg_tokens: np.ndarray) -> np.ndarray:
        """Tokens each rank pulls: the segments its blocks read that another rank holds."""
        return np.array([int(seg_tokens[segs[seg_rank[segs] != rank]].sum()) for rank, segs in enumerate(self.segs)],
                        dtype=np.int64)


def _ranges(ptr: np.ndarray, items: np.ndarray, values: np.ndarray | None) -> tuple[np.ndarray, np.ndarray]:
    """The entries ptr[i]:ptr[i + 1] of each item i in `items` (of `values`, or the positions themselves), with the
    position in `items` each comes from."""
    counts = ptr[items + 1] - ptr[items]
    owner = np.repeat(np.arange(items.size), counts)
    positions = np.repeat(ptr[items] - np.concatenate(([0], np.cumsum(counts)[:-1])), counts) + np.arange(
        int(counts.sum()))
    return owner, (values[positions] if values is not None else positions)


def _least(values: np.ndarray, count: int) -> np.ndarray:
    """The first `count` positions of a stable argsort of `values` (ties by position), in O(N + c log c)."""
    if count >= values.size:
        return np.argsort(values, kind="stable")
    threshold = np.partition(values, count - 1)[count - 1]
    candidates = np.flatnonzero(values <= threshold)
    return candidates[np.argsort(values[candidates], kind="stable")][:count]


def _same_segment(query_owner: np.ndarray, query_seg: np.ndarray,
                  target_seg: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Every (query, target) with the same segment, as (the query's owner, the target's position); queries are
    distinct per owner. O((Q + T) log T + hits)."""
    order = np.argsort(target_seg, kind="stable")
    ordered = target_seg[order]
    low = np.searchsorted(ordered, query_seg, side="left")
    counts = np.searchsorted(ordered, query_seg, side="right") - low
    query = np.repeat(np.arange(query_seg.size), counts)
    offsets = np.arange(int(counts.sum())) - np.repeat(np.cumsum(counts) - counts, counts)
    return query_owner[query], order[low[query] + offsets]


def _sum_by(index: np.ndarray, weights: np.ndarray, length: int) -> np.ndarray:
    """Sums of `weights` by `index` (broadcast together), as a flat array of `length`."""
    index, weights = np.broadcast_arrays(index, weights)
    return np.bincount(index.ravel(), weights=weights.ravel(), minlength=length)


def _lookup(keys: np.ndarray, counts: np.ndarray, wanted: np.ndarray) -> np.ndarray:
    """counts at the positions of `wanted` in the sorted `keys`, 0 where absent (any shape)."""
    if keys.size == 0:
        return np.zeros(np.shape(wanted), dtype=np.int64)
    pos = np.minimum(np.searchsorted(keys, wanted), keys.size - 1)
    return np.where(keys[pos] == wanted, counts[pos], 0)


def received_tokens(need_count: np.ndarray, seg_rank: np.ndarray, seg_tokens: np.ndarray) -> np.ndarray:
    """Tokens each rank pulls, from a dense ranks x segments count (a reference for the sparse RankNeeds)."""
    needed = need_count > 0
    needed[seg_rank, np.arange(seg_rank.size)] = False
    return needed @ seg_tokens


def balance_two_dimensional(block_rank: np.ndarray, block_weight: np.ndarray, block_tokens: np.ndarray,
                            seg_block: np.ndarray, seg_seq: np.ndarray, seg_tokens: np.ndarray,
                            need_block: np.ndarray,
                            need_seg: np.ndarray, num_ranks: int, token_cap: int, compute_tolerance: float,
                            received_tolerance: float, num_partner_ranks: int = 8,
                            affinity_per_sequence: int = 3, fixed_compute: np.ndarray | None = None,
                            token_tolerance: float | None = None, block_pairs: np.ndarray | None = None,
                            fixed_pairs: np.ndarray | None = None, pair_tolerance: float | None = None,
                            max_steps: int | None = None) -> np.ndarray:
    """Balance compute and received volume together by moving and swapping blocks within the token cap.

    Objective: minimise max_r F_r with F_r = max((C_r / C_mean - 1) / compute_tolerance,
    (R_r / R_mean - 1) / received_tolerance[, (T_r / T_mean - 1) / token_tolerance]): each rank's excess over the
    mean compute C, the mean received volume R (both as on entry) and, when their tolerances are given, the mean
    tokens T and the mean visible (q, k) pairs P (compute free of the efficiency model), in units of what each may
    exceed it by, so F <= 1 means all within their tolerance. R_r counts the
    tokens of the distinct segments that r's blocks read and r does not hold (a rank pulls a segment once however
    many of its blocks read it). Local search: each step takes the rank A with the largest F and tries every block
    x of A against the num_partner_ranks ranks with the smallest F (moves) and against their blocks and the blocks
    that hold segments A pulls, a few per sequence (swaps). Both touched ranks' new volumes are exact for every
    candidate at once. The best action is applied if both end below A's old F; a rank with no such action is
    left as it is and the search goes on with the next worst over the compute (or token) tolerance, so the largest
    F never rises.
    Stops when every rank has F <= 1 or is stuck, or after max_steps. O(k * (P + S)) a step for k blocks on A,
    P need pairs of the candidates and S segments.

    Args:
        block_rank: owner of each block (a feasible placement).
        block_weight, block_tokens: compute and tokens of each block.
        seg_block, seg_seq, seg_tokens: block, sequence and size of each segment, segments sorted by block.
        need_block, need_seg: pairs (block b reads segment k), k not in b, unique, sorted by block.
        num_ranks, token_cap: ranks and their token cap.
        compute_tolerance, received_tolerance: relative excess over the mean each load may have.
        num_partner_ranks: how many of the least loaded ranks are tried as partners.
        affinity_per_sequence: how many blocks holding segments A pulls are tried per sequence.
        fixed_compute: per-rank work that does not move (tiles run for other ranks' blocks).
        token_tolerance: relative excess over the mean tokens a rank may hold (None: tokens only within the cap),
            for the plan layout, where every other layer works on a rank's own tokens.
        block_pairs, fixed_pairs, pair_tolerance: visible pairs of each block's own tiles, per-rank pairs that do
            not move, and their relative excess over the mean (None: pairs not balanced).
        max_steps: step limit (default 4 * num_ranks).
    Returns:
        a new block_rank array; its largest F (with the entry means) is never above the input's.
    """
    block_rank = np.array(block_rank, dtype=np.int64)
    num_blocks, num_segments = block_rank.size, seg_block.size
    seg_tokens = np.asarray(seg_tokens, dtype=np.int64)
    need_ptr = np.searchsorted(need_block, np.arange(num_blocks + 1))
    seg_ptr = np.searchsorted(seg_block, np.arange(num_blocks + 1))
    needs = RankNeeds(block_rank[need_block], need_seg, num_ranks, num_segments)
    seg_rank = block_rank[seg_block]
    received = needs.received(seg_rank, seg_tokens).astype(np.float64)
    scratch = np.zeros(num_segments, dtype=np.int64)
    rank_blocks = [set() for _ in range(num_ranks)]
    for block, rank in enumerate(block_rank.tolist()):
        rank_blocks[rank].add(block)
    compute = np.bincount(block_rank, weights=block_weight, minlength=num_ranks)
    if fixed_compute is not None:
        compute = compute + fixed_compute
    tokens = np.bincount(block_rank, weights=block_tokens, minlength=num_ranks).astype(np.int64)
    mean_compute = max(float(compute.mean()), 1e-300)
    mean_tokens = max(float(tokens.mean()), 1.0)
    if pair_tolerance is None:
        block_pairs = np.zeros(num_blocks)
    pairs = np.bincount(block_rank, weights=block_pairs, minlength=num_ranks)
    if fixed_pairs is not None:
        pairs = pairs + fixed_pairs
    mean_pairs = max(float(pairs.mean()), 1e-300)
    steps = max_steps if max_steps is not None else 4 * num_ranks

    def excess(compute_value, received_value, mean_received, tokens_value, pairs_value):
        return np.maximum(hard_excess(compute_value, tokens_value, pairs_value),
                          (received_value / mean_received - 1.0) / received_tolerance)

    def hard_excess(compute_value, tokens_value, pairs_value):
        worst = (compute_value / mean_compute - 1.0) / compute_tolerance
        if token_tolerance is not None:
            worst = np.maximum(worst, (tokens_value / mean_tokens - 1.0) / token_tolerance)
        if pair_tolerance is not None:
            worst = np.maximum(worst, (pairs_value / mean_pairs - 1.0) / pair_tolerance)
        return worst

    def needs_of(block: int) -> np.ndarray:
        return need_seg[need_ptr[block]:need_ptr[block + 1]]

    def segs_of(block: int) -> np.ndarray:
        return np.arange(seg_ptr[block], seg_ptr[block + 1])

    def volume_after(rank: int, leaving: int, arriving: int) -> int:
        """Exact received tokens of `rank` after block `leaving` goes (-1: none) and `arriving` comes (-1: none)."""
        gone = needs_of(leaving) if leaving >= 0 else np.zeros(0, dtype=np.int64)
        come = needs_of(arriving) if arriving >= 0 else np.zeros(0, dtype=np.int64)
        segs, inverse = np.unique(np.concatenate((needs.row(rank), gone, come)), return_inverse=True)
        count = np.bincount(inverse, weights=np.concatenate((needs.counts[rank], np.full(gone.size, -1),
                                                             np.ones(come.size))), minlength=segs.size)
        local = seg_rank[segs] == rank
        if leaving >= 0:
            local[np.isin(segs, segs_of(leaving))] = False
        if arriving >= 0:
            local[np.isin(segs, segs_of(arriving))] = True
        return int(seg_tokens[segs[(count > 0) & ~local]].sum())

    # The received normaliser stays the entry mean, so that the largest F can only fall (moves change the mean).
    mean_received = max(float(received.mean()), 1.0)
    stuck = np.zeros(num_ranks, dtype=bool)
    for _ in range(steps):
        rank_excess = excess(compute, received, mean_received, tokens, pairs)
        # The worst rank not yet found stuck; a stuck rank keeps its F, and others still improve below it. Once a
        # rank is stuck, traffic is as balanced as this search gets, so only ranks over the compute tolerance are
        # taken up.
        open_excess = np.where(stuck, -np.inf, rank_excess)
        if stuck.any():
            open_excess = np.where(hard_excess(compute, tokens, pairs) > 1.0, open_excess, -np.inf)
        top = int(np.argmax(open_excess))
        top_excess = open_excess[top]
        if top_excess <= 1.0:
            break
        partners = _least(rank_excess, num_partner_ranks)
        partners = partners[partners != top]
        # Swap partners: the blocks of the least loaded ranks, and the blocks that hold segments the top rank pulls
        # (bringing one over makes its segments local).
        pulled = needs.row(top)[seg_rank[needs.row(top)] != top]
        # ... a few per sequence (its blocks are alike), from the least loaded ranks in the lower half.
        pulled_excess = rank_excess[seg_rank[pulled]]
        pulled = pulled[pulled_excess <= np.median(rank_excess)]
        pulled = pulled[np.lexsort((pulled, rank_excess[seg_rank[pulled]], seg_seq[pulled]))]
        first_of_seq = np.searchsorted(seg_seq[pulled], seg_seq[pulled], side="left")
        pulled_from = seg_block[pulled[np.arange(pulled.size) - first_of_seq < affinity_per_sequence]]
        on_partners = [block for rank in partners.tolist() for block in rank_blocks[rank]]
        partner_blocks = np.union1d(np.array(on_partners, dtype=np.int64), pulled_from)
        pair_owner, pair_seg = _ranges(need_ptr, partner_blocks, need_seg)  # the segments each partner block reads
        own_owner, own_seg = _ranges(seg_ptr, partner_blocks, None)  # and its own segments
        y_rank = block_rank[partner_blocks]
        # What a partner block y would add to A as A is now; removing x changes it only where x's leaving
        # changes a segment's state (x was its only reader on A, or it is one of x's own segments).
        pair_tokens = seg_tokens[pair_seg]
        pair_top_count = needs.get(top, pair_seg)
        fresh_now = (pair_top_count == 0) & (seg_rank[pair_seg] != top)
        gained_now = np.bincount(pair_owner, weights=np.where(fresh_now, pair_tokens, 0), minlength=partner_blocks.size)
        volume_now = int(received[top])
        # What y's leaving saves its own rank B: the segments only y reads there (corrected per x below), and
        # which of y's own segments B's other blocks read (they become remote).
        partner_ranks, partner_idx = np.unique(np.concatenate((y_rank, partners)), return_inverse=True)
        y_rank_idx = partner_idx[:y_rank.size]
        partners_idx = partner_idx[y_rank.size:]
        partner_count = needs.table(partner_ranks)
        only_reader = ((partner_count(y_rank_idx[pair_owner], pair_seg) == 1)
                       & (seg_rank[pair_seg] != y_rank[pair_owner]))
        only_reader_pairs = np.flatnonzero(only_reader)
        only_reader_owner = pair_owner[only_reader_pairs]
        only_reader_seg = pair_seg[only_reader_pairs]
        only_reader_tokens = pair_tokens[only_reader_pairs]
        y_saves = np.bincount(only_reader_owner, weights=only_reader_tokens, minlength=partner_blocks.size)
        own_read_on_b = partner_count(y_rank_idx[own_owner], own_seg)
        own_top_count = needs.get(top, own_seg)
        # Every block x of A against every partner rank (moves) and partner block (swaps) at once.
        xs = np.array(sorted(rank_blocks[top]), dtype=np.int64)
        num_x, num_y = xs.size, partner_blocks.size
        xn_owner, xn_seg = _ranges(need_ptr, xs, need_seg)  # the segments each x reads
        xo_owner, xo_seg = _ranges(seg_ptr, xs, None)  # each x's own segments
        xn_count, xo_count = needs.get(top, xn_seg), needs.get(top, xo_seg)
        dropped_remote = (xn_count == 1) & (seg_rank[xn_seg] != top)  # remote, and no longer read once x leaves
        volume_without_x = (volume_now
                            - np.bincount(xn_owner, weights=np.where(dropped_remote, seg_tokens[xn_seg], 0),
                                          minlength=num_x)
                            + np.bincount(xo_owner, weights=np.where(xo_count > 0, seg_tokens[xo_seg], 0),
                                          minlength=num_x))
        # On a partner rank B, x adds the segments it reads that B neither holds nor reads, and makes its own
        # segments that B reads local: x_adds[B, x].
        every_partner = np.arange(partner_ranks.size)[:, None]
        partner_reads = needs.matrix(partner_ranks, np.concatenate((xn_seg, xo_seg)), scratch)
        adds = ((partner_reads[:, :xn_seg.size] == 0)
                & (seg_rank[xn_seg][None, :] != partner_ranks[:, None])) * seg_tokens[xn_seg][None, :]
        takes = (partner_reads[:, xn_seg.size:] > 0) * seg_tokens[xo_seg][None, :]
        x_adds = (_sum_by(every_partner * num_x + xn_owner[None, :], adds, partner_ranks.size * num_x)
                  - _sum_by(every_partner * num_x + xo_owner[None, :], takes, partner_ranks.size * num_x)
                  ).reshape(partner_ranks.size, num_x)
        # Moves of x to a partner with room.
        move_ok = tokens[partners][None, :] + block_tokens[xs][:, None] <= token_cap
        top_after = excess(compute[top] - block_weight[xs], volume_without_x, mean_received,
                           tokens[top] - block_tokens[xs], pairs[top] - block_pairs[xs])
        move_volume = received[partners][None, :] + x_adds[partners_idx].T
        move_score = np.maximum(top_after[:, None], excess(
            compute[partners][None, :] + block_weight[xs][:, None], move_volume, mean_received,
            tokens[partners][None, :] + block_tokens[xs][:, None], pairs[partners][None, :] + block_pairs[xs][:, None]))
        # Swaps of x with a partner block y. Segments x leaves unread on A (and not x's own) become fresh for a y
        # that reads them; x's own segments are never read by x, so they stay fresh exactly when A's other blocks
        # do not read them.
        # x_of_* and *_idx below: the (x, entry) pairs where an entry's segment is one x touches in that way.
        fresh = np.concatenate((np.flatnonzero(dropped_remote), xn_seg.size + np.flatnonzero(xo_count == 0)))
        x_owner, x_seg = np.concatenate((xn_owner, xo_owner)), np.concatenate((xn_seg, xo_seg))
        x_of_pair, pair_idx = _same_segment(x_owner[fresh], x_seg[fresh], pair_seg)
        gained = gained_now[None, :] + _sum_by(x_of_pair * num_y + pair_owner[pair_idx], pair_tokens[pair_idx],
                                               num_x * num_y).reshape(num_x, num_y)
        own_tokens = seg_tokens[own_seg]
        x_of_own, own_idx = _same_segment(xn_owner, xn_seg, own_seg)  # y's own segments that x reads
        own_pos = x_of_own * num_y + own_owner[own_idx]
        # A's other blocks still read y's segment unless x was its only reader there.
        freed = (np.bincount(own_owner, weights=np.where(own_top_count > 0, own_tokens, 0), minlength=num_y)[None, :]
                 - _sum_by(own_pos, np.where(own_top_count[own_idx] == 1, own_tokens[own_idx], 0),
                           num_x * num_y).reshape(num_x, num_y))
        new_top = volume_without_x[:, None] + gained - freed
        # B's side: a segment y alone read there stays read if x reads or holds it; y's own segments become
        # remote for B if B's other blocks or x read them.
        x_of_only, only_idx = _same_segment(x_owner, x_seg, only_reader_seg)
        kept = _sum_by(x_of_only * num_y + only_reader_owner[only_idx], only_reader_tokens[only_idx],
                       num_x * num_y).reshape(num_x, num_y)
        y_unlocal = (np.bincount(own_owner, weights=np.where(own_read_on_b > 0, own_tokens, 0), minlength=num_y)[None, :]
                     + _sum_by(own_pos, np.where(own_read_on_b[own_idx] == 0, own_tokens[own_idx], 0),
                               num_x * num_y).reshape(num_x, num_y))
        swap_volume = received[y_rank][None, :] + x_adds[y_rank_idx].T - y_saves[None, :] + kept + y_unlocal
        token_change = block_tokens[partner_blocks][None, :] - block_tokens[xs][:, None]
        pair_change = block_pairs[partner_blocks][None, :] - block_pairs[xs][:, None]
        x_weight, y_weight = block_weight[xs][:, None], block_weight[partner_blocks][None, :]
        swap_ok = ((tokens[top] + token_change <= token_cap) & (tokens[y_rank][None, :] - token_change <= token_cap))
        # (Loads as load - leaving + arriving, in that order: the rounding decides ties between candidates.)
        swap_score = np.maximum(
            excess(compute[top] - x_weight + y_weight, new_top, mean_received, tokens[top] + token_change,
                   pairs[top] + pair_change),
            excess(compute[y_rank][None, :] - y_weight + x_weight, swap_volume, mean_received,
                   tokens[y_rank][None, :] - token_change, pairs[y_rank][None, :] - pair_change))
        # Candidates as parallel arrays (moves first, each in (x, partner) order): exact score, x, y (-1: a move),
        # partner rank, A's and B's new volumes.
        move_x, move_p = np.nonzero(move_ok & (move_score < top_excess))
        swap_x, swap_y = np.nonzero(swap_ok & (swap_score < top_excess))
        score = np.concatenate((move_score[move_x, move_p], swap_score[swap_x, swap_y]))
        xs_of = np.concatenate((xs[move_x], xs[swap_x]))
        ys_of = np.concatenate((np.full(move_x.size, -1), partner_blocks[swap_y]))
        partner_of = np.concatenate((partners[move_p], y_rank[swap_y]))
        new_tops = np.concatenate((volume_without_x[move_x], new_top[swap_x, swap_y]))
        new_partners = np.concatenate((move_volume[move_x, move_p], swap_volume[swap_x, swap_y]))
        if score.size == 0:
            stuck[top] = True
            continue
        best = int(np.lexsort((ys_of, xs_of, score))[0])
        x, y, partner = int(xs_of[best]), int(ys_of[best]), int(partner_of[best])
        new_top, new_partner = float(new_tops[best]), float(new_partners[best])
        assert new_partner == volume_after(partner, y, x), (new_partner, volume_after(partner, y, x))
        for block, source, target in ((x, top, partner), (y, partner, top)):
            if block < 0:
                continue
            block_rank[block] = target
            rank_blocks[source].remove(block)
            rank_blocks[target].add(block)
            needs.add(source, needs_of(block), -1)
            needs.add(target, needs_of(block), 1)
            seg_rank[segs_of(block)] = target
            compute[source] -= block_weight[block]
            compute[target] += block_weight[block]
            tokens[source] -= block_tokens[block]
            tokens[target] += block_tokens[block]
            pairs[source] -= block_pairs[block]
            pairs[target] += block_pairs[block]
        received[top], received[partner] = new_top, new_partner
    return block_rank

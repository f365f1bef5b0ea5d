"""Balancing the bytes each rank receives, by swaps and moves that keep compute balanced."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from fcp_compiler.algorithms.keys import lexsort_first, lookup, stable_argsort
from fcp_compiler.algorithms.ranges import expand_ranges


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
        return lookup(self.segs[rank], self.counts[rank], segs, 0)

    def table(self, ranks: np.ndarray):
        """A lookup (rank position in `ranks`, segment) -> count over several ranks at once (arrays broadcast)."""
        rank_list = ranks.tolist()
        keys = np.concatenate([self.segs[r] + i * self.num_segments for i, r in enumerate(rank_list)] + [[]])
        counts = np.concatenate([self.counts[r] for r in rank_list] + [[]])
        keys, counts = keys.astype(np.int64), counts.astype(np.int64)
        return lambda rank_idx, segs: lookup(keys, counts, rank_idx * self.num_segments + segs, 0)

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
    positions = expand_ranges(ptr[items], counts)
    return owner, (values[positions] if values is not None else positions)


def _least(values: np.ndarray, count: int) -> np.ndarray:
    """The first `count` positions of a stable argsort of `values` (ties by position), in O(N + c log c)."""
    if count >= values.size:
        return stable_argsort(values)
    threshold = np.partition(values, count - 1)[count - 1]
    candidates = np.flatnonzero(values <= threshold)
    return candidates[stable_argsort(values[candidates])][:count]


def _same_segment(query_owner: np.ndarray, query_seg: np.ndarray,
                  target_seg: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Every (query, target) with the same segment, as (the query's owner, the target's position); queries are
    distinct per owner. O((Q + T) log T + hits)."""
    order = stable_argsort(target_seg)
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
    Stops when every rank has F <= 1 or is stuck, or after max_steps. A step is O((P + k n) log P + R k n + N) for
    k blocks on A reading n segments each, P need pairs of the partner blocks, R partner ranks and N ranks; memory
    grows with the needs (sparse per-rank counts), not with ranks x segments.

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
    search = _Search(block_rank, block_weight, block_tokens, block_pairs if pair_tolerance is not None else None,
                     seg_block, seg_seq, seg_tokens, need_block, need_seg, num_ranks, fixed_compute, fixed_pairs)
    limits = _Limits(compute_tolerance=compute_tolerance, received_tolerance=received_tolerance,
                     token_tolerance=token_tolerance, pair_tolerance=pair_tolerance,
                     mean_compute=max(float(search.compute.mean()), 1e-300),
                     mean_tokens=max(float(search.tokens.mean()), 1.0),
                     mean_pairs=max(float(search.pairs.mean()), 1e-300),
                     # The received normaliser stays the entry mean, so that the largest F can only fall (moves
                     # change the mean).
                     mean_received=max(float(search.received.mean()), 1.0))
    stuck = np.zeros(num_ranks, dtype=bool)
    for _ in range(max_steps if max_steps is not None else 4 * num_ranks):
        rank_excess = limits.excess(search.compute, search.received, search.tokens, search.pairs)
        # The worst rank not yet found stuck; a stuck rank keeps its F, and others still improve below it. Once a
        # rank is stuck, traffic is as balanced as this search gets, so only ranks over the compute (or token, or
        # pair) tolerance are taken up.
        open_excess = np.where(stuck, -np.inf, rank_excess)
        if stuck.any():
            open_excess = np.where(limits.hard_excess(search.compute, search.tokens, search.pairs) > 1.0,
                                   open_excess, -np.inf)
        top_excess = open_excess[top := int(np.argmax(open_excess))]
        if top_excess <= 1.0:
            break
        partners = (least := _least(rank_excess, num_partner_ranks))[least != top]
        partner_blocks = search.partner_blocks(top, partners, rank_excess, affinity_per_sequence)
        score, xs, ys, partner_of, new_tops, new_partners = search.candidates(
            top, top_excess, partners, partner_blocks, limits, token_cap)
        if score.size == 0:
            stuck[top] = True
            continue
        best = lexsort_first((ys, xs, score))
        search.apply(int(xs[best]), int(ys[best]), top, int(partner_of[best]), float(new_tops[best]),
                     float(new_partners[best]))
    return search.block_rank


@dataclass(frozen=True, slots=True, kw_only=True)
class _Limits:
    """The joint search's objective: each load's excess over its mean, in units of its tolerance."""

    compute_tolerance: float
    received_tolerance: float
    token_tolerance: float | None
    pair_tolerance: float | None
    mean_compute: float
    mean_tokens: float
    mean_pairs: float
    mean_received: float

    def hard_excess(self, compute, tokens, pairs):
        """F without the received term: the loads a rank must keep within tolerance (arrays broadcast)."""
        worst = (compute / self.mean_compute - 1.0) / self.compute_tolerance
        if self.token_tolerance is not None:
            worst = np.maximum(worst, (tokens / self.mean_tokens - 1.0) / self.token_tolerance)
        if self.pair_tolerance is not None:
            worst = np.maximum(worst, (pairs / self.mean_pairs - 1.0) / self.pair_tolerance)
        return worst

    def excess(self, compute, received, tokens, pairs):
        """F (arrays broadcast)."""
        return np.maximum(self.hard_excess(compute, tokens, pairs),
                          (received / self.mean_received - 1.0) / self.received_tolerance)


@dataclass(frozen=True, slots=True, kw_only=True)
class _PartnerSide:
    """Per step, what the partner blocks y (on ranks B) read and hold, as seen from A and from B."""

    partner_blocks: np.ndarray
    y_rank: np.ndarray
    partner_ranks: np.ndarray  # the distinct ranks of the partners and of the partner blocks
    y_rank_idx: np.ndarray  # position of each y's rank in partner_ranks
    partners_idx: np.ndarray  # position of each move partner in partner_ranks
    pair_owner: np.ndarray  # (y, segment y reads) pairs
    pair_seg: np.ndarray
    pair_tokens: np.ndarray
    gained_now: np.ndarray  # per y: what it would add to A as A is now
    only_reader_owner: np.ndarray  # pairs whose segment only y reads on B (and B does not hold)
    only_reader_seg: np.ndarray
    only_reader_tokens: np.ndarray
    y_saves: np.ndarray  # per y: what its leaving saves B
    own_owner: np.ndarray  # (y, own segment) pairs
    own_seg: np.ndarray
    own_read_on_b: np.ndarray  # how many of B's blocks read each
    own_top_count: np.ndarray  # how many of A's blocks read each


class _Search:
    """The joint search's state: each block's rank, each rank's loads and received volume, and the sparse counts
    of the segments each rank's blocks read."""

    def __init__(self, block_rank, block_weight, block_tokens, block_pairs, seg_block, seg_seq, seg_tokens,
                 need_block, need_seg, num_ranks, fixed_compute, fixed_pairs) -> None:
        self.block_rank = np.array(block_rank, dtype=np.int64)
        num_blocks, num_segments = self.block_rank.size, seg_block.size
        self.block_weight, self.block_tokens = block_weight, block_tokens
        self.block_pairs = block_pairs if block_pairs is not None else np.zeros(num_blocks)
        self.seg_block, self.seg_seq = seg_block, seg_seq
        self.seg_tokens = np.asarray(seg_tokens, dtype=np.int64)
        self.need_seg = need_seg
        self.need_ptr = np.searchsorted(need_block, np.arange(num_blocks + 1))
        self.seg_ptr = np.searchsorted(seg_block, np.arange(num_blocks + 1))
        self.needs = RankNeeds(self.block_rank[need_block], need_seg, num_ranks, num_segments)
        self.seg_rank = self.block_rank[seg_block]
        self.received = self.needs.received(self.seg_rank, self.seg_tokens).astype(np.float64)
        self.scratch = np.zeros(num_segments, dtype=np.int64)
        self.rank_blocks = [set() for _ in range(num_ranks)]
        for block, rank in enumerate(self.block_rank.tolist()):
            self.rank_blocks[rank].add(block)
        self.compute = np.bincount(self.block_rank, weights=block_weight, minlength=num_ranks)
        if fixed_compute is not None:
            self.compute = self.compute + fixed_compute
        self.tokens = np.bincount(self.block_rank, weights=block_tokens, minlength=num_ranks).astype(np.int64)
        self.pairs = np.bincount(self.block_rank, weights=self.block_pairs, minlength=num_ranks)
        if fixed_pairs is not None and block_pairs is not None:
            self.pairs = self.pairs + fixed_pairs

    def needs_of(self, block: int) -> np.ndarray:
        return self.need_seg[self.need_ptr[block]:self.need_ptr[block + 1]]

    def segs_of(self, block: int) -> np.ndarray:
        return np.arange(self.seg_ptr[block], self.seg_ptr[block + 1])

    def volume_after(self, rank: int, leaving: int, arriving: int) -> int:
        """Exact received tokens of `rank` after block `leaving` goes (-1: none) and `arriving` comes (-1: none)."""
        gone = self.needs_of(leaving) if leaving >= 0 else np.zeros(0, dtype=np.int64)
        come = self.needs_of(arriving) if arriving >= 0 else np.zeros(0, dtype=np.int64)
        segs, inverse = np.unique(np.concatenate((self.needs.row(rank), gone, come)), return_inverse=True)
        count = np.bincount(inverse, weights=np.concatenate((self.needs.counts[rank], np.full(gone.size, -1),
                                                             np.ones(come.size))), minlength=segs.size)
        local = self.seg_rank[segs] == rank
        if leaving >= 0:
            local[np.isin(segs, self.segs_of(leaving))] = False
        if arriving >= 0:
            local[np.isin(segs, self.segs_of(arriving))] = True
        return int(self.seg_tokens[segs[(count > 0) & ~local]].sum())

    def partner_blocks(self, top: int, partners: np.ndarray, rank_excess: np.ndarray, affinity: int) -> np.ndarray:
        """Swap partners: the blocks of the least loaded ranks, and the blocks that hold segments the top rank
        pulls (bringing one over makes its segments local), a few per sequence (its blocks are alike), from the
        least loaded ranks in the lower half."""
        row = self.needs.row(top)
        pulled = row[self.seg_rank[row] != top]
        pulled = pulled[rank_excess[self.seg_rank[pulled]] <= np.median(rank_excess)]
        seg_seq = self.seg_seq
        pulled = pulled[np.lexsort((pulled, rank_excess[self.seg_rank[pulled]], seg_seq[pulled]))]
        first_of_seq = np.searchsorted(seg_seq[pulled], seg_seq[pulled], side="left")
        pulled_from = self.seg_block[pulled[np.arange(pulled.size) - first_of_seq < affinity]]
        on_partners = [block for rank in partners.tolist() for block in self.rank_blocks[rank]]
        return np.union1d(np.array(on_partners, dtype=np.int64), pulled_from)

    def apply(self, x: int, y: int, top: int, partner: int, new_top: float, new_partner: float) -> None:
        """Move x from A (top) to B (partner) and, for a swap, y from B to A; A's and B's new volumes given."""
        assert new_partner == self.volume_after(partner, y, x), (new_partner, self.volume_after(partner, y, x))
        for block, source, target in ((x, top, partner), (y, partner, top)):
            if block < 0:
                continue
            self.block_rank[block] = target
            self.rank_blocks[source].remove(block)
            self.rank_blocks[target].add(block)
            self.needs.add(source, self.needs_of(block), -1)
            self.needs.add(target, self.needs_of(block), 1)
            self.seg_rank[self.segs_of(block)] = target
            self.compute[source] -= self.block_weight[block]
            self.compute[target] += self.block_weight[block]
            self.tokens[source] -= self.block_tokens[block]
            self.tokens[target] += self.block_tokens[block]
            self.pairs[source] -= self.block_pairs[block]
            self.pairs[target] += self.block_pairs[block]
        self.received[top], self.received[partner] = new_top, new_partner

    def partner_side(self, top: int, partners: np.ndarray, partner_blocks: np.ndarray) -> _PartnerSide:
        """What each partner block y would add to A as A is now (removing x changes that only where x's leaving
        changes a segment's state: x was its only reader on A, or it is one of x's own segments), and what y's
        leaving saves its own rank B: the segments only y reads there (corrected per x later), and which of y's own
        segments B's other blocks read (they become remote)."""
        seg_rank, seg_tokens, needs = self.seg_rank, self.seg_tokens, self.needs
        pair_owner, pair_seg = _ranges(self.need_ptr, partner_blocks, self.need_seg)
        own_owner, own_seg = _ranges(self.seg_ptr, partner_blocks, None)
        y_rank = self.block_rank[partner_blocks]
        pair_tokens = seg_tokens[pair_seg]
        fresh_now = (needs.get(top, pair_seg) == 0) & (seg_rank[pair_seg] != top)
        gained_now = np.bincount(pair_owner, weights=np.where(fresh_now, pair_tokens, 0),
                                 minlength=partner_blocks.size)
        partner_ranks, partner_idx = np.unique(np.concatenate((y_rank, partners)), return_inverse=True)
        y_rank_idx = partner_idx[:y_rank.size]
        partner_count = needs.table(partner_ranks)
        only_reader = np.flatnonzero((partner_count(y_rank_idx[pair_owner], pair_seg) == 1)
                                     & (seg_rank[pair_seg] != y_rank[pair_owner]))
        return _PartnerSide(
            partner_blocks=partner_blocks, y_rank=y_rank, partner_ranks=partner_ranks, y_rank_idx=y_rank_idx,
            partners_idx=partner_idx[y_rank.size:], pair_owner=pair_owner, pair_seg=pair_seg,
            pair_tokens=pair_tokens, gained_now=gained_now, only_reader_owner=pair_owner[only_reader],
            only_reader_seg=pair_seg[only_reader], only_reader_tokens=pair_tokens[only_reader],
            y_saves=np.bincount(pair_owner[only_reader], weights=pair_tokens[only_reader],
                                minlength=partner_blocks.size),
            own_owner=own_owner, own_seg=own_seg, own_read_on_b=partner_count(y_rank_idx[own_owner], own_seg),
            own_top_count=needs.get(top, own_seg))

    def candidates(self, top: int, top_excess: float, partners: np.ndarray, partner_blocks: np.ndarray,
                   limits: _Limits, token_cap: int) -> tuple[np.ndarray, ...]:
        """Every block x of A against every partner rank (moves) and partner block (swaps) at once: the actions
        that leave both touched ranks below top_excess, as parallel arrays (moves first, each in (x, partner)
        order): exact score, x, y (-1: a move), partner rank, A's and B's new volumes."""
        side = self.partner_side(top, partners, partner_blocks)
        xs = np.array(sorted(self.rank_blocks[top]), dtype=np.int64)
        xn_owner, xn_seg = _ranges(self.need_ptr, xs, self.need_seg)  # the segments each x reads
        xo_owner, xo_seg = _ranges(self.seg_ptr, xs, None)  # each x's own segments
        xn_count, xo_count = self.needs.get(top, xn_seg), self.needs.get(top, xo_seg)
        dropped_remote = (xn_count == 1) & (self.seg_rank[xn_seg] != top)  # remote, unread once x leaves
        seg_tokens = self.seg_tokens
        volume_without_x = (int(self.received[top])
                            - np.bincount(xn_owner, weights=np.where(dropped_remote, seg_tokens[xn_seg], 0),
                                          minlength=xs.size)
                            + np.bincount(xo_owner, weights=np.where(xo_count > 0, seg_tokens[xo_seg], 0),
                                          minlength=xs.size))
        # On a partner rank B, x adds the segments it reads that B neither holds nor reads, and makes its own
        # segments that B reads local: x_adds[B, x].
        num_partner_ranks = side.partner_ranks.size
        every_partner = np.arange(num_partner_ranks)[:, None]
        partner_reads = self.needs.matrix(side.partner_ranks, np.concatenate((xn_seg, xo_seg)), self.scratch)
        adds = ((partner_reads[:, :xn_seg.size] == 0)
                & (self.seg_rank[xn_seg][None, :] != side.partner_ranks[:, None])) * seg_tokens[xn_seg][None, :]
        takes = (partner_reads[:, xn_seg.size:] > 0) * seg_tokens[xo_seg][None, :]
        x_adds = (_sum_by(every_partner * xs.size + xn_owner[None, :], adds, num_partner_ranks * xs.size)
                  - _sum_by(every_partner * xs.size + xo_owner[None, :], takes, num_partner_ranks * xs.size)
                  ).reshape(num_partner_ranks, xs.size)
        moves = self._moves(top, xs, partners, side, x_adds, volume_without_x, limits, token_cap)
        # Segments x leaves unread on A (and not x's own) become fresh for a y that reads them; x's own segments
        # are never read by x, so they stay fresh exactly when A's other blocks do not read them.
        fresh = np.concatenate((np.flatnonzero(dropped_remote), xn_seg.size + np.flatnonzero(xo_count == 0)))
        x_reads = (xn_owner, xn_seg)
        x_touches = (np.concatenate((xn_owner, xo_owner)), np.concatenate((xn_seg, xo_seg)))
        swaps = self._swaps(top, xs, side, x_adds, volume_without_x, x_reads, x_touches, fresh, limits, token_cap)
        move_score, swap_score = moves[0], swaps[0]
        move_x, move_p = np.nonzero(moves[1] & (move_score < top_excess))
        swap_x, swap_y = np.nonzero(swaps[1] & (swap_score < top_excess))
        return (np.concatenate((move_score[move_x, move_p], swap_score[swap_x, swap_y])),
                np.concatenate((xs[move_x], xs[swap_x])),
                np.concatenate((np.full(move_x.size, -1), side.partner_blocks[swap_y])),
                np.concatenate((partners[move_p], side.y_rank[swap_y])),
                np.concatenate((volume_without_x[move_x], swaps[2][swap_x, swap_y])),
                np.concatenate((moves[2][move_x, move_p], swaps[3][swap_x, swap_y])))

    def _moves(self, top, xs, partners, side, x_adds, volume_without_x, limits, token_cap):
        """(score, allowed, B's new volume) of moving each x to each partner rank, as (x, partner) arrays."""
        compute, tokens, pairs = self.compute, self.tokens, self.pairs
        weight, size, pair = self.block_weight[xs], self.block_tokens[xs], self.block_pairs[xs]
        allowed = tokens[partners][None, :] + size[:, None] <= token_cap
        top_after = limits.excess(compute[top] - weight, volume_without_x, tokens[top] - size, pairs[top] - pair)
        volume = self.received[partners][None, :] + x_adds[side.partners_idx].T
        score = np.maximum(top_after[:, None], limits.excess(
            compute[partners][None, :] + weight[:, None], volume, tokens[partners][None, :] + size[:, None],
            pairs[partners][None, :] + pair[:, None]))
        return score, allowed, volume

    def _swaps(self, top, xs, side, x_adds, volume_without_x, x_reads, x_touches, fresh, limits, token_cap):
        """(score, allowed, A's new volume, B's new volume) of swapping each x with each partner block y, as
        (x, y) arrays. The _same_segment pairs: (x, entry) where the entry's segment is one x touches that way."""
        num_x, num_y = xs.size, side.partner_blocks.size
        shape, size = (num_x, num_y), num_x * num_y
        x_of_pair, pair_idx = _same_segment(x_touches[0][fresh], x_touches[1][fresh], side.pair_seg)
        gained = side.gained_now[None, :] + _sum_by(x_of_pair * num_y + side.pair_owner[pair_idx],
                                                    side.pair_tokens[pair_idx], size).reshape(shape)
        own_tokens = self.seg_tokens[side.own_seg]
        x_of_own, own_idx = _same_segment(x_reads[0], x_reads[1], side.own_seg)  # y's own segments x reads
        own_pos = x_of_own * num_y + side.own_owner[own_idx]
        # A's other blocks still read y's segment unless x was its only reader there.
        freed = (np.bincount(side.own_owner, weights=np.where(side.own_top_count > 0, own_tokens, 0),
                             minlength=num_y)[None, :]
                 - _sum_by(own_pos, np.where(side.own_top_count[own_idx] == 1, own_tokens[own_idx], 0),
                           size).reshape(shape))
        new_top = volume_without_x[:, None] + gained - freed
        # B's side: a segment y alone read there stays read if x reads or holds it; y's own segments become
        # remote for B if B's other blocks or x read them.
        x_of_only, only_idx = _same_segment(x_touches[0], x_touches[1], side.only_reader_seg)
        kept = _sum_by(x_of_only * num_y + side.only_reader_owner[only_idx], side.only_reader_tokens[only_idx],
                       size).reshape(shape)
        y_unlocal = (np.bincount(side.own_owner, weights=np.where(side.own_read_on_b > 0, own_tokens, 0),
                                 minlength=num_y)[None, :]
                     + _sum_by(own_pos, np.where(side.own_read_on_b[own_idx] == 0, own_tokens[own_idx], 0),
                               size).reshape(shape))
        y_rank, blocks = side.y_rank, side.partner_blocks
        new_partner = (self.received[y_rank][None, :] + x_adds[side.y_rank_idx].T - side.y_saves[None, :] + kept
                       + y_unlocal)
        compute, tokens, pairs = self.compute, self.tokens, self.pairs
        token_change = self.block_tokens[blocks][None, :] - self.block_tokens[xs][:, None]
        pair_change = self.block_pairs[blocks][None, :] - self.block_pairs[xs][:, None]
        x_weight, y_weight = self.block_weight[xs][:, None], self.block_weight[blocks][None, :]
        allowed = (tokens[top] + token_change <= token_cap) & (tokens[y_rank][None, :] - token_change <= token_cap)
        # (Loads as load - leaving + arriving, in that order: the rounding decides ties between candidates.)
        score = np.maximum(
            limits.excess(compute[top] - x_weight + y_weight, new_top, tokens[top] + token_change,
                          pairs[top] + pair_change),
            limits.excess(compute[y_rank][None, :] - y_weight + x_weight, new_partner,
                          tokens[y_rank][None, :] - token_change, pairs[y_rank][None, :] - pair_change))
        return score, allowed, new_top, new_partner

"""Baseline planners (docs/DESIGN.md section 6), expressed in the same plan format as FCP.

Each takes the batch and returns a Sharding (blocks of segments, of any size) and the rank of each block; the
common passes (cost, transfers, rounds, coalesce, reshuffle, encode) make the rest of the plan, so a baseline is
validated, simulated and replayed by the same code as FCP. Every tile runs on its query block's owner.

Sliding windows: every baseline's tiles and pulls come from the common cost pass, so a block pair a window leaves
wholly masked has no tile and no transfer. MagiAttention and WLB-LLM plan with the mask in their real systems
(area and cost under the window), and so do ours. A real ring (and ByteScale's ring groups) passes every shard
around the ring whatever the window; the ring plans here skip the fully masked steps, which favours them.
"""

from __future__ import annotations

import dataclasses
import enum
import heapq

import numpy as np

from fcp_compiler.algorithms.keys import sorted_unique
from fcp_compiler.algorithms.ranges import expand_ranges
from fcp_compiler.algorithms.visibility import visible_pairs
from fcp_compiler.core.ir import Batch, Sharding
from fcp_compiler.errors import InfeasibleError


class Planner(str, enum.Enum):
    """Which placement strategy compiles the plan."""

    FCP = "fcp"
    RING = "ring"
    BYTESCALE = "bytescale"
    WLBLLM = "wlbllm"
    MAGI = "magi"


# Baselines that shard sequences over ranks and size their blocks themselves (a block is a rank's shard): a
# --block-size does not apply to them and is refused rather than ignored.
OWN_BLOCK_SIZE = frozenset({Planner.RING, Planner.BYTESCALE, Planner.WLBLLM})


def _zigzag_pieces(seq: int, length: int, ranks: list[int]) -> list[tuple[int, int, int, int]]:
    """Cut a sequence into 2g chunks over g ranks; the j-th rank holds chunks j and 2g-1-j.

    Returns (rank, seq, start, end) for every non-empty chunk.
    """
    g = len(ranks)
    bounds = [(k * length) // (2 * g) for k in range(2 * g + 1)]
    pieces = []
    for j, rank in enumerate(ranks):
        for chunk in (j, 2 * g - 1 - j):
            if bounds[chunk + 1] > bounds[chunk]:
                pieces.append((rank, seq, bounds[chunk], bounds[chunk + 1]))
    return pieces


def _document_work(batch: Batch) -> list[int]:
    """Visible (q, k) pairs of each whole sequence under its mask."""
    return visible_pairs(0, batch.lengths, 0, batch.lengths, batch.windows).tolist()


def _assemble(batch: Batch, pieces: list[tuple[int, int, int, int, int]],
              block_size: int) -> tuple[Sharding, np.ndarray]:
    """Build a Sharding from (block key, rank, seq, start, end) pieces; blocks are numbered by key order."""
    return _assemble_columns(batch, *(np.array([p[i] for p in pieces], dtype=np.int64) for i in range(5)),
                             block_size)


def _assemble_columns(batch: Batch, keys: np.ndarray, ranks: np.ndarray, seg_seq: np.ndarray, seg_start: np.ndarray,
                      seg_end: np.ndarray, block_size: int) -> tuple[Sharding, np.ndarray]:
    """:func:`_assemble` of the pieces' columns (int64 each)."""
    unique_keys, block_of = sorted_unique(keys, return_inverse=True)
    order = np.lexsort((seg_start, seg_seq, block_of))
    block_rank = np.zeros(unique_keys.size, dtype=np.int64)
    block_rank[block_of] = ranks
    sharding = Sharding(batch=batch, block_size=block_size, zigzag=True, seg_block=block_of[order].astype(np.int64),
                        seg_seq=seg_seq[order], seg_start=seg_start[order], seg_end=seg_end[order])
    return sharding, block_rank


def _block_size_for(pieces) -> int:
    """The header's block size for a baseline: its largest block, rounded up to a multiple of 64."""
    sizes: dict[int, int] = {}
    for key, _, _, start, end in pieces:
        sizes[key] = sizes.get(key, 0) + end - start
    largest = max(sizes.values())
    return -(-largest // 64) * 64


def ring(batch: Batch, num_ranks: int, block_size: int, token_cap: int) -> tuple[Sharding, np.ndarray]:
    """Ring (zig-zag): every sequence in 2N chunks, rank i holds chunks i and 2N-1-i of each; one block per rank.

    The rank's block reads every other rank's block; the rounds become N-1 shifts (one block per rank per round),
    the traffic of a ring, though each round's message comes from its owner rather than the previous neighbour.
    Kept from the real system: every sequence sharded over all ranks, zig-zag pairing, equal tokens per rank.
    """
    pieces = []
    for seq, length in enumerate(batch.lengths.tolist()):
        for rank, s, start, end in _zigzag_pieces(seq, length, list(range(num_ranks))):
            pieces.append((rank, rank, s, start, end))
    return _assemble(batch, pieces, _block_size_for(pieces))


def bytescale(batch: Batch, num_ranks: int, block_size: int, token_cap: int) -> tuple[Sharding, np.ndarray]:
    """ByteScale-like: a sequence longer than a rank's share gets the fewest ranks that fit it (zig-zag ring in the
    group); shorter ones go whole, best fit by tokens. Balances memory, not compute. Kept from the real system:
    the fewest ranks per long sequence, whole short sequences, balance by tokens only."""
    total = batch.total_tokens
    share = -(-total // num_ranks)
    room = [share] * num_ranks
    pieces = []
    order = sorted(range(batch.num_sequences), key=lambda s: (-int(batch.lengths[s]), s))
    for seq in order:
        length = int(batch.lengths[seq])
        if length > share:
            size = -(-length // share)
            group = sorted(range(num_ranks), key=lambda r: (-room[r], r))[:size]
            group.sort()
            for rank, s, start, end in _zigzag_pieces(seq, length, group):
                pieces.append((num_ranks + seq * num_ranks + rank, rank, s, start, end))
                room[rank] -= end - start
        else:
            fits = [r for r in range(num_ranks) if room[r] >= length]
            rank = min(fits, key=lambda r: (room[r], r)) if fits else max(range(num_ranks), key=lambda r: (room[r], -r))
            pieces.append((rank, rank, seq, 0, length))  # short sequences share one block per rank
            room[rank] -= length
    return _assemble(batch, pieces, _block_size_for(pieces))


def wlbllm(batch: Batch, num_ranks: int, block_size: int, token_cap: int) -> tuple[Sharding, np.ndarray]:
    """WLB-LLM-like: per document, shard it zig-zag over all ranks when its work outweighs a rank's share (or it
    does not fit one), else pack it whole onto the least-loaded rank by work, within a token cap. Kept from the
    real system: the per-document choice between packing and sharding by a cost estimate, and work-balanced
    packing."""
    lengths = batch.lengths.tolist()
    work = _document_work(batch)
    mean_work = sum(work) / num_ranks
    share = -(-batch.total_tokens // num_ranks)
    pieces = []
    load = [0.0] * num_ranks
    tokens = [0] * num_ranks
    whole = []
    for seq, length in enumerate(lengths):
        if work[seq] > mean_work or length > share:
            for rank, s, start, end in _zigzag_pieces(seq, length, list(range(num_ranks))):
                pieces.append((num_ranks + seq * num_ranks + rank, rank, s, start, end))
                load[rank] += work[seq] / num_ranks
                tokens[rank] += end - start
        else:
            whole.append(seq)
    heap = [(load[r], r) for r in range(num_ranks)]
    heapq.heapify(heap)
    limit = max(token_cap, max(tokens) + max((lengths[s] for s in whole), default=0))
    for seq in sorted(whole, key=lambda s: (-work[s], s)):
        skipped = []
        while heap and tokens[heap[0][1]] + lengths[seq] > limit:
            skipped.append(heapq.heappop(heap))
        if not heap:
            raise InfeasibleError(f"wlbllm: no rank has room for sequence {seq} ({lengths[seq]} tokens)")
        rank_load, rank = heapq.heappop(heap)
        pieces.append((rank, rank, seq, 0, lengths[seq]))
        tokens[rank] += lengths[seq]
        heapq.heappush(heap, (rank_load + work[seq], rank))
        for entry in skipped:
            heapq.heappush(heap, entry)
    return _assemble(batch, pieces, _block_size_for(pieces))


def magi(batch: Batch, num_ranks: int, block_size: int, token_cap: int) -> tuple[Sharding, np.ndarray]:
    """MagiAttention-like, as its dispatch solver works: the packed sequence (all documents concatenated) is cut into
    fixed slices of block_size tokens, across document boundaries; the slices go by a min-heap greedy on
    attention area (visible pairs of their queries), largest first, to the rank with the least area among those
    still short of their slice count, and every rank gets the same number of slices (one more for the first
    ranks when they do not divide). Kept from the real system: fixed slices of the packed sequence, area-only
    balance, an equal slice count per rank (so equal tokens); communication is not considered. Its own kernels
    and collectives are not modelled: it runs on FCP's execution, like every baseline."""
    offsets = np.asarray(batch.seq_offsets, dtype=np.int64)
    total = batch.total_tokens
    num_slices = -(-total // block_size)
    # Each slice's pieces, one a document it meets, slice by slice, documents in order.
    lo = np.arange(num_slices, dtype=np.int64) * block_size
    hi = np.minimum(lo + block_size, total)
    first = np.searchsorted(offsets, lo, side="right") - 1
    count = np.searchsorted(offsets, hi, side="left") - first
    piece_slice = np.repeat(np.arange(num_slices, dtype=np.int64), count)
    piece_seq = expand_ranges(first, count)
    base = offsets[piece_seq]
    piece_start = np.maximum(lo[piece_slice], base) - base
    piece_end = np.minimum(hi[piece_slice], offsets[piece_seq + 1]) - base
    kept = piece_end > piece_start
    piece_slice, piece_seq, piece_start, piece_end = (column[kept] for column in (piece_slice, piece_seq, piece_start,
                                                                                    piece_end))
    # A slice's area: its queries against their whole document, under the document's mask (causal, window, full).
    area = np.zeros(num_slices)
    np.add.at(area, piece_slice, visible_pairs(piece_start, piece_end, 0, batch.lengths[piece_seq],
                                               batch.windows[piece_seq]).astype(np.float64))
    quota = [num_slices // num_ranks + (1 if r < num_slices % num_ranks else 0) for r in range(num_ranks)]
    heap = [(0.0, r) for r in range(num_ranks) if quota[r]]
    heapq.heapify(heap)
    slice_rank = np.zeros(num_slices, dtype=np.int64)
    for idx in sorted(range(num_slices), key=lambda i: (-area[i], i)):
        load, rank = heapq.heappop(heap)
        slice_rank[idx] = rank
        quota[rank] -= 1
        if quota[rank]:
            heapq.heappush(heap, (load + area[idx], rank))
    sharding, block_rank = _assemble_columns(batch, piece_slice, slice_rank[piece_slice], piece_seq, piece_start,
                                             piece_end, block_size)
    return dataclasses.replace(sharding, zigzag=False), block_rank


BASELINES = {Planner.RING: ring, Planner.BYTESCALE: bytescale, Planner.WLBLLM: wlbllm, Planner.MAGI: magi}

"""Each pass's kernel launches from a plan's segment pairs: what a tile costs at its kernel call's efficiency
(:func:`coalesced_seconds`) and how many kernel calls each stage makes on each rank (:func:`kernel_calls`).

A pass groups the segment pairs a rank runs in one launch (a stage, or the tiles run during the input reshuffle) for
one query segment into one kernel call over all their keys. The pairs are read a part at a time
(:meth:`TileSet.pair_parts`): every pair of a query segment, and of a tile, is in one part, so each part groups its
own pairs, and what the parts add up is what one pass over every pair gives, to the last bit (a tile's seconds are
summed over its pairs in their order, the calls' rows are integers). At 64-token blocks a batch has tens of
millions of pairs, and each column of them, and of their groups, is hundreds of MB: a part is PAIR_PART of them.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

from fcp_compiler.algorithms.call_plan import call_parts
from fcp_compiler.algorithms.kernel_entries import CAUSAL, UNMASKED, classify_pairs
from fcp_compiler.algorithms.keys import unique_keys
from fcp_compiler.core.ir import TileSet
from fcp_compiler.core.layer_model import BACKWARD_WORK, LayerCosts
from fcp_compiler.core.passes.cost import tile_efficiency
from fcp_compiler.format.inputs import HardwareProfile, Layout
from fcp_compiler.format.models import ModelPreset

# Segment pairs read at a time: their columns and groups stay a few MB, reused from part to part (a part of 2^20
# held 100 MB more at the peak, and was no faster).
PAIR_PART = 1 << 18
# Segment pairs classified at a time (pair_kinds): each part's temporaries stay a few MB, reused, where one pass over
# the tens of millions of pairs of 64-token blocks spent most of its time faulting in fresh pages.
KIND_PART_PAIRS = 1 << 20


def pair_kinds(tiles, pairs: tuple) -> tuple[np.ndarray, np.ndarray]:
    """Each segment pair's kernel entry kind (int8) and window left (:func:`classify_pairs`), the same in both
    passes, classified KIND_PART_PAIRS pairs at a time."""
    sharding = tiles.sharding
    _, q_seg, k_seg, _ = pairs
    start, end, window = sharding.seg_start, sharding.seg_end, sharding.batch.windows[sharding.seg_seq]
    kind = np.empty(q_seg.size, dtype=np.int8)
    left = np.empty(q_seg.size, dtype=np.int64)
    for low in range(0, q_seg.size, KIND_PART_PAIRS):
        q, k = q_seg[low:low + KIND_PART_PAIRS], k_seg[low:low + KIND_PART_PAIRS]
        kind[low:low + q.size], left[low:low + q.size], _, _ = classify_pairs(start[q], end[q], start[k], end[k],
                                                                              window[q])
    return kind, left


@dataclass(slots=True, kw_only=True)
class PassLaunches:
    """One pass's tiles as its launches group them, and what :func:`sweep` adds up for it.

    rank, launch: per tile of the TileSet (in its order), the rank running it and its launch, an int in
    [0, num_launches): its stage, or one launch of its own for the tiles run during the input reshuffle.
    split: large packed calls are counted as the call plan cuts them (the backward's: call_parts).
    count_calls: count the kernel calls (:meth:`stage_calls`) besides each tile's seconds.
    """

    rank: np.ndarray
    launch: np.ndarray
    num_launches: int
    num_ranks: int
    split: bool = False
    count_calls: bool = True
    seconds: np.ndarray = field(default=None)  # per tile, once swept
    _rows: np.ndarray = field(default=None)  # [3, 2 x slots]: packed calls' entries, query rows, key rows
    _cut: list = field(default_factory=list)  # per part: (slot, kind, left) of window-cut entries, and most repeats
    _closed: np.ndarray | None = None  # the calls of closed-form tiles

    @property
    def num_slots(self) -> int:
        return self.num_launches * self.num_ranks

    def _start(self, num_tiles: int) -> None:
        self.seconds = np.zeros(num_tiles)
        self._rows = np.zeros((3, 2 * self.num_slots)) if self.count_calls else None
        self._cut, self._closed = [], None

    def _groups(self, pair_tile: np.ndarray, q_seg: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """The part's pairs grouped by (rank, launch, query segment): each pair's group, and one pair of each."""
        low = int(q_seg.min())
        width = int(q_seg.max()) - low + 1
        key = np.multiply(self.rank[pair_tile], self.num_launches, dtype=np.int64)
        key += self.launch[pair_tile]
        key *= width
        key += q_seg
        key -= low
        _, group = unique_keys(key, self.num_slots * width, return_inverse=True)
        group_pair = np.empty(int(group.max()) + 1, dtype=np.int64)
        group_pair[group] = np.arange(group.size)
        return group, group_pair

    def add(self, pairs: tuple, kinds: tuple | None, tile_runs: tuple, seg_tokens: np.ndarray,
            profile: HardwareProfile) -> None:
        """One part of the pairs (:meth:`TileSet.pair_parts`; `kinds`: :func:`pair_kinds` of them, `tile_runs`:
        :func:`_tile_runs` of their tiles): its tiles' seconds, each pair charged its FLOPs at the efficiency of its
        call (a tile of sqrt(query tokens x all the call's key tokens)), and its calls."""
        pair_tile, q_seg, kv_seg, flops = pairs
        group, group_pair = self._groups(pair_tile, q_seg)
        key_tokens = np.bincount(group, weights=seg_tokens[kv_seg], minlength=group_pair.size)
        query_tokens = seg_tokens[q_seg[group_pair]].astype(np.float64)
        efficiency = tile_efficiency(profile, np.sqrt(query_tokens * key_tokens))
        pair_seconds = flops / (profile.peak_tflops * 1e12 * efficiency[group])
        tile_of, local = tile_runs
        self.seconds[tile_of] = np.bincount(local, weights=pair_seconds, minlength=tile_of.size)
        if self.count_calls:
            self._add_calls(pairs, kinds, group, group_pair, seg_tokens)

    def _add_calls(self, pairs: tuple, kinds: tuple, group: np.ndarray, group_pair: np.ndarray,
                   seg_tokens: np.ndarray) -> None:
        """A part's kernel calls (:func:`kernel_calls`): its packed entries per (slot, causal) with their rows, and
        per (slot, window kind, left) of its window-cut entries the most any one query segment has."""
        pair_tile, q_seg, k_seg, _ = pairs
        kind, left = kinds
        num_groups, group_tile = group_pair.size, pair_tile[group_pair]
        group_slot = np.multiply(self.launch[group_tile], self.num_ranks, dtype=np.int64)
        group_slot += self.rank[group_tile]
        packed = kind <= CAUSAL
        # An entry is a group with packed pairs: a query segment's call in its slot, causal where it holds its diagonal.
        packed_group = group[packed]
        has_packed = np.bincount(packed_group, minlength=num_groups) > 0
        diagonal = np.bincount(packed_group, weights=kind[packed] == CAUSAL, minlength=num_groups) > 0
        call = (group_slot * 2 + diagonal)[has_packed]
        width = 2 * self.num_slots
        self._rows[0] += np.bincount(call, minlength=width)
        self._rows[1] += np.bincount(call, weights=seg_tokens[q_seg[group_pair[has_packed]]], minlength=width)
        self._rows[2] += np.bincount(call, weights=np.bincount(packed_group, weights=seg_tokens[k_seg[packed]],
                                                               minlength=num_groups)[has_packed], minlength=width)
        cut = ~packed
        if cut.any():
            # One call per (slot, window kind, left), repeated as often as one query segment recurs in it.
            slot = group_slot[group[cut]]
            triples, triple_of = np.unique(np.stack([slot, kind[cut], left[cut]]), axis=1, return_inverse=True)
            per_query, counts = np.unique(np.stack([triple_of.ravel(), q_seg[cut]]), axis=1, return_counts=True)
            most = np.zeros(triples.shape[1], dtype=np.int64)
            np.maximum.at(most, per_query[0], counts)
            self._cut.append((triples, most))

    def stage_calls(self) -> np.ndarray:
        """Kernel calls per (launch, rank), once swept: int64 [num_launches, num_ranks]."""
        if self._closed is not None:
            return self._closed
        count, query_rows, key_rows = (row.astype(np.int64) for row in self._rows)
        # One causal and one unmasked call per slot, each cut as the call plan cuts a large backward call.
        parts = call_parts(count, query_rows, key_rows) if self.split else 1
        calls = np.where(count > 0, parts, 0).reshape(self.num_slots, 2).sum(axis=1)
        if self._cut:
            triples, inverse = np.unique(np.concatenate([part[0] for part in self._cut], axis=1), axis=1,
                                         return_inverse=True)
            most = np.zeros(triples.shape[1], dtype=np.int64)
            np.maximum.at(most, inverse.ravel(), np.concatenate([part[1] for part in self._cut]))
            calls += np.bincount(triples[0], weights=most, minlength=self.num_slots).astype(np.int64)
        return calls.reshape(self.num_launches, self.num_ranks)


def _dense_kinds(itself: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """:func:`pair_kinds` of pairs of dense zig-zag sequences (`itself`: a chunk against itself), in closed form: a
    causal sequence's earlier chunk is seen whole (UNMASKED), a chunk against itself holds its diagonal (CAUSAL),
    and no window cuts either (left -1)."""
    return np.where(itself, CAUSAL, UNMASKED).astype(np.int8), np.full(itself.size, -1, dtype=np.int64)


def _tile_runs(pair_tile: np.ndarray, num_tiles: int) -> tuple[np.ndarray, np.ndarray]:
    """A part's tiles (each once) and each pair's index among them: runs where its pairs come tile by tile in order
    (the dense parts), else by sorting."""
    if pair_tile.size > 1 and (pair_tile[1:] >= pair_tile[:-1]).all():
        starts = np.empty(pair_tile.size, dtype=bool)
        starts[0] = True
        np.not_equal(pair_tile[1:], pair_tile[:-1], out=starts[1:])
        local = np.cumsum(starts)
        local -= 1
        return pair_tile[starts], local
    return unique_keys(pair_tile, num_tiles, return_inverse=True)


def sweep(tiles: TileSet, passes: Sequence[PassLaunches], profile: HardwareProfile, pairs: tuple | None = None,
          kinds: tuple | None = None) -> None:
    """Fill every pass's tile seconds (and kernel calls) in one pass over the tile set's segment pairs, a part at a
    time. `pairs`: tiles.segment_pairs(), and `kinds`: :func:`pair_kinds` of them, where the caller holds them (else
    each part is built, and classified, alone). Closed-form tiles (no pairs) are each one call at their own cost."""
    for launches in passes:
        launches._start(tiles.num_tiles)
    if not tiles.has_pairs:
        for launches in passes:
            launches.seconds = tiles.tile_seconds
            if launches.count_calls:  # one call per (launch, rank) with tiles, two where a sequence is causal
                slot = np.multiply(launches.launch, launches.num_ranks, dtype=np.int64) + launches.rank
                runs = np.bincount(slot, minlength=launches.num_slots) > 0
                per_run = 2 if bool(tiles.sharding.batch.seq_causal.any()) else 1
                launches._closed = (runs * per_run).astype(np.int64).reshape(launches.num_launches, -1)
        return
    counting = any(launches.count_calls for launches in passes)
    seg_tokens = tiles.sharding.seg_tokens
    for rows, part, itself in tiles.pair_parts(PAIR_PART, pairs):
        part_kinds = None
        if counting and kinds is not None:
            part_kinds = (kinds[0][rows], kinds[1][rows])
        elif counting:
            part_kinds = pair_kinds(tiles, part) if itself is None else _dense_kinds(itself)
        tile_runs = _tile_runs(part[0], tiles.num_tiles)
        for launches in passes:
            launches.add(part, part_kinds, tile_runs, seg_tokens, profile)


def _scattered(tiles: TileSet, tile_idx: np.ndarray, tile_rank: np.ndarray, launch: np.ndarray,
               num_ranks: int | None = None, **fields) -> PassLaunches:
    """A PassLaunches of plan tiles given in any order (each tile of `tiles` once: its index there, rank and launch,
    any ints, one per launch)."""
    launch = np.asarray(launch, dtype=np.int64)
    low = int(launch.min()) if launch.size else 0
    rank, launch_of = np.zeros(tiles.num_tiles, dtype=np.int64), np.zeros(tiles.num_tiles, dtype=np.int64)
    rank[tile_idx], launch_of[tile_idx] = tile_rank, launch - low
    num_ranks = num_ranks if num_ranks is not None else int(tile_rank.max()) + 1 if tile_rank.size else 1
    return PassLaunches(rank=rank, launch=launch_of, num_launches=int(launch.max()) - low + 1 if launch.size else 1,
                        num_ranks=num_ranks, **fields)


def coalesced_seconds(tiles: TileSet, tile_idx: np.ndarray, tile_rank: np.ndarray, launch_group: np.ndarray,
                      profile: HardwareProfile, pairs: tuple | None = None) -> np.ndarray:
    """Modelled time of each plan tile when a stage runs as one launch.

    Scheduling is at block size, execution at the stage: the tiles a rank runs in one launch for the same query
    segment form one kernel call over all their keys, whose efficiency is that of a tile of
    sqrt(query tokens x all their key tokens). Each tile is charged its FLOPs at its call's efficiency.

    Args:
        tiles: the TileSet of the plan's blocks (segment pairs and FLOPs).
        tile_idx: for each plan tile, its index in `tiles` (each tile once).
        tile_rank, launch_group: rank and launch (stage, or -1 for tiles run during the reshuffle) of each plan tile.
        profile: peak and efficiency curve.
        pairs: tiles.segment_pairs(), when the caller has them (else they are built a part at a time).
    Returns:
        seconds per plan tile.
    """
    if not tiles.has_pairs:  # costed in closed form: each tile is one call (a ring step over every sequence)
        return tiles.tile_seconds[tile_idx]
    launches = _scattered(tiles, tile_idx, tile_rank, launch_group, count_calls=False)
    sweep(tiles, [launches], profile, pairs)
    return launches.seconds[tile_idx]


def kernel_calls(tiles: TileSet, tile_idx: np.ndarray, tile_rank: np.ndarray, stage: np.ndarray, num_stages: int,
                 num_ranks: int, pairs: tuple | None = None, split: bool = False,
                 kinds: tuple | None = None) -> np.ndarray:
    """Kernel calls the runtime makes per (stage, rank), as fcp_runtime.stage_calls groups them: one entry per
    query segment with its wholly visible keys, those holding their diagonal segment in one causal call, the rest
    in one unmasked call; under a sliding window each cut key segment (or a diagonal longer than the window) is an
    entry of its own, one call per distinct window, and as many calls as a query segment has entries in it
    (:mod:`fcp_compiler.algorithms.kernel_entries`). `stage`: each plan tile's (tile_idx: its index in `tiles`),
    below `num_stages`. `pairs`: tiles.segment_pairs(), and `kinds`: :func:`pair_kinds` of them, when the caller has
    them. `split`: large packed calls are cut as the call plan cuts the backward's (call_parts).

    Returns:
        int64 [num_stages, num_ranks].
    """
    rank, launch = np.zeros(tiles.num_tiles, dtype=np.int64), np.zeros(tiles.num_tiles, dtype=np.int64)
    rank[tile_idx], launch[tile_idx] = tile_rank, stage
    launches = PassLaunches(rank=rank, launch=launch, num_launches=num_stages, num_ranks=num_ranks, split=split)
    sweep(tiles, [launches], tiles.profile, pairs, kinds)
    return launches.stage_calls()


def busy_lower_bound(assignment, layout: Layout, model: ModelPreset | None, pairs: tuple | None = None) -> float:
    """A lower bound on the simulated layer makespan, forward plus backward, of every plan scheduled from this
    placement (any stages, rounds, fan-out or relays; ranks renumbered): the busiest rank's compute alone.

    Each rank computes its linear layers and its tiles. :func:`coalesced_seconds` charges a tile its FLOPs at the
    efficiency of its kernel call, one per (rank, stage, query segment) over all of that segment's keys in the stage;
    the efficiency curve rises with a call's size (checked here), so one call over all of a query segment's keys on
    the rank, whatever the stages, is the cheapest the simulator can charge. Launches, waits and the SMs lent to
    communication only add time. In the user layout the linear layers see the even chunks, whichever rank the tiles
    land on after renumbering, so the smallest chunk is counted. O(pairs).

    Args:
        assignment: the placement (tiles and where each runs, blocks and where each lives).
        layout: the plan's layout.
        model: the layer around attention (None: attention alone).
        pairs: the tiles' segment_pairs(), when the caller holds them.
    Returns:
        seconds.
    """
    tiles, num_ranks = assignment.tiles, assignment.num_ranks
    curve = np.array([point.efficiency for point in tiles.profile.efficiency_curve])
    assert (np.diff(curve) >= 0).all(), "the bound needs an efficiency curve that rises with the call's size"
    seconds = coalesced_seconds(tiles, np.arange(tiles.num_tiles), assignment.tile_rank,
                                np.zeros(tiles.num_tiles, dtype=np.int64), tiles.profile, pairs)
    attention = np.bincount(assignment.tile_rank, weights=seconds, minlength=num_ranks)
    if layout is Layout.USER:
        total = tiles.sharding.batch.total_tokens
        tokens = np.full(num_ranks, float(total // num_ranks))
    else:
        tokens = np.bincount(assignment.block_rank, weights=tiles.sharding.block_tokens, minlength=num_ranks)
    linear = LayerCosts.of(model, tiles.profile).phases(tokens)  # zero without a model
    forward = attention + linear["fwd_before"] + linear["fwd_after"]
    backward = BACKWARD_WORK * attention + linear["bwd_before"] + linear["bwd_after"]
    return float(forward.max()) + float(backward.max())

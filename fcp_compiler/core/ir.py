"""Frozen IR objects passed from one compiler pass to the next.

Each pass is a pure function from one of these to the next; later objects hold the earlier ones, so the last
one carries everything. Arrays are numpy and never mutated after construction. Derived figures are properties.
"""

from __future__ import annotations

import enum
from collections.abc import Iterator
from dataclasses import dataclass, field

import numpy as np

from fcp_compiler.algorithms.dense_zigzag import dense_row_spans, dense_zigzag_pairs, dense_zigzag_rows
from fcp_compiler.algorithms.fan_out import class_degrees, link_class
from fcp_compiler.format.inputs import AttentionShape, HardwareProfile, MaskKind
from fcp_compiler.format.plan_format import TransferKind


class ZigzagMode(str, enum.Enum):
    """Whether long sequences pair chunk i with chunk 2n-1-i inside a block."""

    AUTO = "auto"  # on for causal batches with a sequence of two blocks or more
    ON = "on"
    OFF = "off"


@dataclass(frozen=True, slots=True, kw_only=True)
class Batch:
    """Sequence lengths in batch order and each sequence's mask, as a window.

    windows[s] is how many keys a query of sequence s sees back, itself included: query t sees keys
    t - windows[s] + 1 .. t. A causal sequence has windows[s] = its length, a sliding window min(W, length), and a
    full mask 0 (every key of the sequence, before and after).
    """

    lengths: np.ndarray  # int64 [num_sequences]
    windows: np.ndarray  # int64 [num_sequences]
    # Where several layer kinds share one layout (core.kinds), the windows that decide zig-zag pairing: the
    # narrowest kind's, so that every kind's sharding is one. None: this batch's own windows.
    pairing_windows: np.ndarray | None = None

    @classmethod
    def uniform(cls, lengths, mask: MaskKind = MaskKind.CAUSAL, window: int | None = None) -> Batch:
        """Every sequence with the same mask (a window of `window` for SLIDING_WINDOW)."""
        lengths = np.asarray(lengths, dtype=np.int64)
        if mask is MaskKind.FULL:
            return cls(lengths=lengths, windows=np.zeros(lengths.size, dtype=np.int64))
        if mask is MaskKind.SLIDING_WINDOW:
            assert window is not None and window >= 1
            return cls(lengths=lengths, windows=np.minimum(lengths, window))
        assert mask is MaskKind.CAUSAL
        return cls(lengths=lengths, windows=lengths.copy())

    @property
    def num_sequences(self) -> int:
        return int(self.lengths.size)

    @property
    def total_tokens(self) -> int:
        return int(self.lengths.sum())

    @property
    def seq_offsets(self) -> np.ndarray:
        """Global token offset of each sequence in the user layout's concatenation (num_sequences + 1 entries)."""
        return np.concatenate(([0], np.cumsum(self.lengths))).astype(np.int64)

    @property
    def seq_causal(self) -> np.ndarray:
        """Per sequence, whether it is causal (a sliding window included)."""
        return self.windows > 0

    @property
    def mask(self) -> MaskKind:
        """The batch's mask in one word: causal, full or sliding_window when every sequence has it, else mixed."""
        return mask_summary(self.lengths, self.windows)


def mask_summary(lengths: np.ndarray, windows: np.ndarray) -> MaskKind:
    """causal, full or sliding_window when every sequence has that mask, else mixed (a window as long as its
    sequence is causal)."""
    if (windows == 0).all():
        return MaskKind.FULL
    if (windows == lengths).all():
        return MaskKind.CAUSAL
    if (windows > 0).all():
        return MaskKind.SLIDING_WINDOW
    return MaskKind.MIXED


@dataclass(frozen=True, slots=True, kw_only=True)
class Sharding:
    """Blocks as lists of segments (sequence, start, end); segments sorted by block."""

    batch: Batch
    block_size: int
    zigzag: bool
    seg_block: np.ndarray  # int64 [num_segments]
    seg_seq: np.ndarray
    seg_start: np.ndarray  # position inside the sequence
    seg_end: np.ndarray

    @property
    def num_blocks(self) -> int:
        return int(self.seg_block[-1]) + 1 if self.seg_block.size else 0

    @property
    def num_segments(self) -> int:
        return int(self.seg_block.size)

    @property
    def seg_tokens(self) -> np.ndarray:
        return self.seg_end - self.seg_start

    @property
    def block_tokens(self) -> np.ndarray:
        return np.bincount(self.seg_block, weights=self.seg_tokens, minlength=self.num_blocks).astype(np.int64)

    @property
    def block_seg_offsets(self) -> np.ndarray:
        """Segments of block b are [offsets[b], offsets[b + 1])."""
        counts = np.bincount(self.seg_block, minlength=self.num_blocks)
        return np.concatenate(([0], np.cumsum(counts))).astype(np.int64)


@dataclass(frozen=True, slots=True, kw_only=True)
class DenseTiles:
    """Causal zig-zag sequences whose tiles and segment pairs a TileSet holds in closed form
    (:mod:`fcp_compiler.algorithms.dense_zigzag`): sequence m has blocks first_block[m] .. + num_blocks[m] - 1,
    segments first_seg[m] .. + 2 num_blocks[m] - 1, and tiles tile_offset[m] .. + num_blocks[m]^2 - 1, row by row.
    Every pair of them is two chunks of h tokens: whole_flops, or self_flops for a chunk against itself."""

    first_block: np.ndarray
    num_blocks: np.ndarray
    first_seg: np.ndarray
    tile_offset: np.ndarray
    whole_flops: float = 0.0
    self_flops: float = 0.0

    @classmethod
    def none(cls) -> DenseTiles:
        empty = np.zeros(0, dtype=np.int64)
        return cls(first_block=empty, num_blocks=empty, first_seg=empty, tile_offset=empty)


@dataclass(frozen=True, slots=True, kw_only=True)
class TileSet:
    """Every (query block, key/value block) pair with visible token pairs, and its modelled cost.

    Segment pairs (pair_*) are the kernel calls inside tiles; tiles are sorted by (q_block, kv_block). The pairs of
    dense causal zig-zag sequences (`dense`, n^2 tiles each, millions at small blocks) are not stored: the pair_*
    properties list them after the stored ones (listed_pair_*), built on each call.
    """

    sharding: Sharding
    shape: AttentionShape
    profile: HardwareProfile
    tile_q_block: np.ndarray  # int64 [num_tiles]
    tile_kv_block: np.ndarray
    tile_flops: np.ndarray  # float64 forward FLOPs
    tile_seconds: np.ndarray  # float64 modelled forward time at the profile's peak and efficiency
    listed_pair_tile: np.ndarray  # int64 [num_listed_pairs] tile of each segment pair not in `dense`
    listed_pair_q_seg: np.ndarray
    listed_pair_kv_seg: np.ndarray
    listed_pair_flops: np.ndarray  # float64 forward FLOPs of each segment pair
    dense: DenseTiles = DenseTiles.none()

    @property
    def num_tiles(self) -> int:
        return int(self.tile_q_block.size)

    @property
    def has_pairs(self) -> bool:
        """False for a tile set costed in closed form (the ring at scale): its tiles read whole blocks."""
        return self.listed_pair_tile.size > 0 or self.dense.num_blocks.size > 0 or self.num_tiles == 0

    def segment_pairs(self) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
        """(pair_tile, pair_q_seg, pair_kv_seg, pair_flops): every segment pair, the listed ones then the dense
        ones, built in one go (the dense ones are millions at small blocks: a caller wanting several columns should
        take them from one call)."""
        dense = self.dense
        listed = (self.listed_pair_tile, self.listed_pair_q_seg, self.listed_pair_kv_seg, self.listed_pair_flops)
        if dense.num_blocks.size == 0:
            return listed
        # The dense pairs written after room for the listed ones: no copy of tens of millions of rows to join them.
        head = self.listed_pair_tile.size
        pair_tile, q_seg, kv_seg, itself = dense_zigzag_pairs(dense.first_seg, dense.num_blocks, dense.tile_offset,
                                                              head=head)
        flops = np.where(itself, dense.self_flops, dense.whole_flops)
        for column, values in zip((pair_tile, q_seg, kv_seg, flops), listed):
            column[:head] = values
        return pair_tile, q_seg, kv_seg, flops

    def pair_parts(self, most: int, pairs: tuple | None = None) -> Iterator[tuple[slice, tuple, np.ndarray | None]]:
        """:meth:`segment_pairs` a part at a time: (its rows among them, its (pair_tile, pair_q_seg, pair_kv_seg,
        pair_flops), and for a part of dense pairs built here whether each is a chunk against itself, else None).
        The listed pairs are one part; the dense ones follow about `most` pairs a part, a few rows of a sequence (at
        least one) or a few whole sequences, each tile's pairs together and tiles in order. A query block's pairs,
        and so a tile's and a query segment's, are all in one part. `pairs`: segment_pairs(), where the caller holds
        them (the parts are views of them); else each part is built alone (tens of millions of pairs at small blocks
        are never all held)."""
        head, dense = self.listed_pair_tile.size, self.dense
        if head:
            yield slice(0, head), (tuple(column[:head] for column in pairs) if pairs is not None else (
                self.listed_pair_tile, self.listed_pair_q_seg, self.listed_pair_kv_seg, self.listed_pair_flops)), None
        start = head
        for spans in dense_row_spans(dense.first_seg, dense.num_blocks, dense.tile_offset, most):
            part = slice(start, start + sum((high - low) * (2 * num + 1) for _, num, _, low, high in spans))
            if pairs is not None:
                yield part, tuple(column[part] for column in pairs), None
            else:
                pair_tile, q_seg, kv_seg, itself = dense_zigzag_rows(spans)
                yield part, (pair_tile, q_seg, kv_seg, np.where(itself, dense.self_flops, dense.whole_flops)), itself
            start = part.stop

    @property
    def pair_tile(self) -> np.ndarray:
        """int64 [num_pairs]: the tile of each segment pair (:meth:`segment_pairs`)."""
        return self.segment_pairs()[0]

    @property
    def pair_q_seg(self) -> np.ndarray:
        return self.segment_pairs()[1]

    @property
    def pair_kv_seg(self) -> np.ndarray:
        return self.segment_pairs()[2]

    @property
    def pair_flops(self) -> np.ndarray:
        """float64 [num_pairs]: forward FLOPs of each segment pair."""
        return self.segment_pairs()[3]

    @property
    def block_seconds(self) -> np.ndarray:
        """Forward time of all tiles of each query block (its work when its owner computes it)."""
        return np.bincount(self.tile_q_block, weights=self.tile_seconds, minlength=self.sharding.num_blocks)


@dataclass(frozen=True, slots=True, kw_only=True)
class Assignment:
    """Where each block lives and where each tile runs."""

    tiles: TileSet
    num_ranks: int
    token_cap: int
    block_rank: np.ndarray  # int64 [num_blocks]
    tile_rank: np.ndarray  # int64 [num_tiles]

    @property
    def rank_tokens(self) -> np.ndarray:
        return np.bincount(self.block_rank, weights=self.tiles.sharding.block_tokens,
                           minlength=self.num_ranks).astype(np.int64)

    @property
    def rank_seconds(self) -> np.ndarray:
        """Modelled forward compute time per rank."""
        return np.bincount(self.tile_rank, weights=self.tiles.tile_seconds, minlength=self.num_ranks)

    @property
    def num_offloaded_tiles(self) -> int:
        return int((self.tile_rank != self.block_rank[self.tiles.tile_q_block]).sum())


@dataclass(frozen=True, slots=True, kw_only=True)
class Transfers:
    """Pull edges: one per (remote block, receiving rank, kind), with the segments each carries."""

    assignment: Assignment
    edge_kind: np.ndarray  # int64 TransferKind
    edge_block: np.ndarray
    edge_src: np.ndarray  # the rank that sends it: the block's owner, or a relay that received it earlier
    edge_dst: np.ndarray  # the rank whose tiles need it
    edge_parent: np.ndarray  # -1 for a pull from the owner, else the earlier pull whose receiver re-sends it
    edge_seg_offsets: np.ndarray  # segments carried by edge e: edge_segs[offsets[e]:offsets[e + 1]]; none: all
    edge_segs: np.ndarray  # global segment indices
    # Derived arrays the passes read again and again (edge_tokens, edge_link: a million pulls at thousands of
    # ranks), computed once an object and handed out read-only. dataclasses.replace starts a new object empty.
    _derived: dict = field(default_factory=dict, init=False, repr=False, compare=False)

    def _once(self, name: str, compute) -> np.ndarray:
        held = self._derived.get(name)
        if held is None:
            held = self._derived[name] = compute()
            held.flags.writeable = False
        return held

    @property
    def num_edges(self) -> int:
        return int(self.edge_kind.size)

    @property
    def num_relayed(self) -> int:
        return int((self.edge_parent >= 0).sum())

    @property
    def edge_owner(self) -> np.ndarray:
        return self.assignment.block_rank[self.edge_block]

    @property
    def edge_link(self) -> np.ndarray:
        """Per pull, its link class: 1 across nodes (the NIC), 0 inside one (NVLink)."""
        return self._once("edge_link", lambda: link_class(self.edge_src, self.edge_dst,
                                                          self.assignment.tiles.profile.gpus_per_node))

    @property
    def class_degrees(self) -> tuple[int, int]:
        """(NVLink, NIC): each link class's Delta over the pulls as they are sent (fan-out and relays included),
        the fewest rounds that class's pulls can take."""
        return class_degrees(self.edge_src, self.edge_dst, self.edge_link, self.assignment.num_ranks)

    @property
    def edge_tokens(self) -> np.ndarray:
        """Tokens each pull carries; a pull with no segment list carries its whole block."""
        return self._once("edge_tokens", self._edge_tokens)

    def _edge_tokens(self) -> np.ndarray:
        sharding = self.assignment.tiles.sharding
        counts = np.diff(self.edge_seg_offsets)
        edge_of_seg = np.repeat(np.arange(self.num_edges), counts)
        listed = np.bincount(edge_of_seg, weights=sharding.seg_tokens[self.edge_segs], minlength=self.num_edges)
        return np.where(counts == 0, sharding.block_tokens[self.edge_block], listed).astype(np.int64)

    @property
    def edge_bytes(self) -> np.ndarray:
        """Forward bytes of each pull: K and V for KV edges, Q for Q edges."""
        shape = self.assignment.tiles.shape
        per_token = np.where(self.edge_kind == TransferKind.KV, shape.kv_bytes_per_token, shape.q_bytes_per_token)
        return self.edge_tokens * per_token


@dataclass(frozen=True, slots=True, kw_only=True)
class Rounds:
    """Pull edges from their owners coloured into congestion-free rounds, each link class apart.

    edge_round is each pull's colour within its class (a matching of that class), -1 for a pull re-sent inside a
    node (coalesce places those after their entry); `nvlink_lanes` NVLink colours share one round (NVLink is that
    much faster), so the pulls take num_rounds = max(NIC Delta, ceil(NVLink Delta / lanes)) rounds."""

    transfers: Transfers
    edge_round: np.ndarray  # int64 [num_edges]
    num_rounds: int
    nvlink_lanes: int = 1

    @property
    def owner_degrees(self) -> tuple[int, int]:
        """(NVLink, NIC): Delta of each class's graph of the pulls sent from their owners' own blocks, the rounds
        schedule_rounds colours them into (fan-out pulls, placed after their entries, are not among them)."""
        transfers = self.transfers
        from_owner = transfers.edge_parent < 0
        return class_degrees(transfers.edge_src[from_owner], transfers.edge_dst[from_owner],
                             transfers.edge_link[from_owner], transfers.assignment.num_ranks)

    @property
    def max_degree(self) -> int:
        """The larger of the two classes' Delta (owner_degrees)."""
        return max(self.owner_degrees)

    @property
    def lane_rounds(self) -> int:
        """Rounds the pulls from owners need: max(NIC Delta, ceil(NVLink Delta / nvlink_lanes)), Konig per class."""
        nvlink, nic = self.owner_degrees
        return max(nic, -(-nvlink // self.nvlink_lanes))


@dataclass(frozen=True, slots=True, kw_only=True)
class PassSchedule:
    """One pass's program: its pulls in rounds, its tiles in stages, its pushes in rounds.

    In every round each rank sends at most one message and receives at most one, pulls and pushes together. Stage s
    holds rounds [s * coalesce, (s + 1) * coalesce): it posts their messages, runs its tiles (which read only what
    earlier stages delivered), then waits. A push leaves in a stage after every tile that made it.
    """

    coalesce: int
    edge_round: np.ndarray  # int64 [num_edges], the round of each pull
    tile_stage: np.ndarray  # int64 [num_tiles]
    push_edge: np.ndarray  # the pull edges a result returns along (from the puller to the owner) ...
    push_round: np.ndarray  # ... and the round it does

    @property
    def edge_stage(self) -> np.ndarray:
        return self.edge_round // self.coalesce

    @property
    def push_stage(self) -> np.ndarray:
        return self.push_round // self.coalesce

    @property
    def num_rounds(self) -> int:
        """Rounds that carry a message."""
        return max([int(a.max()) + 1 for a in (self.edge_round, self.push_round) if a.size] + [0])

    @property
    def num_stages(self) -> int:
        return max([int(a.max()) + 1 for a in (self.edge_stage, self.tile_stage, self.push_stage) if a.size] + [1])


@dataclass(frozen=True, slots=True, kw_only=True)
class Schedule:
    """The forward and backward programs, and which pull each tile reads."""

    rounds: Rounds
    coalesce: int
    forward: PassSchedule  # pushes: partial O and LSE back along Q pulls
    backward: PassSchedule  # pushes: dK, dV (or dQ) back along every pull
    tile_kv_edge: np.ndarray  # int32 [num_tiles], the KV pull each tile reads, -1 where its K,V are local
    tile_q_edge: np.ndarray  # int32, the Q pull, -1 where its queries are local
    tile_order: np.ndarray  # int32, tiles in forward pipeline order: by rank, stage, arrival round, index


@dataclass(frozen=True, slots=True, kw_only=True)
class Reshuffle:
    """Runs of tokens moved between the user layout and the plan layout.

    Run i moves run_length[i] tokens starting at global token run_global_start[i] from user rank run_user_rank[i]
    (at local offset run_user_offset[i]) to plan rank run_plan_rank[i] (at local offset run_plan_offset[i]).
    Runs are sorted by (user rank, plan rank, global start), the order both sides pack them in.
    """

    schedule: Schedule
    run_user_rank: np.ndarray
    run_plan_rank: np.ndarray
    run_global_start: np.ndarray
    run_length: np.ndarray
    run_user_offset: np.ndarray
    run_plan_offset: np.ndarray
    user_bounds: np.ndarray  # [num_ranks + 1] token bounds of the user layout

    # The final IR holds every earlier one; these name them directly, so no reader walks the chain.
    @property
    def rounds(self) -> Rounds:
        return self.schedule.rounds

    @property
    def transfers(self) -> Transfers:
        return self.schedule.rounds.transfers

    @property
    def assignment(self) -> Assignment:
        return self.schedule.rounds.transfers.assignment

    @property
    def tiles(self) -> TileSet:
        return self.schedule.rounds.transfers.assignment.tiles

    @property
    def sharding(self) -> Sharding:
        return self.schedule.rounds.transfers.assignment.tiles.sharding

    @property
    def batch(self) -> Batch:
        return self.sharding.batch

    @property
    def num_ranks(self) -> int:
        return self.assignment.num_ranks

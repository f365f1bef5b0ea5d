"""Structural checks every plan reader runs before using a section: sizes agree, every index is in range.

These make a plan safe to index (no reader raises IndexError or allocates more than the file's own sizes imply);
whether the plan is *right* (coverage, data before use, congestion freedom, liveness) is
:mod:`~fcp_compiler.format.validate`'s job. Each check raises PlanFormatError with one line naming the array and the
value.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

from fcp_compiler.errors import PlanFormatError

# A plan stores int32 arrays: token counts and offsets must fit.
MAX_TOKENS = 2**31 - 1


def _fail(where: str, message: str) -> None:
    raise PlanFormatError(f"{where}: {message}")


def _within(where: str, name: str, values: np.ndarray, low: int, high: int) -> None:
    """Every value in [low, high)."""
    if values.size and (int(values.min()) < low or int(values.max()) >= high):
        bad = int(values.min()) if int(values.min()) < low else int(values.max())
        _fail(where, f"{name} holds {bad}, outside [{low}, {high})")


def _same_length(where: str, arrays: dict[str, np.ndarray], names: tuple[str, ...]) -> int:
    sizes = {name: int(arrays[name].size) for name in names}
    if len(set(sizes.values())) > 1:
        _fail(where, f"arrays of one table differ in length: {sizes}")
    return next(iter(sizes.values()))


def check_tables(where: str, header, tables: dict[str, np.ndarray]) -> None:
    """The global section agrees with the header: sequences, tokens, segments sorted by block, blocks counted."""
    lengths = tables["seq_lengths"]
    if lengths.size != header.num_sequences:
        _fail(where, f"seq_lengths holds {lengths.size} sequences, the header says {header.num_sequences}")
    _within(where, "seq_lengths", lengths, 1, MAX_TOKENS + 1)
    if int(lengths.sum()) != header.total_tokens:
        _fail(where, f"seq_lengths sum to {int(lengths.sum())} tokens, the header says {header.total_tokens}")
    windows = tables["seq_window"]
    if windows.size != lengths.size:
        _fail(where, f"seq_window holds {windows.size} windows for {lengths.size} sequences")
    if (windows < 0).any() or (windows > lengths).any():
        bad = int(np.flatnonzero((windows < 0) | (windows > lengths))[0])
        _fail(where, f"seq_window[{bad}] = {int(windows[bad])} is outside [0, its length {int(lengths[bad])}]")
    num_segments = _same_length(where, tables, ("seg_block", "seg_seq", "seg_start", "seg_end"))
    if num_segments == 0:
        _fail(where, "the plan has no segments")
    seg_block, seg_seq = tables["seg_block"], tables["seg_seq"]
    _within(where, "seg_seq", seg_seq, 0, lengths.size)
    _within(where, "seg_block", seg_block, 0, header.num_blocks)
    steps = np.diff(seg_block)
    if ((steps < 0) | (steps > 1)).any() or int(seg_block[0]) != 0 or int(seg_block[-1]) != header.num_blocks - 1:
        # Every block has a segment, so the header's block count is bounded by the file.
        _fail(where, f"seg_block does not run through every block from 0 to the header's num_blocks - 1 "
                     f"({header.num_blocks - 1}) in order")
    start, end = tables["seg_start"], tables["seg_end"]
    if (start < 0).any() or (end <= start).any() or (end > lengths[seg_seq]).any():
        bad = int(np.flatnonzero((start < 0) | (end <= start) | (end > lengths[seg_seq]))[0])
        _fail(where, f"segment {bad} [{int(start[bad])}, {int(end[bad])}) is empty or outside sequence "
                     f"{int(seg_seq[bad])}")
    block_tokens = np.bincount(seg_block, weights=end - start, minlength=header.num_blocks)
    if block_tokens.max() > header.block_size:  # so tokens stay within segments x block size: bounded by the file
        bad = int(np.argmax(block_tokens))
        _fail(where, f"block {bad} holds {int(block_tokens[bad])} tokens, more than the block size {header.block_size}")
    if int((end - start).sum()) != header.total_tokens:
        _fail(where, f"segments hold {int((end - start).sum())} tokens, the header says {header.total_tokens}")


def _check_pulls(where: str, header, a: dict[str, np.ndarray], num_segments: int) -> tuple[int, int]:
    rows = {}
    for side in ("send", "recv"):
        names = tuple(f"pull_{side}_{name}" for name in ("round", "bwd_round", "kind", "block", "peer", "seg_count"))
        rows[side] = _same_length(where, a, names + (("pull_send_source",) if side == "send" else ()))
        _within(where, f"pull_{side}_round", a[f"pull_{side}_round"], 0, max(header.num_rounds, 1))
        _within(where, f"pull_{side}_bwd_round", a[f"pull_{side}_bwd_round"], 0, max(header.num_bwd_rounds, 1))
        _within(where, f"pull_{side}_kind", a[f"pull_{side}_kind"], 0, 2)
        _within(where, f"pull_{side}_block", a[f"pull_{side}_block"], 0, header.num_blocks)
        _within(where, f"pull_{side}_peer", a[f"pull_{side}_peer"], 0, header.num_ranks)
        counts = a[f"pull_{side}_seg_count"]
        _within(where, f"pull_{side}_seg_count", counts, 0, num_segments + 1)  # 0: every segment of the block
        if int(counts.sum()) != a[f"pull_{side}_segs"].size:
            _fail(where, f"pull_{side}_seg_count sums to {int(counts.sum())} but pull_{side}_segs holds "
                         f"{a[f'pull_{side}_segs'].size}")
        _within(where, f"pull_{side}_segs", a[f"pull_{side}_segs"], 0, num_segments)
    _within(where, "pull_send_source", a["pull_send_source"], -1, rows["recv"])
    return rows["send"], rows["recv"]


def check_rank_arrays(where: str, header, a: dict[str, np.ndarray], num_segments: int, block_tokens: np.ndarray,
                      block_num_segments: np.ndarray, rank: int) -> None:
    """One rank's section: tables of equal length, every index, round and stage within the header's counts, and
    every reshuffle run within the rank's user-layout chunk and plan-layout tokens."""
    _within(where, "blocks", a["blocks"], 0, header.num_blocks)
    if np.unique(a["blocks"]).size != a["blocks"].size:
        _fail(where, "blocks lists a block more than once")
    num_send, num_recv = _check_pulls(where, header, a, num_segments)
    # Whole-block rows (seg_count 0) expand on read: a rank receives each block at most once a kind, and sends at
    # most one row a kind to each other rank, which bounds what the expansion may allocate.
    for side, most in (("recv", 2 * num_segments), ("send", 2 * header.num_ranks * num_segments)):
        counts = a[f"pull_{side}_seg_count"]
        expanded = int(np.where(counts == 0, block_num_segments[a[f"pull_{side}_block"]], counts).sum())
        if expanded > most:
            _fail(where, f"pull_{side} rows carry {expanded} segments, more than the {most} a rank can {side}")
    _same_length(where, a, ("tile_stage", "tile_bwd_stage", "tile_q_block", "tile_kv_block"))
    _within(where, "tile_stage", a["tile_stage"], 0, header.num_fwd_stages)
    _within(where, "tile_bwd_stage", a["tile_bwd_stage"], 0, header.num_bwd_stages)
    _within(where, "tile_q_block", a["tile_q_block"], 0, header.num_blocks)
    _within(where, "tile_kv_block", a["tile_kv_block"], 0, header.num_blocks)
    for prefix, num_rounds, per_stage, num_stages in (
            ("fwd", header.num_fwd_rounds, header.coalesce, header.num_fwd_stages),
            ("bwd", header.num_bwd_rounds, header.bwd_coalesce, header.num_bwd_stages)):
        for side, rows in (("send", num_recv), ("recv", num_send)):  # a push leaves along a received pull
            _same_length(where, a, (f"{prefix}_push_{side}_round", f"{prefix}_push_{side}_pull"))
            rounds = a[f"{prefix}_push_{side}_round"]
            _within(where, f"{prefix}_push_{side}_round", rounds, 0, max(num_rounds, 1))
            _within(where, f"{prefix}_push_{side}_round stage", rounds // per_stage, 0, num_stages)
            _within(where, f"{prefix}_push_{side}_pull", a[f"{prefix}_push_{side}_pull"], 0, rows)
    for prefix, per_stage, num_stages in (("pull_send", header.coalesce, header.num_fwd_stages),
                                          ("pull_recv", header.coalesce, header.num_fwd_stages)):
        _within(where, f"{prefix}_round stage", a[f"{prefix}_round"] // per_stage, 0, num_stages)
        _within(where, f"{prefix}_bwd_round stage", a[f"{prefix}_bwd_round"] // header.bwd_coalesce, 0,
                header.num_bwd_stages)
    user_tokens = (rank + 1) * header.total_tokens // header.num_ranks - rank * header.total_tokens // header.num_ranks
    plan_tokens = int(block_tokens[a["blocks"]].sum())
    for side, layout, tokens in (("send", "user", user_tokens), ("recv", "plan", plan_tokens)):
        names = tuple(f"reshuffle_{side}_{name}" for name in ("peer", "offset", "length"))
        _same_length(where, a, names)
        _within(where, f"reshuffle_{side}_peer", a[f"reshuffle_{side}_peer"], 0, header.num_ranks)
        if (np.diff(a[f"reshuffle_{side}_peer"]) < 0).any():  # all_to_all_single packs the peers in rank order
            _fail(where, f"reshuffle_{side} runs are not grouped by peer in ascending order")
        _within(where, f"reshuffle_{side}_offset", a[f"reshuffle_{side}_offset"], 0, max(tokens, 1))
        _within(where, f"reshuffle_{side}_length", a[f"reshuffle_{side}_length"], 1, tokens + 1)
        end = a[f"reshuffle_{side}_offset"] + a[f"reshuffle_{side}_length"]
        if end.size and int(end.max()) > tokens or int(a[f"reshuffle_{side}_length"].sum()) > tokens:
            _fail(where, f"reshuffle_{side} runs reach past the rank's {tokens} {layout}-layout tokens")


def check_ranks_arrays(where: Callable[[int], str], header, ranks: list[dict[str, np.ndarray]], num_segments: int,
                       block_tokens: np.ndarray, block_num_segments: np.ndarray) -> None:
    """:func:`check_rank_arrays` of every rank (rank r's arrays at position r of `ranks`; `where(r)` names its
    section): the checks run over all ranks at once, and only where they find something are the ranks checked one
    by one, so the error is the one the first bad rank raises alone. (At thousands of ranks, forty small checks a
    rank cost seconds.)

    Raises:
        PlanFormatError: as :func:`check_rank_arrays`, for the first bad rank.
    """
    if _ranks_pass(header, _Joined(ranks), num_segments, block_tokens, block_num_segments):
        return
    for rank, arrays in enumerate(ranks):
        check_rank_arrays(where(rank), header, arrays, num_segments, block_tokens, block_num_segments, rank)


def check_joined_arrays(where: Callable[[int], str], header, arrays: dict[str, np.ndarray],
                        bounds: dict[str, np.ndarray], num_segments: int, block_tokens: np.ndarray,
                        block_num_segments: np.ndarray) -> None:
    """:func:`check_ranks_arrays` of ranks read end to end (per name, every rank's values and each rank's bounds in
    them, num_ranks + 1 entries): the same checks and the same message for the first bad rank.

    Raises:
        PlanFormatError: as :func:`check_rank_arrays`, for the first bad rank.
    """
    if _ranks_pass(header, _Stacked(arrays, bounds), num_segments, block_tokens, block_num_segments):
        return
    for rank in range(len(bounds["blocks"]) - 1):
        rank_arrays = {name: values[bounds[name][rank]:bounds[name][rank + 1]] for name, values in arrays.items()}
        check_rank_arrays(where(rank), header, rank_arrays, num_segments, block_tokens, block_num_segments, rank)


class _Joined:
    """Every rank's arrays of a name end to end, with each rank's row count and each row's rank."""

    def __init__(self, ranks: list[dict[str, np.ndarray]]):
        self.ranks = ranks
        self.num_ranks = len(ranks)

    def rows(self, name: str) -> np.ndarray:
        return np.fromiter((arrays[name].size for arrays in self.ranks), dtype=np.int64, count=self.num_ranks)

    def values(self, name: str) -> np.ndarray:
        return np.concatenate([arrays[name] for arrays in self.ranks]) if self.ranks else np.zeros(0, dtype=np.int64)

    def same_rows(self, names: tuple[str, ...]) -> np.ndarray | None:
        """Each rank's rows of `names`, or None where a rank's tables of them differ in length."""
        first = self.rows(names[0])
        return first if all(np.array_equal(first, self.rows(name)) for name in names[1:]) else None

    def rank_sums(self, values: np.ndarray, rows: np.ndarray) -> np.ndarray:
        """Per rank, the sum of its rows of `values` (laid out as `rows` says), exactly."""
        ends = np.concatenate(([0], np.cumsum(values, dtype=np.int64)))
        bounds = np.concatenate(([0], np.cumsum(rows)))
        return ends[bounds[1:]] - ends[bounds[:-1]]


class _Stacked(_Joined):
    """:class:`_Joined` of arrays already end to end: per name the values and each rank's bounds in them."""

    def __init__(self, arrays: dict[str, np.ndarray], bounds: dict[str, np.ndarray]):
        super().__init__([])
        self.arrays, self.bounds = arrays, bounds
        self.num_ranks = len(bounds["blocks"]) - 1

    def rows(self, name: str) -> np.ndarray:
        return np.diff(self.bounds[name])

    def values(self, name: str) -> np.ndarray:
        return self.arrays[name]


def _inside(values: np.ndarray, low, high) -> bool:
    """Every value in [low, high) (`high` a number, or an array of one bound a value)."""
    if values.size == 0:
        return True
    if np.ndim(high) == 0:
        return int(values.min()) >= low and int(values.max()) < high
    return bool(((values >= low) & (values < high)).all())


def _ranks_pass(header, joined: _Joined, num_segments: int, block_tokens: np.ndarray,
                block_num_segments: np.ndarray) -> bool:
    """Whether every rank passes :func:`check_rank_arrays` (each of its checks, over all ranks at once)."""
    num_ranks = joined.num_ranks
    rank_ids = np.arange(num_ranks, dtype=np.int64)
    blocks, block_rows = joined.values("blocks"), joined.rows("blocks")
    if not _inside(blocks, 0, header.num_blocks):
        return False
    held = np.sort(np.repeat(rank_ids, block_rows) * header.num_blocks + blocks)
    if (held[1:] == held[:-1]).any():
        return False
    pull_rows = {}
    for side, most in (("send", 2 * header.num_ranks * num_segments), ("recv", 2 * num_segments)):
        names = tuple(f"pull_{side}_{name}" for name in ("round", "bwd_round", "kind", "block", "peer", "seg_count"))
        rows = joined.same_rows(names + (("pull_send_source",) if side == "send" else ()))
        if rows is None:
            return False
        pull_rows[side] = rows
        columns = {}  # each joined once: the block and count columns are read again below
        for name, high in (("round", max(header.num_rounds, 1)), ("bwd_round", max(header.num_bwd_rounds, 1)),
                           ("kind", 2), ("block", header.num_blocks), ("peer", header.num_ranks),
                           ("seg_count", num_segments + 1)):
            columns[name] = joined.values(f"pull_{side}_{name}")
            if not _inside(columns[name], 0, high):
                return False
        counts, segs = columns["seg_count"], f"pull_{side}_segs"
        if not np.array_equal(joined.rank_sums(counts, rows), joined.rows(segs)) or \
                not _inside(joined.values(segs), 0, num_segments):
            return False
        expanded = np.where(counts == 0, block_num_segments[columns["block"]], counts)
        if (joined.rank_sums(expanded, rows) > most).any():
            return False
    if not _inside(joined.values("pull_send_source"), -1, np.repeat(pull_rows["recv"], pull_rows["send"])):
        return False
    if joined.same_rows(("tile_stage", "tile_bwd_stage", "tile_q_block", "tile_kv_block")) is None:
        return False
    for name, high in (("tile_stage", header.num_fwd_stages), ("tile_bwd_stage", header.num_bwd_stages),
                       ("tile_q_block", header.num_blocks), ("tile_kv_block", header.num_blocks)):
        if not _inside(joined.values(name), 0, high):
            return False
    return _pushes_pass(header, joined, pull_rows) and _pull_stages_pass(header, joined) and \
        _reshuffles_pass(header, joined, block_tokens)


def _pushes_pass(header, joined: _Joined, pull_rows: dict[str, np.ndarray]) -> bool:
    for prefix, num_rounds, per_stage, num_stages in (
            ("fwd", header.num_fwd_rounds, header.coalesce, header.num_fwd_stages),
            ("bwd", header.num_bwd_rounds, header.bwd_coalesce, header.num_bwd_stages)):
        for side, pulls in (("send", pull_rows["recv"]), ("recv", pull_rows["send"])):
            rows = joined.same_rows((f"{prefix}_push_{side}_round", f"{prefix}_push_{side}_pull"))
            if rows is None:
                return False
            rounds = joined.values(f"{prefix}_push_{side}_round")
            if not (_inside(rounds, 0, max(num_rounds, 1)) and _inside(rounds // per_stage, 0, num_stages)
                    and _inside(joined.values(f"{prefix}_push_{side}_pull"), 0, np.repeat(pulls, rows))):
                return False
    return True


def _pull_stages_pass(header, joined: _Joined) -> bool:
    return all(_inside(joined.values(f"{prefix}_round") // header.coalesce, 0, header.num_fwd_stages)
               and _inside(joined.values(f"{prefix}_bwd_round") // header.bwd_coalesce, 0, header.num_bwd_stages)
               for prefix in ("pull_send", "pull_recv"))


def _reshuffles_pass(header, joined: _Joined, block_tokens: np.ndarray) -> bool:
    num_ranks, total = joined.num_ranks, header.total_tokens
    user_tokens = np.array([(rank + 1) * total // header.num_ranks - rank * total // header.num_ranks
                            for rank in range(num_ranks)], dtype=np.int64)
    plan_tokens = joined.rank_sums(block_tokens[joined.values("blocks")], joined.rows("blocks"))
    for side, tokens in (("send", user_tokens), ("recv", plan_tokens)):
        names = tuple(f"reshuffle_{side}_{name}" for name in ("peer", "offset", "length"))
        rows = joined.same_rows(names)
        if rows is None:
            return False
        peer, offset, length = (joined.values(name) for name in names)
        row_rank = np.repeat(np.arange(num_ranks), rows)
        if not _inside(peer, 0, header.num_ranks) or \
                ((np.diff(peer) < 0) & (row_rank[1:] == row_rank[:-1])).any():
            return False
        row_tokens = tokens[row_rank]
        if not (_inside(offset, 0, np.maximum(row_tokens, 1)) and _inside(length, 1, row_tokens + 1)):
            return False
        if (offset + length > row_tokens).any() or (joined.rank_sums(length, rows) > tokens).any():
            return False
    return True

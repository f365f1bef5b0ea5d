"""Structural checks every plan reader runs before using a section: sizes agree, every index is in range.

These make a plan safe to index (no reader raises IndexError or allocates more than the file's own sizes imply);
whether the plan is *right* (coverage, data before use, congestion freedom, liveness) is
:mod:`~fcp_compiler.format.validate`'s job. Each check raises PlanFormatError with one line naming the array and the
value.
"""

from __future__ import annotations

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

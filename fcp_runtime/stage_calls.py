"""The varlen kernel calls of one stage: its tiles' segment pairs grouped by query segment.

Every query segment with visible keys in the stage is one entry whose keys are all of its wholly visible key
segments in the stage packed together. Under a causal mask a key segment of the same sequence is either wholly
before the query segment (all visible) or the query segment itself; the diagonal one goes last, so the
bottom-right-aligned causal mask of flash-attn is exactly right for the entry, and entries without a diagonal
segment run in a second, unmasked call (a full mask has only that one). Under a sliding window a key segment partly
out of reach, or a diagonal longer than the window, is an entry of its own with the window flash-attn applies
(:mod:`fcp_compiler.algorithms.kernel_entries`); entries with the same mask share a call, a query segment at most
once per call. A call whose queries are whole local segments also lists, without keys, the local segments between
them, so that its queries are one run of the rank's rows, read and merged in place.

Every call of a step is built before its stage loop runs (:func:`prepare_host`, :func:`prepare_calls`): on the
host, in a DataLoader worker if the caller wants, then moved to the device with one copy.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch

from fcp_compiler.algorithms.kernel_entries import CAUSAL, UNMASKED, WINDOW_DIAGONAL, classify_pairs
from fcp_compiler.format.plan_format import TransferKind
from fcp_runtime.plan import RankPlan

LOCAL = -1  # source of rows this rank holds in the plan layout; otherwise a pull_recv row
# A call's queries are widened to one run of the rank's rows when the segments it skips add at most this many times
# its own rows: the rows skipped cost the merge a pass over them; reading the queries and merging the outputs by
# index instead costs about three passes over the rows the call has.
GAP_LIMIT = 1.0


@dataclass(frozen=True, slots=True, kw_only=True)
class RowIndex:
    """Where one source's rows go in a call's packed tensor: packed[positions] = source rows[rows].

    When both are one run of consecutive rows (`span` = (first position, first row, length)), the rows are read
    and written in place through views, with no index op."""

    source: int
    positions: torch.Tensor  # int32, on the device
    rows: torch.Tensor
    span: tuple[int, int, int] | None = None


@dataclass(frozen=True, slots=True, kw_only=True)
class KernelCall:
    """One varlen call: entry i's query rows are [cu_q[i], cu_q[i+1]) of the packed queries, its key rows
    [cu_k[i], cu_k[i+1]) of the packed keys; the index tensors say where each packed row comes from."""

    causal: bool
    window: tuple[int, int]  # flash-attn's window_size (left, right) of every entry; (-1, -1): none
    q_index: tuple[RowIndex, ...]  # per source: the packed query rows, to gather inputs and scatter results
    kv_index: tuple[RowIndex, ...]
    cu_q: torch.Tensor  # int32 [entries + 1] on the device
    cu_k: torch.Tensor
    max_q: int
    max_k: int
    tile_rows: tuple[int, ...]  # the plan tiles this call computes (for the event log)
    pull_rows: tuple[int, ...]  # the received pulls it reads
    q_runs: tuple[tuple[int, int, int], ...] = ()  # the packed rows in order, as (source, first row, rows) runs
    kv_runs: tuple[tuple[int, int, int], ...] = ()


def _sources(plan: RankPlan) -> dict[tuple[int, int], int]:
    return {(pull.kind, pull.block): row for row, pull in enumerate(plan.pull_recv)}


def _entries(plan: RankPlan, tiles: list[int]):
    """Per (query source, query segment): its (key source, key segment) pairs and the tiles they come from."""
    sources = plan.cached("sources", lambda: _sources(plan))
    entries: dict[tuple[int, int], list[tuple[int, int]]] = {}
    for idx in tiles:
        q_block, kv_block = plan.tiles[idx]
        q_source = LOCAL if q_block in plan.local_blocks else sources[(TransferKind.Q, q_block)]
        kv_source = LOCAL if kv_block in plan.local_blocks else sources[(TransferKind.KV, kv_block)]
        q_segs = plan.block_segs[q_block] if q_source == LOCAL else plan.pull_recv[q_source].segs
        kv_segs = plan.block_segs[kv_block] if kv_source == LOCAL else plan.pull_recv[kv_source].segs
        for qs in q_segs:
            window = int(plan.seq_window[plan.seg_seq[qs]])
            for ks in kv_segs:
                if plan.seg_seq[ks] != plan.seg_seq[qs] or (window and (
                        plan.seg_start[ks] >= plan.seg_end[qs] or plan.seg_start[qs] - plan.seg_end[ks] + 1 >= window)):
                    continue
                entries.setdefault((q_source, qs), []).append((kv_source, ks))
    return entries


def _store_rows(plan: RankPlan, source: int) -> dict[int, int]:
    """Segment -> first row in a source's store: the plan layout, or a pulled block's segments in pull order."""
    if source == LOCAL:
        return plan.local_seg_row

    def build() -> dict[int, int]:
        rows, row = {}, 0
        for seg in plan.pull_recv[source].segs:
            rows[seg] = row
            row += plan.seg_len(seg)
        return rows
    return plan.cached(("store rows", source), build)


def merge_runs(pieces) -> list[tuple[int, int, int, int]]:
    """Pieces (source, first row, rows), in the order they are packed, merged where one continues the last:
    [(source, first row, first packed position, rows)]."""
    runs: list[list[int]] = []
    position = 0
    for source, start, length in pieces:
        if runs and runs[-1][0] == source and runs[-1][1] + runs[-1][3] == start:
            runs[-1][3] += length
        else:
            runs.append([source, start, position, length])
        position += length
    return [(source, start, first, length) for source, start, first, length in runs]


def _runs(plan: RankPlan, parts) -> tuple[tuple[int, int, int], ...]:
    """Packed rows as runs of consecutive source rows, in packing order: (source, first row, rows)."""
    pieces = ((source, _store_rows(plan, source)[seg] + first, length) for source, seg, first, length in parts)
    return tuple((source, start, length) for source, start, _, length in merge_runs(pieces))


def _row_index(plan: RankPlan, parts, device) -> tuple[RowIndex, ...]:
    """Index tensors of packed rows: parts are (source, segment, first row, rows) in packing order."""
    positions: dict[int, list[torch.Tensor]] = {}
    rows: dict[int, list[torch.Tensor]] = {}
    offset = 0
    for source, seg, first, length in parts:
        start = _store_rows(plan, source)[seg] + first
        positions.setdefault(source, []).append(torch.arange(offset, offset + length))
        rows.setdefault(source, []).append(torch.arange(start, start + length))
        offset += length
    out = []
    for source in sorted(positions):
        where, what = torch.cat(positions[source]), torch.cat(rows[source])
        length = int(where.numel())
        one_run = (bool(torch.equal(where, torch.arange(int(where[0]), int(where[0]) + length)))
                   and bool(torch.equal(what, torch.arange(int(what[0]), int(what[0]) + length))))
        out.append(RowIndex(source=source, positions=where.to(device, torch.int32), rows=what.to(device, torch.int32),
                            span=(int(where[0]), int(what[0]), length) if one_run else None))
    return tuple(out)


def _with_gaps(plan: RankPlan, entries: list) -> list:
    """The entries in local row order, each local segment between the first and the last one an entry (with no
    keys where the call has none for it), when every entry's queries are whole local segments and the gaps add at
    most GAP_LIMIT x the rows: the call's queries are then one run of the rank's rows, read and merged in place.
    An entry without keys costs the kernel nothing; its rows come out with lse -inf, which merges as nothing."""
    if any(q[0] != LOCAL or q[2] != 0 or q[3] != plan.seg_len(q[1]) for q, _ in entries):
        return entries
    order = plan.cached("local segments by row", lambda: sorted(plan.local_seg_row, key=plan.local_seg_row.get))
    position = plan.cached("local segment position", lambda: {seg: i for i, seg in enumerate(order)})
    by_seg = {q[1]: (q, keys) for q, keys in entries}
    first, last = min(position[seg] for seg in by_seg), max(position[seg] for seg in by_seg)
    span = order[first:last + 1]
    rows = sum(q[3] for q, _ in entries)
    if sum(plan.seg_len(seg) for seg in span) > (1 + GAP_LIMIT) * rows:
        return entries
    return [by_seg.get(seg, ((LOCAL, seg, 0, plan.seg_len(seg)), [])) for seg in span]


def _call(plan: RankPlan, causal: bool, window: tuple[int, int], entries: list, tiles: tuple[int, ...],
          device) -> KernelCall:
    """One call from entries ((query source, segment, first row, rows), [(key source, segment, first, rows)])."""
    entries = _with_gaps(plan, entries)
    q_parts, kv_parts, cu_q, cu_k = [], [], [0], [0]
    pulls = set()
    for q_part, keys in entries:
        q_parts.append(q_part)
        kv_parts.extend(keys)
        cu_q.append(cu_q[-1] + q_part[3])
        cu_k.append(cu_k[-1] + sum(part[3] for part in keys))
        pulls.update(part[0] for part in [q_part, *keys] if part[0] != LOCAL)
    lengths_q = [b - a for a, b in zip(cu_q, cu_q[1:])]
    lengths_k = [b - a for a, b in zip(cu_k, cu_k[1:])]
    return KernelCall(causal=causal, window=window, q_index=_row_index(plan, q_parts, device),
                      kv_index=_row_index(plan, kv_parts, device), q_runs=_runs(plan, q_parts),
                      kv_runs=_runs(plan, kv_parts),
                      cu_q=torch.tensor(cu_q, dtype=torch.int32, device=device),
                      cu_k=torch.tensor(cu_k, dtype=torch.int32, device=device), max_q=max(lengths_q),
                      max_k=max(lengths_k), tile_rows=tiles, pull_rows=tuple(sorted(pulls)))


def _grouped_entries(plan: RankPlan, entries: dict) -> dict[tuple, list]:
    """(causal, window) -> the entries of that mask: each query segment's packed keys (wholly visible ones, the
    diagonal last), and one entry per key segment a sliding window cuts."""
    groups: dict[tuple, list] = {}
    for (q_source, qs), keys in entries.items():
        window = int(plan.seq_window[plan.seg_seq[qs]])
        kinds, lefts, q_rows, k_firsts = classify_pairs(
            [plan.seg_start[qs]] * len(keys), [plan.seg_end[qs]] * len(keys), [plan.seg_start[ks] for _, ks in keys],
            [plan.seg_end[ks] for _, ks in keys], [window] * len(keys))
        packed, diagonal = [], False
        for (kv_source, ks), kind, left, rows, first in zip(keys, kinds.tolist(), lefts.tolist(), q_rows.tolist(),
                                                           k_firsts.tolist()):
            if kind in (UNMASKED, CAUSAL):
                packed.append((kind == CAUSAL, plan.seg_start[ks], (kv_source, ks, 0, plan.seg_len(ks))))
                diagonal |= kind == CAUSAL
                continue
            mask = (True, (left, 0)) if kind == WINDOW_DIAGONAL else (False, (left, -1))
            groups.setdefault(mask, []).append(((q_source, qs, 0, rows),
                                                [(kv_source, ks, first, plan.seg_len(ks) - first)]))
        if packed:
            # Keys wholly before the queries first, the diagonal segment (the query segment itself) last.
            keys_in_order = [part for _, _, part in sorted(packed, key=lambda item: (item[0], item[1]))]
            groups.setdefault((diagonal, (-1, -1)), []).append(((q_source, qs, 0, plan.seg_len(qs)), keys_in_order))
    return groups


def _build(plan: RankPlan, tiles: tuple[int, ...], device) -> list[KernelCall]:
    entries = _entries(plan, list(tiles))
    calls = []
    for (causal, window), group in sorted(_grouped_entries(plan, entries).items(), key=lambda item: (
            not item[0][0], item[0][1])):
        # A query segment at most once a call: its partial outputs merge one call at a time.
        split: list[list] = []
        for entry in group:
            slot = next((call for call in split if all(e[0][:2] != entry[0][:2] for e in call)), None)
            if slot is None:
                split.append(slot := [])
            slot.append(entry)
        calls.extend(_call(plan, causal, window, entries_of_call, tiles, device) for entries_of_call in split)
    return calls


def stage_calls(plan: RankPlan, pass_name: str, stage: int, tiles: list[int], device) -> list[KernelCall]:
    """The kernel calls that compute `tiles` (rows of plan.tiles) of one stage (cached per plan; built here only
    if :func:`prepare_calls` did not build them before the stage loop)."""
    key = ("calls", pass_name, stage, tuple(tiles), torch.device(device))
    return plan.cached(key, lambda: _build(plan, tuple(tiles), device))


def plan_requests(plan: RankPlan, layout: str) -> list[tuple[str, int, tuple[int, ...]]]:
    """Every (pass, stage, tiles) whose calls a step of this plan runs: each stage's tiles, and in the user layout
    the stage-0 tiles that run during the reshuffle apart from the rest."""
    skip = plan.early_tiles if layout == "user" else frozenset()
    requests = [("fwd", 0, tuple(sorted(skip)))] if skip else []
    for program in (plan.forward, plan.backward):
        for stage, tiles in enumerate(program.tiles):
            kept = tuple(idx for idx in tiles if idx not in skip) if program.name == "fwd" else tuple(tiles)
            requests.append((program.name, stage, kept))
    return requests


def prepare_host(plan: RankPlan, layout: str) -> tuple[dict, torch.Tensor]:
    """Build every call of a step on the host, its index tensors packed into one int32 buffer (cached on the plan):
    a DataLoader worker may do this, off the training loop's thread. Returns ({(pass, stage, tiles): calls}, the
    buffer)."""
    def build():
        host = {(name, stage, tiles): _build(plan, tiles, torch.device("cpu"))
                for name, stage, tiles in plan_requests(plan, layout)}
        tensors = [t for calls in host.values() for call in calls for t in _call_tensors(call)]
        flat = torch.cat(tensors) if tensors else torch.zeros(0, dtype=torch.int32)
        return host, flat
    return plan.cached(("host calls", layout), build)


def prepare_calls(plan: RankPlan, layout: str, device) -> None:
    """Put every call of a step on `device` before the stage loop runs: the host buffer of
    :func:`prepare_host` (pinned on CUDA) moves with one non-blocking copy, and every call's index tensors become
    views of the copy; the stage loop then builds and copies nothing."""
    device = torch.device(device)
    prepared = plan.cached(("prepared", layout), set)  # the devices this layout's calls are on already
    if device in prepared:
        return
    host, flat = prepare_host(plan, layout)
    if device.type == "cuda":  # pragma: no cover - needs a GPU
        flat = flat.pin_memory()
    buffer = flat.to(device, non_blocking=True)
    offset = 0

    def view(tensor: torch.Tensor) -> torch.Tensor:
        nonlocal offset
        offset += tensor.numel()
        return buffer.narrow(0, offset - tensor.numel(), tensor.numel())

    for (name, stage, tiles), calls in host.items():  # the order prepare_host packed them in
        on_device = [_on(call, view) for call in calls]
        plan.cached(("calls", name, stage, tiles, device), lambda: on_device)
    prepared.add(device)


def _call_tensors(call: KernelCall) -> list[torch.Tensor]:
    return [t for index in call.q_index + call.kv_index for t in (index.positions, index.rows)] + [call.cu_q,
                                                                                                   call.cu_k]


def _on(call: KernelCall, view) -> KernelCall:
    """The call with its tensors replaced by view(tensor), in :func:`_call_tensors` order."""
    def index(entries):
        return tuple(dataclasses.replace(e, positions=view(e.positions), rows=view(e.rows)) for e in entries)
    q_index, kv_index = index(call.q_index), index(call.kv_index)
    return dataclasses.replace(call, q_index=q_index, kv_index=kv_index, cu_q=view(call.cu_q), cu_k=view(call.cu_k))

"""The kernel calls of a step, as torch objects: the call plan the compiler decides, either as packed varlen calls
(:func:`fcp_compiler.format.call_plan.rank_calls`, with the index tensors that read and merge their rows) or, for a
range kernel, as ranges over the rank's rows and its arenas (:func:`fcp_compiler.format.arena.rank_range_calls`).

A call's queries and keys are runs of rows of the rank's stores (its plan-layout rows, LOCAL, or a received pull's
buffer); where a source's rows in a call are one run, they are read and written in place through views and no index
tensor is built. Every call of a step is built before its stage loop runs (:func:`prepare_host`,
:func:`prepare_calls`): on the host, in a DataLoader worker if the caller wants, then moved to the device with one
copy.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import numpy as np
import torch

from fcp_compiler.algorithms.call_plan import LOCAL, CallArrays
from fcp_compiler.format.arena import Arenas, RangeCalls, rank_arenas, rank_range_calls
from fcp_compiler.format.call_plan import Request, rank_calls, step_requests
from fcp_compiler.format.plan_format import expand_ranges
from fcp_runtime.plan import RankPlan

__all__ = ["LOCAL", "KernelCall", "RangeCall", "RowIndex", "arenas", "merge_runs", "plan_requests", "prepare_calls",
           "prepare_host", "stage_calls"]


@dataclass(frozen=True, slots=True, kw_only=True)
class RowIndex:
    """Where one source's rows go in a call's packed tensor: packed[positions] = source rows[rows].

    When both are one run of consecutive rows (`span` = (first position, first row, length)), the rows are read
    and written in place through views, and positions and rows are empty."""

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
    kv_index: tuple[RowIndex, ...]  # backward only: where dK, dV add (the forward reads keys by kv_runs)
    cu_q: torch.Tensor  # int32 [entries + 1] on the device
    cu_k: torch.Tensor
    max_q: int
    max_k: int
    tile_rows: tuple[int, ...]  # the plan tiles of the request this call belongs to (for the event log)
    pull_rows: tuple[int, ...]  # the received pulls it reads
    q_runs: tuple[tuple[int, int, int], ...] = ()  # the packed rows in order, as (source, first row, rows) runs
    kv_runs: tuple[tuple[int, int, int], ...] = ()


@dataclass(frozen=True, slots=True, kw_only=True)
class RangeCall:
    """One range kernel call: its queries are rows of the query arena (q_arena) or of the rank's own rows, its keys
    rows of the key arena (kv_arena) or of its own; range i pairs q_ranges[i] with k_ranges[i] under masks[i]
    ((left, right), bottom-right aligned). Index tensors are int32, flat ([2 n]: view them as [n, 2])."""

    q_arena: bool
    kv_arena: bool
    q_ranges: torch.Tensor
    k_ranges: torch.Tensor
    masks: torch.Tensor
    max_q: int
    max_k: int
    tile_rows: tuple[int, ...]  # the plan tiles of the request this call belongs to (for the event log)
    pull_rows: tuple[int, ...]  # the received pulls it reads


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


def _row_index(source: np.ndarray, row: np.ndarray, rows: np.ndarray) -> tuple[RowIndex, ...]:
    """Per source, where its pieces (source, first row, rows; in packing order) sit in the packed tensor: a span
    where they are one run in both, else index tensors (host int32)."""
    position = (np.cumsum(rows) - rows).astype(np.int64)
    out = []
    for src in np.unique(source).tolist():
        mine = source == src
        where, first, length = position[mine], row[mine], rows[mine]
        if bool((where[1:] == where[:-1] + length[:-1]).all() and (first[1:] == first[:-1] + length[:-1]).all()):
            empty = torch.zeros(0, dtype=torch.int32)
            out.append(RowIndex(source=src, positions=empty, rows=empty,
                                span=(int(where[0]), int(first[0]), int(length.sum()))))
            continue
        out.append(RowIndex(source=src, positions=torch.from_numpy(expand_ranges(where, length).astype(np.int32)),
                            rows=torch.from_numpy(expand_ranges(first, length).astype(np.int32))))
    return tuple(out)


def _runs(source: np.ndarray, row: np.ndarray, rows: np.ndarray) -> tuple[tuple[int, int, int], ...]:
    """Packed rows as runs of consecutive source rows, in packing order: (source, first row, rows)."""
    return tuple((s, start, length) for s, start, _, length in merge_runs(zip(source.tolist(), row.tolist(),
                                                                            rows.tolist())))


def _kernel_calls(arrays: CallArrays, requests: list[Request]) -> list[list[KernelCall]]:
    """Per request, its calls as torch objects (index tensors on the host)."""
    per_request: list[list[KernelCall]] = [[] for _ in requests]
    entry_k_rows = arrays.entry_k_rows
    for call in range(arrays.num_calls):
        e0, e1 = int(arrays.call_entry_ptr[call]), int(arrays.call_entry_ptr[call + 1])
        k0, k1 = int(arrays.entry_key_ptr[e0]), int(arrays.entry_key_ptr[e1])
        q = (arrays.entry_q_source[e0:e1], arrays.entry_q_row[e0:e1], arrays.entry_q_rows[e0:e1])
        kv = (arrays.key_source[k0:k1], arrays.key_row[k0:k1], arrays.key_rows[k0:k1])
        cu_q = np.concatenate(([0], np.cumsum(q[2])))
        cu_k = np.concatenate(([0], np.cumsum(entry_k_rows[e0:e1])))
        sources = np.unique(np.concatenate([q[0], kv[0]]))
        request = int(arrays.call_request[call])
        backward = requests[request].pass_name == "bwd"
        per_request[request].append(KernelCall(
            causal=bool(arrays.call_causal[call]), window=(int(arrays.call_left[call]), int(arrays.call_right[call])),
            q_index=_row_index(*q), kv_index=_row_index(*kv) if backward else (), q_runs=_runs(*q), kv_runs=_runs(*kv),
            cu_q=torch.from_numpy(cu_q.astype(np.int32)), cu_k=torch.from_numpy(cu_k.astype(np.int32)),
            max_q=int(q[2].max()), max_k=int(entry_k_rows[e0:e1].max()), tile_rows=requests[request].tiles,
            pull_rows=tuple(sources[sources != LOCAL].tolist())))
    return per_request


def _range_calls(arrays: RangeCalls, requests: list[Request]) -> list[list[RangeCall]]:
    """Per request, its range calls as torch objects (index tensors on the host)."""
    per_request: list[list[RangeCall]] = [[] for _ in requests]
    ptr = arrays.call_range_ptr.tolist()
    pull_ptr = arrays.call_pull_ptr.tolist()
    for call in range(arrays.num_calls):
        low, high = ptr[call], ptr[call + 1]
        q = np.stack([arrays.q_start[low:high], arrays.q_end[low:high]], axis=1)
        k = np.stack([arrays.k_start[low:high], arrays.k_end[low:high]], axis=1)
        masks = np.stack([arrays.left[low:high], arrays.right[low:high]], axis=1)
        request = int(arrays.call_request[call])
        per_request[request].append(RangeCall(
            q_arena=bool(arrays.call_q_arena[call]), kv_arena=bool(arrays.call_kv_arena[call]),
            q_ranges=_int32(q), k_ranges=_int32(k), masks=_int32(masks), max_q=int((q[:, 1] - q[:, 0]).max()),
            max_k=int((k[:, 1] - k[:, 0]).max()), tile_rows=requests[request].tiles,
            pull_rows=tuple(arrays.call_pull[pull_ptr[call]:pull_ptr[call + 1]].tolist())))
    return per_request


def _int32(values: np.ndarray) -> torch.Tensor:
    return torch.from_numpy(np.ascontiguousarray(values, dtype=np.int32).reshape(-1))


def arenas(plan: RankPlan) -> dict[str, Arenas]:
    """Where this rank's received pulls sit in its arenas, per pass (:func:`fcp_compiler.format.arena.rank_arenas`;
    cached on the plan)."""
    return plan.cached("arenas", lambda: rank_arenas(plan.program))


def _build(plan: RankPlan, requests: list[Request], ranges: bool) -> list[list]:
    """Per request, its calls: range calls where `ranges`, else packed calls (index tensors on the host)."""
    if ranges:
        return _range_calls(rank_range_calls(plan.program, requests, arenas(plan)), requests)
    return _kernel_calls(rank_calls(plan.program, requests), requests)


def stage_calls(plan: RankPlan, pass_name: str, stage: int, tiles: list[int], device,
                ranges: bool = False) -> list:
    """The kernel calls that compute `tiles` (rows of plan.tiles) of one stage (stage -1: the forward's tiles that
    run during the user layout's reshuffle): range calls where `ranges`, else packed calls; cached per plan; built
    here only if :func:`prepare_calls` did not build them before the stage loop."""
    device = torch.device(device)
    key = ("calls", ranges, pass_name, stage, tuple(tiles), device)

    def build() -> list:
        request = Request(pass_name=pass_name, stage=stage, tiles=tuple(tiles))
        (calls,) = _build(plan, [request], ranges)
        view = _device_views(device, [t for call in calls for t in _call_tensors(call)])
        return [_on(call, view) for call in calls]
    return plan.cached(key, build)


def plan_requests(plan: RankPlan, layout: str) -> list[Request]:
    """Every request whose calls a step of this plan runs (:func:`fcp_compiler.format.call_plan.step_requests`)."""
    return step_requests(plan.program, layout)


def prepare_host(plan: RankPlan, layout: str, ranges: bool = False) -> tuple[dict, torch.Tensor]:
    """Build every call of a step on the host (range calls where `ranges`), its index tensors packed into one int32
    buffer (cached on the plan): a DataLoader worker may do this, off the training loop's thread. Returns
    ({(pass, stage, tiles): calls}, the buffer)."""
    def build():
        requests = plan_requests(plan, layout)
        calls = _build(plan, requests, ranges)
        host = {(r.pass_name, r.stage, r.tiles): request_calls for r, request_calls in zip(requests, calls)}
        tensors = [t for calls in host.values() for call in calls for t in _call_tensors(call)]
        flat = torch.cat(tensors) if tensors else torch.zeros(0, dtype=torch.int32)
        return host, flat
    return plan.cached(("host calls", layout, ranges), build)


def prepare_calls(plan: RankPlan, layout: str, device, ranges: bool = False) -> None:
    """Put every call of a step on `device` before the stage loop runs: the host buffer of
    :func:`prepare_host` (pinned on CUDA) moves with one non-blocking copy, and every call's index tensors become
    views of the copy; the stage loop then builds and copies nothing."""
    device = torch.device(device)
    prepared = plan.cached(("prepared", layout, ranges), set)  # the devices this layout's calls are on already
    if device in prepared:
        return
    host, flat = prepare_host(plan, layout, ranges)
    view = _device_views(device, [flat])
    for (name, stage, tiles), calls in host.items():  # the order prepare_host packed them in
        on_device = [_on(call, view) for call in calls]
        plan.cached(("calls", ranges, name, stage, tiles, device), lambda: on_device)
    prepared.add(device)


def _device_views(device: torch.device, tensors: list[torch.Tensor]):
    """A function that hands out, in order, views of one device copy of `tensors` (concatenated int32)."""
    flat = tensors[0] if len(tensors) == 1 else torch.cat(tensors) if tensors else torch.zeros(0, dtype=torch.int32)
    if device.type == "cuda":  # pragma: no cover - needs a GPU
        flat = flat.pin_memory()
    buffer = flat.to(device, non_blocking=True)
    offset = 0

    def view(tensor: torch.Tensor) -> torch.Tensor:
        nonlocal offset
        offset += tensor.numel()
        return buffer.narrow(0, offset - tensor.numel(), tensor.numel())
    return view


def _call_tensors(call) -> list[torch.Tensor]:
    if isinstance(call, RangeCall):
        return [call.q_ranges, call.k_ranges, call.masks]
    return [t for index in call.q_index + call.kv_index for t in (index.positions, index.rows)] + [call.cu_q,
                                                                                                   call.cu_k]


def _on(call, view):
    """The call with its tensors replaced by view(tensor), in :func:`_call_tensors` order."""
    if isinstance(call, RangeCall):
        return dataclasses.replace(call, q_ranges=view(call.q_ranges), k_ranges=view(call.k_ranges),
                                   masks=view(call.masks))
    def index(entries):
        return tuple(dataclasses.replace(e, positions=view(e.positions), rows=view(e.rows)) for e in entries)
    q_index, kv_index = index(call.q_index), index(call.kv_index)
    return dataclasses.replace(call, q_index=q_index, kv_index=kv_index, cu_q=view(call.cu_q), cu_k=view(call.cu_k))

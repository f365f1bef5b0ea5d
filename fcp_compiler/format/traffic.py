"""Device memory traffic the runtime issues outside the attention kernels on the range path, per rank and stage:
the bytes its ops read and write and how many ops it launches. The simulator charges them on the compute stream
(at the profile's HBM bandwidth, a launch each); benchmarks/runtime_traffic.py counts the same ops on the meta
device, and tests/test_traffic.py holds the two equal.

On the range path (:mod:`fcp_compiler.format.arena`) the kernels read in place and accumulate into the tensors they
are given, so what is left is what the messages make the runtime do, op by op as fcp_runtime.attention runs them:

- at the pass's start, the rank's accumulators are made (forward O and LSE; backward dQ and dK, dV, zeroed);
- a sent pull whose segments are not one run of their store is packed (one concatenation a tensor); a backward Q
  pull's LSE is always copied (its rows are a heads-first slice); a forward Q pull's results go back with their LSE
  copied out of the arena (a heads-first slice too);
- a pull that arrives gets its accumulators zeroed in its arena rows (forward Q: O and LSE; backward K,V: dK, dV;
  backward Q: dQ, and its LSE copied in from the buffer it arrived in);
- a push that comes back lands in the rows it belongs to, one run at a time: forward, a log-sum-exp merge (ten
  elementwise ops); backward, one add;
- at the pass's end, the outputs are cast to the input dtype.

An op is charged what the meta-device count charges: every tensor it reads and every tensor it writes, whole (an
in-place op reads and writes its target). Not counted: in the user layout, the reshuffles' gathers and scatters of
Q, K, V and O; and what the packing path adds (packed inputs, merges and adds after each call: on the 256-GPU paper
plan 69 and 136 GB a pass on the busiest rank against 3 and 42 here, benchmarks/runtime_traffic.py).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from fcp_compiler.format.liveness import PassMessages, stacked_messages
from fcp_compiler.format.memory import Sizes, send_runs
from fcp_compiler.format.plan_format import TransferKind
from fcp_compiler.format.stacked import StackedRanks

# A forward landing's merge of l rows (fcp_runtime.kernels.merge_into): ten ops, moving 22 LSE rows and 5 output
# accumulator rows (logaddexp 3, two subs 3 each, two exps 2 each, two nan_to_num_ 2 each, the scale 2 + 1 LSE,
# the addcmul 3 + 1 LSE, the LSE copy 3).
MERGE_OPS, MERGE_LSE_ROWS, MERGE_ACC_ROWS = 10, 22, 5


@dataclass(frozen=True, slots=True, kw_only=True)
class Traffic:
    """Per stacked rank and stage of one pass: bytes read and written outside the kernels, and ops launched
    (float64 / int64 [num_ranks, num_stages]); the pass's first stage carries its start, its last its end."""

    bytes: np.ndarray
    ops: np.ndarray


def stacked_range_traffic(stacked: StackedRanks, sizes: Sizes, index_bytes: np.ndarray | None = None,
                          recv_rows: np.ndarray | None = None) -> dict[str, Traffic]:
    """The range path's traffic outside the kernels, per pass ("fwd", "bwd"), for every stacked rank (the module
    docstring). O(messages + ranks x stages).

    Args:
        stacked: the ranks.
        sizes: bytes per token of each tensor kind (:class:`fcp_compiler.format.memory.Sizes`).
        index_bytes: per rank, the bytes of its step's range index tensors, copied to the device once at the
            forward's start (None: 0; a few KB).
        recv_rows: stacked.pull_tokens("recv"), where the caller has it.
    """
    a = stacked.arrays
    recv_rows = stacked.pull_tokens("recv") if recv_rows is None else recv_rows
    send_rows = stacked.pull_tokens("send")
    tokens = stacked.plan_tokens().astype(np.float64)
    runs = send_runs(stacked)
    out = {}
    for name in ("fwd", "bwd"):
        messages = stacked_messages(stacked, name, last_use=False)  # when buffers are freed moves nothing
        forward = name == "fwd"
        num_stages = max(messages.num_stages, 1)
        traffic = _Tally(stacked.num_ranks, num_stages)
        _ends(traffic, tokens, sizes, forward, index_bytes if forward else None)
        _sends(traffic, a, messages, send_rows, runs, recv_rows, sizes, forward)
        _arrivals(traffic, a, messages, recv_rows, sizes, forward)
        _landings(traffic, a, messages, send_rows, runs, sizes, forward)
        out[name] = Traffic(bytes=traffic.bytes, ops=traffic.ops)
    return out


class _Tally:
    """Bytes and ops per (rank, stage)."""

    def __init__(self, num_ranks: int, num_stages: int):
        self.num_stages = num_stages
        self.bytes = np.zeros((num_ranks, num_stages))
        self.ops = np.zeros((num_ranks, num_stages), dtype=np.int64)

    def add(self, rank: np.ndarray, stage: np.ndarray, nbytes: np.ndarray, ops: np.ndarray) -> None:
        slot = rank * self.num_stages + stage
        size = self.bytes.size
        self.bytes += np.bincount(slot, weights=nbytes, minlength=size)[:size].reshape(self.bytes.shape)
        self.ops += np.bincount(slot, weights=ops, minlength=size)[:size].astype(np.int64).reshape(self.ops.shape)


def own_bytes_per_token(sizes: Sizes, forward: bool) -> tuple[int, int]:
    """Bytes a rank moves per token it holds, whatever its schedule: (at a pass's start, its accumulators made:
    forward O zeroed and LSE filled, backward dQ and dK, dV zeroed; at the end, its outputs cast to the input dtype:
    forward O, backward dQ, dK, dV)."""
    if forward:
        return sizes.q_acc + sizes.lse, sizes.q_acc + sizes.q
    return sizes.q_acc + 2 * sizes.kv_acc, sizes.q_acc + sizes.q + 2 * (sizes.kv_acc + sizes.kv)


def _ends(traffic: _Tally, tokens: np.ndarray, sizes: Sizes, forward: bool, index_bytes) -> None:
    """The accumulators made at the start, the outputs cast at the end (and the forward's index copy)."""
    ranks = np.arange(tokens.size)
    first, last = np.zeros(tokens.size, dtype=np.int64), np.full(tokens.size, traffic.num_stages - 1)
    start, end = own_bytes_per_token(sizes, forward)
    # Forward: zeros, full and the index copy, then one cast; backward: two zeros, then three casts.
    traffic.add(ranks, first, tokens * start + (0 if index_bytes is None else index_bytes),
                np.full(tokens.size, 3 if forward else 2))
    traffic.add(ranks, last, tokens * end, np.full(tokens.size, 1 if forward else 3))


def _sends(traffic: _Tally, a: dict, messages: PassMessages, send_rows, runs, recv_rows, sizes: Sizes,
           forward: bool) -> None:
    """Packed sends, the backward Q pulls' LSE, the forward Q pulls' results' LSE."""
    kv = a["pull_send_kind"] == TransferKind.KV
    packed = runs > 1
    if forward:
        nbytes = np.where(packed, 2 * np.where(kv, 2 * sizes.kv, sizes.q), 0) * send_rows
        ops = np.where(packed, np.where(kv, 2, 1), 0)
    else:
        nbytes = (np.where(packed, 2 * np.where(kv, 2 * sizes.kv, 3 * sizes.q), 0)
                  + np.where(kv, 0, 2 * sizes.lse)) * send_rows
        ops = np.where(packed, np.where(kv, 2, 3), 0) + np.where(kv, 0, 1)
    traffic.add(messages.pull_send_rank, messages.pull_send_stage, nbytes, ops)
    if forward and sizes.q_heads > 1:  # a [heads, rows] slice of the arena's LSE is not contiguous
        rows = recv_rows[messages.push_send_pull]
        traffic.add(messages.push_send_rank, messages.push_send_stage, 2 * sizes.lse * rows, np.ones(rows.size))


def _arrivals(traffic: _Tally, a: dict, messages: PassMessages, recv_rows, sizes: Sizes, forward: bool) -> None:
    """A pull's accumulators zeroed in its arena rows when it arrives (and a backward Q pull's LSE copied in)."""
    kv = a["pull_recv_kind"] == TransferKind.KV
    if forward:
        nbytes = np.where(kv, 0, 2 * (sizes.q_acc + sizes.lse)) * recv_rows
        ops = np.where(kv, 0, 2)
    else:
        nbytes = np.where(kv, 2 * 2 * sizes.kv_acc, 3 * sizes.lse + 2 * sizes.q_acc) * recv_rows
        ops = np.where(kv, 1, 2)
    traffic.add(messages.pull_recv_rank, messages.pull_recv_stage, nbytes, ops)


def _landings(traffic: _Tally, a: dict, messages: PassMessages, send_rows, runs, sizes: Sizes,
              forward: bool) -> None:
    """Pushes that come back, folded into their rows one run at a time."""
    pull = messages.push_recv_pull
    rows, pieces = send_rows[pull], runs[pull]
    kv = a["pull_send_kind"][pull] == TransferKind.KV
    if forward:
        nbytes = rows * (MERGE_LSE_ROWS * sizes.lse + MERGE_ACC_ROWS * sizes.q_acc)
        ops = MERGE_OPS * pieces
    else:
        nbytes = rows * 3 * np.where(kv, 2 * sizes.kv_acc, sizes.q_acc)
        ops = pieces
    traffic.add(messages.push_recv_rank, messages.push_recv_stage, nbytes, ops)

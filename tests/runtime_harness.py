"""Multi-process CPU harness: forked gloo workers run fcp_attn_func and compare with a dense reference."""

from __future__ import annotations

import multiprocessing
import os
import socket
import traceback

import torch


# Against an fp64 reference on the same inputs: bf16 runs keep fp32 accumulators, so they land within bf16's
# rounding of the result.
TOLERANCE = {torch.float64: dict(rtol=1e-10, atol=1e-10), torch.float32: dict(rtol=1e-5, atol=1e-5),
             torch.bfloat16: dict(rtol=2e-2, atol=2e-2)}


def sequence_windows(lengths, masks) -> list[int]:
    """Per sequence, keys a query sees back, itself included (0: full): from True (causal), False (full), or a list
    of windows already."""
    if isinstance(masks, bool):
        return [length if masks else 0 for length in lengths]
    return [int(w) for w in masks]


REFERENCE_QUERY_CHUNK = 1024  # queries a step of the reference holds scores for (its backward recomputes them)


def _dense_rows(qs, ks, vs, first: int, window: int, scale: float):
    """Dense attention of the queries at positions first.. of one sequence against all its keys."""
    scores = torch.einsum("qhd,khd->hqk", qs, ks) * scale
    if window:
        back = torch.arange(first, first + qs.shape[0])[:, None] - torch.arange(ks.shape[0])[None, :]
        scores = scores.masked_fill(~((back >= 0) & (back < window)), float("-inf"))
    return torch.einsum("hqk,khd->qhd", torch.softmax(scores, dim=-1), vs)


def reference_attention(lengths, q, k, v, masks, scale: float):
    """Plain dense attention, sequence by sequence, written apart from the runtime: query t of a sequence with
    window w sees keys t - w < s <= t (w 0: every key). Long sequences go in chunks of queries, each recomputed in
    the backward (torch.utils.checkpoint), so memory stays at one chunk's scores, not a sequence's square."""
    from torch.utils.checkpoint import checkpoint

    outs, start = [], 0
    group = q.shape[1] // k.shape[1]
    for length, window in zip(lengths, sequence_windows(lengths, masks)):
        qs, ks, vs = (x[start:start + length] for x in (q, k, v))
        ks, vs = ks.repeat_interleave(group, dim=1), vs.repeat_interleave(group, dim=1)
        for first in range(0, length, REFERENCE_QUERY_CHUNK):
            rows = qs[first:first + REFERENCE_QUERY_CHUNK]
            if length <= REFERENCE_QUERY_CHUNK:
                outs.append(_dense_rows(rows, ks, vs, first, window, scale))
            else:
                outs.append(checkpoint(_dense_rows, rows, ks, vs, first, window, scale, use_reentrant=False))
        start += length
    return torch.cat(outs)


def validated(plan_bytes: bytes) -> bytes:
    """The plan, validated once here (every kind's, for a plan of layer kinds), so that the forked ranks load it with
    validate=False rather than each validating it again (load_rank_plan's own check is tested in
    test_plan_structure.py)."""
    from fcp_compiler.format.validate_kinds import validate_kinds

    validate_kinds(plan_bytes)
    return plan_bytes


def compare_with_reference(plan_bytes: bytes, lengths, causal, q_heads: int, kv_heads: int, dtype,
                           layout: str, kernels=None, head_dim: int = 8, order_matching: bool = False,
                           groups: int = 1, prefetch=lambda rank: False):
    """A rank task: run fcp_attn_func forward and backward on this rank's rows of seeded global Q, K, V (the
    plan layout takes rows at the plan's token_index, the user layout its contiguous chunk) and assert out, dq, dk
    and dv equal dense fp64 attention's at those rows (within TOLERANCE of the dtype). Returns the number of
    all-to-all calls the runtime made, and the number of kernel calls when `kernels` counts them (a `num_calls`
    attribute). The reference is computed once, here, and inherited by the forked ranks.

    causal: True (every sequence causal), False (full), or each sequence's window (0: full).
    order_matching: send every point-to-point message with tag 0, so gloo matches them by posting order per pair
    of ranks, as NCCL does; replay is then exact only if both ends of every pair post in the same order.
    groups: the world splits into this many context-parallel groups of consecutive ranks (dist.new_group), each
    replaying the plan among its own ranks on the same data.
    prefetch: whether a rank posts each pass's first-stage K,V pulls early: prefetch_kv before fcp_attn_func, and
    backward_starts_at on its output."""
    total, plan_bytes = sum(lengths), validated(plan_bytes)
    generator = torch.Generator().manual_seed(0)
    q = torch.randn(total, q_heads, head_dim, generator=generator, dtype=dtype)
    k = torch.randn(total, kv_heads, head_dim, generator=generator, dtype=dtype)
    v = torch.randn(total, kv_heads, head_dim, generator=generator, dtype=dtype)
    d_out = torch.randn(total, q_heads, head_dim, generator=generator, dtype=dtype)
    # The reference runs in fp64 on the same (rounded) inputs, whatever the runtime's dtype.
    ref_q, ref_k, ref_v = (x.to(torch.float64, copy=True).requires_grad_() for x in (q, k, v))
    ref = reference_attention(lengths, ref_q, ref_k, ref_v, causal, head_dim ** -0.5)
    ref.backward(d_out.to(torch.float64))
    expected = (ref.detach(), ref_q.grad, ref_k.grad, ref_v.grad)

    def task(rank, world):
        import torch.distributed as dist

        from fcp_runtime import fcp_attn_func, load_rank_plan, prefetch_kv

        calls = []
        real = dist.all_to_all_single

        def counting(*args, **kwargs):
            calls.append(1)
            return real(*args, **kwargs)

        dist.all_to_all_single = counting
        real_op = dist.P2POp
        if order_matching:
            dist.P2POp = lambda op, tensor, peer=None, group=None, tag=0, **kw: real_op(op, tensor, peer, group, 0,
                                                                                      **kw)
        group, cp_rank, cp_world = None, rank, world
        if groups > 1:
            cp_world = world // groups
            handles = [dist.new_group(list(range(g * cp_world, (g + 1) * cp_world))) for g in range(groups)]
            group, cp_rank = handles[rank // cp_world], rank % cp_world
        try:
            plan = load_rank_plan(plan_bytes, cp_rank, validate=False)
            rows = plan.token_index if layout == "plan" else torch.arange(cp_rank * total // cp_world,
                                                                          (cp_rank + 1) * total // cp_world)
            mine = [x[rows].clone().requires_grad_() for x in (q, k, v)]
            prefetched = prefetch_kv(mine[1], mine[2], plan, group) if prefetch(rank) else None
            out = fcp_attn_func(*mine, plan, group=group, layout=layout, kernels=kernels, prefetched=prefetched)
            if prefetched is not None:  # the backward's first-stage K,V pulls leave as its backward starts
                out = prefetched.backward_starts_at(out)
            out.backward(d_out[rows])
        finally:
            dist.all_to_all_single = real
            dist.P2POp = real_op
        tolerance = TOLERANCE[dtype]
        for got, want in zip((out, *(x.grad for x in mine)), expected):
            assert got.dtype == dtype
            torch.testing.assert_close(got.to(torch.float64), want[rows], **tolerance)
        return len(calls), getattr(kernels, "num_calls", None)
    return task


def compare_kinds_with_reference(plan_bytes: bytes, lengths, kind_windows: dict, layout: str, q_heads: int = 4,
                                 kv_heads: int = 2, head_dim: int = 8, dtype=torch.float64):
    """A rank task for a plan of layer kinds: the rank's rows are taken once (one layout for every kind), and each
    kind's fcp_attn_func (kind=NAME) forward and backward on them must equal dense fp64 attention under that kind's
    windows (`kind_windows`: name -> each sequence's window, 0: full) at those rows. Returns the kinds run."""
    total, plan_bytes = sum(lengths), validated(plan_bytes)
    generator = torch.Generator().manual_seed(1)
    q, d_out = (torch.randn(total, q_heads, head_dim, generator=generator, dtype=dtype) for _ in range(2))
    k, v = (torch.randn(total, kv_heads, head_dim, generator=generator, dtype=dtype) for _ in range(2))
    expected = {}
    for name, windows in kind_windows.items():
        ref_q, ref_k, ref_v = (x.to(torch.float64, copy=True).requires_grad_() for x in (q, k, v))
        ref = reference_attention(lengths, ref_q, ref_k, ref_v, windows, head_dim ** -0.5)
        ref.backward(d_out.to(torch.float64))
        expected[name] = (ref.detach(), ref_q.grad, ref_k.grad, ref_v.grad)

    def task(rank, world):
        from fcp_runtime import KindsRankPlan, fcp_attn_func, load_rank_plan

        plan = load_rank_plan(plan_bytes, rank, validate=False)
        assert isinstance(plan, KindsRankPlan) and set(plan.kinds) == set(kind_windows)
        rows = plan.token_index if layout == "plan" else torch.arange(rank * total // world,
                                                                      (rank + 1) * total // world)
        for name, want in expected.items():
            mine = [x[rows].clone().requires_grad_() for x in (q, k, v)]
            out = fcp_attn_func(*mine, plan, layout=layout, kind=name)
            out.backward(d_out[rows])
            for got, reference in zip((out, *(x.grad for x in mine)), want):
                torch.testing.assert_close(got, reference[rows].to(dtype), **TOLERANCE[dtype])
        return sorted(expected)

    return task


def dispatch_round_trip(plan_bytes: bytes, total: int):
    """A rank task: dispatch() moves the rank's user-layout rows to exactly its plan-layout tokens, undispatch()
    moves them back, and the gradient of both moves comes back the same way (asserts exact equality)."""
    plan_bytes = validated(plan_bytes)

    def task(rank, world):
        from fcp_runtime import dispatch, load_rank_plan, undispatch

        plan = load_rank_plan(plan_bytes, rank, validate=False)
        everything = torch.arange(total, dtype=torch.float64)[:, None] * torch.tensor([1.0, -1.0], dtype=torch.float64)
        lo, hi = rank * total // world, (rank + 1) * total // world
        mine = everything[lo:hi].clone().requires_grad_()
        dispatched = dispatch(mine, plan)
        torch.testing.assert_close(dispatched, everything[plan.token_index], rtol=0, atol=0)
        back = undispatch(dispatched * 3, plan)
        torch.testing.assert_close(back, 3 * everything[lo:hi], rtol=0, atol=0)
        back.sum().backward()  # d/dx of sum(3 x) through both moves
        torch.testing.assert_close(mine.grad, torch.full_like(mine, 3.0), rtol=0, atol=0)
        # A 1-D per-token tensor (token ids, labels: [T]) moves the same way, and keeps its shape.
        ids = torch.arange(total, dtype=torch.int64)
        moved = dispatch(ids[lo:hi], plan)
        assert moved.shape == (plan.plan_tokens,) and torch.equal(moved, ids[plan.token_index])
        assert torch.equal(undispatch(moved, plan), ids[lo:hi])
        return True

    return task


def free_port() -> int:
    """A TCP port free on 127.0.0.1 now (the OS picks it): for a process group's rendezvous."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _worker(rank, world, port, task, queue):
    torch.set_num_threads(1)
    try:
        import torch.distributed as dist
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
        try:
            queue.put((rank, "ok", task(rank, world)))
        finally:
            dist.destroy_process_group()
    except BaseException as error:  # report every failure to the parent instead of hanging it
        queue.put((rank, "error", f"{type(error).__name__}: {error}\n{traceback.format_exc()}"))


def run_ranks(world: int, task, timeout: float = 120.0) -> list:
    """Run task(rank, world) on `world` forked gloo ranks; return each rank's result, raise on any failure."""
    context = multiprocessing.get_context("fork")
    queue = context.Queue()
    port = free_port()
    procs = [context.Process(target=_worker, args=(r, world, port, task, queue)) for r in range(world)]
    for proc in procs:
        proc.start()
    results, errors = {}, []
    try:
        for _ in range(world):
            rank, status, payload = queue.get(timeout=timeout)
            if status == "ok":
                results[rank] = payload
            else:
                errors.append((rank, payload))
    finally:
        for proc in procs:
            proc.join(timeout=5)
            if proc.is_alive():
                proc.kill()
    if errors:
        raise AssertionError("\n".join(f"rank {rank}: {message}" for rank, message in sorted(errors)))
    return [results[r] for r in range(world)]


os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")

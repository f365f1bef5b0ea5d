"""fcp_attn_func: distributed attention that replays one rank's plan, forward and backward.

One code path for every backend: torch.distributed collectives and batched point-to-point messages (gloo on CPU,
NCCL on CUDA), and the kernels of :mod:`fcp_runtime.kernels`.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from fcp_runtime.kernels import backward_pair, forward_pair, merge
from fcp_runtime.plan import KIND_KV, KIND_Q, RankPlan


class PlanMismatchError(RuntimeError):
    """The ranks of a group do not hold the same plan, or the group is not the plan's world."""


_CHECKED: set[tuple[int, int, str]] = set()


def check_plan(plan: RankPlan, group=None) -> None:
    """Fail on every rank, before any transfer, unless all ranks hold the same plan and the group is its world.

    One all_gather_object of (digest, world size, rank) whatever the plan says, so a mismatch is an error
    everywhere, never a hang. Checked once per plan and group.

    Raises:
        PlanMismatchError: naming the ranks and what differs.
    """
    key = (id(plan), id(group), plan.digest)
    if key in _CHECKED:
        return
    size = dist.get_world_size(group)
    mine = (plan.digest, plan.num_ranks, plan.rank)
    gathered: list = [None] * size
    dist.all_gather_object(gathered, mine, group=group)
    if size != plan.num_ranks:
        raise PlanMismatchError(f"the process group has {size} ranks but the plan was compiled for "
                                f"{plan.num_ranks}; compile it with --gpus {size}")
    wrong_world = [r for r, (_, n, _) in enumerate(gathered) if n != size]
    digests = sorted({d for d, _, _ in gathered})
    if len(digests) > 1 or wrong_world:
        groups = {d: [r for r, (dd, _, _) in enumerate(gathered) if dd == d] for d in digests}
        detail = "; ".join(f"ranks {ranks} hold plan {d[:12]}" for d, ranks in groups.items())
        raise PlanMismatchError(f"ranks hold different plans: {detail}")
    wrong_rank = [r for r, (_, _, plan_rank) in enumerate(gathered) if plan_rank != r]
    if wrong_rank:
        raise PlanMismatchError(f"ranks {wrong_rank} hold another rank's slice of the plan "
                                f"(slice {gathered[wrong_rank[0]][2]} on rank {wrong_rank[0]})")
    _CHECKED.add(key)


def _tag(block: int, code: int, part: int) -> int:
    """Message tag: code 0/1 a KV/Q pull, 2/3 a push back along a KV/Q pull; part numbers a message's tensors."""
    return (block * 4 + code) * 8 + part


@dataclass
class _Store:
    """Rows of some segments: where each segment starts, and named tensors [rows, ...] (or [heads, rows])."""

    seg_row: dict[int, int]
    rows: int
    tensors: dict[str, torch.Tensor] = field(default_factory=dict)


class _Executor:
    def __init__(self, plan: RankPlan, group, scale: float, device: torch.device, dtype: torch.dtype,
                 head_dim: int):
        self.plan, self.group, self.scale, self.head_dim = plan, group, scale, head_dim
        self.device, self.dtype = device, dtype
        self.acc_dtype = torch.float32 if dtype in (torch.bfloat16, torch.float16) else dtype

    # --- layout -------------------------------------------------------------------------------------------------
    def peer(self, rank: int) -> int:
        return rank if self.group is None else dist.get_global_rank(self.group, rank)

    def reshuffle(self, x: torch.Tensor, to_plan: bool) -> torch.Tensor:
        """Move rows between the user layout and the plan layout with one all_to_all_single."""
        plan = self.plan
        gather, scatter = plan.indices_on(x.device)
        flat = x.flatten(1)
        if to_plan:
            send, recv_rows, split_in, split_out, where = gather, plan.plan_tokens, plan.send_splits, \
                plan.recv_splits, scatter
        else:
            send, recv_rows, split_in, split_out, where = scatter, plan.user_tokens, plan.recv_splits, \
                plan.send_splits, gather
        out = torch.empty((sum(split_out), flat.shape[1]), dtype=flat.dtype, device=flat.device)
        dist.all_to_all_single(out, flat.index_select(0, send).contiguous(), output_split_sizes=split_out,
                               input_split_sizes=split_in, group=self.group)
        result = torch.empty((recv_rows, flat.shape[1]), dtype=flat.dtype, device=flat.device)
        result[where] = out
        return result.view(recv_rows, *x.shape[1:])

    def reshuffle_async(self, x: torch.Tensor):
        """Start moving user-layout rows [T, F] to the plan layout; return the plan-layout buffer, already holding
        the rows that stay on this rank, and a function that waits for the rest and puts them in place."""
        plan = self.plan
        gather, scatter = plan.indices_on(x.device)
        out = torch.empty((sum(plan.recv_splits), x.shape[1]), dtype=x.dtype, device=x.device)
        work = dist.all_to_all_single(out, x.index_select(0, gather).contiguous(), output_split_sizes=plan.recv_splits,
                                      input_split_sizes=plan.send_splits, group=self.group, async_op=True)
        result = torch.empty((plan.plan_tokens, x.shape[1]), dtype=x.dtype, device=x.device)
        self_user, self_plan = plan.self_rows_on(x.device)
        result[self_plan] = x[self_user]

        def finish() -> None:
            work.wait()
            result[scatter] = out
        return result, finish

    def local_store(self, **tensors: torch.Tensor) -> _Store:
        return _Store(seg_row=self.plan.local_seg_row, rows=self.plan.plan_tokens, tensors=tensors)

    def rows(self, store: _Store, seg: int) -> slice:
        start = store.seg_row[seg]
        return slice(start, start + self.plan.seg_len(seg))

    def gather_rows(self, store: _Store, name: str, segs, heads_first: bool = False) -> torch.Tensor:
        tensor = store.tensors[name]
        parts = [tensor[:, self.rows(store, s)] if heads_first else tensor[self.rows(store, s)] for s in segs]
        return torch.cat(parts, dim=1 if heads_first else 0).contiguous()

    def new_store(self, segs) -> _Store:
        seg_row, row = {}, 0
        for seg in segs:
            seg_row[seg] = row
            row += self.plan.seg_len(seg)
        return _Store(seg_row=seg_row, rows=row)

    # --- messages -----------------------------------------------------------------------------------------------
    def exchange(self, sends: list[tuple[int, int, list[torch.Tensor]]],
                 recvs: list[tuple[int, int, list[torch.Tensor]]]) -> None:
        """Post every send and receive of a stage as one batch and wait for all of them."""
        ops = []
        for peer, tag, tensors in sends:
            ops += [dist.P2POp(dist.isend, t, self.peer(peer), self.group, tag + i) for i, t in enumerate(tensors)]
        for peer, tag, tensors in recvs:
            ops += [dist.P2POp(dist.irecv, t, self.peer(peer), self.group, tag + i) for i, t in enumerate(tensors)]
        if ops:
            for request in dist.batch_isend_irecv(ops):
                request.wait()

    def empty(self, rows: int, heads: int, dtype=None) -> torch.Tensor:
        return torch.empty((rows, heads, self.head_dim), dtype=dtype or self.dtype, device=self.device)

    def pairs(self, q_block: int, kv_block: int, q_store: _Store, kv_store: _Store):
        """Segment pairs of a tile with visible tokens, restricted to the segments the stores hold."""
        plan = self.plan
        for qs in plan.block_segs[q_block]:
            if qs not in q_store.seg_row:
                continue
            for ks in plan.block_segs[kv_block]:
                if ks not in kv_store.seg_row or plan.seg_seq[ks] != plan.seg_seq[qs]:
                    continue
                if plan.causal and plan.seg_start[ks] >= plan.seg_end[qs]:
                    continue
                yield qs, ks

    # --- the stage loop, shared by both passes -----------------------------------------------------------------
    def run_stages(self, phase, local: _Store, num_stages: int, skip: frozenset[int] = frozenset()) -> None:
        """Replay the stages of one pass: per stage, post its pulls and pushes as one batch, run its tiles (which
        read only data of earlier stages: the plan guarantees it), then make the arrived pulls usable and fold the
        returned pushes into this rank's own rows. Tiles whose indices are in `skip` already ran."""
        plan = self.plan
        remote: dict[int, dict[int, _Store]] = {KIND_KV: {}, KIND_Q: {}}
        for stage in range(num_stages):
            sends, recvs, arrived, returned = [], [], [], []
            for pull in plan.pull_send:
                if pull.round // plan.coalesce == stage:
                    sends.append((pull.peer, _tag(pull.block, pull.kind, 0), phase.pull_payload(local, pull)))
            for pull in plan.pull_recv:
                if pull.round // plan.coalesce == stage:
                    store = self.new_store(pull.segs)
                    store.tensors = phase.pull_buffers(pull, store.rows)
                    recvs.append((pull.peer, _tag(pull.block, pull.kind, 0), list(store.tensors.values())))
                    arrived.append((pull, store))
            # A push goes back along its pull (code 2 + the pull's kind): partial O and LSE forward, dK dV or dQ
            # backward.
            for push in phase.push_send:
                if push.stage == stage:
                    pull = plan.pull_recv[push.pull]
                    sends.append((pull.peer, _tag(pull.block, 2 + pull.kind, 0),
                                  phase.push_payload(remote[pull.kind][pull.block], pull)))
            for push in phase.push_recv:
                if push.stage == stage:
                    pull = plan.pull_send[push.pull]
                    tensors = phase.push_buffers(pull, sum(plan.seg_len(s) for s in pull.segs))
                    recvs.append((pull.peer, _tag(pull.block, 2 + pull.kind, 0), tensors))
                    returned.append((pull, tensors))
            self.exchange(sends, recvs)
            for idx, (tile_stage, q_block, kv_block) in enumerate(plan.tiles):
                if tile_stage == stage and idx not in skip:
                    phase.tile(q_block, kv_block, local, remote)
            for pull, store in arrived:
                phase.accumulators(pull, store)
                remote[pull.kind][pull.block] = store
            for pull, tensors in returned:
                row = 0
                for seg in pull.segs:
                    length = plan.seg_len(seg)
                    phase.land(local, self.rows(local, seg), pull.kind, tensors, slice(row, row + length))
                    row += length

    def stores_of(self, q_block: int, kv_block: int, local: _Store, remote) -> tuple[_Store, _Store]:
        """Where a tile's query rows and key/value rows are: this rank's own store or a pulled one."""
        owned = self.plan.local_blocks
        return (local if q_block in owned else remote[KIND_Q][q_block],
                local if kv_block in owned else remote[KIND_KV][kv_block])


class _ForwardPass:
    """What the forward pass moves and computes: K,V or Q pulled, partial O and LSE pushed back and merged."""

    def __init__(self, executor: _Executor, q_heads: int, kv_heads: int):
        self.ex, self.hq, self.hkv = executor, q_heads, kv_heads
        self.push_send, self.push_recv = executor.plan.fwd_push_send, executor.plan.fwd_push_recv

    def local_store(self, q, k, v) -> _Store:
        """The plan-layout store with empty output accumulators."""
        ex = self.ex
        return ex.local_store(q=q, k=k, v=v, out=torch.zeros(q.shape, dtype=ex.acc_dtype, device=ex.device),
                              lse=torch.full((q.shape[1], q.shape[0]), float("-inf"), dtype=ex.acc_dtype,
                                             device=ex.device))

    def pull_payload(self, local: _Store, pull) -> list[torch.Tensor]:
        return [self.ex.gather_rows(local, n, pull.segs) for n in (("k", "v") if pull.kind == KIND_KV else ("q",))]

    def pull_buffers(self, pull, rows: int) -> dict[str, torch.Tensor]:
        if pull.kind == KIND_KV:
            return {"k": self.ex.empty(rows, self.hkv), "v": self.ex.empty(rows, self.hkv)}
        return {"q": self.ex.empty(rows, self.hq)}

    def accumulators(self, pull, store: _Store) -> None:
        if pull.kind == KIND_Q:
            ex = self.ex
            store.tensors["out"] = torch.zeros((store.rows, self.hq, ex.head_dim), dtype=ex.acc_dtype,
                                               device=ex.device)
            store.tensors["lse"] = torch.full((self.hq, store.rows), float("-inf"), dtype=ex.acc_dtype,
                                              device=ex.device)

    def push_payload(self, store: _Store, pull) -> list[torch.Tensor]:
        return [store.tensors["out"].contiguous(), store.tensors["lse"].contiguous()]

    def push_buffers(self, pull, rows: int) -> list[torch.Tensor]:
        ex = self.ex
        return [ex.empty(rows, self.hq, ex.acc_dtype),
                torch.empty((self.hq, rows), dtype=ex.acc_dtype, device=ex.device)]

    def land(self, local: _Store, rows: slice, kind: int, tensors: list[torch.Tensor], part: slice) -> None:
        out, lse = tensors
        merge(local.tensors["out"], local.tensors["lse"], rows, out[part], lse[:, part])

    def tile(self, q_block: int, kv_block: int, local: _Store, remote) -> None:
        ex = self.ex
        q_store, kv_store = ex.stores_of(q_block, kv_block, local, remote)
        for qs, ks in ex.pairs(q_block, kv_block, q_store, kv_store):
            q_rows, k_rows = ex.rows(q_store, qs), ex.rows(kv_store, ks)
            out, lse = forward_pair(q_store.tensors["q"][q_rows], kv_store.tensors["k"][k_rows],
                                    kv_store.tensors["v"][k_rows], ex.plan.positions(qs).to(ex.device),
                                    ex.plan.positions(ks).to(ex.device), ex.plan.causal, ex.scale)
            merge(q_store.tensors["out"], q_store.tensors["lse"], q_rows, out, lse)


class _BackwardPass:
    """What the backward pass moves and computes: K,V or (Q, dO, O, LSE) pulled, dK dV or dQ pushed back and
    summed; each tile recomputed from the final O and LSE."""

    def __init__(self, executor: _Executor, q_heads: int, kv_heads: int):
        self.ex, self.hq, self.hkv = executor, q_heads, kv_heads
        self.push_send, self.push_recv = executor.plan.bwd_push_send, executor.plan.bwd_push_recv

    def local_store(self, q, k, v, out, lse, d_out) -> _Store:
        """The plan-layout store with D = rowsum(dO * O) and empty gradient accumulators."""
        zeros = dict(dtype=self.ex.acc_dtype, device=self.ex.device)
        return self.ex.local_store(q=q, k=k, v=v, do=d_out, out=out, lse=lse, delta=self.delta(d_out, out),
                                   dq=torch.zeros(q.shape, **zeros), dk=torch.zeros(k.shape, **zeros),
                                   dv=torch.zeros(v.shape, **zeros))

    def delta(self, d_out: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        acc = self.ex.acc_dtype
        return (d_out.to(acc) * out.to(acc)).sum(-1).transpose(0, 1).contiguous()

    def pull_payload(self, local: _Store, pull) -> list[torch.Tensor]:
        ex = self.ex
        if pull.kind == KIND_KV:
            return [ex.gather_rows(local, "k", pull.segs), ex.gather_rows(local, "v", pull.segs)]
        return [ex.gather_rows(local, "q", pull.segs), ex.gather_rows(local, "do", pull.segs),
                ex.gather_rows(local, "out", pull.segs), ex.gather_rows(local, "lse", pull.segs, heads_first=True)]

    def pull_buffers(self, pull, rows: int) -> dict[str, torch.Tensor]:
        ex = self.ex
        if pull.kind == KIND_KV:
            return {"k": ex.empty(rows, self.hkv), "v": ex.empty(rows, self.hkv)}
        return {"q": ex.empty(rows, self.hq), "do": ex.empty(rows, self.hq), "out": ex.empty(rows, self.hq),
                "lse": torch.empty((self.hq, rows), dtype=ex.acc_dtype, device=ex.device)}

    def accumulators(self, pull, store: _Store) -> None:
        ex = self.ex
        if pull.kind == KIND_KV:
            store.tensors["dk"] = ex.empty(store.rows, self.hkv, ex.acc_dtype).zero_()
            store.tensors["dv"] = ex.empty(store.rows, self.hkv, ex.acc_dtype).zero_()
        else:
            store.tensors["dq"] = ex.empty(store.rows, self.hq, ex.acc_dtype).zero_()
            store.tensors["delta"] = self.delta(store.tensors["do"], store.tensors["out"])

    def push_payload(self, store: _Store, pull) -> list[torch.Tensor]:
        names = ("dk", "dv") if pull.kind == KIND_KV else ("dq",)
        return [store.tensors[name].contiguous() for name in names]

    def push_buffers(self, pull, rows: int) -> list[torch.Tensor]:
        heads, count = (self.hkv, 2) if pull.kind == KIND_KV else (self.hq, 1)
        return [self.ex.empty(rows, heads, self.ex.acc_dtype) for _ in range(count)]

    def land(self, local: _Store, rows: slice, kind: int, tensors: list[torch.Tensor], part: slice) -> None:
        for name, tensor in zip(("dk", "dv") if kind == KIND_KV else ("dq",), tensors):
            local.tensors[name][rows] += tensor[part]

    def tile(self, q_block: int, kv_block: int, local: _Store, remote) -> None:
        ex = self.ex
        q_store, kv_store = ex.stores_of(q_block, kv_block, local, remote)
        for qs, ks in ex.pairs(q_block, kv_block, q_store, kv_store):
            q_rows, k_rows = ex.rows(q_store, qs), ex.rows(kv_store, ks)
            t = q_store.tensors
            dq, dk, dv = backward_pair(t["q"][q_rows], kv_store.tensors["k"][k_rows], kv_store.tensors["v"][k_rows],
                                       t["do"][q_rows], t["out"][q_rows], t["lse"][:, q_rows], t["delta"][:, q_rows],
                                       ex.plan.positions(qs).to(ex.device), ex.plan.positions(ks).to(ex.device),
                                       ex.plan.causal, ex.scale)
            t["dq"][q_rows] += dq.to(ex.acc_dtype)
            kv_store.tensors["dk"][k_rows] += dk.to(ex.acc_dtype)
            kv_store.tensors["dv"][k_rows] += dv.to(ex.acc_dtype)


class _FcpAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, plan: RankPlan, group, scale: float):
        executor = _Executor(plan, group, scale, q.device, q.dtype, q.shape[2])
        hq, hkv = q.shape[1], k.shape[1]
        packed, finish = executor.reshuffle_async(torch.cat([q.flatten(1), k.flatten(1), v.flatten(1)], dim=1))
        dim = q.shape[2]
        q_p = packed[:, :hq * dim].reshape(-1, hq, dim)
        k_p = packed[:, hq * dim:(hq + hkv) * dim].reshape(-1, hkv, dim)
        v_p = packed[:, (hq + hkv) * dim:].reshape(-1, hkv, dim)
        forward = _ForwardPass(executor, hq, hkv)
        local = forward.local_store(q_p, k_p, v_p)
        # Tiles whose tokens stay on this rank run while the all-to-all is in flight.
        for idx in plan.early_tiles:
            forward.tile(plan.tiles[idx][1], plan.tiles[idx][2], local, {KIND_KV: {}, KIND_Q: {}})
        finish()
        executor.run_stages(forward, local, plan.num_fwd_stages, skip=plan.early_tiles)
        out_p, lse_p = local.tensors["out"].to(q.dtype), local.tensors["lse"]
        ctx.save_for_backward(q_p, k_p, v_p, out_p, lse_p)
        ctx.executor = executor
        return executor.reshuffle(out_p, to_plan=False)

    @staticmethod
    def backward(ctx, d_out):
        executor = ctx.executor
        q_p, k_p, v_p, out_p, lse_p = ctx.saved_tensors
        d_out_p = executor.reshuffle(d_out.contiguous(), to_plan=True)
        hq, hkv, dim = q_p.shape[1], k_p.shape[1], q_p.shape[2]
        backward = _BackwardPass(executor, hq, hkv)
        local = backward.local_store(q_p, k_p, v_p, out_p, lse_p, d_out_p)
        executor.run_stages(backward, local, executor.plan.num_bwd_stages)
        dq_p, dk_p, dv_p = (local.tensors[name].to(q_p.dtype) for name in ("dq", "dk", "dv"))
        packed = executor.reshuffle(torch.cat([dq_p.flatten(1), dk_p.flatten(1), dv_p.flatten(1)], dim=1),
                                    to_plan=False)
        dq = packed[:, :hq * dim].reshape(-1, hq, dim)
        dk = packed[:, hq * dim:(hq + hkv) * dim].reshape(-1, hkv, dim)
        dv = packed[:, (hq + hkv) * dim:].reshape(-1, hkv, dim)
        return dq, dk, dv, None, None, None


def fcp_attn_func(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, plan: RankPlan, group=None,
                  softmax_scale: float | None = None) -> torch.Tensor:
    """Attention over the whole batch, each rank holding its user-layout slice; autograd gives dq, dk, dv.

    Args:
        q: [local_tokens, q_heads, head_dim]; k, v: [local_tokens, kv_heads, head_dim], the rows
            [floor(r*T/N), floor((r+1)*T/N)) of the concatenated batch on rank r.
        plan: this rank's plan (:func:`fcp_runtime.load_rank_plan`).
        group: the process group (default: the world); its size must be the plan's.
        softmax_scale: default head_dim ** -0.5.
    Returns:
        out, q's shape and layout.
    Raises:
        PlanMismatchError: on every rank, when the ranks hold different plans or the group size differs.
        ValueError: shapes that do not fit the plan.
    """
    check_plan(plan, group)
    if q.dim() != 3 or k.shape != v.shape or k.shape[0] != q.shape[0] or k.shape[2] != q.shape[2]:
        raise ValueError(f"expected q [T, Hq, D] and k, v [T, Hkv, D] with equal T and D, got {tuple(q.shape)}, "
                         f"{tuple(k.shape)}, {tuple(v.shape)}")
    if q.shape[0] != plan.user_tokens:
        raise ValueError(f"rank {plan.rank} holds {q.shape[0]} tokens but the plan's user layout gives it "
                         f"{plan.user_tokens}")
    if q.shape[1] % k.shape[1]:
        raise ValueError(f"q heads {q.shape[1]} are not a multiple of kv heads {k.shape[1]}")
    scale = softmax_scale if softmax_scale is not None else q.shape[2] ** -0.5
    return _FcpAttention.apply(q, k, v, plan, group, scale)

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

    # --- forward ------------------------------------------------------------------------------------------------
    def forward_local_store(self, q, k, v) -> _Store:
        """The plan-layout store with empty output accumulators."""
        return self.local_store(q=q, k=k, v=v, out=torch.zeros(q.shape, dtype=self.acc_dtype, device=self.device),
                                lse=torch.full((q.shape[1], q.shape[0]), float("-inf"), dtype=self.acc_dtype,
                                               device=self.device))

    def forward(self, local: _Store, done: frozenset[int] = frozenset()) -> tuple[torch.Tensor, torch.Tensor]:
        """Run the forward stages on a filled local store, skipping the tiles already run (indices in done)."""
        plan = self.plan
        q, k = local.tensors["q"], local.tensors["k"]
        remote_kv: dict[int, _Store] = {}
        remote_q: dict[int, _Store] = {}
        hq, hkv = q.shape[1], k.shape[1]
        for stage in range(plan.num_fwd_stages):
            sends, recvs, arrived, returned = [], [], [], []
            for pull in plan.pull_send:
                if pull.round // plan.coalesce == stage:
                    names = ("k", "v") if pull.kind == KIND_KV else ("q",)
                    sends.append((pull.peer, _tag(pull.block, pull.kind, 0),
                                  [self.gather_rows(local, n, pull.segs) for n in names]))
            for pull in plan.pull_recv:
                if pull.round // plan.coalesce == stage:
                    store = self.new_store(pull.segs)
                    if pull.kind == KIND_KV:
                        store.tensors = {"k": self.empty(store.rows, hkv), "v": self.empty(store.rows, hkv)}
                        recvs.append((pull.peer, _tag(pull.block, KIND_KV, 0), [store.tensors["k"],
                                                                                 store.tensors["v"]]))
                    else:
                        store.tensors = {"q": self.empty(store.rows, hq)}
                        recvs.append((pull.peer, _tag(pull.block, KIND_Q, 0), [store.tensors["q"]]))
                    arrived.append((pull, store))
            for push in plan.fwd_push_send:
                if push.stage == stage:
                    pull = plan.pull_recv[push.pull]
                    store = remote_q[pull.block]
                    sends.append((pull.peer, _tag(pull.block, 3, 0),
                                  [store.tensors["out"].contiguous(), store.tensors["lse"].contiguous()]))
            for push in plan.fwd_push_recv:
                if push.stage == stage:
                    pull = plan.pull_send[push.pull]
                    rows = sum(plan.seg_len(s) for s in pull.segs)
                    out = torch.empty((rows, hq, self.head_dim), dtype=self.acc_dtype, device=self.device)
                    lse = torch.empty((hq, rows), dtype=self.acc_dtype, device=self.device)
                    recvs.append((pull.peer, _tag(pull.block, 3, 0), [out, lse]))
                    returned.append((pull, out, lse))
            self.exchange(sends, recvs)
            # Tiles of this stage read only data of earlier stages (the plan guarantees it).
            for idx, (tile_stage, q_block, kv_block) in enumerate(plan.tiles):
                if tile_stage == stage and idx not in done:
                    self.forward_tile(q_block, kv_block, local, remote_q, remote_kv)
            for pull, store in arrived:
                if pull.kind == KIND_KV:
                    remote_kv[pull.block] = store
                else:
                    store.tensors["out"] = torch.zeros((store.rows, hq, self.head_dim), dtype=self.acc_dtype,
                                                       device=self.device)
                    store.tensors["lse"] = torch.full((hq, store.rows), float("-inf"), dtype=self.acc_dtype,
                                                      device=self.device)
                    remote_q[pull.block] = store
            for pull, out, lse in returned:
                row = 0
                for seg in pull.segs:
                    length = plan.seg_len(seg)
                    merge(local.tensors["out"], local.tensors["lse"], self.rows(local, seg), out[row:row + length],
                          lse[:, row:row + length])
                    row += length
        return local.tensors["out"].to(self.dtype), local.tensors["lse"]

    def forward_tile(self, q_block, kv_block, local, remote_q, remote_kv) -> None:
        plan = self.plan
        q_store = local if q_block in plan.local_blocks else remote_q[q_block]
        kv_store = local if kv_block in plan.local_blocks else remote_kv[kv_block]
        for qs, ks in self.pairs(q_block, kv_block, q_store, kv_store):
            q_rows, k_rows = self.rows(q_store, qs), self.rows(kv_store, ks)
            out, lse = forward_pair(q_store.tensors["q"][q_rows], kv_store.tensors["k"][k_rows],
                                    kv_store.tensors["v"][k_rows], plan.positions(qs).to(self.device),
                                    plan.positions(ks).to(self.device), plan.causal, self.scale)
            merge(q_store.tensors["out"], q_store.tensors["lse"], q_rows, out, lse)

    # --- backward -----------------------------------------------------------------------------------------------
    def backward(self, q, k, v, out, lse, d_out):
        plan = self.plan
        delta = (d_out.to(self.acc_dtype) * out.to(self.acc_dtype)).sum(-1).transpose(0, 1).contiguous()
        zeros = dict(dtype=self.acc_dtype, device=self.device)
        local = self.local_store(q=q, k=k, v=v, do=d_out, out=out, lse=lse, delta=delta,
                                 dq=torch.zeros(q.shape, **zeros),
                                 dk=torch.zeros(k.shape, **zeros), dv=torch.zeros(v.shape, **zeros))
        remote_kv: dict[int, _Store] = {}
        remote_q: dict[int, _Store] = {}
        hq, hkv = q.shape[1], k.shape[1]
        for stage in range(plan.num_bwd_stages):
            sends, recvs, arrived, returned = [], [], [], []
            for pull in plan.pull_send:
                if pull.round // plan.coalesce == stage:
                    if pull.kind == KIND_KV:
                        tensors = [self.gather_rows(local, "k", pull.segs), self.gather_rows(local, "v", pull.segs)]
                    else:
                        tensors = [self.gather_rows(local, "q", pull.segs), self.gather_rows(local, "do", pull.segs),
                                   self.gather_rows(local, "out", pull.segs),
                                   self.gather_rows(local, "lse", pull.segs, heads_first=True)]
                    sends.append((pull.peer, _tag(pull.block, pull.kind, 0), tensors))
            for pull in plan.pull_recv:
                if pull.round // plan.coalesce == stage:
                    store = self.new_store(pull.segs)
                    rows = store.rows
                    if pull.kind == KIND_KV:
                        store.tensors = {"k": self.empty(rows, hkv), "v": self.empty(rows, hkv)}
                        tensors = [store.tensors["k"], store.tensors["v"]]
                    else:
                        store.tensors = {"q": self.empty(rows, hq), "do": self.empty(rows, hq),
                                         "out": self.empty(rows, hq), "lse": torch.empty((hq, rows), **zeros)}
                        tensors = [store.tensors[n] for n in ("q", "do", "out", "lse")]
                    recvs.append((pull.peer, _tag(pull.block, pull.kind, 0), tensors))
                    arrived.append((pull, store))
            for push in plan.bwd_push_send:
                if push.stage == stage:
                    pull = plan.pull_recv[push.pull]
                    if pull.kind == KIND_KV:
                        store = remote_kv[pull.block]
                        tensors = [store.tensors["dk"].contiguous(), store.tensors["dv"].contiguous()]
                    else:
                        tensors = [remote_q[pull.block].tensors["dq"].contiguous()]
                    sends.append((pull.peer, _tag(pull.block, 2 + pull.kind, 0), tensors))
            for push in plan.bwd_push_recv:
                if push.stage == stage:
                    pull = plan.pull_send[push.pull]
                    rows = sum(plan.seg_len(s) for s in pull.segs)
                    heads = hkv if pull.kind == KIND_KV else hq
                    tensors = [self.empty(rows, heads, self.acc_dtype)
                               for _ in range(2 if pull.kind == KIND_KV else 1)]
                    recvs.append((pull.peer, _tag(pull.block, 2 + pull.kind, 0), tensors))
                    returned.append((pull, tensors))
            self.exchange(sends, recvs)
            for tile_stage, q_block, kv_block in plan.tiles:
                if tile_stage == stage:
                    self.backward_tile(q_block, kv_block, local, remote_q, remote_kv)
            for pull, store in arrived:
                if pull.kind == KIND_KV:
                    store.tensors["dk"] = torch.zeros((store.rows, hkv, self.head_dim), **zeros)
                    store.tensors["dv"] = torch.zeros((store.rows, hkv, self.head_dim), **zeros)
                    remote_kv[pull.block] = store
                else:
                    store.tensors["dq"] = torch.zeros((store.rows, hq, self.head_dim), **zeros)
                    store.tensors["delta"] = (store.tensors["do"].to(self.acc_dtype) * store.tensors["out"].to(
                        self.acc_dtype)).sum(-1).transpose(0, 1).contiguous()
                    remote_q[pull.block] = store
            for pull, tensors in returned:
                names = ("dk", "dv") if pull.kind == KIND_KV else ("dq",)
                row = 0
                for seg in pull.segs:
                    length = plan.seg_len(seg)
                    for name, tensor in zip(names, tensors):
                        local.tensors[name][self.rows(local, seg)] += tensor[row:row + length]
                    row += length
        return (local.tensors["dq"].to(self.dtype), local.tensors["dk"].to(self.dtype),
                local.tensors["dv"].to(self.dtype))

    def backward_tile(self, q_block, kv_block, local, remote_q, remote_kv) -> None:
        plan = self.plan
        q_store = local if q_block in plan.local_blocks else remote_q[q_block]
        kv_store = local if kv_block in plan.local_blocks else remote_kv[kv_block]
        for qs, ks in self.pairs(q_block, kv_block, q_store, kv_store):
            q_rows, k_rows = self.rows(q_store, qs), self.rows(kv_store, ks)
            t = q_store.tensors
            dq, dk, dv = backward_pair(t["q"][q_rows], kv_store.tensors["k"][k_rows], kv_store.tensors["v"][k_rows],
                                       t["do"][q_rows], t["out"][q_rows], t["lse"][:, q_rows], t["delta"][:, q_rows],
                                       plan.positions(qs).to(self.device), plan.positions(ks).to(self.device),
                                       plan.causal, self.scale)
            t["dq"][q_rows] += dq.to(self.acc_dtype)
            kv_store.tensors["dk"][k_rows] += dk.to(self.acc_dtype)
            kv_store.tensors["dv"][k_rows] += dv.to(self.acc_dtype)


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
        local = executor.forward_local_store(q_p, k_p, v_p)
        # Tiles whose tokens stay on this rank run while the all-to-all is in flight.
        for idx in plan.early_tiles:
            executor.forward_tile(plan.tiles[idx][1], plan.tiles[idx][2], local, {}, {})
        finish()
        out_p, lse_p = executor.forward(local, done=plan.early_tiles)
        ctx.save_for_backward(q_p, k_p, v_p, out_p, lse_p)
        ctx.executor = executor
        return executor.reshuffle(out_p, to_plan=False)

    @staticmethod
    def backward(ctx, d_out):
        executor = ctx.executor
        q_p, k_p, v_p, out_p, lse_p = ctx.saved_tensors
        d_out_p = executor.reshuffle(d_out.contiguous(), to_plan=True)
        dq_p, dk_p, dv_p = executor.backward(q_p, k_p, v_p, out_p, lse_p, d_out_p)
        hq, hkv, dim = q_p.shape[1], k_p.shape[1], q_p.shape[2]
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

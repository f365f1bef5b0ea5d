"""The two passes, as the executor runs them: what each pulls, computes, pushes back and folds in. The forward
merges partial outputs by their LSE; the backward recomputes each tile from the final output and LSE and sums the
gradients."""

from __future__ import annotations

import torch

from fcp_compiler.format.plan_format import TransferKind
from fcp_runtime.executor import Arenas, Executor, Store, pass_arenas
from fcp_runtime.merge import merge_into, merge_rows
from fcp_runtime.stage_calls import KernelCall, RangeCall, arenas


class ForwardPass:
    """What the forward pass moves and computes: K,V or Q pulled, partial O and LSE pushed back and merged."""

    def __init__(self, executor: Executor, q_heads: int | None, kv_heads: int, adopted: Arenas | None = None):
        self.ex, self.hq, self.hkv = executor, q_heads, kv_heads
        ex = executor
        rows = arenas(ex.plan)["fwd"] if ex.ranges else None
        self.arenas = pass_arenas(ex, "fwd", {
            TransferKind.KV: lambda: {"k": ex.empty(rows.kv_rows, kv_heads), "v": ex.empty(rows.kv_rows, kv_heads)},
            TransferKind.Q: lambda: {"q": ex.empty(rows.q_rows, self.hq),
                                     "out": ex.empty(rows.q_rows, self.hq, ex.acc_dtype),
                                     "lse": torch.empty((self.hq, rows.q_rows), dtype=ex.acc_dtype, device=ex.device)},
        }, adopted)

    def arena_row(self, pull_row: int) -> int:
        return self.arenas.offsets[pull_row] if self.arenas is not None else -1

    def local_store(self, q, k, v) -> Store:
        """The plan-layout store with empty output accumulators."""
        ex = self.ex
        return ex.local_store(q=q, k=k, v=v, out=torch.zeros(q.shape, dtype=ex.acc_dtype, device=ex.device),
                              lse=torch.full((q.shape[1], q.shape[0]), float("-inf"), dtype=ex.acc_dtype,
                                             device=ex.device))

    def pull_payload(self, local: Store, pull) -> list[torch.Tensor]:
        names = ("k", "v") if pull.kind == TransferKind.KV else ("q",)
        return [self.ex.payload_rows(local, name, pull.segs) for name in names]

    def pull_buffers(self, pull, store: Store) -> dict[str, torch.Tensor]:
        names = ("k", "v") if pull.kind == TransferKind.KV else ("q",)
        if self.arenas is not None:
            return self.arenas.views(pull.kind, store.arena_row, store.rows, names)
        return {name: self.ex.empty(store.rows, self.hkv if pull.kind == TransferKind.KV else self.hq)
                for name in names}

    def accumulators(self, pull, store: Store) -> None:
        if pull.kind != TransferKind.Q:
            return
        ex = self.ex
        if self.arenas is not None:  # the slot's earlier pull left its results there
            views = self.arenas.views(pull.kind, store.arena_row, store.rows, ("out", "lse"))
            store.tensors.update(out=views["out"].zero_(), lse=views["lse"].fill_(float("-inf")))
            return
        store.tensors["out"] = torch.zeros((store.rows, self.hq, ex.head_dim), dtype=ex.acc_dtype, device=ex.device)
        store.tensors["lse"] = torch.full((self.hq, store.rows), float("-inf"), dtype=ex.acc_dtype, device=ex.device)

    def push_payload(self, store: Store, pull) -> list[torch.Tensor]:
        return [store.tensors["out"].contiguous(), store.tensors["lse"].contiguous()]

    def push_buffers(self, pull, rows: int) -> list[torch.Tensor]:
        ex = self.ex
        return [ex.empty(rows, self.hq, ex.acc_dtype),
                torch.empty((self.hq, rows), dtype=ex.acc_dtype, device=ex.device)]

    @staticmethod
    def push_parts(tensors: list[torch.Tensor]) -> list[torch.Tensor]:
        """The tensors a push is received into, as its sender sends them."""
        return tensors

    def land(self, local: Store, rows: slice, kind: int, tensors: list[torch.Tensor], part: slice) -> None:
        out, lse = tensors
        merge_into(local.tensors["out"][rows], local.tensors["lse"][:, rows], out[part], lse[:, part])

    def run_call(self, call, local: Store, remote: dict[int, Store]) -> None:
        """One kernel call: a range call merges into the accumulators in the kernel; a packed varlen call's
        entries' partial outputs merge into their query rows' accumulators here."""
        ex = self.ex
        if isinstance(call, RangeCall):
            queries = self.arenas.of(TransferKind.Q) if call.q_arena else local.tensors
            keys = self.arenas.of(TransferKind.KV) if call.kv_arena else local.tensors
            ex.kernels.forward(queries["q"], keys["k"], keys["v"], call.q_ranges.view(-1, 2),
                               call.k_ranges.view(-1, 2), call.masks.view(-1, 2), call.max_q, call.max_k, ex.scale,
                               queries["out"], queries["lse"])
            return
        out, lse = self.attend(call, local, remote)
        for entry in call.q_index:
            store = ex.store_of(entry.source, local, remote)
            if entry.span is not None:  # in place, through views
                position, row, length = entry.span
                merge_into(store.tensors["out"].narrow(0, row, length), store.tensors["lse"].narrow(1, row, length),
                           out.narrow(0, position, length), lse.narrow(1, position, length))
            else:
                merge_rows(store.tensors["out"], store.tensors["lse"], entry.rows, out.index_select(0, entry.positions),
                           lse.index_select(1, entry.positions))

    def attend(self, call: KernelCall, local: Store, remote: dict[int, Store]):
        """The call's kernel on its packed inputs, whose copies are freed on return, before the merges."""
        ex = self.ex
        q = ex.gather(call.q_runs, "q", local, remote)
        k = ex.gather(call.kv_runs, "k", local, remote)
        v = ex.gather(call.kv_runs, "v", local, remote)
        return ex.kernels.forward(q, k, v, call.cu_q, call.cu_k, call.max_q, call.max_k, ex.scale, call.causal,
                                  call.window)


_BACKWARD_PULLED = {TransferKind.KV: ("k", "v"), TransferKind.Q: ("q", "do", "out", "lse")}


class BackwardPass:
    """What the backward pass moves and computes: K,V or (Q, dO, O, LSE) pulled, dK dV or dQ pushed back and
    summed; each tile recomputed from the final O and LSE."""

    def __init__(self, executor: Executor, q_heads: int | None, kv_heads: int, adopted: Arenas | None = None):
        self.ex, self.hq, self.hkv = executor, q_heads, kv_heads
        ex = executor
        rows = arenas(ex.plan)["bwd"] if ex.ranges else None

        def kv_arena():
            dkv = torch.empty((2, rows.kv_rows, kv_heads, ex.head_dim), dtype=ex.acc_dtype, device=ex.device)
            return {"k": ex.empty(rows.kv_rows, kv_heads), "v": ex.empty(rows.kv_rows, kv_heads), "dkv": dkv,
                    "dk": dkv[0], "dv": dkv[1]}

        def q_arena():
            return {"q": ex.empty(rows.q_rows, self.hq), "do": ex.empty(rows.q_rows, self.hq),
                    "out": ex.empty(rows.q_rows, self.hq),
                    "lse": torch.empty((self.hq, rows.q_rows), dtype=ex.acc_dtype, device=ex.device),
                    "dq": ex.empty(rows.q_rows, self.hq, ex.acc_dtype)}
        self.arenas = pass_arenas(ex, "bwd", {TransferKind.KV: kv_arena, TransferKind.Q: q_arena}, adopted)

    def arena_row(self, pull_row: int) -> int:
        return self.arenas.offsets[pull_row] if self.arenas is not None else -1

    def local_store(self, q, k, v, out, lse, d_out) -> Store:
        """The plan-layout store with empty gradient accumulators."""
        zeros = dict(dtype=self.ex.acc_dtype, device=self.ex.device)
        dkv = torch.zeros((2, *k.shape), **zeros)
        return self.ex.local_store(q=q, k=k, v=v, do=d_out, out=out, lse=lse, dq=torch.zeros(q.shape, **zeros),
                                   dkv=dkv, dk=dkv[0], dv=dkv[1])

    def pull_payload(self, local: Store, pull) -> list[torch.Tensor]:
        return [self.ex.payload_rows(local, name, pull.segs, heads_first=name == "lse")
                for name in _BACKWARD_PULLED[pull.kind]]

    def pull_buffers(self, pull, store: Store) -> dict[str, torch.Tensor]:
        ex, rows = self.ex, store.rows
        lse = {"lse": torch.empty((self.hq, rows), dtype=ex.acc_dtype, device=ex.device)} \
            if pull.kind == TransferKind.Q else {}
        names = tuple(name for name in _BACKWARD_PULLED[pull.kind] if name != "lse")
        if self.arenas is not None:  # the LSE arrives whole and is copied into its arena rows on arrival
            return self.arenas.views(pull.kind, store.arena_row, rows, names) | lse
        heads = self.hkv if pull.kind == TransferKind.KV else self.hq
        return {name: ex.empty(rows, heads) for name in names} | lse

    def accumulators(self, pull, store: Store) -> None:
        """dK and dV as the halves of one [2, rows, kv_heads, head_dim] tensor (one zeroing, one message back, one
        add where it lands), or dQ."""
        ex = self.ex
        if self.arenas is not None:
            if pull.kind == TransferKind.KV:
                dkv = self.arenas.views(pull.kind, store.arena_row, store.rows, ("dkv",))["dkv"].zero_()
                store.tensors.update(dkv=dkv, dk=dkv[0], dv=dkv[1])
            else:
                views = self.arenas.views(pull.kind, store.arena_row, store.rows, ("lse", "dq"))
                store.tensors.update(lse=views["lse"].copy_(store.tensors["lse"]), dq=views["dq"].zero_())
            return
        if pull.kind == TransferKind.KV:
            dkv = torch.zeros((2, store.rows, self.hkv, ex.head_dim), dtype=ex.acc_dtype, device=ex.device)
            store.tensors.update(dkv=dkv, dk=dkv[0], dv=dkv[1])
        else:
            store.tensors["dq"] = torch.zeros((store.rows, self.hq, ex.head_dim), dtype=ex.acc_dtype,
                                              device=ex.device)

    def push_payload(self, store: Store, pull) -> list[torch.Tensor]:
        """dK and dV as two messages (each a run of rows, in an arena too), or dQ."""
        if pull.kind == TransferKind.KV:
            return [store.tensors["dk"], store.tensors["dv"]]
        return [store.tensors["dq"]]

    def push_buffers(self, pull, rows: int) -> list[torch.Tensor]:
        """One [2, rows, kv_heads, head_dim] buffer for dK and dV (one add where it lands), or dQ."""
        ex = self.ex
        if pull.kind == TransferKind.KV:
            return [torch.empty((2, rows, self.hkv, ex.head_dim), dtype=ex.acc_dtype, device=ex.device)]
        return [ex.empty(rows, self.hq, ex.acc_dtype)]

    @staticmethod
    def push_parts(tensors: list[torch.Tensor]) -> list[torch.Tensor]:
        """The tensors a push is received into, as its sender sends them: dK and dV into the halves of one buffer."""
        (buffer,) = tensors
        return [buffer[0], buffer[1]] if buffer.dim() == 4 else [buffer]

    def land(self, local: Store, rows: slice, kind: int, tensors: list[torch.Tensor], part: slice) -> None:
        (tensor,) = tensors
        if kind == TransferKind.KV:
            local.tensors["dkv"][:, rows].add_(tensor[:, part])  # in place on the view: no write-back copy
        else:
            local.tensors["dq"][rows].add_(tensor[part])

    def run_call(self, call, local: Store, remote: dict[int, Store]) -> None:
        """One kernel call: a range call adds dq, dk and dv into the accumulators in the kernel; a packed varlen
        call's results add into the rows they belong to here."""
        ex = self.ex
        if isinstance(call, RangeCall):
            queries = self.arenas.of(TransferKind.Q) if call.q_arena else local.tensors
            keys = self.arenas.of(TransferKind.KV) if call.kv_arena else local.tensors
            ex.kernels.backward(queries["do"], queries["q"], keys["k"], keys["v"], queries["out"], queries["lse"],
                                call.q_ranges.view(-1, 2), call.k_ranges.view(-1, 2), call.masks.view(-1, 2),
                                call.max_q, call.max_k, ex.scale, queries["dq"], keys["dk"], keys["dv"])
            return
        dq, dkv = self.gradients(call, local, remote)
        ex.scatter_add(call.q_index, "dq", dq, local, remote)
        ex.scatter_add(call.kv_index, "dkv", dkv, local, remote, dim=1)

    def gradients(self, call: KernelCall, local: Store, remote: dict[int, Store]):
        """The call's kernel on its packed inputs, whose copies are freed on return, before the adds: (dq, dK and dV
        as the halves of one tensor)."""
        ex = self.ex
        q, d_out, out = (ex.gather(call.q_runs, name, local, remote) for name in ("q", "do", "out"))
        lse = ex.gather(call.q_runs, "lse", local, remote, heads_first=True)
        k = ex.gather(call.kv_runs, "k", local, remote)
        v = ex.gather(call.kv_runs, "v", local, remote)
        dq, dk, dv = ex.kernels.backward(d_out, q, k, v, out, lse, call.cu_q, call.cu_k, call.max_q, call.max_k,
                                         ex.scale, call.causal, call.window)
        return dq, _halves(dk, dv)


def _halves(dk: torch.Tensor, dv: torch.Tensor) -> torch.Tensor:
    """dk and dv as one [2, ...] tensor: the one they are the halves of when a kernel wrote them so (no copy),
    else stacked."""
    base = dk._base
    if (base is not None and base is dv._base and base.shape == (2, *dk.shape) and base.is_contiguous()
            and dk.storage_offset() == base.storage_offset()
            and dv.storage_offset() == base.storage_offset() + dk.numel()):
        return base
    return torch.stack((dk, dv))

"""The executor: one pass of a rank's plan replayed stage by stage, its messages posted as batched point-to-point
ops, its tiles run, its received buffers freed by the plan's liveness rule. What a pass moves and computes is the
pass's (:mod:`fcp_runtime.passes`); the executor only knows rows, stores and messages."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from fcp_runtime.events import log_event
from fcp_runtime.kernels import default_kernels
from fcp_runtime.rank_plan import Message, PassProgram, RankPlan
from fcp_runtime.stage_calls import LOCAL, arenas, merge_runs, stage_calls


@dataclass
class Store:
    """Rows of some segments: where each segment starts, and named tensors [rows, ...] (or [heads, rows]); a
    received pull on the range path has its rows in an arena, from `arena_row` on."""

    seg_row: dict[int, int]
    rows: int
    tensors: dict[str, torch.Tensor] = field(default_factory=dict)
    arena_row: int = -1


def wait_all(requests: list) -> None:
    """Wait for every work of a batch and let them go (a backend holds the tensors a work moves until it is
    dropped)."""
    while requests:
        requests.pop().wait()


class Executor:
    """Replays one pass of a rank's plan: messages, tiles and buffers, stage by stage."""

    def __init__(self, plan: RankPlan, group, scale: float, device: torch.device, dtype: torch.dtype,
                 head_dim: int, kernels=None):
        self.plan, self.group, self.scale, self.head_dim = plan, group, scale, head_dim
        self.device, self.dtype = device, dtype
        self.acc_dtype = torch.float32 if dtype in (torch.bfloat16, torch.float16) else dtype
        self.kernels = kernels if kernels is not None else default_kernels(device, plan.has_windows)
        if plan.has_windows and not getattr(self.kernels, "takes_windows", True):
            raise ValueError(f"the {getattr(self.kernels, 'name', 'given')} kernels have no sliding window, and the "
                             f"plan gives some documents one; run it with the exact or the flash-attn kernels")
        # A range kernel reads keys in place: pulls are received into arenas, calls are ranges over them.
        self.ranges = bool(getattr(self.kernels, "ranges", False))
        self.live_tokens = 0  # received buffers under the plan's liveness rule (logged by recording())

    # --- layout -------------------------------------------------------------------------------------------------
    def peer(self, rank: int) -> int:
        return rank if self.group is None else dist.get_global_rank(self.group, rank)

    def local_store(self, **tensors: torch.Tensor) -> Store:
        return Store(seg_row=self.plan.local_seg_row, rows=self.plan.plan_tokens, tensors=tensors)

    def rows(self, store: Store, seg: int) -> slice:
        start = store.seg_row[seg]
        return slice(start, start + self.plan.seg_len(seg))

    def payload_rows(self, store: Store, name: str, segs, heads_first: bool = False) -> torch.Tensor:
        """A message's rows of one tensor: a view where the segments are one run of rows, else one copy of the
        runs."""
        dim = 1 if heads_first else 0
        views = [store.tensors[name].narrow(dim, row, length) for row, _, length in self.runs(store, segs)]
        return (views[0] if len(views) == 1 else torch.cat(views, dim=dim)).contiguous()

    def runs(self, store: Store, segs) -> list[tuple[int, int, int]]:
        """A message's segments as runs of consecutive store rows: (first store row, first message row, rows)."""
        pieces = ((LOCAL, store.seg_row[seg], self.plan.seg_len(seg)) for seg in segs)
        return [(row, first, length) for _, row, first, length in merge_runs(pieces)]

    def new_store(self, segs) -> Store:
        seg_row, row = {}, 0
        for seg in segs:
            seg_row[seg] = row
            row += self.plan.seg_len(seg)
        return Store(seg_row=seg_row, rows=row)

    def empty(self, rows: int, heads: int, dtype=None) -> torch.Tensor:
        return torch.empty((rows, heads, self.head_dim), dtype=dtype or self.dtype, device=self.device)

    # --- buffers ------------------------------------------------------------------------------------------------
    def allocate(self, name: str, stage: int, tokens: int) -> None:
        self.live_tokens += tokens
        log_event("alloc", name, stage, tokens, self.live_tokens)

    def release(self, name: str, stage: int, tokens: int) -> None:
        self.live_tokens -= tokens
        log_event("free", name, stage, tokens, self.live_tokens)

    # --- the stage loop, shared by both passes -----------------------------------------------------------------
    def run_stages(self, phase, program: PassProgram, local: Store, skip: frozenset[int] = frozenset(),
                   prefetched: Posted | None = None) -> None:
        """Replay one pass: per stage, post its messages as one batch (in round order, the order the peer posts
        them too), run its tiles, wait, make the arrived pulls usable, fold the returned pushes into this rank's
        rows, and free the buffers whose last use was this stage. Tiles whose rows are in `skip` already ran;
        stage 0's first `program.num_prefetched` messages are in flight already where `prefetched` holds them."""
        plan = self.plan
        remote: dict[int, Store] = {}  # pull_recv row -> its store, from arrival to free
        for stage in range(program.num_stages):
            arrived, returned = [], []
            posted = prefetched.num_messages if stage == 0 and prefetched is not None else 0
            requests = self.post_batch(phase, program.name, stage, program.messages[stage][posted:], local, remote,
                                       arrived, returned)
            if posted:  # taken over from the prefetch, which then holds none of them
                requests, arrived = prefetched.requests + requests, prefetched.arrived + arrived
                prefetched.requests, prefetched.arrived = [], []
            log_event("post", program.name, stage, len(program.messages[stage]),
                      tuple(m.pull for m in program.messages[stage] if m.what == "push_send"))
            tiles = [idx for idx in program.tiles[stage] if idx not in skip]
            for call in stage_calls(plan, program.name, stage, tiles, self.device, self.ranges):
                log_event("tile", program.name, stage, call.tile_rows, call.pull_rows)
                phase.run_call(call, local, remote)
            # Works, arrived stores and landed pushes are let go here, by helpers: a loop variable would keep the last
            # of each (a whole batch of sent and received tensors) alive into the next stage.
            wait_all(requests)
            log_event("wait", program.name, stage)
            self.arrive(phase, arrived, remote)
            self.land_pushes(phase, program.name, stage, returned, local, remote)
            for row in program.free_after[stage]:
                del remote[row]
                self.release(program.name, stage, plan.pull_tokens(plan.pull_recv[row]))

    def arrive(self, phase, arrived: list, remote: dict[int, Store]) -> None:
        """Make the pulls that arrived usable: their accumulators, and their stores under their pull rows."""
        for row, store in arrived:
            phase.accumulators(self.plan.pull_recv[row], store)
            remote[row] = store
        arrived.clear()

    def land_pushes(self, phase, name: str, stage: int, returned: list, local: Store,
                    remote: dict[int, Store]) -> None:
        """Fold the results pushed back to this rank into the rows they belong to, and free their buffers."""
        for pull, tensors in returned:
            # A relay sums the gradient of a pull it re-sent into its own partial gradient of the block.
            into = self.store_of(pull.source, local, remote)
            for row, offset, length in self.runs(into, pull.segs):
                phase.land(into, slice(row, row + length), pull.kind, tensors, slice(offset, offset + length))
            self.release(name, stage, self.plan.pull_tokens(pull))
        returned.clear()

    def post_batch(self, phase, name: str, stage: int, messages, local: Store, remote: dict[int, Store],
                   arrived: list, returned: list) -> list:
        """Post `messages` as one batch_isend_irecv (in the order given, the order the peer posts them too); returns
        its requests."""
        ops = []
        for message in messages:
            ops += self.post(phase, name, stage, message, local, remote, arrived, returned)
        return dist.batch_isend_irecv(ops) if ops else []

    def post(self, phase, name: str, stage: int, message: Message, local: Store, remote: dict[int, Store],
             arrived: list, returned: list) -> list:
        """The point-to-point ops of one message; buffers it receives into are allocated here."""
        plan = self.plan
        if message.what == "pull_send":  # from this rank's own rows, or relayed from a block it received
            pull = plan.pull_send[message.pull]
            return self.ops(dist.isend, pull.peer, pull.block, pull.kind,
                            phase.pull_payload(self.store_of(pull.source, local, remote), pull))
        if message.what == "pull_recv":
            pull = plan.pull_recv[message.pull]
            store = self.new_store(pull.segs)
            store.arena_row = phase.arena_row(message.pull)
            store.tensors = phase.pull_buffers(pull, store)
            self.allocate(name, stage, store.rows)
            arrived.append((message.pull, store))
            return self.ops(dist.irecv, pull.peer, pull.block, pull.kind, list(store.tensors.values()))
        if message.what == "push_send":  # back along a pull this rank received: its partial results
            pull = plan.pull_recv[message.pull]
            return self.ops(dist.isend, pull.peer, pull.block, 2 + pull.kind,
                            phase.push_payload(remote[message.pull], pull))
        pull = plan.pull_send[message.pull]  # push_recv: results of a pull this rank sent
        tensors = phase.push_buffers(pull, plan.pull_tokens(pull))
        self.allocate(name, stage, plan.pull_tokens(pull))
        returned.append((pull, tensors))
        return self.ops(dist.irecv, pull.peer, pull.block, 2 + pull.kind, phase.push_parts(tensors))

    def ops(self, operation, peer: int, block: int, code: int, tensors: list[torch.Tensor]) -> list:
        """One P2POp per tensor; tags (block, code, part) keep gloo's matching exact, and NCCL, which matches by
        posting order, sees the same order on both ends."""
        return [dist.P2POp(operation, t, self.peer(peer), self.group, (block * 4 + code) * 8 + i)
                for i, t in enumerate(tensors)]

    def store_of(self, source: int, local: Store, remote: dict[int, Store]) -> Store:
        return local if source == LOCAL else remote[source]

    def gather(self, runs, name: str, local: Store, remote: dict[int, Store], heads_first: bool = False):
        """One tensor's rows of a call, packed: the rows in place when they are one run of one source (heads-first
        rows made contiguous), else one concatenation of the runs' views (one copy, one launch)."""
        dim = 1 if heads_first else 0
        views = [self.store_of(source, local, remote).tensors[name].narrow(dim, row, length)
                 for source, row, length in runs]
        if len(views) == 1:
            return views[0].contiguous() if heads_first else views[0]
        return torch.cat(views, dim=dim)

    def scatter_add(self, index, name: str, values: torch.Tensor, local: Store, remote: dict[int, Store],
                    dim: int = 0) -> None:
        """Add a call's packed results (rows along `dim`) into the rows they belong to: a run in place, other rows
        by index_add_ (repeated rows sum)."""
        for entry in index:
            target = self.store_of(entry.source, local, remote).tensors[name]
            if entry.span is not None:
                position, row, length = entry.span
                target.narrow(dim, row, length).add_(values.narrow(dim, position, length))
            else:
                target.index_add_(dim, entry.rows, values.index_select(dim, entry.positions).to(target.dtype))


@dataclass(kw_only=True)
class Posted:
    """The first messages of a pass's stage 0, posted before the pass began (its stage-0 K,V pulls)."""

    num_messages: int  # program.num_prefetched
    requests: list
    arrived: list  # (pull_recv row, its store) of the pulls it receives
    arenas: Arenas | None = None  # on the range path: the pass's arenas, its K,V pulls received into them


# Tensors of an arena laid out [heads, rows] (LSE) or [2, rows, ...] (dK and dV as halves): their rows are dim 1.
_ROWS_DIM = {"lse": 1, "dkv": 1}


class Arenas:
    """One pass's arenas on the range path: per kind (Q, K,V) named tensors whose rows hold the received pulls at
    the rows the compiler placed them (fcp_compiler.format.arena); each made when its kind's first pull is posted."""

    def __init__(self, offsets: list[int], make: dict):
        self.offsets, self.make, self.tensors = offsets, make, {}

    def of(self, kind: int) -> dict[str, torch.Tensor]:
        if kind not in self.tensors:
            self.tensors[kind] = self.make[kind]()
        return self.tensors[kind]

    def views(self, kind: int, row: int, rows: int, names) -> dict[str, torch.Tensor]:
        """A pull's rows of the named tensors of its kind's arena, in place."""
        tensors = self.of(kind)
        return {name: tensors[name].narrow(_ROWS_DIM.get(name, 0), row, rows) for name in names}


def adopt(posted: Posted | None) -> Arenas | None:
    """The arenas a prefetch received into, handed to the pass that takes its messages over (and let go by the
    prefetch, which the caller may keep)."""
    if posted is None:
        return None
    arenas_, posted.arenas = posted.arenas, None
    return arenas_


def pass_arenas(executor: Executor, pass_name: str, make: dict, adopted: Arenas | None) -> Arenas | None:
    """The pass's arenas on the range path (those a prefetch made, if it did), else None."""
    if not executor.ranges:
        return None
    if adopted is not None:
        adopted.make.update(make)  # the prefetch did not know the query heads
        return adopted
    return Arenas(arenas(executor.plan)[pass_name].pull_offset.tolist(), make)

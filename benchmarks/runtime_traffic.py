"""Data the runtime moves in HBM outside the attention kernels, and the device ops it launches (issues 22, 33).

Usage: python benchmarks/runtime_traffic.py [--main-tree PATH] [--eval-data DIR] [--dtype bf16]

One rank's forward and backward of one attention call are replayed on the meta device at the plan's attention
shape (Llama-3-70B's by default: 64 query heads, 8 K,V heads, head_dim 128), bf16 with fp32 accumulators. The
kernels and the point-to-point messages are stubbed (no data moves through them); a TorchDispatchMode sees every
other device op the executor issues and charges the bytes it reads and writes:

- views (narrow, reshape of contiguous rows, transpose) move nothing and launch nothing; allocations launch nothing;
- an indexed read or write (index_select, index_copy_, index_add_, index_put_, advanced indexing) moves the rows it
  touches, its values read and written (index_add_ also reads the rows it adds to), plus the index;
- every other op reads its tensor inputs and writes its outputs, whole;
- host ops (building index tensors) are not device ops; a host-to-device copy is one, charged its device side.

It also reports the pass's peak device memory: every tensor an op creates (not a view, not an input it returns)
counts from its creation until Python frees it, kernel outputs included, and a batch of messages holds its tensors
until its work object is dropped, as a backend does; the call's inputs (and, backward, what the forward saved and
the incoming gradient) are not counted. Beside it, what the memory account states for that rank, which should equal
it: on the packing path the plan's header (max_buffer_bytes_fwd and _bwd; recomputed for another --dtype), on the
range path fcp_compiler.format.memory.rank_range_peak_bytes.

Each rank runs both kernel paths: "ranges", a range kernel (FFA's contract: keys read in place from the rank's rows
and its arenas, results accumulated in the kernel) and "packing", flash-attn's varlen contract (inputs packed per
call, results merged or added after it). Another tree (--main-tree) runs its own path, the packing one.

Plans: the 256-GPU paper-like trace (traces/paper_lognormal_256gpu.json) and the MagiAttention-histogram-like batch
at 256 GPUs (benchmarks/placement.py), at the busiest rank (most planned attention seconds) and the median one.
--main-tree runs the same measurement with another checkout's compiler and runtime (its own code, its own plans of
the same batches, in fresh processes) and prints both side by side, busiest beside busiest.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parents[1]

# Runs in a fresh process inside either tree: only APIs both trees have.
_JOB_SCRIPT = r'''
import json, sys, weakref
import numpy as np
import torch
from torch.utils._python_dispatch import TorchDispatchMode
import fcp_runtime.attention as attention
from fcp_runtime.plan import load_rank_plan

try:  # the modules whose names the stage loop and the call's checks look up (attention.py before its split)
    import fcp_runtime.checks as checks
    import fcp_runtime.executor as stage_loop
except ImportError:
    checks = stage_loop = attention

INDEXED = {"index_select": (1, 0), "index": (1, 0), "index_copy_": (0, 1), "index_copy": (0, 1),
           "index_put_": (0, 1), "_index_put_impl_": (0, 1), "index_put": (0, 1), "index_add_": (0, 2),
           "index_add": (0, 2)}
FREE = {"empty", "empty_like", "empty_strided", "new_empty", "new_empty_strided", "detach", "alias", "lift_fresh",
        "_to_copy_meta_noop"}


def _tensors(values):
    for value in values:
        if isinstance(value, torch.Tensor):
            yield value
        elif isinstance(value, (list, tuple)):
            yield from _tensors(value)


class Counter(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.paused, self.bytes, self.ops, self.by_op = 0, 0, 0, {}
        self.live = self.peak = 0

    def _allocated(self, tensors, inputs) -> None:
        """Device memory: a tensor an op creates (not a view, not one of its inputs) is live until it is freed."""
        for t in tensors:
            if t.device.type == "meta" and not any(t is i for i in inputs):
                self.live += t.nbytes
                self.peak = max(self.peak, self.live)
                weakref.finalize(t, self._freed, t.nbytes)

    def _freed(self, nbytes) -> None:
        self.live -= nbytes

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        name = func.overloadpacket.__name__
        inputs = list(_tensors(list(args) + list(kwargs.values())))
        outputs = list(_tensors([out]))
        if not func.is_view:
            self._allocated(outputs, inputs)
        if self.paused or func.is_view or name in FREE:
            return out
        if not any(t.device.type == "meta" for t in inputs + outputs):
            return out  # host work (index building), not a device op
        inputs = [t for t in inputs if t.device.type == "meta"]  # a host-to-device copy charges its device side
        if name in INDEXED:
            # The rows touched: the values read and written, plus what an add reads back; the indices.
            values = [t for t in inputs if t.dtype not in (torch.int64, torch.int32, torch.bool)]
            index = [t for t in inputs if t.dtype in (torch.int64, torch.int32, torch.bool)]
            gathered, extra = INDEXED[name]
            moved = (outputs[0].nbytes if gathered else values[-1].nbytes) * (2 + (extra == 2))
            moved += sum(t.nbytes for t in index)
        else:
            moved = sum(t.nbytes for t in inputs) + sum(t.nbytes for t in outputs)
        self.bytes += moved
        self.ops += 1
        entry = self.by_op.setdefault(name, [0, 0])
        entry[0] += 1
        entry[1] += moved
        return out


COUNTER = None


class MetaKernels:
    """The varlen contract's shapes, moving nothing (the kernels' own traffic is not counted)."""

    name = "meta"

    def forward(self, q, k, v, cu_q, cu_k, max_q, max_k, scale, causal, window=(-1, -1)):
        COUNTER.paused += 1
        try:
            return torch.empty_like(q), torch.empty((q.shape[1], q.shape[0]), dtype=torch.float32, device=q.device)
        finally:
            COUNTER.paused -= 1

    def backward(self, d_out, q, k, v, out, lse, cu_q, cu_k, max_q, max_k, scale, causal, window=(-1, -1)):
        COUNTER.paused += 1
        try:
            dkv = torch.empty((2, *k.shape), dtype=k.dtype, device=k.device)  # as FlashAttnKernels lays them out
            return torch.empty_like(q), dkv[0], dkv[1]
        finally:
            COUNTER.paused -= 1


class MetaRangeKernels:
    """The range contract's effects, moving nothing: it writes into the accumulators it is given."""

    name = "meta-ranges"
    ranges = True

    def forward(self, q, k, v, q_ranges, k_ranges, masks, max_q, max_k, scale, out, lse):
        return None

    def backward(self, d_out, q, k, v, out, lse, q_ranges, k_ranges, masks, max_q, max_k, scale, dq, dk, dv):
        return None


class Work:
    """A batch of messages in flight: like a backend's work object, it holds their tensors until it is dropped."""

    def __init__(self, tensors):
        self.tensors = tensors

    def wait(self):
        return True


class FakeDist:
    """Point-to-point messages that move nothing (their tensors held until the work is dropped, as backends do);
    everything else is torch.distributed's."""

    def __init__(self, real):
        self.real = real

    def __getattr__(self, name):
        return getattr(self.real, name)

    @staticmethod
    def P2POp(operation, tensor, *args, **kwargs):
        return tensor

    @staticmethod
    def batch_isend_irecv(ops):
        return [Work(ops)]

    @staticmethod
    def get_global_rank(group, rank):
        return rank


def measure(plan_path, rank, dtype, kernels):
    global COUNTER
    plan = load_rank_plan(plan_path, rank)
    stage_loop.dist = FakeDist(stage_loop.dist)
    checks.check_plan = lambda plan, group=None: None
    meta = torch.device("meta")
    tokens = plan.plan_tokens
    q = torch.empty((tokens, plan.q_heads, plan.head_dim), dtype=dtype, device=meta, requires_grad=True)
    k = torch.empty((tokens, plan.kv_heads, plan.head_dim), dtype=dtype, device=meta, requires_grad=True)
    v = torch.empty((tokens, plan.kv_heads, plan.head_dim), dtype=dtype, device=meta, requires_grad=True)
    result = {}
    for label in ("fwd", "bwd"):
        COUNTER = Counter()
        grad = torch.empty((tokens, plan.q_heads, plan.head_dim), dtype=dtype, device=meta)  # an input: not counted
        with COUNTER:
            if label == "fwd":
                out = attention.fcp_attn_func(q, k, v, plan, layout="plan", kernels=kernels)
            else:
                out.backward(grad)
        top = sorted(COUNTER.by_op.items(), key=lambda item: -item[1][1])[:6]
        result[label] = {"bytes": COUNTER.bytes, "ops": COUNTER.ops, "peak": COUNTER.peak,
                         "top": [[name, count, moved] for name, (count, moved) in top]}
    result["tokens"] = tokens
    return result


plan_path, ranks, dtype = sys.argv[1], json.loads(sys.argv[2]), getattr(torch, sys.argv[3])
kernels = MetaRangeKernels() if sys.argv[4:] == ["ranges"] else MetaKernels()
print(json.dumps({str(rank): measure(plan_path, rank, dtype, kernels) for rank in ranks}))
'''


DTYPES = {"bfloat16": "bf16", "float16": "fp16", "float32": "fp32"}


# Compiles each batch with the tree's own compiler (trees may read different plan formats) and picks its ranks.
_PLAN_SCRIPT = r'''
import json, sys
import numpy as np
from fcp_compiler import compile_plan
folder, batches = sys.argv[1], json.loads(sys.argv[2])
out = {}
for name, lengths in batches.items():
    plan = compile_plan(lengths, 256)
    assignment = plan.ir.assignment
    seconds = np.bincount(assignment.tile_rank, weights=assignment.tiles.tile_seconds,
                          minlength=assignment.num_ranks)
    order = np.argsort(seconds, kind="stable")
    path = f"{folder}/{name.replace('@', '_')}.fcp"
    plan.write(path)
    out[name] = [path, [int(order[-1]), int(order[order.size // 2])]]
print(json.dumps(out))
'''


def _batches(eval_data: Path) -> dict[str, list[int]]:
    """The two 256-GPU batches: the paper-like trace and a MagiAttention-histogram-like batch."""
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from fcp_compiler.format.inputs import load_batch
    from placement import TOKENS_PER_GPU, batches

    makers = batches(eval_data)
    sources = {"paper@256": load_batch(HERE / "traces" / "paper_lognormal_256gpu.json")}
    if "magi" in makers:
        sources["magi@256"] = makers["magi"](256 * TOKENS_PER_GPU, 0)
    return {name: [int(n) for n in getattr(lengths, "sequences", lengths)] for name, lengths in sources.items()}


def _plans(tree: Path, folder: Path, batches: dict) -> dict[str, tuple[str, list[int]]]:
    """Name -> (plan file, [busiest rank, median rank]), compiled in `tree`."""
    folder.mkdir(parents=True, exist_ok=True)
    done = subprocess.run([sys.executable, "-c", _PLAN_SCRIPT, str(folder), json.dumps(batches)], text=True,
                          capture_output=True, cwd=tree, env={"PYTHONPATH": str(tree), "PATH": ""})
    if done.returncode:
        raise SystemExit(f"runtime_traffic: compiling in {tree} failed:\n{done.stderr[-3000:]}")
    return {name: (path, ranks) for name, (path, ranks) in json.loads(done.stdout).items()}


def _run(tree: Path, path: Path, ranks: list[int], dtype: str, path_kind: str = "packing") -> dict:
    done = subprocess.run([sys.executable, "-c", _JOB_SCRIPT, str(path), json.dumps(ranks), dtype, path_kind], text=True,
                          capture_output=True, cwd=tree, env={"PYTHONPATH": str(tree), "PATH": ""})
    if done.returncode:
        raise SystemExit(f"runtime_traffic: the run in {tree} failed:\n{done.stderr[-3000:]}")
    return json.loads(done.stdout)


def _stated(reader, rank: int, dtype: str) -> dict[str, int]:
    """The packing path's peak the header states for a rank (recomputed for another dtype or layout)."""
    from fcp_compiler.format.memory import rank_peak_bytes

    header = reader.header
    if header.shape.dtype.value == DTYPES[dtype] and header.layout.value == "plan":
        return {"fwd": header.max_buffer_bytes_fwd[rank], "bwd": header.max_buffer_bytes_bwd[rank]}
    return rank_peak_bytes(reader.rank(rank), layout="plan", dtype=DTYPES[dtype])


def main() -> None:
    import tempfile

    from fcp_compiler.format.memory import rank_range_peak_bytes
    from fcp_compiler.format.plan_format import PlanReader
    from fcp_compiler.tools.report import table

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--main-tree", type=Path, help="another checkout to measure beside this one")
    parser.add_argument("--eval-data", type=Path, default=Path(os.environ.get("FCP_EVAL_DATA", "eval-data")))
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    args = parser.parse_args()
    trees = {"this": HERE} | ({"main": args.main_tree.resolve()} if args.main_tree else {})
    rows, tops = [], []
    batches = _batches(args.eval_data)
    with tempfile.TemporaryDirectory() as folder:
        plans = {label: _plans(tree, Path(folder) / label, batches) for label, tree in trees.items()}
        for name, (path, ranks) in plans["this"].items():
            measured = {(label, "packing"): _run(tree, plans[label][name][0], plans[label][name][1], args.dtype)
                        for label, tree in trees.items()}
            measured["this", "ranges"] = _run(HERE, path, ranks, args.dtype, "ranges")
            reader = PlanReader(path)
            for index, (rank, which) in enumerate(zip(ranks, ("busiest", "median"))):
                stated = {"packing": _stated(reader, rank, args.dtype),
                          "ranges": rank_range_peak_bytes(reader.rank(rank), layout="plan", dtype=DTYPES[args.dtype])}
                for kernels in ("ranges", "packing"):
                    ours = measured["this", kernels][str(rank)]
                    for label in ("fwd", "bwd"):
                        row = [f"{name} rank {rank} ({which})", kernels, label, f"{ours['tokens']}",
                               f"{ours[label]['bytes'] / 1e9:.2f}", f"{ours[label]['ops']}",
                               f"{ours[label]['peak'] / 2 ** 30:.2f}", f"{stated[kernels][label] / 2 ** 30:.2f}",
                               f"{stated[kernels][label] / ours[label]['peak']:.3f}"]
                        if ("main", "packing") in measured:
                            base = measured["main", "packing"][str(plans["main"][name][1][index])][label]
                            row += [f"{base['bytes'] / 1e9:.2f}", f"{base['ops']}", f"{base['peak'] / 2 ** 30:.2f}",
                                    f"{ours[label]['bytes'] / base['bytes']:.3f}" if base["bytes"] else "-",
                                    f"{ours[label]['ops'] / base['ops']:.3f}" if base["ops"] else "-"]
                        rows.append(row)
                        tops.append(f"{name} rank {rank} {kernels} {label}: " + ", ".join(
                            f"{op} x{count} {moved / 1e9:.2f} GB" for op, count, moved in ours[label]["top"]))
    headers = ["plan, rank", "kernels", "pass", "tokens", "HBM GB", "ops", "peak GiB", "stated GiB", "stated/peak"]
    if "main" in trees:
        headers += ["main GB", "main ops", "main peak", "GB x main", "ops x main"]
    print(table(headers, rows))
    print("\nlargest ops (this tree):")
    print("\n".join(tops))


if __name__ == "__main__":
    main()

"""The GPU check: the CUDA kernel backends against the exact kernel on a real plan's call shapes, a world-1 training
step of a Hugging Face model under fcp, and measured kernel time per call shape beside the profile's efficiency curve.
Where torchtitan is installed (the torchtitan extra), also torchtitan's own Trainer with fcp (FcpTrainer) for a step
against torchtitan's model one document at a time (torchtitan_step; on the CPU its model, collate and hook alone).

    python benchmarks/gpu_check.py              # on one CUDA GPU: under 8 minutes on an H100
    python benchmarks/gpu_check.py --dry-run    # the same code on the CPU, at a small shape (run by the test suite)

On a GPU the calls are the paper trace's (traces/paper_lognormal_256gpu.json at 256 GPUs, one rank's forward and
backward calls; Llama-3-70B heads, bf16) and the backends are torch's own flash attention, plus flash-attn and FFA
where installed; the reference is the exact kernel in fp32 on the same inputs. On the CPU (--dry-run) the backend
under test is the exact range kernel against the exact varlen one, at 4/2 heads of 64 on a small batch at 4 GPUs.
Exit status 1 when a backend differs from the reference beyond its tolerance.
"""

from __future__ import annotations

import argparse
import math
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from fcp_compiler import compile_plan  # noqa: E402
from fcp_compiler.core.passes.cost import tile_efficiency  # noqa: E402
from fcp_compiler.format.inputs import AttentionShape, load_profile, parse_batch  # noqa: E402
from fcp_runtime.kernels import (ExactKernels, ExactRangeKernels, FlashAttnKernels, FlexFlashAttnKernels,  # noqa: E402
                                 TorchFlashKernels)
from fcp_runtime.plan import load_rank_plan  # noqa: E402
from fcp_runtime.stage_calls import plan_requests, stage_calls  # noqa: E402

# bf16 inputs against an fp32 reference on the same (rounded) inputs: flash kernels accumulate in fp32, so outputs
# land within bf16's rounding of the reference (as tests/runtime_harness.py's bf16 tolerance).
TOLERANCE = {torch.bfloat16: dict(rtol=2e-2, atol=2e-2), torch.float32: dict(rtol=1e-5, atol=1e-5)}


@dataclass(frozen=True, kw_only=True)
class Setting:
    device: torch.device
    dtype: torch.dtype
    trace: str
    gpus: int
    block_size: int
    shape: AttentionShape
    num_calls: int


def setting(dry_run: bool, num_calls: int) -> Setting:
    if dry_run:
        return Setting(device=torch.device("cpu"), dtype=torch.float32, trace="", gpus=4, block_size=128, shape=AttentionShape(q_heads=4, kv_heads=2, head_dim=64, dtype="fp32"),
                       num_calls=min(num_calls, 3))
    return Setting(device=torch.device("cuda"), dtype=torch.bfloat16, trace="paper_lognormal_256gpu.json", gpus=256,
                   block_size=4096, shape=AttentionShape(), num_calls=num_calls)


def backends(device: torch.device) -> dict:
    """The kernel backends to check on this device: every CUDA one installed, or on the CPU the exact range
    kernel (the CPU path's own backend)."""
    if device.type != "cuda":
        return {"exact-ranges": ExactRangeKernels()}
    found = {"torch-flash": TorchFlashKernels()}
    for name, make in (("flash-attn", FlashAttnKernels.installed), ("ffa", FlexFlashAttnKernels.installed)):
        try:
            found[name] = make()
        except ImportError:
            print(f"  {name}: not installed, skipped")
    return found


def chosen_calls(run: Setting) -> list:
    """Up to num_calls forward varlen calls of the busiest rank of the trace's plan, spread over their sizes."""
    import json

    batch = parse_batch(json.loads((REPO / "traces" / run.trace).read_text())) if run.trace else \
        [3000, 1200, 600, 200, 100, 64] * 2  # the dry run's small long-tail batch
    plan = compile_plan(batch, run.gpus, block_size=run.block_size, shape=run.shape, model="none")
    rank = int(np.argmax(plan.stats.get("rank_tiles", [0])) if "rank_tiles" in plan.stats else 0)
    rank_plan = load_rank_plan(plan.to_bytes(), rank)
    calls = []
    for request in plan_requests(rank_plan, "plan"):
        if request.pass_name == "fwd" and request.tiles:
            calls += stage_calls(rank_plan, "fwd", request.stage, list(request.tiles), "cpu")
    calls = [call for call in calls if call.window == (-1, -1) and int(call.cu_q[-1]) <= 65536]
    calls.sort(key=lambda call: (int(call.cu_q[-1]) * int(call.cu_k[-1]), call.tile_rows))
    picks = np.unique(np.linspace(0, len(calls) - 1, num=min(run.num_calls, len(calls))).round().astype(int))
    return [calls[i] for i in picks]


def visible_pairs(call) -> int:
    """Visible (query, key) pairs of a varlen call: bottom-right causal or full per entry."""
    cu_q, cu_k = call.cu_q.tolist(), call.cu_k.tolist()
    total = 0
    for i in range(len(cu_q) - 1):
        lq, lk = cu_q[i + 1] - cu_q[i], cu_k[i + 1] - cu_k[i]
        if call.causal:
            seen = np.clip(lk - lq + 1 + np.arange(lq), 0, lk)
            total += int(seen.sum())
        else:
            total += lq * lk
    return total


def _inputs(call, run: Setting, seed: int):
    generator = torch.Generator().manual_seed(seed)
    shape = run.shape
    rows_q, rows_k = int(call.cu_q[-1]), int(call.cu_k[-1])
    q = torch.randn(rows_q, shape.q_heads, shape.head_dim, generator=generator)
    k = torch.randn(rows_k, shape.kv_heads, shape.head_dim, generator=generator)
    v = torch.randn(rows_k, shape.kv_heads, shape.head_dim, generator=generator)
    d_out = torch.randn(rows_q, shape.q_heads, shape.head_dim, generator=generator)
    return [x.to(run.device, run.dtype) for x in (q, k, v, d_out)]


def _ranges(call, device):
    """A varlen call as the range contract's ranges: entry i's query and key rows, masked alike."""
    cu_q, cu_k = call.cu_q.to(device), call.cu_k.to(device)
    q_ranges = torch.stack([cu_q[:-1], cu_q[1:]], dim=1).to(torch.int32)
    k_ranges = torch.stack([cu_k[:-1], cu_k[1:]], dim=1).to(torch.int32)
    mask = (-1, 0) if call.causal else (-1, -1)
    masks = torch.tensor([mask], dtype=torch.int32, device=device).expand(len(q_ranges), 2).contiguous()
    return q_ranges, k_ranges, masks


def run_backend(kernels, call, q, k, v, d_out, scale: float):
    """(out, lse, dq, dk, dv) of one call by one backend, in its contract."""
    device = q.device
    if getattr(kernels, "ranges", False):
        q_ranges, k_ranges, masks = _ranges(call, device)
        acc = torch.float32 if q.dtype in (torch.bfloat16, torch.float16) else q.dtype
        out = torch.zeros(q.shape, dtype=acc, device=device)
        lse = torch.full((q.shape[1], q.shape[0]), float("-inf"), dtype=acc, device=device)
        kernels.forward(q, k, v, q_ranges, k_ranges, masks, call.max_q, call.max_k, scale, out, lse)
        dq, dk, dv = (torch.zeros(x.shape, dtype=acc, device=device) for x in (q, k, v))
        kernels.backward(d_out, q, k, v, out.to(q.dtype), lse, q_ranges, k_ranges, masks, call.max_q, call.max_k,
                         scale, dq, dk, dv)
        return out, lse, dq, dk, dv
    cu_q, cu_k = call.cu_q.to(device), call.cu_k.to(device)
    out, lse = kernels.forward(q, k, v, cu_q, cu_k, call.max_q, call.max_k, scale, call.causal, call.window)
    dq, dk, dv = kernels.backward(d_out, q, k, v, out, lse, cu_q, cu_k, call.max_q, call.max_k, scale, call.causal,
                                  call.window)
    return out, lse, dq, dk, dv


def reference(call, q, k, v, d_out, scale: float):
    """The exact varlen kernel in fp32 on the same inputs."""
    return run_backend(ExactKernels(), call, *(x.float() for x in (q, k, v, d_out)), scale)


def seconds_per_call(kernels, call, q, k, v, repeats: int) -> float:
    """Median wall time of one forward call (the device synchronised around each)."""
    scale = q.shape[2] ** -0.5
    sync = torch.cuda.synchronize if q.device.type == "cuda" else (lambda: None)
    times = []
    for attempt in range(repeats + 1):
        sync()
        start = time.perf_counter()
        if getattr(kernels, "ranges", False):
            q_ranges, k_ranges, masks = _ranges(call, q.device)
            out = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
            lse = torch.full((q.shape[1], q.shape[0]), float("-inf"), device=q.device)
            kernels.forward(q, k, v, q_ranges, k_ranges, masks, call.max_q, call.max_k, scale, out, lse)
        else:
            kernels.forward(q, k, v, call.cu_q.to(q.device), call.cu_k.to(q.device), call.max_q, call.max_k, scale,
                            call.causal, call.window)
        sync()
        if attempt:  # the first is a warm-up
            times.append(time.perf_counter() - start)
    return sorted(times)[len(times) // 2]


def check_kernels(run: Setting, kernels_by_name: dict, repeats: int) -> tuple[bool, list[str]]:
    """Every backend against the reference on each chosen call; the timing table's rows."""
    profile = load_profile("h100")
    ok, rows = True, []
    for call_idx, call in enumerate(chosen_calls(run)):
        q, k, v, d_out = _inputs(call, run, call_idx)
        scale = q.shape[2] ** -0.5
        want = reference(call, q, k, v, d_out, scale)
        entries = len(call.cu_q) - 1
        tile = math.sqrt(max(1, int(call.cu_q[-1])) * max(1, int(call.cu_k[-1])) / max(entries, 1))
        flops = 4.0 * visible_pairs(call) * run.shape.q_heads * run.shape.head_dim
        for name, kernels in kernels_by_name.items():
            got = run_backend(kernels, call, q, k, v, d_out, scale)
            worst = max(float((g.float() - w).abs().nan_to_num(0.0, 0.0, 0.0).max()) for g, w in zip(got, want))
            close = all(torch.allclose(g.float().nan_to_num(), w.nan_to_num(), **TOLERANCE[run.dtype])
                        for g, w in zip(got, want))
            ok &= close
            seconds = seconds_per_call(kernels, call, q, k, v, repeats)
            measured = flops / (seconds * profile.peak_tflops * 1e12)
            modelled = float(tile_efficiency(profile, np.array([tile]))[0])
            rows.append(f"{call_idx:>4} {name:>12} {int(call.cu_q[-1]):>8} {int(call.cu_k[-1]):>8} {entries:>7} "
                        f"{tile:>8.0f} {seconds * 1e3:>9.3f} {measured:>9.1%} {modelled:>9.1%} {worst:>9.2e} "
                        f"{'ok' if close else 'DIFFERS'}")
    return ok, rows


def train_step(run: Setting) -> str:
    """One world-1 training step of a tiny random Llama under fcp on the device, against HF's own attention on the
    same documents: their losses."""
    import os
    import socket

    import torch.distributed as dist
    from transformers import LlamaConfig, LlamaForCausalLM

    from fcp_runtime.hf import HFPlanningCollate

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    dist.init_process_group("nccl" if run.device.type == "cuda" else "gloo", init_method=f"tcp://127.0.0.1:{port}",
                            rank=0, world_size=1)
    try:
        losses = {}
        documents = [torch.arange(n) % 250 for n in (700, 200, 64, 30)]
        for implementation in ("fcp", "sdpa"):
            torch.manual_seed(0)
            config = LlamaConfig(vocab_size=256, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                                 num_attention_heads=2, num_key_value_heads=1, attn_implementation=implementation)
            model = LlamaForCausalLM(config).to(run.device, run.dtype)
            count = torch.tensor(sum(len(doc) - 1 for doc in documents))
            if implementation == "fcp":
                batch = HFPlanningCollate.for_model(config, dtype=run.dtype, block_size=128)(documents)
                batch = {k: v.to(run.device) if isinstance(v, torch.Tensor) else v for k, v in batch.items()}
                loss = model(**batch).loss
            else:
                loss = sum(model(input_ids=doc[None].to(run.device), labels=doc[None].to(run.device),
                                 num_items_in_batch=count).loss for doc in documents)
            loss.backward()
            losses[implementation] = float(loss.detach())
    finally:
        dist.destroy_process_group()
    relative = abs(losses["fcp"] - losses["sdpa"]) / abs(losses["sdpa"])
    bound = 2e-2 if run.dtype == torch.bfloat16 else 1e-5
    verdict = "ok" if relative <= bound else "DIFFERS"
    return f"training step on {run.device.type}: loss fcp {losses['fcp']:.6f}, HF sdpa {losses['sdpa']:.6f}, " \
           f"relative {relative:.1e} (bound {bound:.0e}) {verdict}"


def _titan_trainer_config(folder: str, dump_folder: str, steps: int):
    """A torchtitan Trainer.Config for a tiny random GQA Llama 3 (torchtitan's own Llama3Model, 2 layers, 4 query and
    2 KV heads of 32) on a local long-tail set of documents (torchtitan's c4_test format) with a byte tokenizer: no
    download. Returns (config, tokenizer class)."""
    import dataclasses
    import json

    from torchtitan.components.loss import CrossEntropyLoss
    from torchtitan.components.metrics import MetricsProcessor
    from torchtitan.components.optimizer import default_adamw
    from torchtitan.components.tokenizer import BaseTokenizer
    from torchtitan.config import ParallelismConfig, TrainingConfig
    from torchtitan.config.configs import DebugConfig
    from torchtitan.hf_datasets.text_datasets import HuggingFaceTextDataLoader
    from torchtitan.models.common import ComplexRoPE, Embedding, Linear, RMSNorm
    from torchtitan.models.llama3 import Llama3Model, _build_llama3_layers, parallelize_llama
    from torchtitan.protocols.model_spec import ModelSpec
    from torchtitan.trainer import Trainer

    class ByteTokenizer(BaseTokenizer):
        @dataclasses.dataclass(kw_only=True, slots=True)
        class Config(BaseTokenizer.Config):
            pass

        def __init__(self, config=None, *, tokenizer_path=None):
            super().__init__()
            self.bos_id, self.eos_id = 1, 2

        def encode(self, text, add_bos=False, add_eos=False):
            return [1] * add_bos + [3 + byte % 253 for byte in text.encode()] + [2] * add_eos

        def decode(self, ids):
            return ""

        def get_vocab_size(self):
            return 256

    rng = np.random.default_rng(0)
    lengths = [int(np.clip(rng.lognormal(np.log(60), 1.0), 2, 600)) for _ in range(200)]
    lengths[1] = 1500  # one document longer than a row of 1,024 tokens: it crosses rows, as torchtitan packs them
    with open(Path(folder) / "train.jsonl", "w") as out:
        for length in lengths:
            out.write(json.dumps({"text": "".join(chr(97 + int(c)) for c in rng.integers(0, 26, length))}) + "\n")
    dim, heads = 128, 4
    model = Llama3Model.Config(
        dim=dim, vocab_size=256,
        tok_embeddings=Embedding.Config(num_embeddings=256, embedding_dim=dim,
                                        param_init={"weight": torch.nn.init.normal_}),
        norm=RMSNorm.Config(normalized_shape=dim, param_init={"weight": torch.nn.init.ones_}),
        lm_head=Linear.Config(in_features=dim, out_features=256,
                              param_init={"weight": lambda w: torch.nn.init.normal_(w, std=dim ** -0.5)}),
        layers=_build_llama3_layers(n_layers=2, dim=dim, n_heads=heads, n_kv_heads=2, hidden_dim=256,
                                    rope=ComplexRoPE.Config(dim=dim // heads, max_seq_len=4096, theta=500000,
                                                            scaling="llama"), attn_backend="flex"))
    spec = ModelSpec(name="llama3", flavor="gpu_check", model=model, parallelize_fn=parallelize_llama,
                     pipelining_fn=None, post_optimizer_build_fn=None, state_dict_adapter=None)
    config = Trainer.Config(model_spec=spec, loss=CrossEntropyLoss.Config(), optimizer=default_adamw(lr=1e-3),
                            tokenizer=ByteTokenizer.Config(), dump_folder=dump_folder,
                            metrics=MetricsProcessor.Config(log_freq=1), debug=DebugConfig(seed=0),
                            parallelism=ParallelismConfig(),
                            training=TrainingConfig(local_batch_size=2, seq_len=1024, steps=steps),
                            dataloader=HuggingFaceTextDataLoader.Config(dataset="c4_test", dataset_path=folder))
    return config, ByteTokenizer


def _titan_reference_loss(model_config, weights: dict, batch, device, dtype) -> float:
    """The batch's loss in one process without CP: torchtitan's model with its ScaledDotProductAttention inner
    attention (causal) and the given weights, each document alone at positions 0.. (torchtitan's block-causal mask
    reads documents where positions restart at 0), the summed cross-entropy (fp32 logits, as torchtitan's loss)
    over the batch's label count."""
    import copy

    from torchtitan.components.loss import IGNORE_INDEX
    from torchtitan.models.common.attention import ScaledDotProductAttention

    from fcp_runtime.torchtitan import row_documents

    model_config = copy.deepcopy(model_config)  # the trainer's own stays as it is
    for layer in model_config.layers:
        layer.attention.inner_attention = ScaledDotProductAttention.Config()
    with torch.device("meta"):
        model = model_config.build()
    model.to_empty(device=device)
    with torch.no_grad():
        model.init_weights(buffer_device=None)
        for name, p in model.named_parameters():
            p.copy_(weights[name.replace("_checkpoint_wrapped_module.", "")])
    model.to(dtype)
    input_dict, labels = batch
    count = int((labels != IGNORE_INDEX).sum())
    total = 0.0
    with torch.no_grad():
        for row in range(labels.shape[0]):
            pieces = row_documents(input_dict["positions"][row].cpu(), row)
            for ids, doc_labels in zip(input_dict["input"][row].split(pieces), labels[row].split(pieces)):
                logits = model(ids[None].to(device), positions=torch.arange(ids.numel(), device=device)[None])
                total += float(torch.nn.functional.cross_entropy(logits[0].float(), doc_labels.to(device),
                                                                 reduction="sum", ignore_index=IGNORE_INDEX))
    return total / count


def torchtitan_step(run: Setting) -> str:
    """torchtitan with fcp as its context parallelism (fcp_runtime/torchtitan.py, the torchtitan extra), world 1.

    On CUDA: torchtitan's own Trainer with fcp (FcpTrainer: its mesh, FSDP's bf16 mixed precision, selective
    activation checkpointing, fcp's CUDA kernels) takes the first batch's forward and backward
    (Trainer.forward_backward_step), beside torchtitan's model with its SDPA one document at a time on the trainer's
    initial weights, then two more training steps (Trainer.train_step; torchtitan's train() loop calls
    torch.distributed.set_timeout, which torch 2.13 does not have). On the CPU (--dry-run) torchtitan's Trainer
    cannot be built: it picks its device as `_get_available_device_type() or "cuda"` (torchtitan/tools/utils.py) and
    Trainer.__init__ calls `device_module.set_device(self.device)`; so the same model, dataloader, collate and hook
    run without the Trainer: torchtitan's Llama 3 through FcpAttention and prepare_fcp_input (world 1, gloo), fp32.
    """
    try:
        import fcp_runtime.torchtitan as fcp_titan
    except ImportError:
        return "torchtitan step: torchtitan not installed, skipped"
    import os
    import socket
    import tempfile

    import torch.distributed as dist
    from torchtitan.components.loss import IGNORE_INDEX

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
    os.environ.update(LOCAL_RANK="0", RANK="0", WORLD_SIZE="1")
    dist.init_process_group("nccl" if run.device.type == "cuda" else "gloo", init_method=f"tcp://127.0.0.1:{port}",
                            rank=0, world_size=1)
    try:
        with tempfile.TemporaryDirectory() as folder:
            import datasets.config

            datasets.config.HF_DATASETS_CACHE = str(Path(folder) / "cache")  # load_dataset's cache, read at each call
            config, tokenizer = _titan_trainer_config(folder, str(Path(folder) / "outputs"), steps=3)
            config = fcp_titan.FcpTrainer.Config.of(config, block_size=256)
            if run.device.type == "cuda":
                trainer = config.build()
                model = trainer.model_parts[0]
                weights = {name.replace("_checkpoint_wrapped_module.", ""):
                           (p.full_tensor() if hasattr(p, "full_tensor") else p).detach().clone()
                           for name, p in model.named_parameters()}
                batches = trainer.batch_generator(trainer.dataloader)
                input_dict, labels = next(batches)
                batch = ({k: v.to(trainer.device) if isinstance(v, torch.Tensor) else v
                          for k, v in input_dict.items()}, labels.to(trainer.device))
                count = (batch[1] != IGNORE_INDEX).sum()
                loss = float(trainer.forward_backward_step(input_dict=dict(batch[0]), labels=batch[1],
                                                           global_valid_tokens=count).detach())
                dtype = torch.bfloat16  # FSDP's mixed_precision_param
                reference = _titan_reference_loss(trainer.model_config, weights, batch, trainer.device, dtype)
                for _ in range(2):
                    trainer.step += 1
                    trainer.train_step(batches)
                trainer.close()
                extra = ", then 2 train_steps"
            else:
                torch.manual_seed(0)
                model_config = fcp_titan.use_fcp_attention(config.model_spec.model)
                model_config.update_from_config(config=config)
                with torch.device("meta"):
                    model = model_config.build()
                model.to_empty(device="cpu")
                with torch.no_grad():
                    model.init_weights(buffer_device=None)
                weights = {name: p.detach().clone() for name, p in model.named_parameters()}
                loader = config.dataloader.build(dp_world_size=1, dp_rank=0, tokenizer=tokenizer(),
                                                 seq_len=config.training.seq_len,
                                                 local_batch_size=config.training.local_batch_size)
                loader.collate_fn = fcp_titan.TitanPlanningCollate.for_model(model_config, 0, 1, dtype=run.dtype,
                                                                             block_size=config.fcp.block_size)
                input_dict, labels = next(iter(loader))
                extra_kwargs = {k: v for k, v in input_dict.items() if k != "input"}
                inputs, rows_labels, extra_kwargs = fcp_titan.prepare_fcp_input(input_dict["input"], labels,
                                                                                extra_kwargs, None)
                logits = model(inputs, **extra_kwargs)
                count = (labels != IGNORE_INDEX).sum()
                step_loss = torch.nn.functional.cross_entropy(logits[0].float(), rows_labels[0], reduction="sum",
                                                              ignore_index=IGNORE_INDEX) / count
                step_loss.backward()
                loss, dtype = float(step_loss.detach()), run.dtype
                batch = ({k: input_dict[k] for k in ("input", "positions")}, labels)
                reference = _titan_reference_loss(model_config, weights, batch, run.device, dtype)
                extra = ""
    finally:
        dist.destroy_process_group()
    relative = abs(loss - reference) / abs(reference)
    bound = 2e-2 if dtype == torch.bfloat16 else 1e-5
    verdict = "ok" if relative <= bound and math.isfinite(loss) else "DIFFERS"
    return f"torchtitan step on {run.device.type}: loss fcp {loss:.6f}, torchtitan SDPA by document " \
           f"{reference:.6f}, relative {relative:.1e} (bound {bound:.0e}){extra} {verdict}"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dry-run", action="store_true", help="run on the CPU at a small shape")
    parser.add_argument("--calls", type=int, default=8, help="call shapes to check (spread over sizes)")
    parser.add_argument("--repeats", type=int, default=10, help="timed calls per shape and backend")
    args = parser.parse_args(argv)
    if not args.dry_run and not torch.cuda.is_available():
        print("gpu_check: error: no CUDA device; run with --dry-run on the CPU", file=sys.stderr)
        return 2
    run = setting(args.dry_run, args.calls)
    started = time.perf_counter()
    print(f"device {torch.cuda.get_device_name() if run.device.type == 'cuda' else 'cpu'}, torch {torch.__version__}, "
          f"{run.trace or 'a small batch'} at {run.gpus} GPUs, block {run.block_size}, heads {run.shape.q_heads}/{run.shape.kv_heads}, "
          f"head_dim {run.shape.head_dim}, {run.dtype}")
    kernels_ok, rows = check_kernels(run, backends(run.device), 1 if args.dry_run else args.repeats)
    print(f"{'call':>4} {'backend':>12} {'q rows':>8} {'k rows':>8} {'entries':>7} {'tile':>8} {'ms':>9} "
          f"{'measured':>9} {'profile':>9} {'max diff':>9}")
    print("\n".join(rows))
    print("measured: the call's useful FLOPs over (time x the profile's peak); profile: the compiler's efficiency "
          "curve (calibrate.py's fit) at the call's mean entry tile")
    titan = torchtitan_step(run)
    print(titan)
    step = train_step(run)
    print(step)
    passed = kernels_ok and step.endswith("ok") and titan.endswith(("ok", "skipped"))
    print(f"gpu_check: {'PASS' if passed else 'FAIL'} in {time.perf_counter() - started:.1f} s")
    return 0 if passed else 1


if __name__ == "__main__":
    sys.exit(main())

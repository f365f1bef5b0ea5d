"""fcp as torchtitan's context parallelism (fcp_runtime/torchtitan.py), on forked gloo ranks.

The must-show: a random small GQA Llama 3 of torchtitan's own (Llama3Model, parallelized by its Module.parallelize on
the mesh its ParallelDims builds, FcpAttention as every layer's inner attention) takes one step on 4 ranks through
torchtitan's own trainer step code (Trainer.forward_backward_step and _forward_backward_body, with
FcpTrainer.post_dataloading_process), on a batch that torchtitan's HuggingFaceTextDataset packs from a local
long-tail set of documents and FcpTrainer's collate plans in torchtitan's dataloader; its loss and gradients equal
torchtitan's model in one process without CP (fp64), and breaking the labels or the loss rule breaks the equality.

What needs CUDA: constructing torchtitan's Trainer (torchtitan/tools/utils.py picks
`device_type = _get_available_device_type() or "cuda"`, and Trainer.__init__ calls `device_module.set_device(...)`:
on a CPU-only torch, "module 'torch._C' has no attribute '_cuda_setDevice'"; test_torchtitans_trainer_itself_needs_cuda
shows it), and torchtitan's own packed-document attention backends (FlexAttention: "FlexAttention does not support
backward on CPU", and on the CPU only fp32/bf16/fp16 forward; VarlenAttention: flash-attention's varlen kernel, bf16,
CUDA). So the must-show step runs on a Trainer instance built without its __init__ (the attributes the step reads
set as __init__ sets them; FSDP's gradient sum, a reduce-scatter over dp_shard x cp with division off, is an
all-reduce), and the reference is torchtitan's model with its ScaledDotProductAttention inner attention, causal, one
document at a time (test_the_reference_is_torchtitans_own_packed_document_attention checks it against FlexAttention
over the packed rows, forward). The long test_fcp_trainer_trains_on_4_gloo_ranks_as_one_process runs FcpTrainer
itself end to end (config.build(), FSDP, AdamW, train_step) with torchtitan's device selection pointed at the CPU and
FSDP's reduce-scatter set to a plain sum (gloo has no PREMUL_SUM); benchmarks/gpu_check.py runs it on a GPU.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import traceback

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("torchtitan")

import torch.distributed as dist  # noqa: E402
from torchtitan.components.loss import IGNORE_INDEX, ChunkedLossWrapper, CrossEntropyLoss  # noqa: E402
from torchtitan.components.optimizer import default_adamw  # noqa: E402
from torchtitan.components.tokenizer import BaseTokenizer  # noqa: E402
from torchtitan.config import ParallelismConfig, TrainingConfig  # noqa: E402
from torchtitan.config.configs import CompileConfig  # noqa: E402
from torchtitan.distributed import ParallelDims  # noqa: E402
from torchtitan.distributed import utils as dist_utils  # noqa: E402
from torchtitan.hf_datasets.text_datasets import HuggingFaceTextDataLoader  # noqa: E402
from torchtitan.models.common import ComplexRoPE, Embedding, Linear, RMSNorm  # noqa: E402
from torchtitan.models.common.attention import ScaledDotProductAttention  # noqa: E402
from torchtitan.models.llama3 import Llama3Model, _build_llama3_layers, parallelize_llama  # noqa: E402
from torchtitan.protocols.model_spec import ModelSpec  # noqa: E402
from torchtitan.trainer import Trainer  # noqa: E402

import fcp_runtime.torchtitan as fcp_titan  # noqa: E402
from runtime_harness import run_ranks  # noqa: E402

VOCAB = 256
# fp64: the ranks replay one process's arithmetic up to the order of sums (attention's log-sum-exp merges, the loss
# over rows in another order, the gradients summed over ranks).
FP64 = {"loss": 1e-10, "grads": 1e-8}


class ByteTokenizer(BaseTokenizer):
    """A local toy tokenizer: each byte of the text is a token id in [3, VOCAB); 1 and 2 are BOS and EOS."""

    @dataclasses.dataclass(kw_only=True, slots=True)
    class Config(BaseTokenizer.Config):
        pass

    def __init__(self, config=None, *, tokenizer_path: str | None = None):
        super().__init__()
        self.bos_id, self.eos_id = 1, 2

    def encode(self, text: str, add_bos: bool = False, add_eos: bool = False) -> list[int]:
        ids = [3 + byte % (VOCAB - 3) for byte in text.encode()]
        return [self.bos_id] * add_bos + ids + [self.eos_id] * add_eos

    def decode(self, ids) -> str:
        return ""

    def get_vocab_size(self) -> int:
        return VOCAB


@dataclasses.dataclass(frozen=True, kw_only=True)
class Setup:
    """One step of a random small GQA Llama 3: the model, the data, the parallelism, and the loss."""

    data: str  # a folder with train.jsonl, {"text": ...} a line (torchtitan's c4_test format)
    cp: int = 4
    dp: int = 1
    seq_len: int = 512
    local_batch_size: int = 2  # rows of seq_len a data-parallel replica takes a step: 1,024 tokens
    block_size: int = 64
    dtype: torch.dtype = torch.float64
    # "fp": cross-entropy summed in the model's dtype over torchtitan's label count (fp64 parity needs it); "titan":
    # torchtitan's own CrossEntropyLoss (it upcasts the logits to fp32).
    loss: str = "fp"
    activation_checkpoint: str | None = None  # None, "full" or "selective": torchtitan's AC applied to the model
    num_workers: int = 0  # the dataloader's workers (the collate compiles the plan in them)
    spmd_backend: str = "spmd_types"
    steps: int = 1
    compile_backend: str | None = None  # torchtitan's per-block torch.compile (compile.enable, fullgraph) with it

    def model_config(self) -> Llama3Model.Config:
        dim, heads, kv_heads = 64, 4, 2
        rope = ComplexRoPE.Config(dim=dim // heads, max_seq_len=4096, theta=500000, scaling="llama")
        return Llama3Model.Config(
            dim=dim, vocab_size=VOCAB,
            tok_embeddings=Embedding.Config(num_embeddings=VOCAB, embedding_dim=dim,
                                            param_init={"weight": torch.nn.init.normal_}),
            norm=RMSNorm.Config(normalized_shape=dim, param_init={"weight": torch.nn.init.ones_}),
            lm_head=Linear.Config(in_features=dim, out_features=VOCAB,
                                  param_init={"weight": lambda w: torch.nn.init.normal_(w, std=dim ** -0.5)}),
            layers=_build_llama3_layers(n_layers=2, dim=dim, n_heads=heads, n_kv_heads=kv_heads, hidden_dim=128,
                                        rope=rope, attn_backend="flex"))

    def trainer_config(self, **changes) -> fcp_titan.FcpTrainer.Config:
        spec = ModelSpec(name="llama3", flavor="tiny", model=self.model_config(), parallelize_fn=parallelize_llama,
                         pipelining_fn=None, post_optimizer_build_fn=None, state_dict_adapter=None)
        config = Trainer.Config(
            model_spec=spec, loss=CrossEntropyLoss.Config(), optimizer=default_adamw(lr=1e-3),
            parallelism=ParallelismConfig(context_parallel_degree=self.cp, data_parallel_shard_degree=self.dp,
                                          spmd_backend=self.spmd_backend),
            training=TrainingConfig(local_batch_size=self.local_batch_size, seq_len=self.seq_len, steps=self.steps),
            dataloader=HuggingFaceTextDataLoader.Config(dataset="c4_test", dataset_path=self.data, infinite=False,
                                                        num_workers=self.num_workers))
        if self.compile_backend is not None:
            config.compile = CompileConfig(enable=True, components=["model"], backend=self.compile_backend)
        config = fcp_titan.FcpTrainer.Config.of(config, spmd_backend=self.spmd_backend, block_size=self.block_size,
                                                compile_options={"dtype": self.dtype})
        for name, value in changes.items():
            section, option = name.split(".")
            setattr(config, section, dataclasses.replace(getattr(config, section), **{option: value}))
        return config


def write_documents(folder, count: int = 120, long_at: int = 2, long_length: int = 440, seed: int = 0) -> str:
    """A local long-tail set of documents (lognormal lengths, mostly short) with one long one early, so that the
    first step holds a document longer than a rank's share of it."""
    rng = np.random.default_rng(seed)
    lengths = [int(np.clip(rng.lognormal(np.log(40), 1.0), 2, 300)) for _ in range(count)]
    lengths[long_at] = long_length
    os.makedirs(folder, exist_ok=True)
    with open(os.path.join(folder, "train.jsonl"), "w") as out:
        for length in lengths:
            out.write(json.dumps({"text": "".join(chr(97 + int(c)) for c in rng.integers(0, 26, length))}) + "\n")
    return str(folder)


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    folder = tmp_path_factory.mktemp("titan_data")
    import datasets.config

    os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
    datasets.config.HF_DATASETS_CACHE = str(folder / "cache")  # load_dataset's cache, read at each call
    write_documents(folder / "docs")
    Setup(data=str(folder / "docs")).trainer_config()  # the configs build before any rank forks
    loader(Setup(data=str(folder / "docs")), 0, 1, collate=None)  # datasets caches the set before the ranks fork
    return str(folder / "docs")


def loader(setup: Setup, dp_rank: int, dp_size: int, collate):
    """torchtitan's text dataloader as its Trainer builds it (config.dataloader.build(...)), with FcpTrainer's
    collate installed as FcpTrainer installs it."""
    config = setup.trainer_config()
    built = config.dataloader.build(dp_world_size=dp_size, dp_rank=dp_rank, tokenizer=ByteTokenizer(),
                                    seq_len=setup.seq_len, local_batch_size=setup.local_batch_size)
    if collate is not None:
        built.collate_fn = collate
    return built


def build_model(model_config, seed: int = 0, parallel_dims=None, activation_checkpoint=None, compile_config=None):
    """A torchtitan model as its Trainer builds one: on the meta device, parallelized (Module.parallelize on the
    mesh, as parallelize_llama does under spmd_types), activation checkpointing applied, each block compiled
    (torchtitan's apply_compile, fullgraph) where `compile_config` enables it, then materialized and initialized by
    its own init_weights from `seed`."""
    with torch.device("meta"):
        model = model_config.build()
    if parallel_dims is not None:
        model.parallelize(parallel_dims)
    if activation_checkpoint is not None:
        from torchtitan.distributed.activation_checkpoint import FullAC, SelectiveAC

        config = FullAC.Config() if activation_checkpoint == "full" else SelectiveAC.Config()
        config.build(dump_folder="").apply(model)
    if compile_config is not None and compile_config.enable:
        from torchtitan.distributed.compile import apply_compile

        apply_compile(model, compile_config=compile_config, parallel_dims=parallel_dims)
    model.to_empty(device="cpu")
    torch.manual_seed(seed)
    with torch.no_grad():
        model.init_weights(buffer_device=None)
    model.train()
    return model


class DtypeLoss:
    """torchtitan's loss rule (CrossEntropyLoss: the rows' summed cross-entropy over global_valid_tokens) computed in
    the model's dtype; torchtitan's own upcasts the logits to fp32."""

    def __call__(self, pred, labels, global_valid_tokens=None, **kwargs):
        loss = torch.nn.functional.cross_entropy(pred.flatten(0, 1), labels.flatten(0, 1), reduction="sum",
                                                 ignore_index=IGNORE_INDEX)
        return loss / global_valid_tokens, {}


class RankMeanLoss:
    """A break: each rank divides its summed loss by its own label count instead of the step's."""

    def __call__(self, pred, labels, global_valid_tokens=None, **kwargs):
        loss = torch.nn.functional.cross_entropy(pred.flatten(0, 1), labels.flatten(0, 1), reduction="sum",
                                                 ignore_index=IGNORE_INDEX)
        return loss / (labels != IGNORE_INDEX).sum(), {}


def labels_across_documents(input_dict, labels):
    """A break: labels shifted along the whole row, so each document's last token predicts the next document's
    first (the labels torchtitan's dataset shifts inside each document)."""
    broken = labels.clone()
    broken[:, :-1] = input_dict["input"][:, 1:]
    return input_dict, broken


def positions_off_by_one(input_dict, labels):
    """A break: every row's position one past where it is in its document (RoPE and the plan's check see it)."""
    return {**input_dict, "positions": input_dict["positions"] + 1}, labels


def _name(parameter: str) -> str:
    """A parameter's name without activation checkpointing's wrapper in it."""
    return parameter.replace("_checkpoint_wrapped_module.", "")


def trainer_step(setup: Setup, rank: int, world: int, loss_fn=None, before_plan=None, after_plan=None) -> dict:
    """One training step on this rank through torchtitan's trainer code under fcp: FcpTrainer's config checks, its
    model config (FcpAttention in every layer, then torchtitan's update_from_config: its sharding, its RoPE length),
    the mesh torchtitan's ParallelDims builds, the model parallelized on it, torchtitan's dataloader with
    FcpTrainer's collate, then Trainer.forward_backward_step -> FcpTrainer.post_dataloading_process ->
    Trainer._forward_backward_body (model, loss, backward). Gradients are summed over every rank (FSDP's reduce-
    scatter with gradient division off, on a GPU). Returns the step's loss (summed over the ranks) and, on rank 0,
    the gradients and the initial weights."""
    torch.set_default_dtype(setup.dtype)
    config = setup.trainer_config()
    fcp_titan.check_config(config, world_size=world)
    model_config = fcp_titan.use_fcp_attention(config.model_spec.model)
    model_config.update_from_config(config=config)
    parallel_dims = ParallelDims.from_config(config.parallelism, world)
    parallel_dims.build_mesh()
    model = build_model(model_config, parallel_dims=parallel_dims, activation_checkpoint=setup.activation_checkpoint,
                        compile_config=config.compile)
    initial = {_name(name): p.detach().numpy().copy() for name, p in model.named_parameters()} if rank == 0 else None

    trainer = object.__new__(fcp_titan.FcpTrainer)  # Trainer.__init__ needs CUDA (the module docstring)
    trainer.config, trainer.parallel_dims, trainer.model_config, trainer.model_parts = config, parallel_dims, \
        model_config, [model]
    trainer.device, trainer.ntokens_seen = torch.device("cpu"), 0
    trainer.loss_fn = loss_fn or (DtypeLoss() if setup.loss == "fp" else config.loss.build(compile_config=None))
    trainer.train_context = dist_utils.get_spmd_context(parallel_dims=parallel_dims)
    trainer.fwd_bwd_fn = trainer._forward_backward_body
    collate = trainer.planning_collate()
    if before_plan is not None or after_plan is not None:
        from torch.utils.data import default_collate

        def collate_fn(samples, plan=collate.plan):
            batch = default_collate(samples)
            batch = before_plan(*batch) if before_plan is not None else batch
            batch = plan(*batch)
            return after_plan(*batch) if after_plan is not None else batch
    else:
        collate_fn = collate
    dp_rank, dp_size = (parallel_dims.get_mesh("batch").get_local_rank(), parallel_dims.dp_shard) \
        if parallel_dims.dp_enabled else (0, 1)
    input_dict, labels = next(iter(loader(setup, dp_rank, dp_size, collate_fn)))

    # Trainer.train_step's label count: the replica's whole batch, summed over the "batch" mesh.
    global_valid_tokens = (labels != IGNORE_INDEX).sum()
    if parallel_dims.dp_enabled:
        global_valid_tokens = dist_utils.dist_sum_tensor(global_valid_tokens, parallel_dims.get_mesh("batch"))
    plan = input_dict[fcp_titan.FCP_PLAN]
    loss = trainer.forward_backward_step(input_dict=input_dict, labels=labels,
                                         global_valid_tokens=global_valid_tokens)
    grads = [p.grad for p in model.parameters()]
    flat = torch.cat([g.flatten() for g in grads])
    dist.all_reduce(flat)
    total = loss.detach().to(torch.float64).clone()
    dist.all_reduce(total)
    # Which ranks hold each document's rows, to show that documents cross ranks.
    seq_ids = plan.sequence_ids if hasattr(plan, "sequence_ids") else None
    holders = [None] * world
    dist.all_gather_object(holders, sorted(set(np.asarray(seq_ids).tolist())) if seq_ids is not None else [])
    result = {"loss": float(total), "rows": int(plan.plan_tokens), "ntokens_seen": trainer.ntokens_seen,
              "lengths": [int(n) for n in plan.seq_lengths], "holders": holders}
    if rank == 0:
        offset, named = 0, {}
        for (name, p), grad in zip(model.named_parameters(), grads):
            named[_name(name)] = flat[offset:offset + grad.numel()].view_as(grad).numpy().copy()
            offset += grad.numel()
        result.update(grads=named, initial=initial)
    return result


@contextlib.contextmanager
def default_dtype(dtype: torch.dtype):
    """torch's default dtype for what the block builds (torchtitan's Trainer builds its model under
    utils.set_default_dtype(training.dtype) likewise), restored after."""
    before = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(before)


def reference_step(setup: Setup) -> dict:
    """The same step in one process without CP: torchtitan's Llama3Model with its ScaledDotProductAttention inner
    attention (causal), the same weights, each data-parallel replica's batch from torchtitan's dataloader, each
    document alone at positions 0.. (torchtitan's block-causal mask reads documents where positions restart at 0),
    its labels torchtitan's, the summed cross-entropy over the step's label count."""
    with default_dtype(setup.dtype):
        return _reference_step(setup)


def _reference_step(setup: Setup) -> dict:
    model_config = setup.model_config()
    for layer in model_config.layers:
        layer.attention.inner_attention = ScaledDotProductAttention.Config()
    model = build_model(model_config)
    batches = [next(iter(loader(setup, dp_rank, setup.dp, None))) for dp_rank in range(setup.dp)]
    count = sum(int((labels != IGNORE_INDEX).sum()) for _, labels in batches)
    total, lengths = 0.0, []
    for input_dict, labels in batches:
        for row in range(labels.shape[0]):
            pieces = fcp_titan.row_documents(input_dict["positions"][row], row)
            lengths += pieces
            for ids, doc_labels in zip(input_dict["input"][row].split(pieces), labels[row].split(pieces)):
                logits = model(ids[None], positions=torch.arange(ids.numel())[None])
                loss = torch.nn.functional.cross_entropy(logits[0], doc_labels, reduction="sum",
                                                         ignore_index=IGNORE_INDEX) / count
                loss.backward()
                total += float(loss.detach())
    return {"loss": total, "lengths": lengths, "count": count,
            "grads": {name: p.grad.numpy().copy() for name, p in model.named_parameters()},
            "initial": {name: p.detach().numpy().copy() for name, p in model.named_parameters()}}


def compare(ranks: list[dict], reference: dict) -> dict:
    """Differences of the step under fcp from the reference: the loss (absolute) and every gradient (the largest
    absolute difference, and that over the largest gradient)."""
    got = ranks[0]
    assert all(r["loss"] == got["loss"] for r in ranks)
    worst_initial = max(float(np.max(np.abs(got["initial"][n] - reference["initial"][n])))
                        for n in reference["initial"])
    assert worst_initial == 0.0, "the two models start from other weights"
    grads = max(float(np.max(np.abs(got["grads"][n] - reference["grads"][n]))) for n in reference["grads"])
    scale = max(float(np.max(np.abs(g))) for g in reference["grads"].values())
    return {"loss": abs(got["loss"] - reference["loss"]), "grads": grads, "grads_relative": grads / scale,
            "loss_value": reference["loss"], "grad_scale": scale}


def _assert_the_step_is_long_tail(ranks: list[dict], reference: dict, setup: Setup) -> None:
    """The step's documents as the must-show asks: long-tail, some crossing ranks, one longer than a rank's share."""
    lengths = ranks[0]["lengths"]
    assert sorted(lengths) == sorted(reference["lengths"])  # the plan holds exactly the documents one process sees
    share = sum(lengths) / setup.cp
    assert max(lengths) > share, (max(lengths), share)
    assert np.median(lengths) < 0.2 * max(lengths)
    crossing = [doc for doc in range(len(lengths)) if sum(doc in held for held in ranks[0]["holders"]) > 1]
    assert len(crossing) >= 2, crossing
    print(f"{len(lengths)} documents, {sum(lengths)} tokens, longest {max(lengths)} (a rank's share {share:.0f}), "
          f"median {np.median(lengths):.0f}, {len(crossing)} held by more than one rank")
    assert sum(r["rows"] for r in ranks) == sum(lengths) * setup.cp // world_of(setup)


def world_of(setup: Setup) -> int:
    return setup.cp * setup.dp


def run_step(setup: Setup, **kwargs) -> list[dict]:
    return run_ranks(world_of(setup), lambda rank, world: trainer_step(setup, rank, world, **kwargs), timeout=600)


# --- the must-show: 4 gloo ranks against one process, fp64 -----------------------------------------------------


def test_a_step_on_4_ranks_equals_torchtitans_model_in_one_process_fp64(data):
    setup = Setup(data=data)
    ranks = run_step(setup)
    reference = reference_step(setup)
    _assert_the_step_is_long_tail(ranks, reference, setup)
    diff = compare(ranks, reference)
    print(f"fp64 CP 4: loss {diff['loss_value']:.12f}, |dloss| {diff['loss']:.2e}, max |dgrad| {diff['grads']:.2e} "
          f"(largest gradient {diff['grad_scale']:.2e})")
    assert diff["loss"] <= FP64["loss"] and diff["grads"] <= FP64["grads"], diff
    # Each rank's step read only its own rows: together they are the step's tokens, once.
    assert sum(r["ntokens_seen"] for r in ranks) == sum(ranks[0]["lengths"])


# --- a parity test fails when it should -----------------------------------------------------------------------------


def _assert_broken(setup: Setup, diff: dict) -> None:
    assert diff["loss"] > 1e4 * FP64["loss"] or diff["grads"] > 1e4 * FP64["grads"], diff


def test_labels_shifted_across_a_document_boundary_break_the_parity(data):
    """Labels shifted along the row (a document's last token predicting the next document's first) train another
    objective; the comparison with one process catches it, by far more than its bound."""
    setup = Setup(data=data)
    diff = compare(run_step(setup, before_plan=labels_across_documents), reference_step(setup))
    print(f"labels across documents: |dloss| {diff['loss']:.2e}, max |dgrad| {diff['grads']:.2e}")
    _assert_broken(setup, diff)


@pytest.mark.long
def test_a_ranks_loss_averaged_over_its_own_labels_breaks_the_parity(data):
    setup = Setup(data=data)
    diff = compare(run_step(setup, loss_fn=RankMeanLoss()), reference_step(setup))
    print(f"rank mean: |dloss| {diff['loss']:.2e}, max |dgrad| {diff['grads']:.2e}")
    _assert_broken(setup, diff)


@pytest.mark.long
def test_positions_off_by_one_are_refused_on_every_rank(data):
    """Positions one past the plan's rows (what RoPE would rotate the rows at) are refused by fcp's attention before
    its first message, on every rank, in one line."""
    setup = Setup(data=data)

    def task(rank, world):
        with pytest.raises(ValueError, match="position") as caught:
            trainer_step(setup, rank, world, after_plan=positions_off_by_one)
        return str(caught.value)

    errors = run_ranks(setup.cp, task, timeout=600)
    assert len(errors) == setup.cp and all("\n" not in error for error in errors), errors


# --- more of torchtitan's step: its own loss, DP x CP, recomputed layers, the plan compiled in a worker -----------


@pytest.mark.long
def test_fp32_through_torchtitans_own_loss_equals_one_process(data):
    """torchtitan's CrossEntropyLoss (fp32 logits) on an fp32 model: the step within fp32's rounding."""
    setup = Setup(data=data, dtype=torch.float32, loss="titan")
    diff = compare(run_step(setup), reference_step(setup))
    print(f"fp32 torchtitan loss: |dloss| {diff['loss']:.2e}, max |dgrad| {diff['grads']:.2e}")
    assert diff["loss"] <= 1e-5 * diff["loss_value"] and diff["grads_relative"] <= 1e-5, diff


@pytest.mark.long
def test_dp_2_by_cp_2_equals_one_process_on_both_replicas_batches(data):
    """ParallelDims with dp_shard 2 and cp 2: each replica loads its own batch (torchtitan's dataloader on the
    "batch" mesh), the label count is summed over the replicas, the gradients over all 4 ranks."""
    setup = Setup(data=data, cp=2, dp=2)
    ranks = run_step(setup)
    diff = compare(ranks, reference_step(setup))
    print(f"DP 2 x CP 2: |dloss| {diff['loss']:.2e}, max |dgrad| {diff['grads']:.2e}")
    assert diff["loss"] <= FP64["loss"] and diff["grads"] <= FP64["grads"], diff
    assert ranks[0]["lengths"] != ranks[2]["lengths"]  # the replicas' batches differ


@pytest.mark.long
@pytest.mark.parametrize("mode", ["full", "selective"])
def test_torchtitans_activation_checkpointing_recomputes_fcp_attention_exactly(data, mode):
    """torchtitan's FullAC and SelectiveAC (its default) on the model: each layer's attention runs again in the
    backward, with the same messages on every rank, and the step is unchanged."""
    setup = Setup(data=data, activation_checkpoint=mode)
    diff = compare(run_step(setup), reference_step(setup))
    print(f"AC {mode}: |dloss| {diff['loss']:.2e}, max |dgrad| {diff['grads']:.2e}")
    assert diff["loss"] <= FP64["loss"] and diff["grads"] <= FP64["grads"], diff


@pytest.mark.long
@pytest.mark.parametrize("backend", ["aot_eager", "inductor"])
def test_torchtitans_per_block_torch_compile_runs_fcp_attention_exactly(data, backend):
    """torchtitan's apply_compile (each TransformerBlock compiled with fullgraph=True: no graph break) over fcp's
    attention, whose custom ops take the step's plan as a handle: the step is unchanged (inductor compiles C++ here,
    some 30 s)."""
    setup = Setup(data=data, compile_backend=backend)
    diff = compare(run_step(setup), reference_step(setup))
    print(f"compile {backend}: |dloss| {diff['loss']:.2e}, max |dgrad| {diff['grads']:.2e}")
    assert diff["loss"] <= FP64["loss"] and diff["grads"] <= FP64["grads"], diff


@pytest.mark.long
def test_the_plan_is_compiled_in_the_dataloaders_worker(data):
    setup = Setup(data=data, num_workers=1)
    diff = compare(run_step(setup), reference_step(setup))
    assert diff["loss"] <= FP64["loss"] and diff["grads"] <= FP64["grads"], diff


# --- refused in one line, before any device or process group -------------------------------------------------------


@pytest.mark.parametrize("change,match", [
    ({"parallelism.context_parallel_degree": 3}, "context_parallel_degree=3 does not divide the world of 4"),
    ({"parallelism.context_parallel_load_balancer": "headtail"}, "context_parallel_load_balancer='headtail'"),
    ({"parallelism.context_parallel_ptrr_mask_key": "causal"}, "context_parallel_ptrr_mask_key='causal'"),
    ({"parallelism.spmd_backend": "full_dtensor"}, "spmd_backend='full_dtensor'"),
    ({"parallelism.tensor_parallel_degree": 2}, "tensor_parallel_degree=2"),
    ({"parallelism.pipeline_parallel_degree": 2}, "pipeline_parallel_degree=2"),
    ({"training.disable_cuda_graphs": False}, "disable_cuda_graphs=False"),
    ({"validator.enable": True}, "validator.enable=True"),
])
def test_an_option_that_cannot_hold_is_refused_in_one_line(data, monkeypatch, change, match):
    monkeypatch.setenv("WORLD_SIZE", "4")
    config = Setup(data=data).trainer_config(**change)
    with pytest.raises(ValueError, match=match.replace("(", r"\(")) as caught:
        fcp_titan.FcpTrainer(config)
    assert "\n" not in str(caught.value)


def test_a_chunked_loss_and_a_lone_cp_rank_are_refused(data, monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "4")
    config = Setup(data=data).trainer_config()
    config.loss = ChunkedLossWrapper.Config(num_chunks=8)
    with pytest.raises(ValueError, match="loss.num_chunks=8"):
        fcp_titan.FcpTrainer(config)
    with pytest.raises(ValueError, match="context_parallel_degree=1 in a world of 4"):
        fcp_titan.FcpTrainer(Setup(data=data, cp=1).trainer_config())


def test_a_config_of_torchtitans_turns_off_what_fcp_replaces(data):
    """FcpTrainer.Config.of keeps every field of a torchtitan config and sets the two fcp needs: no CP load
    balancer (torchtitan's default is "headtail") and no CUDA graphs."""
    plain = Setup(data=data).trainer_config()
    assert plain.parallelism.context_parallel_load_balancer is None and plain.training.disable_cuda_graphs
    assert plain.fcp.block_size == 64 and plain.training.seq_len == 512
    assert fcp_titan.FcpTrainer.Config.of(Trainer.Config()).parallelism.spmd_backend == "partial_dtensor"
    assert isinstance(plain, Trainer.Config)
    fcp_titan.check_config(plain, world_size=4)


@pytest.mark.skipif(torch.cuda.is_available(), reason="shows what fails without CUDA")
def test_torchtitans_trainer_itself_needs_cuda(data, monkeypatch):
    """The evidence for what runs on a GPU only: a config fcp takes gets past fcp's checks, and torchtitan's
    Trainer.__init__ then selects a CUDA device (tools/utils.py: `_get_available_device_type() or "cuda"`) and
    fails in `device_module.set_device(self.device)` (trainer.py) on a CPU-only torch."""
    monkeypatch.setenv("WORLD_SIZE", "1")
    monkeypatch.setenv("LOCAL_RANK", "0")
    config = Setup(data=data, cp=1).trainer_config()
    with pytest.raises((AttributeError, RuntimeError, AssertionError)) as caught:
        fcp_titan.FcpTrainer(config)
    frames = [(frame.name, os.path.basename(frame.filename))
              for frame in traceback.extract_tb(caught.value.__traceback__)]
    assert ("__init__", "trainer.py") in frames and any(name == "set_device" for name, _ in frames), frames
    assert isinstance(config.model_spec.model.layers[0].attention.inner_attention, fcp_titan.FcpAttention.Config)


# --- the pieces: the collate, the hook, the attention's refusals ---------------------------------------------------


def _batch(lengths_by_row, seq_len):
    ids, positions = [], []
    for lengths in lengths_by_row:
        assert sum(lengths) == seq_len
        positions.append(torch.cat([torch.arange(n) for n in lengths]))
        ids.append(1000 * len(ids) + torch.arange(seq_len))
    inputs = torch.stack(ids)
    return {"input": inputs, "positions": torch.stack(positions)}, inputs + 1


def test_the_collate_cuts_rows_where_positions_restart_and_keeps_torchtitans_labels(data):
    config = Setup(data=data).model_config()
    collates = [fcp_titan.TitanPlanningCollate.for_model(config, rank, 2, block_size=64) for rank in range(2)]
    input_dict, labels = _batch([[100, 20, 8], [1, 127]], 128)
    planned = [collate.plan(dict(input_dict), labels) for collate in collates]
    for batch, full_labels in planned:
        assert torch.equal(full_labels, labels)  # torchtitan counts the replica's whole batch
        assert list(batch[fcp_titan.FCP_PLAN].seq_lengths) == [100, 20, 8, 1, 127]
        plan = batch[fcp_titan.FCP_PLAN]
        # The hook takes the rank's rows from the batch at the plan's rows (no group is needed before attention).
        inputs, rows_labels, extra = fcp_titan.prepare_fcp_input(batch["input"], full_labels, dict(batch), None)
        assert torch.equal(inputs[0], input_dict["input"].flatten()[plan.token_index])
        assert torch.equal(rows_labels[0], labels.flatten()[plan.token_index])
        assert torch.equal(extra["positions"][0], input_dict["positions"].flatten()[plan.token_index])
        assert torch.equal(extra["positions"][0], plan.position_ids)  # each row's place in its own document
    assert sum(b[fcp_titan.FCP_PLAN].plan_tokens for b, _ in planned) == 256
    with pytest.raises(ValueError, match="row 0: positions must restart at 0"):
        collates[0].plan({"input": input_dict["input"], "positions": input_dict["positions"] + 1}, labels)
    skipping = input_dict["positions"].clone()
    skipping[1, 5] += 1
    with pytest.raises(ValueError, match="row 1: positions must restart at 0 at each document and count up"):
        collates[0].plan({"input": input_dict["input"], "positions": skipping}, labels)


def test_the_hook_gives_this_ranks_rows_and_refuses_a_plan_of_another_batch(data):
    config = Setup(data=data).model_config()
    collate = fcp_titan.TitanPlanningCollate.for_model(config, 0, 1, block_size=64)
    input_dict, labels = _batch([[100, 28]], 128)
    planned, _ = collate.plan(dict(input_dict), labels)
    inputs, rows_labels, extra = fcp_titan.prepare_fcp_input(planned.pop("input"), labels, planned, None)
    assert inputs.shape == rows_labels.shape == extra["positions"].shape == (1, 128)
    assert isinstance(extra["attention_masks"], fcp_titan.FcpMasks) and extra["attention_masks"].group is None
    assert extra["attention_masks"].positions is extra["positions"]
    assert set(extra) == {"positions", "attention_masks"}  # the model's keyword arguments, as torchtitan's
    # Planned on the training thread when the batch comes unplanned, with a planner.
    _, _, again = fcp_titan.prepare_fcp_input(input_dict["input"], labels, {"positions": input_dict["positions"]},
                                              None, planner=collate)
    assert torch.equal(again["positions"], extra["positions"])
    with pytest.raises(ValueError, match="has no fcp plan"):
        fcp_titan.prepare_fcp_input(input_dict["input"], labels, {"positions": input_dict["positions"]}, None)
    other, _ = collate.plan(*_batch([[64, 64], [128]], 128))
    with pytest.raises(ValueError, match="the batch has 128 tokens but its fcp plan was compiled for 256"):
        fcp_titan.prepare_fcp_input(input_dict["input"], labels, dict(other), None)


def test_the_hook_takes_the_batchs_own_rows_so_a_stale_plan_or_changed_labels_are_refused_by_attention(data):
    """The audit's repros: batch B with batch A's planned fields trained A's rows (loss 5.9598, B's 6.1790), and
    labels masked after the collate never reached the loss. The hook now takes every row from the batch it is
    given, at the plan's rows; attention compares their positions and labels with the plan's."""
    config = Setup(data=data).model_config()
    collate = fcp_titan.TitanPlanningCollate.for_model(config, 0, 1, block_size=64, dtype=torch.float32)
    attention = fcp_titan.FcpAttention.Config().build()
    q, kv = torch.randn(1, 128, 4, 16), torch.randn(1, 128, 2, 16)

    def attend(input_dict, labels, plan_of):
        planned, _ = collate.plan(dict(plan_of[0]), plan_of[1])
        fields = {"positions": input_dict["positions"], fcp_titan.FCP_PLAN: planned[fcp_titan.FCP_PLAN]}
        inputs, rows_labels, extra = fcp_titan.prepare_fcp_input(input_dict["input"], labels, fields, None)
        attention(q, kv, kv, attention_masks=extra["attention_masks"])
        return inputs, rows_labels

    this, other = _batch([[100, 28]], 128), _batch([[28, 100]], 128)
    inputs, _ = attend(*this, plan_of=this)
    assert torch.equal(inputs[0], this[0]["input"].flatten()[collate.plan(*this)[0]["fcp_plan"].token_index])
    with pytest.raises(ValueError, match="position_ids or labels are not those of the batch plan"):
        attend(*this, plan_of=other)  # as many tokens, another batch's plan
    masked = this[1].clone()
    masked[0, :10] = IGNORE_INDEX
    with pytest.raises(ValueError, match="position_ids or labels are not those of the batch plan"):
        attend(this[0], masked, plan_of=this)  # labels changed after the plan was made


def test_fcp_attention_refuses_what_it_cannot_replay(data):
    config = Setup(data=data).model_config()
    collate = fcp_titan.TitanPlanningCollate.for_model(config, 0, 1, block_size=64, dtype=torch.float32)
    input_dict, labels = _batch([[100, 28]], 128)
    planned, _ = collate.plan(dict(input_dict), labels)
    _, _, extra = fcp_titan.prepare_fcp_input(planned.pop("input"), labels, planned, None)
    attention = fcp_titan.FcpAttention.Config().build()
    q, kv = torch.randn(1, 128, 4, 16, dtype=torch.float32), torch.randn(1, 128, 2, 16, dtype=torch.float32)
    with pytest.raises(ValueError, match="needs the step's plan as attention_masks"):
        attention(q, kv, kv, attention_masks=None)
    with pytest.raises(ValueError, match="batch size 1; got 2 rows"):
        attention(q.expand(2, -1, -1, -1), kv.expand(2, -1, -1, -1), kv.expand(2, -1, -1, -1),
                  attention_masks=extra["attention_masks"])
    with pytest.raises(ValueError, match="compiled for fp32 attention but the query is torch.float64"):
        attention(q.double(), kv.double(), kv.double(), attention_masks=extra["attention_masks"])
    with pytest.raises(ValueError, match="no score_mod"):
        attention(q, kv, kv, attention_masks=extra["attention_masks"], score_mod=lambda *a: a[0])
    out = attention(q, kv, kv, attention_masks=extra["attention_masks"])  # one rank, no process group
    assert out.shape == q.shape


def test_use_fcp_attention_replaces_every_layers_inner_attention_and_drops_the_kv_all_gather(data):
    setup = Setup(data=data)
    config = setup.trainer_config()
    model_config = fcp_titan.use_fcp_attention(config.model_spec.model)
    model_config.update_from_config(config=config)
    inner = [layer.attention.inner_attention for layer in model_config.layers]
    assert all(isinstance(cfg, fcp_titan.FcpAttention.Config) for cfg in inner)
    assert inner[0].sharding_config is not None  # torchtitan's Llama 3 declares K, V replicated over "cp" here...
    assert inner[0].build()._sharding_config is None  # ...which fcp's attention drops: it moves the blocks itself
    shape = fcp_titan.attention_shape(model_config, "float32")
    assert (shape.q_heads, shape.kv_heads, shape.head_dim, shape.dtype.value) == (4, 2, 16, "fp32")


def test_importing_fcp_runtime_never_imports_torchtitan():
    import subprocess
    import sys

    code = ("import sys, fcp_runtime, fcp_runtime.attention, fcp_runtime.loader; "
            "print(sorted(m for m in sys.modules if m.split('.')[0] == 'torchtitan'))")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.strip() == "[]"


# --- torchtitan's own Trainer: FcpTrainer.__init__ and Trainer.train_step on 4 gloo ranks ----------------------------


def _torchtitan_on_the_cpu() -> None:
    """Two CPU accommodations for torchtitan's Trainer, each a line of torchtitan or torch that needs CUDA or NCCL:
    torchtitan picks its device as `_get_available_device_type() or "cuda"` (tools/utils.py), read at import by
    several modules, so they are pointed at the CPU with a device module that has what the trainer calls
    (set_device, memory statistics); and FSDP reduce-scatters gradients with ReduceOp.PREMUL_SUM (its divide factor,
    1.0 under torchtitan), which gloo refuses ("Cannot use ReduceOp.PREMUL_SUM with Gloo"), so each FSDP module is
    set to a plain SUM (the same sum at factor 1.0) once built."""
    from types import SimpleNamespace

    import torchtitan.components.metrics as metrics
    import torchtitan.distributed.parallel_dims as parallel_dims
    import torchtitan.distributed.utils as distributed_utils
    import torchtitan.tools.utils as tools_utils

    cpu = SimpleNamespace(set_device=lambda device: None, device_count=lambda: 1, current_device=lambda: 0,
                          get_device_name=lambda device=None: "cpu",
                          get_device_properties=lambda device=None: SimpleNamespace(total_memory=2 ** 36, name="cpu"),
                          reset_peak_memory_stats=lambda *args: None, empty_cache=lambda: None,
                          memory_stats=lambda *args: {}, synchronize=lambda *args: None, is_available=lambda: True)
    for module in (tools_utils, distributed_utils, metrics):
        module.device_type, module.device_module = "cpu", cpu
    parallel_dims.device_type = "cpu"


def _full_weights(model) -> dict:
    return {_name(name): (p.full_tensor() if hasattr(p, "full_tensor") else p).detach().numpy().copy()
            for name, p in model.named_parameters()}


def fcp_trainer_run(setup: Setup, rank: int, world: int, dump_folder: str) -> dict:
    """FcpTrainer built from its config as torchtitan's train.py builds a trainer (config.build()), then
    Trainer.train_step `setup.steps` times as Trainer.train runs it (train() itself calls
    torch.distributed.set_timeout after its first step, which torch 2.13 does not have). Returns the losses torchtitan
    logs (its global_avg_loss) and, on rank 0, the initial and final weights."""
    _torchtitan_on_the_cpu()
    os.environ["LOCAL_RANK"] = str(rank)
    from torch.distributed.fsdp import FSDPModule
    from torchtitan.components.metrics import MetricsProcessor
    from torchtitan.config.configs import DebugConfig

    config = setup.trainer_config()
    config.tokenizer, config.dump_folder = ByteTokenizer.Config(), dump_folder
    config.metrics, config.debug = MetricsProcessor.Config(log_freq=1), DebugConfig(seed=0)
    config.training = dataclasses.replace(config.training, mixed_precision_param="float32")
    trainer = config.build()
    assert type(trainer) is fcp_titan.FcpTrainer
    for module in trainer.model_parts[0].modules():
        if isinstance(module, FSDPModule):
            module.set_force_sum_reduction_for_comms(True)
    initial = _full_weights(trainer.model_parts[0])
    logged = []
    log = trainer.metrics_processor.log
    trainer.metrics_processor.log = lambda step, loss, *args, **kwargs: (logged.append(float(loss)),
                                                                        log(step, loss, *args, **kwargs))
    data_iterator = trainer.batch_generator(trainer.dataloader)
    for _ in range(setup.steps):
        trainer.step += 1
        trainer.train_step(data_iterator)
    final = _full_weights(trainer.model_parts[0])
    inner = type(trainer.model_parts[0].layers["0"].attention.inner_attention).__name__
    return {"losses": logged, "inner": inner, **({"initial": initial, "final": final} if rank == 0 else {})}


def reference_training(setup: Setup, initial: dict) -> dict:
    """The same training in one process: torchtitan's model (SDPA, causal, one document at a time) from the same
    initial weights, torchtitan's optimizer and LR schedule built from the same config, its gradient clipping,
    every replica's batch each step."""
    with default_dtype(setup.dtype):
        return _reference_training(setup, initial)


def _reference_training(setup: Setup, initial: dict) -> dict:
    config = setup.trainer_config()
    model_config = setup.model_config()
    for layer in model_config.layers:
        layer.attention.inner_attention = ScaledDotProductAttention.Config()
    model = build_model(model_config)
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_(torch.from_numpy(initial[name]))
    optimizers = config.optimizer.build(model_parts=[model])
    schedulers = config.lr_scheduler.build(optimizers=optimizers, training_steps=setup.steps)
    iterators = [iter(loader(setup, dp_rank, setup.dp, None)) for dp_rank in range(setup.dp)]
    losses = []
    for _ in range(setup.steps):
        optimizers.zero_grad()
        batches = [next(iterator) for iterator in iterators]
        count = sum(int((labels != IGNORE_INDEX).sum()) for _, labels in batches)
        total = 0.0
        for input_dict, labels in batches:
            for row in range(labels.shape[0]):
                pieces = fcp_titan.row_documents(input_dict["positions"][row], row)
                for ids, doc_labels in zip(input_dict["input"][row].split(pieces), labels[row].split(pieces)):
                    logits = model(ids[None], positions=torch.arange(ids.numel())[None])
                    loss = torch.nn.functional.cross_entropy(logits[0].float(), doc_labels, reduction="sum",
                                                             ignore_index=IGNORE_INDEX) / count
                    loss.backward()
                    total += float(loss.detach())
        torch.nn.utils.clip_grad_norm_(list(model.parameters()), config.training.max_norm, foreach=True)
        optimizers.step()
        schedulers.step()
        losses.append(total)
    return {"losses": losses, "final": {name: p.detach().numpy().copy() for name, p in model.named_parameters()}}


@pytest.mark.long
@pytest.mark.parametrize("cp,dp,compiled", [(4, 1, None), (2, 2, None), (4, 1, "aot_eager")],
                         ids=["cp4", "dp2xcp2", "cp4-compiled"])
def test_fcp_trainer_trains_on_4_gloo_ranks_as_one_process(data, tmp_path, cp, dp, compiled):
    """torchtitan's own Trainer under fcp, end to end: FcpTrainer's config through config.build(), torchtitan's mesh,
    model, FSDP over dp_shard x cp (gradient division off), its default selective activation checkpointing, its
    AdamW, LR schedule, gradient clipping and logged loss, 3 steps, in fp32 (torchtitan's training dtypes are bf16
    and fp32; its loss upcasts to fp32). Against one process: the logged losses and the final weights."""
    setup = Setup(data=data, cp=cp, dp=dp, dtype=torch.float32, loss="titan", spmd_backend="partial_dtensor", steps=3,
                  compile_backend=compiled)
    ranks = run_ranks(cp * dp, lambda rank, world: fcp_trainer_run(setup, rank, world, str(tmp_path)), timeout=900)
    assert all(r["inner"] == "FcpAttention" for r in ranks)
    reference = reference_training(setup, ranks[0]["initial"])
    losses = ranks[0]["losses"]
    assert len(losses) == setup.steps and all(r["losses"] == losses for r in ranks)
    worst_loss = max(abs(a - b) / abs(b) for a, b in zip(losses, reference["losses"]))
    worst_weight = max(float(np.max(np.abs(ranks[0]["final"][n] - reference["final"][n]))) for n in reference["final"])
    moved = max(float(np.max(np.abs(ranks[0]["final"][n] - ranks[0]["initial"][n]))) for n in reference["final"])
    print(f"FcpTrainer {cp=} {dp=}: losses {losses} vs {reference['losses']}, relative {worst_loss:.1e}, "
          f"weights {worst_weight:.1e} (moved {moved:.1e})")
    assert worst_loss <= 1e-5 and worst_weight <= 1e-5 and moved > 100 * 1e-5


@pytest.mark.long
def test_the_reference_is_torchtitans_own_packed_document_attention(data):
    """torchtitan's FlexAttention over the packed rows, with the block-causal document mask its Decoder builds from
    the positions, gives the per-document SDPA reference's logits, and so does fcp (one rank, no process group).
    Forward only and in fp32: on the CPU FlexAttention has no backward and no fp64 (its inductor kernel compiles
    here, some 30 s)."""
    setup = Setup(data=data, dtype=torch.float32)
    with default_dtype(torch.float32):
        configs = {name: setup.model_config() for name in ("flex", "sdpa", "fcp")}
        for layer in configs["sdpa"].layers:
            layer.attention.inner_attention = ScaledDotProductAttention.Config()
        fcp_titan.use_fcp_attention(configs["fcp"])
        models = {name: build_model(config) for name, config in configs.items()}
        input_dict, labels = next(iter(loader(setup, 0, 1, None)))
        positions = input_dict["positions"]
        with torch.no_grad():
            flex = models["flex"](input_dict["input"], positions=positions,
                                  attention_masks=models["flex"].get_attention_masks(positions=positions))
            sdpa = torch.empty_like(flex)
            for row in range(flex.shape[0]):
                start = 0
                for length in fcp_titan.row_documents(positions[row], row):
                    ids = input_dict["input"][row, start:start + length]
                    sdpa[row, start:start + length] = models["sdpa"](ids[None], positions=torch.arange(length)[None])[0]
                    start += length
            collate = fcp_titan.TitanPlanningCollate.for_model(configs["fcp"], 0, 1, dtype=torch.float32,
                                                               block_size=setup.block_size)
            planned, _ = collate.plan(dict(input_dict), labels)
            plan = planned[fcp_titan.FCP_PLAN]
            inputs, _, extra = fcp_titan.prepare_fcp_input(planned.pop("input"), labels, planned, None)
            fcp = models["fcp"](inputs, **extra)
    scale = float(flex.abs().max())
    assert float((sdpa - flex).abs().max()) <= 1e-5 * scale
    assert float((fcp[0] - flex.flatten(0, 1)[plan.token_index]).abs().max()) <= 1e-5 * scale

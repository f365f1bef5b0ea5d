"""The Hugging Face backend (fcp_runtime/hf.py): attn_implementation="fcp" trains a random transformers model on 4
gloo ranks exactly as one rank does, and as HF's own attention does one document at a time; DP x CP under DDP;
recomputed layers; the collate's rows, labels and counts; and every refusal."""

from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

import torch.distributed as dist  # noqa: E402

import fcp_runtime.hf as fcp_hf  # noqa: E402
from hf_harness import IGNORE, Setup, documents, state_of, step_loss, train_fcp, train_reference  # noqa: E402
from runtime_harness import run_ranks  # noqa: E402

# fp64: N ranks replay one rank's arithmetic up to summation order; HF's attention, document by document, differs
# only in how the packed and unpacked rows are reduced.
FP64 = {"ranks_loss": 1e-12, "ranks_weights": 1e-10, "reference_loss": 1e-8, "reference_weights": 1e-5}
# fp32: each step's loss is a sum of ~1.5K cross-entropies whose order differs between layouts (relative rounding
# ~1e-7 each, growing as sqrt(n)); AdamW's update is lr * m / (sqrt(v) + eps), so a weight moves at most ~lr a step
# and rounding in m and v moves it by about lr * 1e-6: 5 steps at lr 1e-3 bound the weight difference near 5e-8;
# measured below 1e-6 (loss) and 1e-6 (weights), asserted at 1e-5 and 1e-5.
FP32 = {"ranks_loss": 1e-5, "ranks_weights": 1e-5, "reference_loss": 1e-5, "reference_weights": 1e-5}


def _worst_weight(got: dict, want: dict) -> float:
    return max(float(np.max(np.abs(got[name] - want[name]))) for name in want)


def _worst_loss(got: list[float], want: list[float]) -> float:
    return max(abs(a - b) / abs(b) for a, b in zip(got, want))


def _assert_trains_alike(setup: Setup, bounds: dict) -> None:
    four = run_ranks(4, lambda rank, world: train_fcp(setup), timeout=600)
    one = run_ranks(1, lambda rank, world: train_fcp(setup), timeout=600)[0]
    reference = train_reference(setup)
    assert all(result["losses"] == four[0]["losses"] for result in four)  # every rank reports the step's loss
    assert _worst_loss(four[0]["losses"], one["losses"]) <= bounds["ranks_loss"], (four[0]["losses"], one["losses"])
    assert _worst_weight(four[0]["state"], one["state"]) <= bounds["ranks_weights"]
    assert _worst_loss(four[0]["losses"], reference["losses"]) <= bounds["reference_loss"]
    assert _worst_weight(four[0]["state"], reference["state"]) <= bounds["reference_weights"]
    # Training moved the weights far beyond the bounds: equality is not that of an untrained model.
    assert _worst_weight(four[0]["state"], state_of(setup.model("sdpa")[0])) > 100 * bounds["reference_weights"]


@pytest.mark.parametrize("arch,layout", [("llama", "plan"), pytest.param("llama", "user", marks=pytest.mark.long),
                                         pytest.param("qwen2", "plan", marks=pytest.mark.long), ("qwen2", "user")])
def test_fp64_training_on_4_ranks_equals_one_rank_and_hf_attention(arch, layout):
    _assert_trains_alike(Setup(arch=arch, layout=layout), FP64)


def test_fp32_training_through_hfs_own_loss_equals_one_rank_and_hf_attention():
    _assert_trains_alike(Setup(dtype=torch.float32, hf_loss=True), FP32)


def test_dp_by_cp_under_ddp_equals_one_process_on_the_whole_step():
    setup = Setup()

    def task(rank, world):
        from torch.distributed.device_mesh import init_device_mesh

        mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "cp"))
        data_parallel = (mesh.get_local_rank("dp"), 2, mesh.get_group("dp"))
        return train_fcp(setup, mesh, data_parallel=data_parallel, ddp=True)

    results = run_ranks(4, task, timeout=600)
    reference = train_reference(setup)
    assert _worst_loss(results[0]["losses"], reference["losses"]) <= FP64["reference_loss"]
    for result in results:  # DDP keeps every replica's weights equal, and equal to one process's
        assert _worst_weight(result["state"], reference["state"]) <= FP64["reference_weights"]


def _first_step_gradients(setup: Setup):
    def task(rank, world):
        model, _ = setup.model(fcp_hf.ATTENTION_NAME)
        collate = fcp_hf.HFPlanningCollate.for_model(model.config, None, block_size=setup.block_size,
                                                     dtype=setup.dtype)
        batch = collate(documents(setup, 0))
        step_loss(setup, model, batch, None).backward()
        fcp_hf.sum_gradients(model)
        return {name: p.grad.detach().numpy().copy() for name, p in model.named_parameters()}
    return run_ranks(2, task, timeout=300)[0]


def test_recomputed_layers_give_the_gradients_of_unchecked_ones():
    plain = _first_step_gradients(Setup(dtype=torch.float32))
    recomputed = _first_step_gradients(Setup(dtype=torch.float32, checkpointing=True))
    assert max(float(np.max(np.abs(recomputed[name] - plain[name]))) for name in plain) <= 1e-6
    assert max(float(np.max(np.abs(g))) for g in plain.values()) > 1e-3


# --- the collate ---------------------------------------------------------------------------------------------------


def _collate_both_ranks(docs, **options):
    collates = [fcp_hf.HFPlanningCollate(rank, 2, block_size=64, shape=fcp_hf.attention_shape(_config()),
                                         model="none", **options) for rank in range(2)]
    return [collate(docs) for collate in collates]


def _config():
    import transformers

    return transformers.LlamaConfig(hidden_size=32, num_attention_heads=4, num_key_value_heads=2)


@pytest.mark.parametrize("layout", ["plan", "user"])
def test_the_collate_gives_each_rank_its_rows_with_labels_shifted_inside_each_document(layout):
    starts = (1000, 2000, 3000, 4000)  # a token's document is its id less its position
    docs = [{"input_ids": torch.arange(s, s + n), "labels": torch.arange(s, s + n)}
            for s, n in zip(starts, (170, 5, 1, 90))]
    docs[1]["labels"] = torch.tensor([-100, -100, 7, 8, 9])  # a prompt masked out of the loss
    batches = _collate_both_ranks(docs, layout=layout)
    ids = torch.cat([b["input_ids"][0] for b in batches])
    labels = torch.cat([b["labels"][0] for b in batches])
    positions = torch.cat([b["position_ids"][0] for b in batches])
    assert sorted(ids.tolist()) == sorted(torch.cat([d["input_ids"] for d in docs]).tolist())
    assert all(b["input_ids"].shape[1] > 0 for b in batches)  # every rank gets work
    expected = {}  # (document start id, position) -> the label of the next token of the same document, or none
    for doc in docs:
        doc_labels = doc["labels"].tolist()
        for position in range(len(doc_labels)):
            expected[(int(doc["input_ids"][0]), position)] = doc_labels[position + 1] \
                if position + 1 < len(doc_labels) else IGNORE
    for token, position, label in zip(ids.tolist(), positions.tolist(), labels.tolist()):
        assert expected[(token - position, position)] == label
    want = sum(1 for label in expected.values() if label != IGNORE)
    assert all(int(b["num_items_in_batch"]) == want for b in batches)
    assert all(b["input_ids"].shape == b["position_ids"].shape == b["labels"].shape for b in batches)
    assert set(batches[0]) == {"input_ids", "position_ids", "labels", "shift_labels", "num_items_in_batch",
                               "fcp_plan", "use_cache"}
    assert batches[0]["use_cache"] is False


def test_the_plan_is_compiled_for_the_models_attention_shape():
    import transformers

    config = transformers.Qwen2Config(hidden_size=96, num_attention_heads=6, num_key_value_heads=2, head_dim=24)
    collate = fcp_hf.HFPlanningCollate.for_model(config, None, rank=0, world_size=2, block_size=64,
                                                 dtype=torch.bfloat16)
    plan = collate([torch.arange(150), torch.arange(90)])["fcp_plan"]
    assert (plan.q_heads, plan.kv_heads, plan.head_dim) == (6, 2, 24)
    assert collate.planning.compile_options["shape"].dtype.value == "bf16"
    assert collate.planning.compile_options["kv_prefetch"] is False


def test_alternating_sliding_and_full_layers_train_on_4_ranks_as_in_one_process():
    """A Qwen2 whose layers alternate a 24-token window with full causal attention (layer_types, as gpt-oss): one
    plan of layer kinds a step, each layer's attention picking its kind by its mask; 5 steps on 4 gloo ranks equal one
    process with HF's own attention (its per-layer sliding masks) document by document."""
    setup = Setup(arch="qwen2", sliding_window=24)
    _assert_trains_alike(setup, FP64)
    # The windows are live: the same model with every layer full trains to other weights (9e-3 apart, 900 times
    # the bound above).
    full, windowed = train_reference(Setup(arch="qwen2")), train_reference(setup)
    assert _worst_weight(full["state"], windowed["state"]) > 100 * FP64["reference_weights"]


def test_the_collate_maps_layer_types_to_layer_kinds():
    import transformers

    from fcp_runtime import KindsRankPlan

    config = Setup(arch="qwen2", sliding_window=24, num_layers=6).config("fcp")
    assert fcp_hf.layer_kinds(config) == ({"sliding_attention": "sliding_window:24", "full_attention": "causal"},
                                          {"sliding_attention": 3, "full_attention": 3})
    assert fcp_hf.layer_kinds(Setup(arch="qwen2").config("fcp")) is None
    collate = fcp_hf.HFPlanningCollate.for_model(config, None, rank=1, world_size=2, block_size=64)
    plan = collate([torch.arange(150), torch.arange(90)])["fcp_plan"]
    assert isinstance(plan, KindsRankPlan) and plan.num_layers == {"sliding_attention": 3, "full_attention": 3}
    chunked = transformers.Qwen2Config(layer_types=["full_attention", "chunked_attention"], num_hidden_layers=2)
    with pytest.raises(ValueError, match="layer_types has 'chunked_attention'"):
        fcp_hf.layer_kinds(chunked)


# --- every batch trains: short steps, windows from every config ----------------------------------------------------


@pytest.mark.parametrize("setup", [
    Setup(lengths=(700, 700, 700), block_size=1024, steps=3, num_layers=2),
    Setup(lengths=(100, 100, 100), block_size=4096, steps=3, num_layers=2),
    Setup(arch="mistral", sliding_window=1024, lengths=(1300, 300), block_size=1024, steps=3, num_layers=2)],
    ids=["3x700-at-block-1024", "3x100", "mistral-window-1024-on-1300"])
def test_a_short_step_or_a_mistral_window_trains_on_4_ranks_as_in_one_process(setup):
    """A step of fewer blocks than ranks is compiled at smaller blocks so that no rank is empty (an empty rank would
    crash inside the model); a Mistral config (a sliding_window, no layer_types) gets plans whose documents slide
    over its window on every layer, so a document longer than the window trains instead of being refused."""
    _assert_trains_alike(setup, FP64)


def test_an_evaluation_of_short_batches_on_4_ranks_equals_one_process():
    """Evaluation (model.eval(), no autograd) takes the same collate: the last short batches of an epoch, 3
    documents of 2,000 tokens at block 4,096 and 3 of 100, give the losses of HF's own attention in one process."""
    setup = Setup(num_layers=2)
    steps = [[{"input_ids": torch.arange(n) * (i + 1) % 96} for i, n in enumerate(lengths)]
             for lengths in ((2000, 2000, 2000), (100, 100, 100))]

    def task(rank, world):
        model, _ = setup.model(fcp_hf.ATTENTION_NAME)
        collate = fcp_hf.HFPlanningCollate.for_model(model, block_size=4096)
        model.eval()
        losses = []
        with torch.no_grad():
            for docs in steps:
                loss = step_loss(setup, model, collate(docs), None)
                dist.all_reduce(loss)
                losses.append(float(loss))
        return losses

    model, _ = setup.model("sdpa")
    model.eval()
    reference = []
    with torch.no_grad():  # each document alone: the sum of its next-token cross-entropies, over the step's count
        for docs in steps:
            ids = [doc["input_ids"] for doc in docs]
            total = sum(torch.nn.functional.cross_entropy(model(input_ids=x[None]).logits[0, :-1], x[1:],
                                                          reduction="sum") for x in ids)
            reference.append(float(total) / sum(len(x) - 1 for x in ids))
    for losses in run_ranks(4, task):
        assert _worst_loss(losses, reference) <= FP64["reference_loss"], (losses, reference)


def test_layer_masks_are_read_from_every_config_as_its_model_family_means_them():
    import transformers

    assert fcp_hf.layer_masks(transformers.MistralConfig(num_hidden_layers=2, sliding_window=4096)) == \
        ["sliding_window:4096"] * 2
    assert fcp_hf.layer_masks(transformers.MistralConfig(num_hidden_layers=2, sliding_window=None)) == ["causal"] * 2
    # Qwen2: use_sliding_window and max_window_layers (layers from max_window_layers on slide), or no window at all.
    qwen2 = transformers.Qwen2Config(num_hidden_layers=4, use_sliding_window=True, sliding_window=64,
                                     max_window_layers=2)
    assert fcp_hf.layer_masks(qwen2) == ["causal", "causal", "sliding_window:64", "sliding_window:64"]
    assert fcp_hf.layer_masks(transformers.Qwen2Config(num_hidden_layers=2, sliding_window=64)) == ["causal"] * 2
    gemma3 = transformers.Gemma3TextConfig(num_hidden_layers=6, sliding_window=32)
    assert fcp_hf.layer_masks(gemma3) == ["sliding_window:32"] * 5 + ["causal"]
    assert fcp_hf.model_mask(transformers.MistralConfig(num_hidden_layers=2, sliding_window=96)) == "sliding_window:96"
    assert fcp_hf.layer_kinds(transformers.MistralConfig(num_hidden_layers=2, sliding_window=96)) is None
    collate = fcp_hf.HFPlanningCollate.for_model(transformers.MistralConfig(
        num_hidden_layers=2, sliding_window=96, hidden_size=32, num_attention_heads=4, num_key_value_heads=2),
        rank=0, world_size=1, block_size=64)
    plan = collate([torch.arange(300)])["fcp_plan"]
    assert plan.seq_window.tolist() == [96]


@pytest.mark.parametrize("rope, layer_type, limit", [
    ({"rope_type": "dynamic", "factor": 4.0, "rope_theta": 1e4}, None, 512),
    ({"rope_type": "longrope", "rope_theta": 1e4, "short_factor": [1.0] * 4, "long_factor": [2.0] * 4,
      "original_max_position_embeddings": 128}, None, 128),
    ("gemma3", "full_attention", 256)])
def test_a_document_past_where_its_rope_follows_the_calls_longest_position_is_refused(rope, layer_type, limit):
    """The audit's repro: dynamic NTK and longrope pick their frequencies from max(position_ids) + 1 of each call,
    each rank's own rows under fcp, once a document passes the pretrained length: 2 ranks trained 2.8e-6 and 9.1e-5
    off in the loss. Documents within it keep the config's frequencies on every rank, and run."""
    import transformers

    if rope == "gemma3":  # per layer type: the full-attention layers' RoPE alone is dynamic
        config = transformers.Gemma3TextConfig(num_hidden_layers=2, sliding_window=32, max_position_embeddings=256,
                                               rope_parameters={
                                                   "sliding_attention": {"rope_type": "default", "rope_theta": 1e4},
                                                   "full_attention": {"rope_type": "dynamic", "factor": 2.0,
                                                                      "rope_theta": 1e6}})
    else:
        config = transformers.LlamaConfig(num_hidden_layers=2, hidden_size=32, num_attention_heads=4,
                                          num_key_value_heads=2, max_position_embeddings=512, rope_parameters=rope)
    collate = fcp_hf.HFPlanningCollate.for_model(config, rank=0, world_size=1, block_size=64)
    collate([torch.arange(limit) % 50, torch.arange(40)])  # within the limit: the config's frequencies
    where = f" \\(layer type '{layer_type}'\\)" if layer_type else ""
    with pytest.raises(ValueError, match=f"^document 1 has {limit + 1} tokens, over the {limit} a rope_type='"
                                         f"[a-z]+'{where} keeps its frequencies for"):
        collate([torch.arange(40), torch.arange(limit + 1) % 50])
    static = transformers.LlamaConfig(num_hidden_layers=2, hidden_size=32, num_attention_heads=4,
                                      num_key_value_heads=2, max_position_embeddings=64,
                                      rope_parameters={"rope_type": "linear", "factor": 2.0, "rope_theta": 1e4})
    fcp_hf.HFPlanningCollate.for_model(static, rank=0, world_size=1, block_size=64)([torch.arange(300) % 50])


def test_a_padding_mask_is_refused_on_every_rank_in_one_line():
    """transformers drops a 2-D mask for an attention implementation its mask interface does not know, so a padding
    mask never reached fcp's attention and the loss came out as if it were all ones: fcp registers a mask function
    that refuses it, before any layer runs."""
    setup = Setup(num_layers=2)

    def task(rank, world):
        model, _ = setup.model(fcp_hf.ATTENTION_NAME)
        batch = fcp_hf.HFPlanningCollate.for_model(model, block_size=64)(documents(setup, 0))
        padding = torch.ones_like(batch["input_ids"])
        padding[0, -3:] = 0
        with pytest.raises(ValueError, match=r"not from an attention mask; the model got attention_mask of shape "
                                             r"\(1, \d+\)") as caught:
            model(**batch, attention_mask=padding)
        return str(caught.value)

    errors = run_ranks(4, task)
    assert len(errors) == 4 and all("\n" not in error for error in errors)


def test_hfs_loss_without_the_collates_shifted_labels_or_label_count_is_refused():
    """Without `shift_labels` HF's loss shifts the collate's labels, already shifted inside each document, again
    (every token trained on the one two ahead); without `num_items_in_batch` each rank averages over its own labels.
    Both ran before; fcp's wrapper of HF's causal-LM loss refuses them, and leaves the whole batch's loss as HF's."""
    setup = Setup(num_layers=2, dtype=torch.float32)

    def task(rank, world):
        model, _ = setup.model(fcp_hf.ATTENTION_NAME)
        batch = fcp_hf.HFPlanningCollate.for_model(model, block_size=64)(documents(setup, 0))
        refusals = []
        for missing in ("shift_labels", "num_items_in_batch"):
            with pytest.raises(ValueError, match=f"HF's loss under fcp needs the collate's {missing}") as caught:
                model(**{name: value for name, value in batch.items() if name != missing})
            refusals.append(str(caught.value))
        return refusals, float(model(**batch).loss.detach())

    results = run_ranks(2, task)
    assert all(len(refusals) == 2 and all("\n" not in refusal for refusal in refusals) for refusals, _ in results)
    # The whole batch: HF's own loss over the step's label count, each rank its share (they add up to it).
    reference = Setup(num_layers=2, dtype=torch.float32, hf_loss=True, steps=1)
    assert abs(sum(loss for _, loss in results) - train_reference(reference)["losses"][0]) <= 1e-5 * abs(
        results[0][1] + results[1][1])


def test_the_collate_refuses_a_padded_document_and_a_field_it_would_drop():
    collate = fcp_hf.HFPlanningCollate(0, 1, block_size=64, shape=fcp_hf.attention_shape(_config()), model="none")
    ids = torch.arange(40) % 90
    with pytest.raises(ValueError, match="document 1 has an attention_mask with 5 padded positions"):
        collate([{"input_ids": ids}, {"input_ids": ids, "attention_mask": torch.cat([torch.zeros(5), torch.ones(35)])}])
    with pytest.raises(ValueError, match="document 0 has field 'position_ids', which the collate does not take"):
        collate([{"input_ids": ids, "position_ids": torch.arange(40)}])
    batch = collate([{"input_ids": ids, "attention_mask": torch.ones(40)}])  # an all-ones mask is no padding
    assert batch["input_ids"].shape == (1, 40)


_ONE_PROCESS = """
import sys, torch, torch.distributed as dist
sys.path.insert(0, {tests!r})
from hf_harness import Setup, documents, step_loss, train_reference
import fcp_runtime.hf as fcp_hf
setup = Setup(num_layers=2, steps=2)
model, optimizer = setup.model("fcp")
collate = fcp_hf.HFPlanningCollate.for_model(model, block_size=64, layout={layout!r})
losses = []
for step in range(setup.steps):
    loss = step_loss(setup, model, collate(documents(setup, step)), None)
    loss.backward(); optimizer.step(); optimizer.zero_grad()
    losses.append(float(loss))
assert not dist.is_initialized()
reference = train_reference(setup)["losses"]
print(max(abs(a - b) / b for a, b in zip(losses, reference)))
"""


@pytest.mark.parametrize("layout", ["plan", "user"])
def test_one_process_without_torch_distributed_trains_as_hf_attention(layout):
    """At world 1 no process group is needed: the collate plans for rank 0 of 1 and attention sends nothing."""
    import subprocess
    import sys
    from pathlib import Path

    script = _ONE_PROCESS.format(tests=str(Path(__file__).parent), layout=layout)
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    assert float(done.stdout.strip()) <= FP64["reference_loss"]


# --- refusals ------------------------------------------------------------------------------------------------------


class _Module(torch.nn.Module):
    is_causal = True
    sliding_window = None


def _plan(masks=None, world=1):
    batch = {"documents": [torch.arange(140), torch.arange(90)]}
    docs = [{"input_ids": d, **({"mask": m} if m else {})} for d, m in zip(batch["documents"], masks or [None] * 2)]
    collate = fcp_hf.HFPlanningCollate(0, world, block_size=64, shape=fcp_hf.attention_shape(_config()),
                                       model="none")
    return collate(docs)["fcp_plan"]


@pytest.mark.parametrize("change,message", [
    (dict(softcap=30.0), "softcap"), (dict(s_aux=torch.zeros(4)), "sinks"), (dict(dropout=0.1), "dropout"),
    (dict(attention_mask=torch.ones(1, 1, 64, 64)), "attention mask"), (dict(fcp_plan=None), "fcp_plan"),
    (dict(sliding_window=8), "sliding window 8"), (dict(batch=2), "batch size 2")])
def test_an_attention_feature_the_plan_cannot_replay_is_refused_in_one_line(change, message):
    def task(rank, world):
        plan = _plan()
        kwargs = {"attention_mask": None, "dropout": 0.0, "fcp_plan": plan, **change}
        batch = kwargs.pop("batch", 1)
        query = torch.randn(batch, 4, plan.plan_tokens, 8)
        key = torch.randn(batch, 2, plan.plan_tokens, 8)
        attention_mask, dropout = kwargs.pop("attention_mask"), kwargs.pop("dropout")
        with pytest.raises(ValueError, match=message) as caught:
            fcp_hf.fcp_attention_forward(_Module(), query, key, key.clone(), attention_mask, dropout=dropout,
                                         **kwargs)
        return str(caught.value)

    (error,) = run_ranks(1, task)
    assert "\n" not in error


def test_a_window_layer_runs_on_a_plan_whose_documents_have_that_window():
    window = {"kind": "sliding_window", "window": 8}

    def task(rank, world):
        plan = _plan([window, window])
        module = _Module()
        query, key = torch.randn(1, 4, plan.plan_tokens, 8), torch.randn(1, 2, plan.plan_tokens, 8)
        positions = plan.position_ids[None]  # the collate's, which a collate's plan needs beside it
        out, _ = fcp_hf.fcp_attention_forward(module, query, key, key, None, sliding_window=8, fcp_plan=plan,
                                              position_ids=positions)
        with pytest.raises(ValueError, match="the layer's mask is causal but the plan gives document 0"):
            fcp_hf.fcp_attention_forward(module, query, key, key, None, fcp_plan=plan, position_ids=positions)
        return tuple(out.shape)

    (shape,) = run_ranks(1, task)
    assert shape[0] == 1 and shape[2:] == (4, 8)


def test_a_mesh_without_a_cp_dimension_is_refused():
    def task(rank, world):
        from torch.distributed.device_mesh import init_device_mesh

        with pytest.raises(ValueError, match=r"dimensions \('dp', 'tp'\); fcp needs one named 'cp'"):
            fcp_hf.cp_group(init_device_mesh("cpu", (1, 2), mesh_dim_names=("dp", "tp")))
        return True

    assert run_ranks(2, task) == [True, True]


def test_importing_the_backend_registers_fcp_with_transformers():
    from transformers import AttentionInterface

    assert AttentionInterface._global_mapping[fcp_hf.ATTENTION_NAME] is fcp_hf.fcp_attention_forward


def test_the_attention_output_is_a_view_of_the_runtimes_rows_not_a_copy():
    def task(rank, world):
        plan = _plan()
        query = torch.randn(1, plan.plan_tokens, 4, 8).transpose(1, 2)  # as HF gives it: a view of [1, T, H, D]
        key = torch.randn(1, plan.plan_tokens, 2, 8).transpose(1, 2)
        seen = {}
        real = fcp_hf.fcp_attn_func

        def spy(q, k, v, *args, **kwargs):
            seen["q_shares_storage"] = q.untyped_storage().data_ptr() == query.untyped_storage().data_ptr()
            seen["out"] = real(q, k, v, *args, **kwargs)
            return seen["out"]

        fcp_hf.fcp_attn_func = spy
        try:
            out, _ = fcp_hf.fcp_attention_forward(_Module(), query, key, key, None, fcp_plan=plan,
                                                  position_ids=plan.position_ids[None])
        finally:
            fcp_hf.fcp_attn_func = real
        return seen["q_shares_storage"], out.untyped_storage().data_ptr() == seen["out"].untyped_storage().data_ptr()

    assert run_ranks(1, task) == [(True, True)]


# --- torch.compile -------------------------------------------------------------------------------------------------


@pytest.mark.long
@pytest.mark.parametrize("setup", [Setup(dtype=torch.float32, num_layers=2),
                                   Setup(arch="qwen2", sliding_window=24, dtype=torch.float32, num_layers=2)],
                         ids=["llama", "qwen2-sliding-and-full"])
def test_a_compiled_model_equals_eager_with_no_graph_break_and_no_recompile_over_new_plans(setup):
    """Under torch.compile a model's attention is fcp's custom op: one graph, no break, no recompile as plans change
    each step; a model of two layer kinds (a plan of layer kinds, each layer picking its kind by its mask) too."""
    import torch._dynamo as dynamo

    def task(rank, world):
        group = dist.new_group([0, 1])  # a group of its own, named to the op by its group_name
        model, _ = setup.model(fcp_hf.ATTENTION_NAME)
        eager, _ = setup.model(fcp_hf.ATTENTION_NAME)
        collate = fcp_hf.HFPlanningCollate.for_model(model.config, group, block_size=64, dtype=setup.dtype)
        dynamo.reset()
        dynamo.utils.counters.clear()
        compiled = torch.compile(model, backend="aot_eager", dynamic=True)
        rows = []
        for step in range(3):  # a new batch, so a new plan and new row counts, every step
            batch = collate(documents(setup, step))
            compiled_loss = step_loss(setup, compiled, batch, group)
            compiled_loss.backward()
            eager_loss = step_loss(setup, eager, batch, group)
            eager_loss.backward()
            worst = max(float((p.grad - q.grad).abs().max()) for p, q in zip(model.parameters(), eager.parameters()))
            rows.append((float(compiled_loss.detach()), float(eager_loss.detach()), worst,
                         int(batch["input_ids"].shape[1])))
            model.zero_grad(set_to_none=True)
            eager.zero_grad(set_to_none=True)
        counters = {name: sum(dynamo.utils.counters[name].values()) for name in ("graph_break", "recompiles")}
        counters.update(frames=dynamo.utils.counters["frames"]["total"],
                        graphs=dynamo.utils.counters["stats"]["unique_graphs"])
        explained = dynamo.explain(model)(**{k: v for k, v in batch.items() if "labels" not in k}, fcp_group=group)
        counters.update(explain_graphs=explained.graph_count, explain_breaks=explained.graph_break_count)
        return rows, counters

    for rows, counters in run_ranks(2, task, timeout=600):
        assert len({tokens for *_, tokens in rows}) > 1  # the plans changed the shapes too
        for compiled_loss, eager_loss, worst, _ in rows:
            assert abs(compiled_loss - eager_loss) <= 1e-6 * abs(eager_loss) and worst <= 1e-6
        assert counters == {"graph_break": 0, "recompiles": 0, "frames": 1, "graphs": 1, "explain_graphs": 1,
                            "explain_breaks": 0}, counters

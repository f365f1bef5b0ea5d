"""The Hugging Face Trainer under fcp (fcp_runtime/trainer.py): FcpTrainer on 4 gloo ranks (CP 4, and DP 2 x CP 2)
trains, evaluates, logs, checkpoints and resumes as the plain Trainer does in one process on the same documents
(sdpa, transformers' own padding-free packing); the parity fails when it should; options that cannot hold are refused
in one line; importing fcp_runtime imports no trainer."""

from __future__ import annotations

import dataclasses
import importlib.util
import os
import subprocess
import sys

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from runtime_harness import run_ranks  # noqa: E402
from trainer_harness import (TrainerRun, as_torchrun_rank, fcp_trainer_run, long_tail_documents,  # noqa: E402
                             reference_trainer_run, run_alone, state_of, step_losses, tiny_model, training_args,
                             worst_relative, worst_weight)

from fcp_runtime.trainer import FcpDataCollator, example_documents  # noqa: E402

# Building a transformers Trainer needs accelerate (the `trainer` extra); the collator and the packaging tests do not.
needs_accelerate = pytest.mark.skipif(importlib.util.find_spec("accelerate") is None,
                                      reason="transformers' Trainer needs accelerate (the trainer extra)")

# fp64 weights and loss (fp64_causal_lm_loss): the ranks reduce the same sums in another order, so a step's loss
# moves by a few ulps (measured: 0 to 2e-16 relative) and the weights by 1e-16 to 1e-13 after 4 AdamW steps.
FP64 = {"loss": 1e-10, "weights": 1e-8}
# transformers' own loss upcasts the logits to fp32: a step's loss is an fp32 sum (measured: 7e-8 relative); the
# gradients stay fp64 (weights measured 1e-15).
FP32_LOSS = {"loss": 1e-6, "weights": 1e-8}
# The Trainer adds each micro-step's loss into an fp32 running total before it logs it (Trainer._tr_loss): the logged
# losses agree to fp32 (measured 1.1e-7 relative), and to every digit it prints (4 significant).
LOGGED = 1e-6
RESUMED = 1e-12

_REFERENCES: dict = {}


def _reference(run: TrainerRun, tmp_path) -> dict:
    """The plain Trainer in one process, once per run's settings (a mutation breaks only the fcp side)."""
    key = dataclasses.replace(run, mutation=None, cp=1, num_workers=0, save_steps=None)  # dp x batch a micro-step
    if key not in _REFERENCES:
        _REFERENCES[key] = reference_trainer_run(key, str(tmp_path / "reference"))
    return _REFERENCES[key]


def _assert_steps_have_long_documents(run: TrainerRun) -> None:
    """Every replica's micro-step holds a document longer than a rank's share of it (so it crosses ranks)."""
    train, _ = run.datasets()
    for first in range(0, len(train), run.batch):
        lengths = [len(doc["input_ids"]) for doc in train[first:first + run.batch]]
        assert max(lengths) > sum(lengths) / run.cp, lengths


def _assert_like_one_process(ranks: list[dict], reference: dict, bounds: dict) -> None:
    steps, want = step_losses(ranks, 2), step_losses([reference], 2)
    assert len(steps) == 4
    assert worst_relative(steps, want) <= bounds["loss"], (steps, want)
    assert worst_relative(ranks[0]["eval_losses"], reference["eval_losses"]) <= bounds["loss"]
    assert len(ranks[0]["eval_losses"]) == 2
    assert worst_relative(ranks[0]["losses"], reference["losses"]) <= LOGGED
    assert worst_relative(ranks[0]["grad_norms"], reference["grad_norms"]) <= LOGGED
    assert ranks[0]["printed"] == reference["printed"]  # what the Trainer prints, every digit
    for result in ranks:  # DDP keeps every rank's weights equal, and equal to one process's
        assert worst_weight(result["state"], reference["state"]) <= bounds["weights"]
    # Training moved the weights far beyond the bound: equality is not that of an untrained model.
    assert worst_weight(reference["state"], state_of(tiny_model("sdpa"))) > 1e4 * bounds["weights"]


@needs_accelerate
def test_fcp_trainer_on_4_ranks_equals_the_one_process_trainer(tmp_path):
    """CP 4, gradient accumulation 2, 4 optimizer steps, evaluation at steps 2 and 4, fp64: each step's loss within
    1e-10 of the Trainer in one process, its logged lines equal, the weights within 1e-8."""
    run = TrainerRun()
    _assert_steps_have_long_documents(run)
    ranks = fcp_trainer_run(run, str(tmp_path / "fcp"))
    _assert_like_one_process(ranks, _reference(run, tmp_path), FP64)


@needs_accelerate
@pytest.mark.long
def test_dp2_by_cp2_with_plans_compiled_in_loader_workers_resumes_from_a_checkpoint_exactly(tmp_path):
    """DP 2 x CP 2 (each replica its share of the documents), one DataLoader worker compiling each step's plan,
    a checkpoint every 2 steps: equal to the one-process Trainer, and a run resumed from the step-2 checkpoint ends
    with the weights of the run that was not interrupted."""
    run = TrainerRun(dp=2, cp=2, num_workers=1, save_steps=2)
    _assert_steps_have_long_documents(run)
    output = tmp_path / "fcp"
    ranks = fcp_trainer_run(run, str(output))
    _assert_like_one_process(ranks, _reference(run, tmp_path), FP64)
    assert sorted(os.listdir(output)) == ["checkpoint-2", "checkpoint-4"]
    resumed = fcp_trainer_run(run, str(output), resume_from=str(output / "checkpoint-2"))
    assert len(resumed[0]["micro_losses"]) == 4  # steps 3 and 4 only, 2 micro-steps each
    for result in resumed:
        assert worst_weight(result["state"], ranks[0]["state"]) <= RESUMED
    # It logs steps 3 and 4 and the evaluation at step 4 as the uninterrupted run did (its train_loss averages the
    # steps this run trained, as the Trainer's does).
    later = [line for line in ranks[0]["printed"] if float(line["epoch"]) > 0.5 and "train_loss" not in line]
    assert [line for line in resumed[0]["printed"] if "train_loss" not in line] == later


@needs_accelerate
@pytest.mark.long
@pytest.mark.parametrize("dp,cp", [(1, 4), (2, 2)], ids=["cp4", "dp2xcp2"])
def test_transformers_own_loss_on_4_ranks_equals_the_one_process_trainer(tmp_path, dp, cp):
    """transformers' ForCausalLMLoss (its fp32 upcast): losses within 1e-6, weights within 1e-8."""
    run = TrainerRun(dp=dp, cp=cp, hf_loss=True)
    _assert_like_one_process(fcp_trainer_run(run, str(tmp_path / "fcp")), _reference(run, tmp_path), FP32_LOSS)


@needs_accelerate
@pytest.mark.long
@pytest.mark.parametrize("mutation", ["labels_across_documents", "rank_mean"])
def test_the_parity_fails_when_labels_cross_documents_or_a_rank_averages_its_loss(tmp_path, mutation):
    """Each break moves the losses and the weights 1000 times past the bounds the parity tests assert (measured:
    labels shifted across documents 5.3e-4 and 1.0e-2, a rank's loss averaged over its own labels 3.0 and
    1.2e-2)."""
    run = TrainerRun(mutation=mutation)
    ranks = fcp_trainer_run(run, str(tmp_path / "fcp"))
    reference = _reference(run, tmp_path)
    loss_gap = worst_relative(step_losses(ranks, 2), step_losses([reference], 2))
    weight_gap = worst_weight(ranks[0]["state"], reference["state"])
    assert loss_gap > 1e3 * FP64["loss"] and weight_gap > 1e3 * FP64["weights"], (loss_gap, weight_gap)


@needs_accelerate
def test_positions_off_by_one_across_ranks_are_refused_on_every_rank(tmp_path):
    """Each rank's position ids one on from the rank before's (a document crossing ranks has its pieces' positions
    off by one against each other): the runtime binds a plan to its batch's positions, so every rank refuses the
    step instead of training on it (before binding, the loss moved 3.2e-6 and the weights 1.2e-2)."""
    with pytest.raises(AssertionError) as caught:
        fcp_trainer_run(TrainerRun(mutation="positions_off_by_one"), str(tmp_path / "fcp"))
    refusal = "BatchMismatchError: the model's position_ids or labels are not those of the batch plan"
    assert all(f"rank {rank}: {refusal}" in str(caught.value) for rank in range(4)), str(caught.value)[:2000]


# --- examples into documents ---------------------------------------------------------------------------------------


def test_an_example_is_cut_into_its_documents_by_seq_lengths_or_by_position_ids():
    ids = torch.arange(10, 19)
    whole = example_documents({"input_ids": ids})
    assert [doc["input_ids"].tolist() for doc in whole] == [ids.tolist()]
    by_lengths = example_documents({"input_ids": ids.tolist(), "labels": [-100] * 2 + list(range(7)),
                                    "seq_lengths": [2, 4, 3]})
    assert [doc["input_ids"].tolist() for doc in by_lengths] == [[10, 11], [12, 13, 14, 15], [16, 17, 18]]
    assert [doc["labels"].tolist() for doc in by_lengths] == [[-100, -100], [0, 1, 2, 3], [4, 5, 6]]
    by_positions = example_documents({"input_ids": ids, "position_ids": [0, 1, 0, 1, 2, 3, 0, 1, 2],
                                      "attention_mask": [1] * 9})
    assert [len(doc["input_ids"]) for doc in by_positions] == [2, 4, 3]


@pytest.mark.parametrize("example,message", [
    ({"input_ids": [1, 2, 3, 0], "attention_mask": [1, 1, 1, 0]}, "attention_mask with 1 padded positions"),
    ({"input_ids": [1, 2, 3, 4], "position_ids": [0, 1, 2, 3][::-1]}, "position_ids must restart at 0"),
    ({"input_ids": [1, 2, 3, 4], "position_ids": [0, 1, 3, 4]}, "count up by one"),
    ({"input_ids": [1, 2, 3, 4], "seq_lengths": [2, 3]}, "add up to its 4 tokens"),
    ({"input_ids": [[1, 2, 3]]}, "one non-empty row"),
    ({"text": "no ids"}, "with 'input_ids'")])
def test_an_example_fcp_cannot_cut_into_whole_documents_is_refused_in_one_line(example, message):
    with pytest.raises(ValueError, match=message) as caught:
        example_documents(example, 0)
    assert "\n" not in str(caught.value)


# --- refusals ------------------------------------------------------------------------------------------------------


def _refusals(rank, world, output: str):
    """Each option that cannot hold, on 2 ranks: (the option, the error's first line) for each."""
    from transformers import DataCollatorWithFlattening

    from fcp_runtime.trainer import FcpTrainer

    as_torchrun_rank(rank, world)
    train, evaluation = long_tail_documents(8, seed=1), long_tail_documents(8, seed=2)

    def attempt(name, model=None, args=None, **kwargs):
        model = model if model is not None else tiny_model("fcp")
        try:
            trainer = FcpTrainer(model=model, args=args or training_args(output), train_dataset=train,
                                 eval_dataset=evaluation, **kwargs)
            trainer.get_eval_dataloader()
        except ValueError as error:
            return name, str(error)
        return name, None

    from torch.distributed.device_mesh import init_device_mesh

    no_loss_kwargs = tiny_model("fcp")
    no_loss_kwargs.accepts_loss_kwargs = False
    results = [
        attempt("cp_size", cp_size=3),
        attempt("mesh", mesh=init_device_mesh("cpu", (1, 2), mesh_dim_names=("dp", "tp"))),
        attempt("attn_implementation", model=tiny_model("sdpa")),
        attempt("data_collator", data_collator=DataCollatorWithFlattening()),
        attempt("average_tokens_across_devices", args=training_args(output, average_tokens_across_devices=False)),
        attempt("label_smoothing_factor", args=training_args(output, label_smoothing_factor=0.1)),
        attempt("compute_loss_func", compute_loss_func=lambda outputs, labels, num_items_in_batch=None: 0),
        attempt("compute_metrics", compute_metrics=lambda prediction: {}),
        attempt("dispatch_batches", args=training_args(output, accelerator_config={"dispatch_batches": True})),
        attempt("fsdp", args=training_args(output, fsdp="full_shard")),
        attempt("neftune_noise_alpha", args=training_args(output, neftune_noise_alpha=5.0)),
        attempt("bf16", args=training_args(output, bf16=True)),
        attempt("num_items_in_batch", model=no_loss_kwargs),
        attempt("eval_dataset", args=training_args(output, per_device_eval_batch_size=3)),
        attempt("accepted", args=training_args(output, per_device_eval_batch_size=4)),
    ]
    torch.distributed.barrier()  # no rank leaves (closing rank 0's store) while another still builds its groups
    return results


@needs_accelerate
def test_options_under_which_the_loss_rule_or_the_plan_cannot_hold_are_refused_in_one_line(tmp_path):
    results = run_ranks(2, lambda rank, world: _refusals(rank, world, str(tmp_path)), timeout=300)
    assert results[0] == results[1]
    errors = dict(results[0])
    assert errors.pop("accepted") is None  # 8 evaluation documents are 2 steps of 4
    expected = {"cp_size": "cp_size=3 does not divide the world of 2 ranks",
                "mesh": r"mesh: dimensions \('dp', 'tp'\)",
                "attn_implementation": "attn_implementation is 'sdpa'",
                "data_collator": "data_collator: .*got DataCollatorWithFlattening",
                "average_tokens_across_devices": "average_tokens_across_devices=False",
                "label_smoothing_factor": "label_smoothing_factor=0.1",
                "compute_loss_func": "^compute_loss_func: ",
                "compute_metrics": "^compute_metrics: ",
                "dispatch_batches": "dispatch_batches=True",
                "fsdp": "^fsdp=",
                "neftune_noise_alpha": "^neftune_noise_alpha=5.0: NEFTune scales its noise",
                "bf16": "^bf16=True autocasts a torch.float64 model",
                "num_items_in_batch": "forward takes no num_items_in_batch",
                "eval_dataset": "eval_dataset: 8 examples are not whole evaluation steps of 3"}
    assert set(errors) == set(expected)
    for name, pattern in expected.items():
        assert errors[name] is not None and __import__("re").search(pattern, errors[name]), (name, errors[name])
        assert "\n" not in errors[name]


@needs_accelerate
def test_fcp_trainer_outside_torch_distributed_is_refused(tmp_path):
    def task():
        from fcp_runtime.trainer import FcpTrainer

        try:
            FcpTrainer(model=tiny_model("fcp"), args=training_args(str(tmp_path), ddp_backend=None),
                       train_dataset=long_tail_documents(4, seed=1))
        except ValueError as error:
            return str(error)
    assert "runs each rank under torch.distributed: launch with torchrun" in run_alone(task)


def test_the_collator_leaves_the_label_count_to_the_trainer():
    from fcp_runtime.hf import HFPlanningCollate, attention_shape

    config = tiny_model("fcp").config
    collator = FcpDataCollator(HFPlanningCollate(0, 1, block_size=64, shape=attention_shape(config), model="none"))
    batch = collator([{"input_ids": torch.arange(5, 40), "seq_lengths": [20, 15]}, {"input_ids": torch.arange(7)}])
    assert set(batch) == {"input_ids", "position_ids", "labels", "shift_labels", "fcp_plan", "use_cache"}
    assert sorted(batch["position_ids"][0].tolist()) == sorted(list(range(20)) + list(range(15)) + list(range(7)))
    assert int(batch["shift_labels"].ne(-100).sum()) == 19 + 14 + 6  # each document's last token predicts nothing


# --- packaging -----------------------------------------------------------------------------------------------------


def test_importing_fcp_runtime_and_its_hf_backend_imports_no_trainer():
    trainers = ("trl", "transformers.trainer", "fcp_runtime.trainer", "fcp_runtime.sft")
    code = (f"import sys, fcp_runtime, fcp_runtime.hf; bad = sorted(m for m in sys.modules if m in {trainers!r} "
            f"or m.startswith('trl.')); print(bad); sys.exit(1 if bad else 0)")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stdout + done.stderr

"""TRL's SFTTrainer with packing under fcp (fcp_runtime/sft.py): FcpSFTTrainer(packing=True) on 4 gloo ranks trains
and evaluates as TRL does alone in one process on the same packed documents (its padding-free collator, sdpa); the
parity fails when it should; what TRL does alone when asked for context parallelism with packing; what fcp refuses.
Skipped where trl is not installed (the main venv: the `trl` extra)."""

from __future__ import annotations

import dataclasses

import pytest

pytest.importorskip("trl")  # the trl extra (it brings accelerate and datasets)
torch = pytest.importorskip("torch")
pytest.importorskip("transformers")
pytest.importorskip("accelerate")

from runtime_harness import run_ranks  # noqa: E402
from trainer_harness import (SFTRun, as_torchrun_rank, fcp_sft_run, local_tokenizer, reference_sft_run,  # noqa: E402
                             state_of, step_losses, tiny_model, worst_relative, worst_weight)

# TRL's loss is its fused LM head's: per-token log-probabilities in fp32, summed in fp32, so a step's loss moves with
# the order of that sum (measured 7.4e-8 relative); the head also accumulates its weight's and the hidden states'
# gradients in fp32 ("Always accumulate in fp32"), which moves the LM head's weights after 4 AdamW steps by about
# lr x 4e-6: measured 3.7e-9 at lr 1e-3 (2.0e-8 at lr 3e-3), every other weight below 6e-10.
TRL = {"loss": 1e-6, "weights": 1e-8}
LOGGED = 1e-6

_REFERENCES: dict = {}


def _reference(run: SFTRun, tmp_path) -> dict:
    key = dataclasses.replace(run, mutation=None, cp=1, num_workers=0)
    if key not in _REFERENCES:
        _REFERENCES[key] = reference_sft_run(key, str(tmp_path / "reference"))
    return _REFERENCES[key]


def test_fcp_sft_trainer_with_packing_on_4_ranks_equals_trl_in_one_process(tmp_path):
    """packing=True (bfd: rows of 256 tokens, seq_lengths, position ids restarting in each document), CP 4,
    gradient accumulation 2, 4 optimizer steps, evaluation at steps 2 and 4: TRL's losses within 1e-6, its printed
    lines (loss, grad norm, entropy, token accuracy, token count) equal, the weights within 1e-8."""
    run = SFTRun()
    reference = _reference(run, tmp_path)
    # Packed rows hold a document longer than a rank's share of a step (2 rows of 256 tokens on 4 ranks: 128).
    assert max(max(row) for row in reference["seq_lengths"]) > run.rows * run.max_length / run.cp
    assert any(len(row) > 1 for row in reference["seq_lengths"])
    ranks = fcp_sft_run(run, str(tmp_path / "fcp"))
    steps, want = step_losses(ranks, 2), step_losses([reference], 2)
    assert len(steps) == 4 and worst_relative(steps, want) <= TRL["loss"], (steps, want)
    assert worst_relative(ranks[0]["losses"], reference["losses"]) <= LOGGED
    assert len(ranks[0]["eval_losses"]) == 2
    assert worst_relative(ranks[0]["eval_losses"], reference["eval_losses"]) <= TRL["loss"]
    assert ranks[0]["printed"] == reference["printed"]
    for result in ranks:
        assert worst_weight(result["state"], reference["state"]) <= TRL["weights"]
    untrained = state_of(tiny_model("sdpa", vocab_size=len(local_tokenizer()), hf_loss=True))
    assert worst_weight(reference["state"], untrained) > 1e4 * TRL["weights"]


@pytest.mark.long
def test_fcp_sft_trainer_with_plans_compiled_in_a_loader_worker_on_2_ranks(tmp_path):
    """CP 2, one DataLoader worker compiling each step's plan: the same parity."""
    run = SFTRun(cp=2, num_workers=1)
    reference = _reference(run, tmp_path)
    ranks = fcp_sft_run(run, str(tmp_path / "fcp"))
    assert worst_relative(step_losses(ranks, 2), step_losses([reference], 2)) <= TRL["loss"]
    assert ranks[0]["printed"] == reference["printed"]
    assert worst_weight(ranks[0]["state"], reference["state"]) <= TRL["weights"]


@pytest.mark.long
def test_bf16_weights_under_trls_default_bf16_autocast_train_as_trl_alone_within_bf16_rounding(tmp_path):
    """TRL's default bf16=True over a bf16 model: the plans are compiled for bf16 attention, and 4 steps on 4 ranks
    stay within bf16's rounding of TRL alone (measured: losses 7.7e-6 relative, weights 2.1e-3, a few bf16 ulps
    of weights near 0.07)."""
    run = SFTRun(bf16=True)
    reference = _reference(run, tmp_path)
    ranks = fcp_sft_run(run, str(tmp_path / "fcp"))
    assert worst_relative(step_losses(ranks, 2), step_losses([reference], 2)) <= 1e-4
    assert worst_weight(ranks[0]["state"], reference["state"]) <= 1e-2


@pytest.mark.long
@pytest.mark.parametrize("mutation", ["labels_across_documents", "rank_mean"])
def test_the_trl_parity_fails_when_labels_cross_documents_or_a_rank_averages_its_loss(tmp_path, mutation):
    """Each break moves the losses and the weights 100 times past the parity's bounds."""
    run = SFTRun(mutation=mutation)
    ranks = fcp_sft_run(run, str(tmp_path / "fcp"))
    reference = _reference(run, tmp_path)
    loss_gap = worst_relative(step_losses(ranks, 2), step_losses([reference], 2))
    weight_gap = worst_weight(ranks[0]["state"], reference["state"])
    # Measured: labels shifted across documents 2.6e-4 and 4.0e-3, a rank's loss averaged over its own labels 3.0
    # and 2.1e-3.
    assert loss_gap > 1e2 * TRL["loss"] and weight_gap > 1e2 * TRL["weights"], (loss_gap, weight_gap)


@pytest.mark.long
def test_positions_off_by_one_across_ranks_are_refused_on_every_rank_under_trl(tmp_path):
    """As under the Trainer: the runtime refuses a step whose position ids are not its plan's, on every rank."""
    with pytest.raises(AssertionError) as caught:
        fcp_sft_run(SFTRun(mutation="positions_off_by_one"), str(tmp_path / "fcp"))
    refusal = "BatchMismatchError: the model's position_ids or labels are not those of the batch plan"
    assert all(f"rank {rank}: {refusal}" in str(caught.value) for rank in range(4)), str(caught.value)[:2000]


# --- context parallelism with packing: TRL alone, and what fcp refuses ---------------------------------------------


def _sft_attempt(rank, world, output: str, *, fcp: bool, skip_device_check: bool = False, **config):
    """Build an SFTTrainer (or FcpSFTTrainer) on this rank; the first line of what it raised, or None."""
    import trl
    from accelerate.parallelism_config import ParallelismConfig

    from fcp_runtime.sft import FcpSFTTrainer

    as_torchrun_rank(rank, world)
    if skip_device_check:  # accelerate checks the device before TRL's own check can run (see below)
        ParallelismConfig._validate_accelerator = lambda self, accelerator: None
    if "cp_size" in config:
        config["parallelism_config"] = ParallelismConfig(cp_size=config.pop("cp_size"), cp_backend="torch")
    tokenizer = local_tokenizer()
    run = SFTRun(cp=world, documents=24)
    train, _ = run.datasets()
    model = tiny_model("fcp" if fcp else "sdpa", vocab_size=len(tokenizer), hf_loss=True)
    args = run.config(output, alone=False, **{"eval_strategy": "no", **config})
    try:
        if fcp:
            FcpSFTTrainer(model=model, args=args, train_dataset=train, processing_class=tokenizer)
        else:
            trl.SFTTrainer(model=model, args=args, train_dataset=train, processing_class=tokenizer)
    except ValueError as error:
        return str(error)
    finally:  # no rank leaves (closing rank 0's store) while another still builds its process groups
        torch.distributed.barrier()
    return None


def test_trl_alone_refuses_context_parallelism_with_packing(tmp_path):
    """What TRL does without fcp when asked for CP with packing. On CPU ranks accelerate refuses the context-parallel
    config before TRL is reached; with accelerate's device check skipped (on GPUs under FSDP2 it passes), TRL's own
    check refuses packing with context parallelism, since accelerate's CP drops the packed documents' mask."""
    def task(rank, world):
        return (_sft_attempt(rank, world, str(tmp_path), fcp=False, cp_size=2),
                _sft_attempt(rank, world, str(tmp_path), fcp=False, cp_size=2, skip_device_check=True))

    accelerate_says, trl_says = run_ranks(2, task, timeout=300)[0]
    assert accelerate_says.startswith("ParallelismConfig is only compatible DistributedType.FSDP (version 2) or "
                                      "DistributedType.Multi{Device} or DistributedType.DEEPSPEED, but got "
                                      "DistributedType.MULTI_CPU")
    assert trl_says.startswith("Packing is not compatible with context parallelism (`cp_size > 1`). Packing relies "
                               "on a block-diagonal attention mask to keep packed documents separate, and context "
                               "parallelism drops that mask")


def test_fcp_sft_refuses_what_cannot_hold_in_one_line(tmp_path):
    """Each attempt on 2 fresh ranks (accelerate keeps process-wide state from one trainer to the next)."""
    def attempt(**config):
        return run_ranks(2, lambda rank, world: _sft_attempt(rank, world, str(tmp_path), fcp=True, **config),
                         timeout=300)[0]

    wrapped = attempt(packing_strategy="wrapped")
    assert wrapped.startswith("packing_strategy='wrapped' cuts documents and glues them")
    accelerate_cp = attempt(cp_size=2, skip_device_check=True, packing=False)
    assert accelerate_cp.startswith("parallelism_config.cp_size=2: accelerate's own parallelism")
    assert all("\n" not in error for error in (wrapped, accelerate_cp))
    assert attempt(packing_strategy="bfd_split") is None  # bfd_split keeps every document's boundaries

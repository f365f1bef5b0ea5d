"""A plan is bound to its batch (fcp_runtime/binding.py): a plan from another step whose ranks hold as many rows as
this step's is refused on every rank, before attention sends anything; the check reads nothing back from a device."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from runtime_harness import run_ranks  # noqa: E402

from fcp_runtime.binding import BatchMismatchError, check_positions, expected_positions  # noqa: E402
from fcp_runtime.loader import PlanningCollate  # noqa: E402


def _step(lengths, rank: int, world: int, layout: str = "plan", **options) -> dict:
    return PlanningCollate(rank, world, layout=layout, block_size=64, model="none", **options)(
        [torch.arange(n) for n in lengths])


@pytest.mark.parametrize("layout", ["plan", "user"])
def test_the_expected_positions_are_the_collates(layout):
    for rank in range(4):
        batch = _step([300, 96, 1000, 7], rank, 4, layout)
        assert torch.equal(expected_positions(batch["plan"], layout), batch["position_ids"])


def test_another_steps_plan_with_the_same_rows_per_rank_is_refused_on_every_rank_in_one_line():
    """Documents [96, 96] and one document of 192 tokens give every rank as many rows, so the row count cannot tell
    the plans apart; the positions do."""

    def task(rank, world):
        this, other = _step([192], rank, world), _step([96, 96], rank, world)
        assert this["plan"].plan_tokens == other["plan"].plan_tokens
        check_positions(this["position_ids"], this["plan"], None, "plan")  # its own plan: passes
        with pytest.raises(BatchMismatchError, match="not those of the batch plan") as caught:
            check_positions(this["position_ids"], other["plan"], None, "plan")
        return str(caught.value)

    assert all("\n" not in message for message in run_ranks(2, task))


def _labelled_step(lengths, rank: int, world: int, seed: int) -> dict:
    generator = torch.Generator().manual_seed(seed)
    documents = [{"tokens": torch.randint(100, (n,), generator=generator)} for n in lengths]
    for document in documents:
        document["labels"] = document["tokens"].roll(-1)
    return PlanningCollate(rank, world, block_size=64, model="none")(documents)


def test_a_step_whose_documents_permute_the_lengths_is_told_apart_by_its_labels_on_every_rank():
    """[64, 128, 96] and [128, 64, 96] on 3 ranks at block 64 give every rank the same positions (each block holds
    positions 0-63, 64-127 or 0-31 whichever document it is from), so positions alone pass the other step's plan;
    the labels the collate recorded do not."""

    def task(rank, world):
        this, other = _labelled_step([128, 64, 96], rank, world, 6), _labelled_step([64, 128, 96], rank, world, 5)
        assert torch.equal(this["position_ids"], other["position_ids"])
        check_positions(this["position_ids"], other["plan"], None, "plan")  # the gap the labels close
        check_positions(this["position_ids"].clone(), this["plan"], None, "plan", this["labels"])  # its own
        with pytest.raises(BatchMismatchError, match="position_ids or labels are not those") as caught:
            check_positions(this["position_ids"].clone(), other["plan"], None, "plan", this["labels"])
        return str(caught.value)

    assert all("\n" not in message for message in run_ranks(3, task))


def test_one_ranks_wrong_positions_are_refused_on_every_rank():
    """Only rank 1's rows are wrong; rank 0 refuses too (rather than wait for a peer that stopped)."""

    def task(rank, world):
        batch = _step([300, 90, 500], rank, world)
        positions = batch["position_ids"].clone()
        if rank == 1:
            positions[-1] += 1
        with pytest.raises(BatchMismatchError):
            check_positions(positions, batch["plan"], None, "plan")
        return True

    assert run_ranks(2, task) == [True, True]


def test_a_rank_whose_positions_hold_another_row_count_is_refused_by_name():
    batch = _step([300, 90], 0, 1)
    with pytest.raises(BatchMismatchError, match="hold 389 rows but the plan's plan layout gives this rank 390"):
        check_positions(batch["position_ids"][:-1], batch["plan"], None, "plan")


def test_the_check_runs_once_per_plan_and_position_tensor_and_again_after_an_in_place_write(monkeypatch):
    import fcp_runtime.binding as binding

    batch = _step([300, 90], 0, 1)
    positions = batch["position_ids"].clone()
    check_positions(positions, batch["plan"], None, "plan")
    compares = []
    monkeypatch.setattr(binding, "expected_positions", lambda *args: compares.append(args) or
                        expected_positions(*args))
    check_positions(positions, batch["plan"], None, "plan")  # the same tensor, unchanged: not checked again
    assert compares == []
    with pytest.raises(BatchMismatchError):  # a new tensor is
        check_positions(positions.clone().fill_(0), batch["plan"], None, "plan")
    # A buffer a loop refills in place (another step's positions written into it) is checked again.
    positions.copy_(_step([390], 0, 1)["position_ids"])
    with pytest.raises(BatchMismatchError):
        check_positions(positions, batch["plan"], None, "plan")


def test_new_labels_are_checked_again_with_the_same_positions():
    batch = _labelled_step([300, 90], 0, 1, 3)
    check_positions(batch["position_ids"], batch["plan"], None, "plan", batch["labels"])
    labels = batch["labels"].clone()
    labels[0] += 1
    with pytest.raises(BatchMismatchError):
        check_positions(batch["position_ids"], batch["plan"], None, "plan", labels)


def test_the_check_reads_nothing_back_from_the_device():
    """On the meta device any read of a tensor's value on the host fails: the check (compare, all-reduce, device
    assertion) runs there without one."""
    batch = _step([300, 90], 0, 1)
    check_positions(batch["position_ids"].to("meta"), batch["plan"], None, "plan")


# --- the Hugging Face path: the probe's repros ---------------------------------------------------------------------


@pytest.mark.parametrize("arch", ["llama", "qwen2-sliding"])
def test_a_hf_model_given_another_steps_plan_is_refused_on_every_rank_before_attention_sends(arch):
    """The probe's repro: a plan for documents [96, 96] with the rows of one 192-token document (as many rows on
    every rank) trained 6.5e-4 (Llama) and 1.1e-3 (a Qwen2 of two layer kinds) off in the loss. Now every rank
    refuses in one line; with the step's own plan the same call runs."""
    pytest.importorskip("transformers")
    import fcp_runtime.hf as fcp_hf
    from hf_harness import Setup

    setup = Setup(num_layers=2) if arch == "llama" else Setup(arch="qwen2", sliding_window=24, num_layers=2)

    def task(rank, world):
        model, _ = setup.model(fcp_hf.ATTENTION_NAME)
        collate = fcp_hf.HFPlanningCollate.for_model(model, block_size=64)
        batch, other = collate([torch.arange(192) % 96]), collate([torch.arange(96), torch.arange(96)])
        assert batch["input_ids"].shape == other["input_ids"].shape
        model(**batch)  # its own plan
        with pytest.raises(ValueError, match="not those of the batch plan") as caught:
            model(**{**batch, "fcp_plan": other["fcp_plan"]})
        return str(caught.value)

    errors = run_ranks(2, task)
    assert len(errors) == 2 and all("\n" not in error for error in errors)


def test_a_hf_model_given_the_plan_of_a_step_with_permuted_lengths_is_refused_by_its_shift_labels():
    """The audit's repro: step [128, 64, 96] with the plan of step [64, 128, 96] holds the same positions on all 3
    ranks and trained 1.6e-4 off in the loss; the model passes the batch's `shift_labels` to attention, which
    compares them with the plan's. Every rank refuses."""
    pytest.importorskip("transformers")
    import fcp_runtime.hf as fcp_hf
    from hf_harness import Setup

    setup = Setup(num_layers=1)

    def task(rank, world):
        model, _ = setup.model(fcp_hf.ATTENTION_NAME)
        collate = fcp_hf.HFPlanningCollate.for_model(model, block_size=64)
        generator = torch.Generator().manual_seed(0)
        this, other = ([torch.randint(96, (n,), generator=generator) for n in lengths]
                       for lengths in ([128, 64, 96], [64, 128, 96]))
        batch, other_batch = collate(this), collate(other)
        assert torch.equal(batch["position_ids"], other_batch["position_ids"])
        model(**batch)
        with pytest.raises(ValueError, match="position_ids or labels are not those") as caught:
            model(**{**batch, "fcp_plan": other_batch["fcp_plan"]})
        return str(caught.value)

    errors = run_ranks(3, task)
    assert len(errors) == 3 and all("\n" not in error for error in errors)


def test_a_hf_model_cast_after_its_plan_was_compiled_is_refused_by_dtype():
    pytest.importorskip("transformers")
    import fcp_runtime.hf as fcp_hf
    from hf_harness import Setup

    def task(rank, world):
        model, _ = Setup(num_layers=2, dtype=torch.float32).model(fcp_hf.ATTENTION_NAME)
        batch = fcp_hf.HFPlanningCollate.for_model(model, block_size=64)([torch.arange(150) % 96])
        assert batch["fcp_plan"].dtype == "fp32"
        with pytest.raises(ValueError, match="compiled for fp32 attention but the model's query is torch.float64"):
            model.to(torch.float64)(**batch)
        return fcp_hf.HFPlanningCollate.for_model(model, block_size=64)([torch.arange(150) % 96])["fcp_plan"].dtype

    assert run_ranks(1, task) == ["fp64"]


@pytest.mark.long
def test_a_compiled_hf_model_given_another_steps_plan_is_refused_on_every_rank():
    """Under torch.compile the check runs inside fcp's custom op, at run time: the same refusal."""
    pytest.importorskip("transformers")
    import fcp_runtime.hf as fcp_hf
    from hf_harness import Setup

    setup = Setup(num_layers=2, dtype=torch.float32)

    def task(rank, world):
        model, _ = setup.model(fcp_hf.ATTENTION_NAME)
        collate = fcp_hf.HFPlanningCollate.for_model(model, block_size=64)
        batch, other = collate([torch.arange(192) % 96]), collate([torch.arange(96), torch.arange(96)])
        compiled = torch.compile(model, backend="aot_eager", dynamic=True)
        compiled(**batch)
        with pytest.raises(ValueError, match="not those of the batch plan") as caught:
            compiled(**{**batch, "fcp_plan": other["fcp_plan"]})
        return str(caught.value).strip().splitlines()[-1]

    errors = run_ranks(2, task, timeout=600)
    assert len(errors) == 2 and all("not those of the batch plan" in error for error in errors)


def test_under_autocast_attention_runs_in_the_autocast_dtype_on_a_plan_compiled_for_it():
    """fp32 weights under bfloat16 autocast: RoPE's float32 cos and sin leave Q and K in float32 and V in bfloat16;
    the backend casts all three to the autocast dtype, as sdpa does, and needs a plan compiled for it."""
    pytest.importorskip("transformers")
    import fcp_runtime.hf as fcp_hf
    from hf_harness import Setup

    def task(rank, world):
        model, _ = Setup(num_layers=2, dtype=torch.float32).model(fcp_hf.ATTENTION_NAME)
        docs = [torch.arange(150) % 96, torch.arange(70) % 96]
        with torch.autocast("cpu", dtype=torch.bfloat16):
            with pytest.raises(ValueError, match="compiled for fp32 attention but the model's query is torch.bfloat16"):
                model(**fcp_hf.HFPlanningCollate.for_model(model, block_size=64)(docs))
            batch = fcp_hf.HFPlanningCollate.for_model(model, block_size=64, dtype=torch.bfloat16)(docs)
            loss = model(**batch).loss
        loss.backward()
        return bool(torch.isfinite(loss))

    assert run_ranks(2, task) == [True, True]

import pytest

torch = pytest.importorskip("torch")

from runtime_harness import dispatch_round_trip, run_ranks  # noqa: E402

from fcp_compiler import compile_plan  # noqa: E402
from fcp_runtime.loader import PlanningCollate  # noqa: E402

DOCUMENTS = [torch.arange(n) + 10_000 * i for i, n in enumerate((700, 3000, 90, 1200))]


def _batches(layout):
    batches = []
    for rank in range(4):
        loader = torch.utils.data.DataLoader(DOCUMENTS, batch_size=4, num_workers=1,
                                             collate_fn=PlanningCollate(rank, 4, layout=layout, block_size=512),
                                             multiprocessing_context="fork")
        (batch,) = list(loader)
        assert batch["plan"].rank == rank
        batches.append(batch)
    assert len({b["plan"].digest for b in batches}) == 1  # every rank compiled the same plan
    return batches


def test_collate_in_dataloader_workers_gives_each_rank_its_user_layout_slice():
    batches = _batches("user")
    assert all(b["plan"].user_tokens == b["tokens"].shape[0] for b in batches)
    assert torch.equal(torch.cat([b["tokens"] for b in batches]), torch.cat(DOCUMENTS))
    # Token t of document i is 10000 i + t: the user layout's positions restart at every document too.
    assert all(torch.equal(b["position_ids"], b["tokens"] % 10_000) for b in batches)


@pytest.mark.parametrize("layout", ["plan", "user"])
def test_collate_takes_every_per_token_field_at_the_same_rows_and_compiles_each_documents_mask(layout):
    documents = [{"tokens": doc, "labels": -doc, "mask": mask}
                 for doc, mask in zip(DOCUMENTS, ("causal", {"kind": "sliding_window", "window": 256}, "full", None))]
    batch = PlanningCollate(1, 4, layout=layout, block_size=512)(documents)
    assert torch.equal(batch["labels"], -batch["tokens"])
    assert torch.equal(batch["tokens"], torch.cat(DOCUMENTS)[batch["rows"]])
    # Per sequence: keys a query sees back (0 every key); a document without a mask is causal.
    assert batch["plan"].seq_window.tolist() == [700, 256, 0, 1200]


def test_collate_refuses_documents_whose_fields_disagree():
    with pytest.raises(ValueError,
                       match="document 0's per-token fields differ in length: {'labels': 3, 'tokens': 700}"):
        PlanningCollate(0, 4)([{"tokens": DOCUMENTS[0], "labels": torch.zeros(3)}])
    with pytest.raises(ValueError, match="document 1 has fields"):
        PlanningCollate(0, 4)([{"tokens": DOCUMENTS[0]}, {"labels": DOCUMENTS[1]}])
    with pytest.raises(ValueError, match="document field 'rows' must be a per-token tensor and not one of"):
        PlanningCollate(0, 4)([{"tokens": DOCUMENTS[0], "rows": DOCUMENTS[0]}])  # the output's own key
    # Fields of one name keep one dtype and per-token shape (no silent promotion of token ids to floats), and are
    # named by strings.
    with pytest.raises(ValueError, match="document 1's field 'tokens' is torch.float32; document 0's is torch.int64"):
        PlanningCollate(0, 4)([DOCUMENTS[0], DOCUMENTS[1].float()])
    with pytest.raises(ValueError, match=r"document 1's field 'x' has per-token shape \(3,\); document 0's has \(2,\)"):
        PlanningCollate(0, 4)([{"x": torch.zeros(5, 2)}, {"x": torch.zeros(6, 3)}])
    with pytest.raises(ValueError, match="document 0 has a field named 7; field names must be strings"):
        PlanningCollate(0, 4)([{"tokens": DOCUMENTS[0], 7: DOCUMENTS[0]}])
    with pytest.raises(ValueError, match="document 0's field 'mask' is a tensor; 'mask' is reserved"):
        PlanningCollate(0, 4)([{"tokens": DOCUMENTS[0], "mask": torch.ones(700, dtype=torch.bool)}])


def test_collate_in_plan_layout_gives_each_rank_its_plan_tokens_with_positions_and_no_communication():
    batches = _batches("plan")
    everything = torch.cat(DOCUMENTS)
    for batch in batches:
        assert batch["plan"].layout == "plan" and batch["plan"].plan_tokens == batch["tokens"].shape[0]
        assert torch.equal(batch["tokens"], everything[batch["token_index"]])
        # Token t of document i is 10000 i + t, so its position is its value modulo 10000.
        assert torch.equal(batch["position_ids"], batch["tokens"] % 10_000)
    assert torch.equal(torch.sort(torch.cat([b["token_index"] for b in batches])).values,
                       torch.arange(everything.numel()))


def test_dispatch_and_undispatch_move_any_per_token_tensor_and_their_gradients():
    lengths = [700, 3000, 90, 1200]
    plan_bytes = compile_plan(lengths, 4, block_size=512).to_bytes()
    assert all(run_ranks(4, dispatch_round_trip(plan_bytes, sum(lengths))))


def test_collate_records_the_inputs_digest_and_a_plan_for_other_windows_is_refused():
    import numpy as np

    from fcp_compiler.core.pipeline import plan_digest
    from fcp_compiler.format.plan_format import GLOBAL_ARRAYS, PlanReader, assemble
    from fcp_runtime import load_rank_plan

    lengths = [int(doc.shape[0]) for doc in DOCUMENTS]
    batch = PlanningCollate(0, 4, block_size=512)(DOCUMENTS)
    assert batch["inputs_digest"] == plan_digest(lengths, 4, block_size=512) == batch["plan"].digest
    batch["plan"].check_batch(lengths)  # causal, as compiled
    with pytest.raises(ValueError, match="sequence 1: the batch has 3000 tokens with window 3000; the plan has 3000 "
                                         "with window 100"):
        # A mutant that only narrows one window is a valid plan, but for other attention: check_batch tells.
        reader = PlanReader(compile_plan(lengths, 4, block_size=512).to_bytes())
        fields = reader.header.model_dump(exclude={"global_section", "rank_sections", "global_sha256", "rank_sha256"})
        tables = {name: getattr(reader.tables, name) for name in GLOBAL_ARRAYS}
        tables["seq_window"] = np.array([700, 100, 90, 1200])
        mutant = assemble(fields, tables, [program.arrays for program in reader.ranks()])
        load_rank_plan(mutant, 0, validate=False).check_batch(lengths)  # (validation refuses it too)
    with pytest.raises(ValueError, match="the batch has 3 sequences"):
        batch["plan"].check_batch(lengths[:3])


def test_dispatch_and_undispatch_refuse_a_tensor_of_another_rank_count():
    lengths = [700, 3000, 90, 1200]
    plan_bytes = compile_plan(lengths, 4, block_size=512).to_bytes()

    def task(rank, world):
        from fcp_runtime import dispatch, load_rank_plan, undispatch

        plan = load_rank_plan(plan_bytes, rank)
        refused = 0
        for move, rows in ((dispatch, plan.user_tokens), (undispatch, plan.plan_tokens)):
            for wrong in (sum(lengths), rows + 5, rows - 1):
                with pytest.raises(ValueError, match=f"holds {rows} tokens"):
                    move(torch.zeros(wrong, 3), plan)
                refused += 1
        return refused
    assert run_ranks(4, task) == [6] * 4


# --- short steps: every rank gets tokens, or the step is refused before any model runs ---------------------------


def test_a_step_of_fewer_blocks_than_ranks_is_planned_at_smaller_blocks_so_no_rank_is_empty():
    """3 documents of 2,000 tokens at block 4,096 are 2 blocks for 4 ranks: two ranks would hold no token and crash
    the model's layers. The collate compiles the step again at smaller blocks until every rank holds rows, and every
    rank takes the same steps (one plan)."""
    documents = [torch.arange(2000) + 10_000 * i for i in range(3)]
    assert min(compile_plan([2000] * 3, 4, block_size=4096).ir.transfers.assignment.rank_tokens) == 0
    batches = [PlanningCollate(rank, 4, block_size=4096)(documents) for rank in range(4)]
    assert len({batch["plan"].digest for batch in batches}) == 1
    assert all(batch["tokens"].shape[0] > 0 for batch in batches)
    assert torch.equal(torch.sort(torch.cat([batch["tokens"] for batch in batches])).values,
                       torch.sort(torch.cat(documents)).values)  # every token once


@pytest.mark.parametrize("lengths,message", [
    ((1, 1, 1), "a step of 3 tokens [(]3 documents[)] cannot give each of the 4 ranks a token"),
    ((50, 50, 50), "a step of 150 tokens leaves rank 3 of 4 without a token in the plan layout at block 64; "
                   "collate it with layout='user'")])
def test_a_step_too_short_for_every_rank_to_hold_a_token_is_refused_in_one_line(lengths, message):
    with pytest.raises(ValueError, match=message) as caught:
        PlanningCollate(0, 4, block_size=4096)([torch.arange(n) for n in lengths])
    assert "\n" not in str(caught.value)
    if sum(lengths) >= 4:  # the user layout gives each rank a contiguous share, however short the step
        user = PlanningCollate(3, 4, layout="user", block_size=4096)([torch.arange(n) for n in lengths])
        assert user["tokens"].numel() > 0

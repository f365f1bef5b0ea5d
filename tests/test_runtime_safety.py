"""Ranks holding different plans, or a group of the wrong size, fail fast on every rank with a clear message."""

import pytest

torch = pytest.importorskip("torch")

from runtime_harness import run_ranks  # noqa: E402

from fcp_compiler import compile_plan  # noqa: E402
from fcp_runtime import PlanMismatchError, fcp_attn_func, load_rank_plan  # noqa: E402

LENGTHS = [700, 300, 1000]


def attempt(path_for_rank, rank_for_slice=None):
    def task(rank, world):
        plan = load_rank_plan(str(path_for_rank(rank)), rank if rank_for_slice is None else rank_for_slice(rank))
        total = sum(LENGTHS)
        lo, hi = rank * total // world, (rank + 1) * total // world
        x = torch.randn(hi - lo, 2, 4, dtype=torch.float64)
        try:
            fcp_attn_func(x, x[:, :1].contiguous(), x[:, :1].contiguous(), plan)
        except PlanMismatchError as error:
            return str(error)
        return None
    return task


def test_ranks_with_different_plans_all_fail(tmp_path):
    a, b = tmp_path / "a.fcp", tmp_path / "b.fcp"
    compile_plan(LENGTHS, 4, block_size=256).write(a)
    compile_plan(LENGTHS, 4, block_size=512).write(b)
    messages = run_ranks(4, attempt(lambda rank: b if rank == 2 else a), timeout=60)
    assert all(m and "different plans" in m and "[2]" in m for m in messages)


def test_a_group_of_the_wrong_size_fails(tmp_path):
    path = tmp_path / "p.fcp"
    compile_plan(LENGTHS, 4, block_size=256).write(path)
    messages = run_ranks(2, attempt(lambda rank: path), timeout=60)
    assert all(m and "2 ranks but the plan was compiled for 4" in m for m in messages)


def test_a_rank_holding_another_ranks_slice_fails(tmp_path):
    path = tmp_path / "p.fcp"
    compile_plan(LENGTHS, 2, block_size=256).write(path)
    messages = run_ranks(2, attempt(lambda rank: path, rank_for_slice=lambda rank: 1 - rank), timeout=60)
    assert all(m and "another rank's slice" in m for m in messages)


def _misuse_prefetch(plan_bytes, user_plan_bytes):
    def task(rank, world):
        from fcp_runtime import prefetch_kv

        plan, user_plan = load_rank_plan(plan_bytes, rank), load_rank_plan(user_plan_bytes, rank)
        q, k, v = (torch.randn(plan.plan_tokens, heads, 4, dtype=torch.float64) for heads in (2, 1, 1))
        errors = []
        prefetched = prefetch_kv(k, v, plan)
        for wrong in (lambda: fcp_attn_func(q, k.clone(), v, plan, prefetched=prefetched),  # not what it sent
                      lambda: fcp_attn_func(q, k, v, load_rank_plan(plan_bytes, rank), prefetched=prefetched)):
            with pytest.raises(ValueError) as error:
                wrong()
            errors.append(str(error.value))
        expected = fcp_attn_func(q, k, v, plan)
        torch.testing.assert_close(fcp_attn_func(q, k, v, plan, prefetched=prefetched), expected, rtol=0, atol=0)
        for wrong in (lambda: fcp_attn_func(q, k, v, plan, prefetched=prefetched),  # used already
                      lambda: prefetch_kv(k[1:], v[1:], plan),
                      lambda: prefetch_kv(k, v, user_plan)):
            with pytest.raises(ValueError) as error:
                wrong()
            errors.append(str(error.value))
        late = prefetch_kv(k, v, plan)
        v.mul_(2.0)  # written in place after its rows left: the peers hold the old V
        with pytest.raises(ValueError) as error:
            fcp_attn_func(q, k, v, plan, prefetched=late)
        errors.append(str(error.value))
        torch.testing.assert_close(fcp_attn_func(q, k, v, plan), 2 * expected, rtol=1e-12, atol=1e-12)  # drained
        return errors
    return task


def test_a_prefetch_is_for_one_call_with_the_tensors_it_sent_in_the_plan_layout():
    plan = compile_plan(LENGTHS, 2, block_size=128, coalesce=2)
    user_plan = compile_plan(LENGTHS, 2, block_size=128, coalesce=2, layout="user")
    for errors in run_ranks(2, _misuse_prefetch(plan.to_bytes(), user_plan.to_bytes()), timeout=60):
        assert ["same k and v" in errors[0], "another plan" in errors[1], "used by an earlier" in errors[2],
                "expected k, v [" in errors[3], "compiled for the user layout" in errors[4],
                "written in place after prefetch_kv" in errors[5]] == [True] * 6, errors


def _drop_prefetch(plan_bytes):
    def task(rank, world):
        import gc

        from fcp_runtime import prefetch_kv

        plan = load_rank_plan(plan_bytes, rank)
        q, k, v = (torch.randn(plan.plan_tokens, heads, 4, dtype=torch.float64) for heads in (2, 1, 1))
        reference = fcp_attn_func(q, k, v, load_rank_plan(plan_bytes, rank))
        prefetch_kv(k, v, plan)  # dropped at once, unused
        gc.collect()
        import pickle

        pickle.loads(pickle.dumps(plan))  # a plan holding a dropped prefetch's messages still pickles (without them)
        torch.testing.assert_close(fcp_attn_func(q, k, v, plan), reference, rtol=0, atol=0)
        # Twice dropped, then a prefetch that is used: each call's messages still match the peers'.
        prefetch_kv(k, v, plan)
        prefetch_kv(k, v, plan)
        kept = prefetch_kv(k, v, plan)
        torch.testing.assert_close(fcp_attn_func(q, k, v, plan, prefetched=kept), reference, rtol=0, atol=0)
        return True
    return task


def test_a_dropped_prefetch_is_drained_and_never_hangs():
    plan = compile_plan(LENGTHS, 2, block_size=128, coalesce=2)
    assert run_ranks(2, _drop_prefetch(plan.to_bytes()), timeout=60) == [True, True]


def test_the_record_of_a_checked_plan_lives_on_the_plan_so_every_new_plan_object_is_checked_on_every_rank():
    """check_plan's collective runs once per plan object and group. The record is the plan's own (not kept by the
    plan's id, which a new plan at a freed plan's address would reuse on some ranks only, skipping the collective
    there and hanging the group), and a pickled copy, as a DataLoader worker sends one, carries none of it."""
    import pickle

    import fcp_runtime.checks as checks
    from fcp_runtime.loader import PlanningCollate

    def task(rank, world):
        calls = []
        real = checks.dist.all_gather_object
        checks.dist.all_gather_object = lambda *args, **kwargs: (calls.append(1), real(*args, **kwargs))[1]
        collate = PlanningCollate(rank, world, block_size=64, model="none")
        plan = collate([torch.arange(300), torch.arange(40)])["plan"]
        checks.check_plan(plan)
        checks.check_plan(plan)
        copy = pickle.loads(pickle.dumps(plan))
        checks.check_plan(copy)
        checks.check_plan(collate([torch.arange(300), torch.arange(40)])["plan"])  # the same documents, a new plan
        return len(calls), not hasattr(checks, "_CHECKED")

    assert run_ranks(2, task) == [(3, True), (3, True)]


def _collated(documents_seed_of_rank, world: int):
    """Each rank collates documents of LENGTHS (the same lengths on every rank) drawn from its seed, and runs
    attention over its rows with the collate's position ids; returns the refusal or the output."""
    from fcp_runtime.loader import PlanningCollate

    def task(rank, world):
        generator = torch.Generator().manual_seed(documents_seed_of_rank(rank))
        documents = [torch.randint(100, (length,), generator=generator) for length in LENGTHS]
        batch = PlanningCollate(rank, world, block_size=256)(documents)
        x = torch.randn(batch["tokens"].shape[0], 2, 4, dtype=torch.float64)
        try:
            fcp_attn_func(x, x[:, :1].contiguous(), x[:, :1].contiguous(), batch["plan"],
                          position_ids=batch["position_ids"])
        except PlanMismatchError as error:
            return str(error)
        return None
    return run_ranks(world, task, timeout=60)


def test_ranks_that_collated_different_documents_of_the_same_lengths_all_fail():
    # One plan (it depends on the lengths alone) and matching positions, but rank 1's queries would attend to the
    # others' keys of another batch: the documents' digest tells them apart.
    messages = _collated(lambda rank: 7 if rank == 1 else 3, 2)
    assert all(m and "collated different documents" in m and "ranks [1] documents" in m for m in messages), messages
    assert _collated(lambda rank: 3, 2) == [None, None]  # the same documents run


def test_a_collates_plan_needs_its_position_ids():
    from fcp_runtime.loader import PlanningCollate

    batch = PlanningCollate(0, 1, block_size=256)([torch.arange(length) % 100 for length in LENGTHS])
    x = torch.randn(batch["tokens"].shape[0], 2, 4, dtype=torch.float64)
    k = x[:, :1].contiguous()
    with pytest.raises(ValueError, match="came from a collate with its batch's position_ids"):
        fcp_attn_func(x, k, k, batch["plan"])
    fcp_attn_func(x, k, k, batch["plan"], position_ids=batch["position_ids"])  # bound to its rows: it runs

"""fcp_attn_func under torch.compile (fcp_runtime/compiled.py): the compiled backward finds its plan even when the
step let go of the plan after the forward, and the plan is let go once nothing can run that backward any more."""

import pytest

torch = pytest.importorskip("torch")

from runtime_harness import run_ranks  # noqa: E402

from conftest import compile_valid  # noqa: E402

LENGTHS = [700, 300, 1000, 48]


def dropped_plan_task(plan_bytes: bytes):
    """A rank task: the same attention eager and compiled (aot_eager) on the same inputs; the compiled forward runs,
    every reference to the plan is dropped and collected, then the backward runs. Returns whether the plan was
    still alive after the drop, and whether it was collected after the backward and after a forward left unused."""

    def task(rank, world):
        import gc
        import weakref

        import torch._dynamo as dynamo

        from fcp_runtime import fcp_attn_func, load_rank_plan

        def attend(q, k, v, plan):
            return fcp_attn_func(q, k, v, plan, layout="plan", mask=(True, None))

        dynamo.reset()
        compiled = torch.compile(attend, backend="aot_eager", dynamic=True)
        plan = load_rank_plan(plan_bytes, rank)
        generator = torch.Generator().manual_seed(rank)
        q, d_out = (torch.randn(plan.plan_tokens, 4, 8, generator=generator, dtype=torch.float64) for _ in range(2))
        k, v = (torch.randn(plan.plan_tokens, 2, 8, generator=generator, dtype=torch.float64) for _ in range(2))
        eager = [x.clone().requires_grad_() for x in (q, k, v)]
        attend(*eager, plan).backward(d_out)
        mine = [x.clone().requires_grad_() for x in (q, k, v)]
        out = compiled(*mine, plan)
        alive = weakref.ref(plan)
        del plan
        gc.collect()
        kept = alive() is not None  # the pending backward keeps it
        out.backward(d_out)  # before the fix: "plan handle N names no live plan"
        for got, want in zip(mine, eager):
            torch.testing.assert_close(got.grad, want.grad, rtol=1e-12, atol=1e-12)
        del out
        gc.collect()
        freed_after_backward = alive() is None
        plan = load_rank_plan(plan_bytes, rank)
        unused = compiled(*[x.clone().requires_grad_() for x in (q, k, v)], plan)
        alive = weakref.ref(plan)
        del plan, unused  # a forward whose backward never runs
        gc.collect()
        return kept, freed_after_backward, alive() is None

    return task


def test_a_compiled_backward_finds_the_plan_its_step_dropped_and_then_lets_it_go():
    plan_bytes = compile_valid(LENGTHS, 2, block_size=128, coalesce=2, model="none").to_bytes()
    assert run_ranks(2, dropped_plan_task(plan_bytes), timeout=300) == [(True, True, True)] * 2


def test_a_user_layout_plan_is_refused_under_compile_not_read_as_the_plan_layout():
    # Compiled, attention runs the plan layout only; a plan compiled for the user layout was once taken as if its
    # rows were the plan layout's where the call named no layout.
    from fcp_runtime import load_rank_plan
    from fcp_runtime.compiled import compiled_attention

    plan = load_rank_plan(compile_valid(LENGTHS, 1, block_size=256, layout="user").to_bytes(), 0)
    q = torch.randn(plan.user_tokens, 4, 8, dtype=torch.float64)
    k = torch.randn(plan.user_tokens, 2, 8, dtype=torch.float64)
    with pytest.raises(ValueError, match=r"plan layout \(a plan compiled for it\)"):
        compiled_attention(q, k, k, plan, None, None, None, None, None, None)

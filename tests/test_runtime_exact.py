"""fcp_attn_func on forked gloo ranks equals dense attention over the whole batch, forward and backward."""

import pytest

torch = pytest.importorskip("torch")

from conftest import compile_valid  # noqa: E402
from runtime_harness import reference_attention, run_ranks  # noqa: E402

from fcp_runtime import load_rank_plan, fcp_attn_func  # noqa: E402

CASES = [
    # (name, lengths, gpus, block, coalesce, mask, zigzag, q_heads, kv_heads, dtype[, planner])
    ("mixed-causal-fp64", [700, 90, 1500, 33, 260, 1200, 64], 4, 256, 1, "causal", "auto", 4, 2, torch.float64),
    ("mixed-full-fp64", [700, 90, 1500, 33, 260, 1200, 64], 4, 256, 3, "full", "off", 4, 2, torch.float64),
    ("plain-causal-2-ranks", [1000, 333, 77, 2100], 2, 192, 2, "causal", "off", 2, 1, torch.float64),
    ("full-fp32-2-ranks", [900, 2000, 150], 2, 320, 2, "full", "auto", 4, 1, torch.float32),
    ("zigzag-8-ranks-fp32", [2600, 1300, 100, 650, 40, 900], 8, 128, 4, "causal", "on", 4, 4, torch.float32),
    ("offloaded-full-fp64", [2048, 100, 60], 8, 512, 2, "full", "off", 2, 1, torch.float64),
    ("offloaded-causal-fp64", [3000, 120], 8, 256, 1, "causal", "off", 2, 2, torch.float64),
] + [(f"baseline-{planner}-{mask}", [700, 90, 1500, 33, 260, 1200, 64], 4, 256, 2, mask, "auto", 4, 2,
      torch.float64, planner) for planner in ("ring", "bytescale", "wlbllm", "magi") for mask in ("causal", "full")]


@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_output_and_gradients_equal_dense_reference(case, tmp_path):
    name, lengths, gpus, block, coalesce, mask, zigzag, hq, hkv, dtype, *planner = case
    plan = compile_valid(lengths, gpus, block_size=block, coalesce_degree=coalesce, mask=mask, zigzag=zigzag,
                         planner=planner[0] if planner else "fcp")
    path = tmp_path / "plan.fcp"
    plan.write(path)
    if name.startswith("offloaded"):
        assert plan.stats["num_offloaded_tiles"] > 0
    if name == "mixed-causal-fp64":  # some tiles run while the reshuffle is in flight
        assert any(load_rank_plan(plan.to_bytes(), rank).early_tiles for rank in range(gpus))
    tolerance = dict(rtol=1e-10, atol=1e-10) if dtype == torch.float64 else dict(rtol=1e-5, atol=1e-5)
    head_dim = 8
    total = sum(lengths)

    def task(rank, world):
        generator = torch.Generator().manual_seed(0)
        q = torch.randn(total, hq, head_dim, generator=generator, dtype=dtype)
        k = torch.randn(total, hkv, head_dim, generator=generator, dtype=dtype)
        v = torch.randn(total, hkv, head_dim, generator=generator, dtype=dtype)
        d_out = torch.randn(total, hq, head_dim, generator=generator, dtype=dtype)
        ref_q, ref_k, ref_v = (x.clone().requires_grad_() for x in (q, k, v))
        ref = reference_attention(lengths, ref_q, ref_k, ref_v, mask == "causal", head_dim ** -0.5)
        ref.backward(d_out)
        lo, hi = rank * total // world, (rank + 1) * total // world
        mine = [x[lo:hi].clone().requires_grad_() for x in (q, k, v)]
        out = fcp_attn_func(*mine, load_rank_plan(str(path), rank))
        out.backward(d_out[lo:hi])
        torch.testing.assert_close(out, ref[lo:hi].detach(), **tolerance)
        for got, want in zip(mine, (ref_q, ref_k, ref_v)):
            torch.testing.assert_close(got.grad, want.grad[lo:hi], **tolerance)
        return True

    assert all(run_ranks(gpus, task))

"""The CUDA path: flash-attn (or, without it, the exact kernels on the GPU) + NCCL against an fp32 dense reference,
forward and all three gradients, causal and full, both layouts, on every visible GPU (skipped without CUDA).

Run on a GPU machine with: python -m pytest tests/test_runtime_gpu.py -m gpu -s (prints per-rank time).
"""

import time

import pytest

torch = pytest.importorskip("torch")
pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]


def _reference(lengths, q, k, v, causal):  # pragma: no cover - needs a GPU
    import torch.nn.functional as F

    outs, begin = [], 0
    group = q.shape[1] // k.shape[1]
    for length in lengths:
        qs, ks, vs = (x[begin:begin + length].transpose(0, 1).float() for x in (q, k, v))
        ks, vs = ks.repeat_interleave(group, 0), vs.repeat_interleave(group, 0)
        outs.append(F.scaled_dot_product_attention(qs, ks, vs, is_causal=causal).transpose(0, 1))
        begin += length
    return torch.cat(outs)


def _rank_main(rank, world, port, plans, lengths, results):  # pragma: no cover - needs GPUs
    import torch.distributed as dist

    from fcp_runtime import fcp_attn_func, load_rank_plan, prefetch_kv
    from fcp_runtime.kernels import default_kernels

    torch.cuda.set_device(rank)
    dist.init_process_group("nccl", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    total, hq, hkv, dim = sum(lengths), 16, 2, 128
    generator = torch.Generator(device="cuda").manual_seed(0)
    q, k, v, d_out = (torch.randn(total, h, dim, device="cuda", dtype=torch.bfloat16, generator=generator)
                      for h in (hq, hkv, hkv, hq))
    for (mask, layout), plan_bytes in plans.items():
        plan = load_rank_plan(plan_bytes, rank)
        rows = plan.token_index.cuda() if layout == "plan" else torch.arange(rank * total // world,
                                                                             (rank + 1) * total // world,
                                                                             device="cuda")
        mine = [x[rows].clone().requires_grad_() for x in (q, k, v)]
        torch.cuda.synchronize()
        start = time.perf_counter()
        # The plan layout's runtime posts each pass's first-stage K,V pulls early, as the plans are scheduled for.
        prefetched = prefetch_kv(mine[1], mine[2], plan) if layout == "plan" else None
        out = fcp_attn_func(*mine, plan, prefetched=prefetched)
        if prefetched is not None:
            out = prefetched.backward_starts_at(out)
        out.backward(d_out[rows])
        torch.cuda.synchronize()
        elapsed = time.perf_counter() - start
        leaves = [x.float().clone().requires_grad_() for x in (q, k, v)]
        ref = _reference(lengths, *leaves, mask == "causal")
        ref.backward(d_out.float())
        pairs = [(out, ref[rows])] + [(mine[i].grad, leaves[i].grad[rows]) for i in range(3)]
        # Largest error relative to the largest reference value (bf16 inputs, fp32 reference).
        errors = [((got.float() - want).abs().max() / want.abs().max()).item() for got, want in pairs]
        results[(rank, mask, layout)] = (elapsed, errors, default_kernels(torch.device("cuda")).name)
    dist.destroy_process_group()


def test_cuda_nccl_replay_matches_the_dense_reference_with_gradients():  # pragma: no cover - needs GPUs
    import socket

    import torch.multiprocessing as mp

    from fcp_compiler import compile_plan

    world = torch.cuda.device_count()
    lengths = [32768, 4096, 2000, 700, 9000, 300] * world
    plans = {(mask, layout): compile_plan(lengths, world, mask=mask, layout=layout).to_bytes()
             for mask in ("causal", "full") for layout in ("plan", "user")}
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    manager = mp.Manager()
    results = manager.dict()
    mp.spawn(_rank_main, args=(world, port, plans, lengths, results), nprocs=world)
    for (rank, mask, layout), (elapsed, errors, kernels) in sorted(results.items()):
        print(f"rank {rank} {mask} {layout} ({kernels}): forward+backward {elapsed * 1e3:.1f} ms, max |error| "
              f"out {errors[0]:.3g} dq {errors[1]:.3g} dk {errors[2]:.3g} dv {errors[3]:.3g} (relative)")
        assert max(errors) < 2e-2

"""flash-attn + NCCL against torch's SDPA on every visible GPU (skipped without CUDA and flash-attn).

Run on a GPU machine with: python -m pytest tests/test_runtime_gpu.py -m gpu -s (prints per-rank attention time).
"""

import time

import pytest

torch = pytest.importorskip("torch")
pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]


def _rank_main(rank, world, port, plan_bytes, lengths, results):  # pragma: no cover - needs GPUs
    import torch.distributed as dist
    import torch.nn.functional as F

    from fcp_runtime import fcp_attn_func, load_rank_plan

    torch.cuda.set_device(rank)
    dist.init_process_group("nccl", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    total, hq, hkv, dim = sum(lengths), 16, 2, 128
    generator = torch.Generator(device="cuda").manual_seed(0)
    q, k, v, d_out = (torch.randn(total, h, dim, device="cuda", dtype=torch.bfloat16, generator=generator)
                      for h in (hq, hkv, hkv, hq))
    lo, hi = rank * total // world, (rank + 1) * total // world
    plan = load_rank_plan(plan_bytes, rank)
    mine = [x[lo:hi].clone().requires_grad_() for x in (q, k, v)]
    torch.cuda.synchronize()
    start = time.perf_counter()
    out = fcp_attn_func(*mine, plan)
    out.backward(d_out[lo:hi])
    torch.cuda.synchronize()
    elapsed = time.perf_counter() - start
    refs, begin = [], 0
    for length in lengths:
        qs, ks, vs = (x[begin:begin + length].transpose(0, 1).float() for x in (q, k, v))
        ks, vs = ks.repeat_interleave(hq // hkv, 0), vs.repeat_interleave(hq // hkv, 0)
        refs.append(F.scaled_dot_product_attention(qs, ks, vs, is_causal=True).transpose(0, 1))
        begin += length
    ref = torch.cat(refs)[lo:hi]
    error = (out.float() - ref).abs().max().item()
    results[rank] = (elapsed, error)
    dist.destroy_process_group()


def test_flash_attn_nccl_matches_sdpa():  # pragma: no cover - needs GPUs
    pytest.importorskip("flash_attn")
    import socket

    import torch.multiprocessing as mp

    from fcp_compiler import compile_plan

    world = torch.cuda.device_count()
    lengths = [32768, 4096, 2000, 700, 9000, 300] * world
    plan = compile_plan(lengths, world)
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    manager = mp.Manager()
    results = manager.dict()
    mp.spawn(_rank_main, args=(world, port, plan.to_bytes(), lengths, results), nprocs=world)
    for rank in range(world):
        elapsed, error = results[rank]
        print(f"rank {rank}: fcp attention forward+backward {elapsed * 1e3:.1f} ms, max |out - sdpa| {error:.3g}")
        assert error < 5e-2

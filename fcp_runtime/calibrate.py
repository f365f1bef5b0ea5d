"""Measure flash-attn tile efficiency on this CUDA machine and write a hardware profile the compiler accepts.

Usage: python -m fcp_runtime.calibrate [--base h100] [--q-heads 64] [--kv-heads 8] [--head-dim 128]
       [--tiles 128,256,...,16384] [--repeats 20] -o profile.json

For each tile size L it times flash_attn_func on one L x L unmasked tile (bf16) and records
efficiency = 4 L^2 q_heads head_dim / (time x peak). Everything else is copied from the base profile.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path


def measure(tile: int, q_heads: int, kv_heads: int, head_dim: int, repeats: int) -> float:  # pragma: no cover
    """Seconds per forward call of flash-attn on one tile (median of repeats, after warm-up)."""
    import torch
    from flash_attn import flash_attn_func

    q = torch.randn(1, tile, q_heads, head_dim, device="cuda", dtype=torch.bfloat16)
    k = torch.randn(1, tile, kv_heads, head_dim, device="cuda", dtype=torch.bfloat16)
    v = torch.randn_like(k)
    for _ in range(3):
        flash_attn_func(q, k, v)
    torch.cuda.synchronize()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        flash_attn_func(q, k, v)
        torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
    return sorted(times)[len(times) // 2]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--base", default="h100", help="preset or profile JSON to start from")
    parser.add_argument("--q-heads", type=int, default=64)
    parser.add_argument("--kv-heads", type=int, default=8)
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument("--tiles", default="128,256,512,1024,2048,4096,8192,16384")
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("-o", "--output", type=Path, required=True)
    args = parser.parse_args(argv)
    try:
        import torch
    except ImportError:
        print("fcp calibrate: error: torch is not installed (pip install torch and flash-attn)", file=sys.stderr)
        return 2
    if not torch.cuda.is_available():
        print("fcp calibrate: error: no CUDA device; calibration measures flash-attn on a GPU", file=sys.stderr)
        return 2
    try:  # pragma: no cover - needs a GPU
        import flash_attn  # noqa: F401
    except ImportError:  # pragma: no cover
        print("fcp calibrate: error: flash-attn is not installed (pip install flash-attn)", file=sys.stderr)
        return 2
    from fcp_compiler.errors import FcpError  # pragma: no cover
    from fcp_compiler.format.inputs import HardwareProfile, load_profile
    from fcp_compiler.format.safe_io import write_atomic

    try:  # pragma: no cover
        base = load_profile(args.base)
        tiles = [int(t) for t in args.tiles.split(",")]
    except (FcpError, ValueError) as error:  # pragma: no cover
        print(f"fcp calibrate: error: {error}", file=sys.stderr)
        return 2
    points = []  # pragma: no cover
    for tile in tiles:  # pragma: no cover
        seconds = measure(tile, args.q_heads, args.kv_heads, args.head_dim, args.repeats)
        efficiency = 4.0 * tile * tile * args.q_heads * args.head_dim / (seconds * base.peak_tflops * 1e12)
        points.append({"tokens": tile, "efficiency": round(min(max(efficiency, 1e-4), 1.0), 4)})
        print(f"tile {tile:>6}: {seconds * 1e3:8.3f} ms  {efficiency:6.1%} of {base.peak_tflops:.0f} TFLOP/s")
    profile = HardwareProfile(**{**base.model_dump(), "name": f"{base.name}-calibrated",  # pragma: no cover
                                 "efficiency_curve": points,
                                 "source": f"fcp_runtime.calibrate on {torch.cuda.get_device_name()}: flash-attn "
                                           f"forward, {args.q_heads} q heads, {args.kv_heads} kv heads, head_dim "
                                           f"{args.head_dim}, bf16; other figures from {base.name}"})
    write_atomic(args.output, (json.dumps(profile.model_dump(mode="json"), indent=2) + "\n").encode())
    print(f"wrote {args.output}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Recompile the golden plans (run after an intended change to a pass): python tests/golden/refresh.py"""

from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
GOLDEN = Path(__file__).resolve().parent
# name -> (trace, gpus, compile options)
CASES = {
    "small_8gpu": ("small_8gpu.json", 8, {}),
    "short_only_16gpu": ("short_only_64gpu.json", 16, {"block_size": 2048}),
    "paper_64gpu_magi": ("paper_lognormal_64gpu.json", 64, {"planner": "magi"}),
}


def compile_case(name: str) -> bytes:
    from fcp_compiler import compile_plan
    from fcp_compiler.format.inputs import load_batch

    trace, gpus, options = CASES[name]
    return compile_plan(load_batch(ROOT / "traces" / trace), gpus, **options).to_bytes()


def main() -> None:
    for name in CASES:
        path = GOLDEN / f"{name}.fcp"
        path.write_bytes(compile_case(name))
        print(f"wrote {path} ({path.stat().st_size} bytes)")


if __name__ == "__main__":
    main()

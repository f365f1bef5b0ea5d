"""Sliding windows and per-sequence masks replay exactly: fcp_attn_func on forked gloo ranks equals dense windowed
attention, forward and backward, fp64 at 1e-10, in both layouts, with the exact kernels and with flash-attn's call
sites on the contract stand-in (window_size at every call)."""

import pytest

torch = pytest.importorskip("torch")

from conftest import cases_by_layout, compile_valid  # noqa: E402
from runtime_harness import compare_with_reference, run_ranks  # noqa: E402

from flash_attn_standin import _flash_attn_varlen_backward, flash_attn_varlen_func  # noqa: E402
from fcp_compiler.format.inputs import BatchSpec  # noqa: E402
from fcp_runtime.kernels import FlashAttnKernels  # noqa: E402

LENGTHS = [1500, 700, 90, 2600, 33, 260, 64]
# Windows of 1 (a token sees itself), shorter than a block, across a few blocks, and a mixed batch with full and
# causal sequences beside windowed ones.
MIXED = [{"kind": "sliding_window", "window": 300}, "full", "causal", {"kind": "sliding_window", "window": 1000},
         {"kind": "sliding_window", "window": 1}, "full", {"kind": "sliding_window", "window": 50}]
CASES = [  # (name, masks, gpus, block, coalesce)
    ("window-200-2-ranks", [{"kind": "sliding_window", "window": 200}] * len(LENGTHS), 2, 256, 2),
    ("window-1000-4-ranks", [{"kind": "sliding_window", "window": 1000}] * len(LENGTHS), 4, 128, 1),
    ("mixed-4-ranks", MIXED, 4, 256, 2),
    ("mixed-8-ranks", MIXED, 8, 128, 2),
]


def _plan(masks, gpus, block, coalesce, layout):
    batch = BatchSpec.model_validate({"masks": masks, "sequences": LENGTHS})
    return compile_valid(batch, gpus, block_size=block, coalesce=coalesce, layout=layout), batch.windows()


@pytest.mark.parametrize("case, layout", cases_by_layout(CASES, long={"window-200-2-ranks-user",
                                                                     "mixed-4-ranks-user", "window-1000-4-ranks-user"}))
def test_windowed_and_mixed_batches_equal_dense_reference(case, layout):
    _, masks, gpus, block, coalesce = case
    plan, windows = _plan(masks, gpus, block, coalesce, layout)
    assert any(0 < w < length for w, length in zip(windows, LENGTHS))
    run_ranks(gpus, compare_with_reference(plan.to_bytes(), LENGTHS, windows, 4, 2, torch.float64, layout))


class _WindowFlash(FlashAttnKernels):
    """flash-attn's call sites on the stand-in, recording the window_size of every call."""

    def __init__(self):
        super().__init__(flash_attn_varlen_func, _flash_attn_varlen_backward)
        self.windows: list = []
        self.num_calls = 0

    def forward(self, *args):
        self.num_calls += 1
        self.windows.append(args[-1])
        return super().forward(*args)

    def backward(self, *args):
        self.num_calls += 1
        return super().backward(*args)


@pytest.mark.parametrize("layout", ["plan", pytest.param("user", marks=pytest.mark.long)])
def test_flash_attn_call_sites_pass_the_window_and_are_exact(layout):
    kernels = _WindowFlash()
    plan, windows = _plan(MIXED, 4, 256, 2, layout)

    def task(rank, world):
        result = compare_with_reference(plan.to_bytes(), LENGTHS, windows, 4, 2, torch.float64, layout,
                                        kernels=kernels)(rank, world)
        return result, kernels.windows

    results = run_ranks(4, task)
    used = {tuple(window) for _, windows_used in results for window in windows_used}
    # The 1000-token window of a 2600-token sequence cuts key segments and (block 256 < 1000 < ...) diagonals
    # stay within it; the 50 and 1-token windows are shorter than a diagonal block: causal with (w - 1, 0).
    assert (-1, -1) in used and (0, 0) in used and (49, 0) in used
    assert any(left >= 0 and right == -1 for left, right in used)

"""The range contract (fcp_runtime/kernels.py): ranges over one query and one key tensor, overlapping in queries and
in keys, merged into accumulators in the forward and summed into dq, dk, dv in the backward; checked against dense
attention in fp64, and the FFA adapter against a stand-in with FFA's arguments."""

import math

import pytest

torch = pytest.importorskip("torch")

from fcp_runtime.kernels import ExactRangeKernels, FlexFlashAttnKernels, default_kernels  # noqa: E402

SCALE = 0.3


def _visible(lq: int, lk: int, left: int, right: int) -> torch.Tensor:
    """flash-attn's bottom-right aligned window over one (query rows, key rows) pair."""
    shift = torch.arange(lk)[None, :] - torch.arange(lq)[:, None] - (lk - lq)
    ok = torch.ones(lq, lk, dtype=torch.bool)
    if right >= 0:
        ok &= shift <= right
    if left >= 0:
        ok &= shift >= -left
    return ok


def _multiplicity(num_q: int, num_k: int, ranges) -> torch.Tensor:
    """How many ranges let query i see key j (a key two ranges cover counts twice, as merged partials do)."""
    count = torch.zeros(num_q, num_k, dtype=torch.float64)
    for (q0, q1), (k0, k1), (left, right) in ranges:
        count[q0:q1, k0:k1] += _visible(q1 - q0, k1 - k0, left, right).double()
    return count


def _reference(q, k, v, count):
    """Dense attention with each (query, key) weighed by its multiplicity: (out, lse [H, Tq])."""
    group = q.shape[1] // k.shape[1]
    kk, vv = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)
    scores = torch.einsum("qhd,khd->hqk", q, kk) * SCALE + torch.log(count)[None]
    lse = torch.logsumexp(scores, -1)
    probs = torch.exp(scores - lse[..., None]).nan_to_num(0.0)
    return torch.einsum("hqk,khd->qhd", probs, vv), lse


def _random_ranges(generator, num_q: int, num_k: int, count: int):
    ranges = []
    for _ in range(count):
        q0 = int(torch.randint(0, num_q - 1, (1,), generator=generator))
        q1 = int(torch.randint(q0 + 1, num_q + 1, (1,), generator=generator))
        k0 = int(torch.randint(0, num_k - 1, (1,), generator=generator))
        k1 = int(torch.randint(k0 + 1, num_k + 1, (1,), generator=generator))
        mask = [(-1, -1), (-1, 0), (2, 0), (3, 1)][int(torch.randint(0, 4, (1,), generator=generator))]
        ranges.append(((q0, q1), (k0, k1), mask))
    return ranges


def _tensors(ranges):
    return [torch.tensor([r[i] for r in ranges], dtype=torch.int32) for i in range(3)]


@pytest.mark.parametrize("seed", range(6))
def test_overlapping_ranges_merge_and_sum_as_dense_attention_does(seed):
    generator = torch.Generator().manual_seed(seed)
    num_q, num_k = 13, 17
    q = torch.randn(num_q, 4, 8, generator=generator, dtype=torch.float64, requires_grad=True)
    k = torch.randn(num_k, 2, 8, generator=generator, dtype=torch.float64, requires_grad=True)
    v = torch.randn(num_k, 2, 8, generator=generator, dtype=torch.float64, requires_grad=True)
    ranges = _random_ranges(generator, num_q, num_k, 7)
    count = _multiplicity(num_q, num_k, ranges)
    seen = count.sum(1) > 0
    q_ranges, k_ranges, masks = _tensors(ranges)
    out = torch.zeros(num_q, 4, 8, dtype=torch.float64)
    lse = torch.full((4, num_q), -math.inf, dtype=torch.float64)
    kernels = ExactRangeKernels()
    kernels.forward(q.detach(), k.detach(), v.detach(), q_ranges, k_ranges, masks, num_q, num_k, SCALE, out, lse)
    ref_out, ref_lse = _reference(q[seen], k, v, count[seen])  # rows no range sees: no reference, no gradient
    torch.testing.assert_close(out[seen], ref_out, rtol=1e-10, atol=1e-10)
    torch.testing.assert_close(lse[:, seen], ref_lse, rtol=1e-10, atol=1e-10)
    assert torch.isneginf(lse[:, ~seen]).all() and (out[~seen] == 0).all()  # they keep their accumulators
    d_out = torch.randn(num_q, 4, 8, generator=generator, dtype=torch.float64)
    (ref_out * d_out[seen]).sum().backward()
    dq, dk, dv = torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v)
    kernels.backward(d_out, q.detach(), k.detach(), v.detach(), out, lse, q_ranges, k_ranges, masks, num_q, num_k,
                     SCALE, dq, dk, dv)
    for ours, theirs in ((dq, q.grad), (dk, k.grad), (dv, v.grad)):
        torch.testing.assert_close(ours, theirs, rtol=1e-10, atol=1e-10)


def _ffa_standin():
    """Functions with FFA's parameters that do what its source says: accumulate into out/lse and dq/dk/dv, with
    attention types 0 (full) and 1 (bottom-right causal); here through the exact range kernels."""
    exact = ExactRangeKernels()
    calls = []

    def masks_of(attn_type_map):
        return torch.stack([torch.full_like(attn_type_map, -1), torch.where(attn_type_map == 1, 0, -1)], 1)

    def _flex_flash_attn_forward(q, k, v, out, lse, q_ranges, k_ranges, max_seqlen_q, max_seqlen_k, attn_type_map,
                                 merge_q_ranges, qk_map, fwd_unique_count, softmax_scale, softcap,
                                 disable_fwd_atomic_reduction, out_type, deterministic, sm_margin):
        calls.append("fwd")
        exact.forward(q, k, v, q_ranges, k_ranges, masks_of(attn_type_map), max_seqlen_q, max_seqlen_k,
                      softmax_scale, out, lse)
        return out, lse

    def _flex_flash_attn_backward(dout, q, k, v, out, dq, dk, dv, softmax_lse, q_ranges, k_ranges, max_seqlen_q,
                                  max_seqlen_k, attn_type_map, merge_k_ranges, bwd_kq_map, bwd_unique_count,
                                  softmax_scale, softcap, disable_bwd_dkv_atomic_reduction, dq_type, dk_type, dv_type,
                                  deterministic, sm_margin):
        calls.append("bwd")
        exact.backward(dout, q, k, v, out, softmax_lse, q_ranges, k_ranges, masks_of(attn_type_map), max_seqlen_q,
                       max_seqlen_k, softmax_scale, dq, dk, dv)
        return dq, dk, dv, None

    return _flex_flash_attn_forward, _flex_flash_attn_backward, calls


def test_the_ffa_adapter_passes_ranges_types_and_accumulators_in_ffas_order():
    forward, backward, calls = _ffa_standin()
    ffa = FlexFlashAttnKernels(forward, backward)
    generator = torch.Generator().manual_seed(3)
    q = torch.randn(9, 4, 8, generator=generator, dtype=torch.float64)
    k, v, d_out = (torch.randn(9, 2 if i < 2 else 4, 8, generator=generator, dtype=torch.float64) for i in range(3))
    ranges = [((0, 5), (0, 5), (-1, 0)), ((3, 9), (0, 4), (-1, -1)), ((5, 9), (5, 9), (-1, 0))]
    results = []
    for kernels in (ffa, ExactRangeKernels()):
        out = torch.zeros_like(q)
        lse = torch.full((4, 9), -math.inf, dtype=torch.float64)
        kernels.forward(q, k, v, *_tensors(ranges), 9, 9, SCALE, out, lse)
        grads = [torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v)]
        kernels.backward(d_out, q, k, v, out, lse, *_tensors(ranges), 9, 9, SCALE, *grads)
        results.append([out, lse, *grads])
    assert calls == ["fwd", "bwd"]
    for ours, theirs in zip(*results):
        torch.testing.assert_close(ours, theirs, rtol=0, atol=0)
    # FFA has no window type: a windowed plan is refused by the executor from the host plan, before any call
    # (tests/test_runtime_syncs.py), so the adapter reads nothing back from the device to check.
    assert ffa.takes_windows is False


def test_the_ffa_adapter_refuses_functions_with_other_arguments():
    forward, backward, _ = _ffa_standin()

    def old_forward(q, k, v, q_ranges, k_ranges, max_seqlen_q, max_seqlen_k, attn_type_map, softmax_scale):
        raise AssertionError("never called")

    with pytest.raises(RuntimeError, match="'q_ranges' as argument 3, where the runtime passes 'out'.*FFA"):
        FlexFlashAttnKernels(old_forward, backward)


def test_the_cpu_default_is_the_exact_range_kernel():
    assert default_kernels(torch.device("cpu")).name == "exact-ranges"
    assert default_kernels(torch.device("cpu"), windows=True).ranges


def test_the_loader_builds_the_calls_the_default_kernels_run():
    from fcp_runtime.kernels import default_takes_ranges

    for windows in (False, True):
        cpu = torch.device("cpu")
        assert default_takes_ranges(cpu, windows) == default_kernels(cpu, windows).ranges
        try:
            chosen = default_kernels(torch.device("cuda"), windows)  # choosing needs no GPU
        except (ImportError, RuntimeError):
            continue
        assert default_takes_ranges(torch.device("cuda"), windows) == bool(getattr(chosen, "ranges", False))

"""Merging partial attention (fcp_runtime/kernels.py): partials over disjoint key sets, merged in any order, in
place through views or by row index, equal attention over all the keys."""

import pytest

torch = pytest.importorskip("torch")

from fcp_runtime.kernels import ExactKernels  # noqa: E402
from fcp_runtime.merge import merge_into, merge_rows  # noqa: E402


def _attention(q, k, v):
    """One entry of the exact kernel: (out, lse)."""
    cu_q = torch.tensor([0, q.shape[0]], dtype=torch.int32)
    cu_k = torch.tensor([0, k.shape[0]], dtype=torch.int32)
    return ExactKernels().forward(q, k, v, cu_q, cu_k, q.shape[0], k.shape[0], 0.25, False)


def _inputs(rows=6, keys=12, seed=0):
    generator = torch.Generator().manual_seed(seed)
    q = torch.randn(rows, 4, 8, generator=generator, dtype=torch.float64)
    k = torch.randn(keys, 2, 8, generator=generator, dtype=torch.float64)
    v = torch.randn(keys, 2, 8, generator=generator, dtype=torch.float64)
    return q, k, v


@pytest.mark.parametrize("order", [(0, 1, 2), (2, 0, 1)])
def test_merging_partials_over_disjoint_keys_gives_attention_over_all_of_them(order):
    q, k, v = _inputs()
    full_out, full_lse = _attention(q, k, v)
    chunks = [slice(0, 5), slice(5, 6), slice(6, 12)]
    acc = torch.zeros_like(q)
    acc_lse = torch.full((q.shape[1], q.shape[0]), float("-inf"), dtype=q.dtype)
    for i in order:
        out, lse = _attention(q, k[chunks[i]], v[chunks[i]])
        merge_into(acc, acc_lse, out, lse)
    torch.testing.assert_close(acc, full_out, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(acc_lse, full_lse, rtol=1e-12, atol=1e-12)


def test_a_first_partial_is_copied_exactly_and_an_empty_one_changes_nothing():
    q, k, v = _inputs()
    out, lse = _attention(q, k, v)
    acc = torch.full_like(q, 7.0)  # nothing merged yet (lse -inf): the first partial replaces whatever it holds
    acc_lse = torch.full((q.shape[1], q.shape[0]), float("-inf"), dtype=q.dtype)
    merge_into(acc, acc_lse, out, lse)
    assert torch.equal(acc, out) and torch.equal(acc_lse, lse)
    # A partial that saw no key (lse -inf everywhere) leaves the accumulator as it was, NaN-free.
    merge_into(acc, acc_lse, torch.zeros_like(out), torch.full_like(lse, float("-inf")))
    assert torch.equal(acc, out) and torch.equal(acc_lse, lse)
    # Both empty: rows stay empty (-inf) with finite outputs.
    empty = torch.zeros_like(q)
    empty_lse = torch.full_like(lse, float("-inf"))
    merge_into(empty, empty_lse, torch.zeros_like(out), torch.full_like(lse, float("-inf")))
    assert torch.isfinite(empty).all() and torch.isneginf(empty_lse).all()


def test_merge_through_views_and_by_row_index_agree():
    q, k, v = _inputs(rows=10)
    first, first_lse = _attention(q, k[:7], v[:7])
    second, second_lse = _attention(q, k[7:], v[7:])
    full_out, full_lse = _attention(q, k, v)
    rows = torch.tensor([7, 2, 3, 9])
    # Accumulators holding the first partial; merge the second into rows 2..5 by view, into `rows` by index.
    by_view, by_view_lse = first.clone(), first_lse.clone()
    merge_into(by_view.narrow(0, 2, 4), by_view_lse.narrow(1, 2, 4), second[2:6], second_lse[:, 2:6])
    by_index, by_index_lse = first.clone(), first_lse.clone()
    merge_rows(by_index, by_index_lse, rows, second[rows], second_lse[:, rows])
    for acc, acc_lse, merged in ((by_view, by_view_lse, torch.arange(2, 6)), (by_index, by_index_lse, rows)):
        untouched = torch.ones(10, dtype=torch.bool)
        untouched[merged] = False
        torch.testing.assert_close(acc[merged], full_out[merged], rtol=1e-12, atol=1e-12)
        torch.testing.assert_close(acc_lse[:, merged], full_lse[:, merged], rtol=1e-12, atol=1e-12)
        assert torch.equal(acc[untouched], first[untouched])


def test_on_cuda_without_flash_attn_the_kernels_are_torchs_flash_attention_never_the_exact_ones():
    from fcp_runtime.kernels import TorchFlashKernels, default_kernels

    try:
        import flash_attn  # noqa: F401
        pytest.skip("flash-attn is installed here")
    except ImportError:
        pass
    kernels = default_kernels(torch.device("cuda"))  # choosing needs no GPU: the schemas are checked, not run
    assert isinstance(kernels, TorchFlashKernels)
    assert default_kernels(torch.device("cpu")).name == "exact-ranges"


def test_torch_flash_schemas_are_checked_by_name_and_position():
    from fcp_runtime.kernels import TORCH_FLASH_FORWARD_ARGUMENTS, check_schema

    forward = torch.ops.aten._flash_attention_forward.default
    check_schema(forward, TORCH_FLASH_FORWARD_ARGUMENTS)
    positions, keywords = TORCH_FLASH_FORWARD_ARGUMENTS
    swapped = (positions[:3] + (positions[4], positions[3]) + positions[5:], keywords)
    with pytest.raises(RuntimeError, match="positional arguments"):
        check_schema(forward, swapped)
    with pytest.raises(RuntimeError, match="no keyword argument 'softmax_scale'"):
        check_schema(forward, (positions, keywords + ("softmax_scale",)))


def test_flash_attn_backward_must_take_the_arguments_in_2_8s_order():
    from flash_attn_standin import _flash_attn_varlen_backward, flash_attn_varlen_func
    from fcp_runtime.kernels import FlashAttnKernels

    FlashAttnKernels(flash_attn_varlen_func, _flash_attn_varlen_backward)  # the 2.8 order: accepted

    def before_softcap(dout, q, k, v, out, softmax_lse, dq, dk, dv, cu_seqlens_q, cu_seqlens_k, max_seqlen_q,
                       max_seqlen_k, dropout_p, softmax_scale, causal, window_size_left, window_size_right,
                       alibi_slopes, deterministic, rng_state=None):
        raise AssertionError("never called")

    with pytest.raises(RuntimeError, match="'alibi_slopes' as argument 18, where the runtime passes 'softcap'"):
        FlashAttnKernels(flash_attn_varlen_func, before_softcap)


def test_dk_and_dv_written_as_halves_of_one_tensor_are_added_as_it_else_stacked():
    from fcp_runtime.passes import _halves

    dkv = torch.randn(2, 5, 2, 8, dtype=torch.float64)
    assert _halves(dkv[0], dkv[1]) is dkv  # no copy
    dk, dv = torch.randn(5, 2, 8, dtype=torch.float64), torch.randn(5, 2, 8, dtype=torch.float64)
    assert torch.equal(_halves(dk, dv), torch.stack((dk, dv)))
    assert torch.equal(_halves(dkv[1], dkv[0]), torch.stack((dkv[1], dkv[0])))  # halves, but swapped: stacked
    generator = torch.Generator().manual_seed(1)
    q, d_out = (torch.randn(4, 4, 8, generator=generator, dtype=torch.float64) for _ in range(2))
    k, v = (torch.randn(4, 2, 8, generator=generator, dtype=torch.float64) for _ in range(2))
    cu = torch.tensor([0, 4], dtype=torch.int32)
    out, lse = ExactKernels().forward(q, k, v, cu, cu, 4, 4, 0.3, True)
    _, dk, dv = ExactKernels().backward(d_out, q, k, v, out, lse, cu, cu, 4, 4, 0.3, True)
    assert _halves(dk, dv) is dk._base  # the exact kernels write the halves of one tensor
    assert torch.equal(_halves(dk, dv)[0], dk) and torch.equal(_halves(dk, dv)[1], dv)

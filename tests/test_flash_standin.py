"""The flash-attn stand-in keeps flash-attn 2.8's varlen contract (checked against plain autograd, entry by entry)."""

import pytest

torch = pytest.importorskip("torch")

from flash_attn_standin import _flash_attn_varlen_backward, flash_attn_varlen_func  # noqa: E402


def _packed(lengths_q, lengths_k, hq=4, hkv=2, dim=8, dtype=torch.float64, seed=0):
    generator = torch.Generator().manual_seed(seed)
    q = torch.randn(sum(lengths_q), hq, dim, generator=generator, dtype=dtype)
    k = torch.randn(sum(lengths_k), hkv, dim, generator=generator, dtype=dtype)
    v = torch.randn(sum(lengths_k), hkv, dim, generator=generator, dtype=dtype)
    cu = [torch.tensor([0] + lengths, dtype=torch.int32).cumsum(0, dtype=torch.int32)
          for lengths in (lengths_q, lengths_k)]
    return q, k, v, cu[0], cu[1]


def _entry_reference(q, k, v, causal, scale):
    """One entry with an explicit mask: query i sees key j when j <= i + Lk - Lq (bottom-right)."""
    group = q.shape[1] // k.shape[1]
    scores = torch.einsum("qhd,khd->hqk", q, k.repeat_interleave(group, 1)) * scale
    if causal:
        lq, lk = q.shape[0], k.shape[0]
        allowed = torch.tensor([[j <= i + lk - lq for j in range(lk)] for i in range(lq)])
        scores = scores.masked_fill(~allowed, float("-inf"))
    return torch.einsum("hqk,khd->qhd", torch.softmax(scores, -1), v.repeat_interleave(group, 1)), \
        torch.logsumexp(scores, -1)


@pytest.mark.parametrize("causal", [True, False])
def test_forward_and_lse_match_each_entry_alone(causal):
    lengths_q, lengths_k = [3, 5, 2], [7, 5, 9]
    q, k, v, cu_q, cu_k = _packed(lengths_q, lengths_k)
    out, lse, _ = flash_attn_varlen_func(q, k, v, cu_q, cu_k, 5, 9, softmax_scale=0.3, causal=causal,
                                         return_attn_probs=True)
    assert lse.shape == (4, sum(lengths_q))
    for i in range(3):
        rq, rk = slice(int(cu_q[i]), int(cu_q[i + 1])), slice(int(cu_k[i]), int(cu_k[i + 1]))
        want_out, want_lse = _entry_reference(q[rq], k[rk], v[rk], causal, 0.3)
        torch.testing.assert_close(out[rq], want_out, rtol=1e-12, atol=1e-12)
        torch.testing.assert_close(lse[:, rq], want_lse, rtol=1e-12, atol=1e-12)


def test_causal_is_bottom_right_aligned():
    # Two queries against four keys: query 0 sees keys 0..2, query 1 all four (not 0 and 0..1 as top-left would).
    q, k, v, cu_q, cu_k = _packed([2], [4], hq=1, hkv=1)
    v = torch.eye(4, 8, dtype=torch.float64)[:, None, :].contiguous()  # value j is unit vector j
    k = torch.zeros(4, 1, 8, dtype=torch.float64)  # equal scores: the output is the mean of the visible values
    out = flash_attn_varlen_func(q, k, v, cu_q, cu_k, 2, 4, causal=True)
    torch.testing.assert_close(out[0, 0, :4], torch.tensor([1 / 3, 1 / 3, 1 / 3, 0], dtype=torch.float64))
    torch.testing.assert_close(out[1, 0, :4], torch.full((4,), 0.25, dtype=torch.float64))


@pytest.mark.parametrize("causal", [True, False])
def test_backward_fills_the_given_tensors_with_autograds_gradients(causal):
    lengths_q, lengths_k = [4, 3], [6, 3]
    q, k, v, cu_q, cu_k = _packed(lengths_q, lengths_k)
    out, lse, _ = flash_attn_varlen_func(q, k, v, cu_q, cu_k, 4, 6, softmax_scale=0.5, causal=causal,
                                         return_attn_probs=True)
    d_out = torch.randn_like(out)
    dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
    ids = (id(dq), id(dk), id(dv))
    softmax_d = _flash_attn_varlen_backward(d_out, q, k, v, out, lse, dq, dk, dv, cu_q, cu_k, 4, 6, 0.0, 0.5,
                                            causal, -1, -1, 0.0, None, False, None)
    assert (id(dq), id(dk), id(dv)) == ids and softmax_d.dtype == torch.float32
    leaves = [x.clone().requires_grad_() for x in (q, k, v)]
    outs = []
    for i in range(2):
        rq, rk = slice(int(cu_q[i]), int(cu_q[i + 1])), slice(int(cu_k[i]), int(cu_k[i + 1]))
        outs.append(_entry_reference(leaves[0][rq], leaves[1][rk], leaves[2][rk], causal, 0.5)[0])
    torch.cat(outs).backward(d_out)
    for got, leaf in zip((dq, dk, dv), leaves):
        torch.testing.assert_close(got, leaf.grad, rtol=1e-10, atol=1e-10)


def test_half_precision_returns_fp32_lse_and_the_contract_is_enforced():
    q, k, v, cu_q, cu_k = _packed([3], [3], dtype=torch.bfloat16)
    out, lse, _ = flash_attn_varlen_func(q, k, v, cu_q, cu_k, 3, 3, causal=True, return_attn_probs=True)
    assert out.dtype == torch.bfloat16 and lse.dtype == torch.float32
    with pytest.raises(RuntimeError, match="int32"):
        flash_attn_varlen_func(q, k, v, cu_q.long(), cu_k, 3, 3)
    with pytest.raises(RuntimeError, match="max_seqlen"):
        flash_attn_varlen_func(q, k, v, cu_q, cu_k, 2, 3)
    with pytest.raises(RuntimeError, match="same dtype"):
        flash_attn_varlen_func(q, k.float(), v, cu_q, cu_k, 3, 3)
    with pytest.raises(RuntimeError, match="contiguous last dimension"):
        flash_attn_varlen_func(q.transpose(1, 2).contiguous().transpose(1, 2), k, v, cu_q, cu_k, 3, 3)
    with pytest.raises(RuntimeError, match="head dimension"):
        wide = _packed([3], [3], dim=12, dtype=torch.bfloat16)
        flash_attn_varlen_func(*wide, 3, 3)
    with pytest.raises(RuntimeError, match="expected q"):
        flash_attn_varlen_func(q, k, v[:, :1], cu_q, cu_k, 3, 3)


def test_an_entry_without_keys_gives_out_0_and_lse_plus_infinity():
    q, k, v, cu_q, cu_k = _packed([2, 3], [0, 4])
    out, lse, _ = flash_attn_varlen_func(q, k, v, cu_q, cu_k, 3, 4, causal=True, return_attn_probs=True)
    assert torch.equal(out[:2], torch.zeros_like(out[:2])) and torch.isposinf(lse[:, :2]).all()
    assert torch.isfinite(lse[:, 2:]).all()

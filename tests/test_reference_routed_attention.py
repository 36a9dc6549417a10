"""The reference routed_attention against torch's scaled_dot_product_attention with masks built here."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

from natsl import ops
from natsl.reference.routed_attention import routed_attention

F64 = torch.float64


def make_qkv(B, T, H, Dk, Dv, *, seed=0, dtype=F64):
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(B, T, H, Dk, generator=gen, dtype=F64)
    k = torch.randn(B, T, H, Dk, generator=gen, dtype=F64)
    v = torch.randn(B, T, H, Dv, generator=gen, dtype=F64)
    return tuple(x.to(dtype) for x in (q, k, v))


def make_keep(B, NB, G, kind, *, seed=1, dtype=F64):
    gen = torch.Generator().manual_seed(seed)
    if kind == "ones":
        return torch.ones(B, NB, G, dtype=dtype)
    if kind == "zeros":
        return torch.zeros(B, NB, G, dtype=dtype)
    if kind == "binary":
        return torch.randint(0, 2, (B, NB, G), generator=gen).to(dtype)
    return torch.rand(B, NB, G, generator=gen, dtype=F64).to(dtype)


def sdpa(q, k, v, **kwargs):
    """torch's attention on [B, T, H, D] tensors."""
    o = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), **kwargs)
    return o.transpose(1, 2)


def loop_mask(keep, T, C, H):
    """M [B, H, T, T] of docs/spec.md section 3, entry by entry (keep may be fractional)."""
    B, _, G = keep.shape
    M = torch.zeros(B, H, T, T, dtype=F64)
    for h in range(H):
        group = h // (H // G)
        for i in range(T):
            for j in range(T):
                if j // C == i // C:
                    M[:, h, i, j] = float(j <= i)
                elif j // C < i // C:
                    M[:, h, i, j] = keep[:, j // C, group].to(F64)
    return M


def masked_sdpa(q, k, v, keep, C):
    """exp(A) M = exp(A + log M): a float attn_mask log M gives the output of docs/spec.md section 3."""
    M = loop_mask(keep, q.shape[1], C, q.shape[2])
    return sdpa(q, k, v, attn_mask=torch.log(M))


def assert_close(actual, expected, tol=1e-12):
    assert actual.dtype == expected.dtype
    torch.testing.assert_close(actual, expected, rtol=tol, atol=tol)


# --------------------------------------------------------------------------- forward values
def test_keep_ones_is_causal_attention():
    q, k, v = make_qkv(2, 11, 3, 4, 5)
    expected = sdpa(q, k, v, is_causal=True)
    assert_close(routed_attention(q, k, v, None, block_size=4), expected)
    assert_close(routed_attention(q, k, v, make_keep(2, 3, 3, "ones"), block_size=4), expected)


def test_keep_zeros_is_block_local_attention():
    q, k, v = make_qkv(2, 11, 2, 3, 3, seed=2)
    blocks = [sdpa(q[:, s:s + 4], k[:, s:s + 4], v[:, s:s + 4], is_causal=True) for s in range(0, 11, 4)]
    expected = torch.cat(blocks, dim=1)
    assert_close(routed_attention(q, k, v, make_keep(2, 3, 2, "zeros"), block_size=4), expected)


@pytest.mark.parametrize("G", [1, 2])
@pytest.mark.parametrize("kind", ["binary", "fractional"])
def test_groups_share_a_route(G, kind):
    """Four softmax heads in G groups: head j follows keep[..., j // (4 // G)]."""
    q, k, v = make_qkv(2, 10, 4, 3, 2, seed=3)
    keep = make_keep(2, 3, G, kind, seed=4)
    expected = masked_sdpa(q, k, v, keep, 4)
    assert_close(routed_attention(q, k, v, keep, block_size=4), expected)


def test_group_assignment_is_consecutive_heads():
    """keep = [1, 0] for G = 2 of 4 heads: heads 0, 1 are causal, heads 2, 3 block-local."""
    q, k, v = make_qkv(1, 8, 4, 3, 3, seed=5)
    keep = torch.tensor([[[1.0, 0.0], [1.0, 0.0]]], dtype=F64)
    o = routed_attention(q, k, v, keep, block_size=4)
    assert_close(o[:, :, :2], sdpa(q, k, v, is_causal=True)[:, :, :2])
    local = torch.cat([sdpa(q[:, s:s + 4], k[:, s:s + 4], v[:, s:s + 4], is_causal=True) for s in (0, 4)], 1)
    assert_close(o[:, :, 2:], local[:, :, 2:])


def test_default_block_size_64_and_scale():
    q, k, v = make_qkv(1, 70, 2, 4, 3, seed=6)
    keep = torch.tensor([[[0.0, 1.0], [1.0, 1.0]]], dtype=F64)
    expected = sdpa(q, k, v, attn_mask=torch.log(loop_mask(keep, 70, 64, 2)), scale=0.3)
    assert_close(routed_attention(q, k, v, keep, scale=0.3), expected)


@pytest.mark.parametrize("T", [1, 3, 4, 9])
def test_lengths(T):
    q, k, v = make_qkv(1, T, 2, 3, 2, seed=T)
    keep = make_keep(1, math.ceil(T / 4), 1, "binary", seed=T)
    o = routed_attention(q, k, v, keep, block_size=4)
    assert o.shape == (1, T, 2, 2)
    assert_close(o, masked_sdpa(q, k, v, keep, 4))


def test_outputs_never_depend_on_current_or_later_routes():
    q, k, v = make_qkv(1, 14, 2, 3, 3, seed=7)
    keep = make_keep(1, 4, 2, "binary", seed=8)
    o = routed_attention(q, k, v, keep, block_size=4)
    for b in range(4):
        other = keep.clone()
        other[:, b:] = 1 - other[:, b:]
        o_other = routed_attention(q, k, v, other, block_size=4)
        end = min((b + 1) * 4, 14)
        assert torch.equal(o[:, :end], o_other[:, :end])
        if b < 3:
            assert not torch.equal(o[:, end:], o_other[:, end:])


# --------------------------------------------------------------------------- intra_block=False
def test_intra_block_off_sees_only_kept_earlier_blocks():
    q, k, v = make_qkv(1, 12, 2, 3, 3, seed=9)
    keep = torch.tensor([[[1.0], [0.0], [1.0]]], dtype=F64)
    o = routed_attention(q, k, v, keep, block_size=4, intra_block=False)
    assert torch.equal(o[:, :4], torch.zeros_like(o[:, :4]))  # block 0 sees nothing
    assert_close(o[:, 4:8], sdpa(q[:, 4:8], k[:, :4], v[:, :4]))  # block 1 sees block 0
    assert_close(o[:, 8:], sdpa(q[:, 8:], k[:, :4], v[:, :4]))  # block 2: block 1 dropped


def test_intra_block_off_empty_rows_have_finite_gradients():
    q, k, v = make_qkv(1, 9, 2, 3, 3, seed=10)
    keep = torch.zeros(1, 3, 2, dtype=F64, requires_grad=True)
    leaves = [x.clone().requires_grad_() for x in (q, k, v)]
    o = routed_attention(*leaves, keep, block_size=4, intra_block=False, route_grad="full")
    assert torch.equal(o, torch.zeros_like(o))
    o.sum().backward()
    for t in (*leaves, keep):
        assert torch.isfinite(t.grad).all()


def test_gradcheck_intra_block_off():
    q, k, v = make_qkv(1, 9, 2, 3, 2, seed=11)
    keep = 0.2 + 0.6 * make_keep(1, 3, 1, "fractional", seed=12)
    inputs = [x.clone().requires_grad_() for x in (q, k, v, keep)]
    fn = lambda q, k, v, keep: routed_attention(q, k, v, keep, block_size=4, intra_block=False, route_grad="full")
    assert torch.autograd.gradcheck(fn, inputs, eps=1e-6, atol=1e-8)


# --------------------------------------------------------------------------- gradients, dtypes
@pytest.mark.parametrize("B, T, G", [(1, 9, 1), (2, 7, 2)])
def test_gradcheck_full_every_input(B, T, G):
    q, k, v = make_qkv(B, T, 2, 3, 4, seed=13)
    keep = 0.1 + 0.8 * make_keep(B, math.ceil(T / 4), G, "fractional", seed=14)
    inputs = [x.clone().requires_grad_() for x in (q, k, v, keep)]
    fn = lambda q, k, v, keep: routed_attention(q, k, v, keep, block_size=4, route_grad="full")
    assert torch.autograd.gradcheck(fn, inputs, eps=1e-6, atol=1e-8)


def test_large_logits_stay_finite():
    """Stability: logits of +-1e4 must not overflow in the forward or the backward."""
    q, k, v = make_qkv(1, 8, 1, 2, 2, seed=15, dtype=torch.float32)
    q = (q * 100).requires_grad_()
    keep = torch.tensor([[[1.0], [0.0]]], requires_grad=True)
    o = routed_attention(q, k * 100, v, keep, block_size=4, route_grad="full")
    o.sum().backward()
    assert torch.isfinite(o).all() and torch.isfinite(q.grad).all() and torch.isfinite(keep.grad).all()
    expected = masked_sdpa(q.detach().to(F64), (k * 100).to(F64), v.to(F64), keep.detach(), 4)
    torch.testing.assert_close(o.detach().to(F64), expected, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_low_precision_inputs(dtype):
    q, k, v = make_qkv(2, 10, 2, 8, 4, seed=16, dtype=dtype)
    keep = make_keep(2, 3, 2, "binary", seed=17, dtype=dtype)
    o = routed_attention(q, k, v, keep, block_size=4)
    assert o.dtype == dtype
    expected = masked_sdpa(*(x.to(F64) for x in (q, k, v)), keep, 4)
    torch.testing.assert_close(o.to(F64), expected, rtol=0, atol=2e-2)


def test_float32_and_ops_dispatch():
    q, k, v = make_qkv(1, 6, 2, 3, 3, seed=18, dtype=torch.float32)
    keep = torch.tensor([[[0.0], [1.0]]])
    o = routed_attention(q, k, v, keep, block_size=4)
    assert o.dtype == torch.float32
    assert torch.equal(o, ops.routed_attention(q, k, v, keep, block_size=4, backend="reference"))


@settings(max_examples=15, deadline=None)
@given(
    B=st.integers(1, 2), T=st.integers(1, 12), G=st.sampled_from([1, 2]), R=st.integers(1, 2),
    Dk=st.integers(1, 4), Dv=st.integers(1, 4), C=st.integers(1, 5), seed=st.integers(0, 1000),
)
def test_property_matches_masked_sdpa(B, T, G, R, Dk, Dv, C, seed):
    q, k, v = make_qkv(B, T, G * R, Dk, Dv, seed=seed)
    keep = make_keep(B, math.ceil(T / C), G, "binary", seed=seed + 1)
    assert_close(routed_attention(q, k, v, keep, block_size=C), masked_sdpa(q, k, v, keep, C), tol=1e-11)


# --------------------------------------------------------------------------- validation
@pytest.mark.parametrize(
    "change, message",
    [
        (dict(k=torch.zeros(1, 6, 4, 2, dtype=F64)), "k must have shape"),
        (dict(v=torch.zeros(1, 5, 4, 2, dtype=F64)), "v must have shape"),
        (dict(keep=torch.ones(1, 3, 2, dtype=F64)), r"keep must be \[B, NB, G\] = \(1, 2, G\)"),
        (dict(keep=torch.ones(1, 2, 3, dtype=F64)), "must divide the 4 softmax heads"),
        (dict(block_size=-1), "block_size must be a positive int"),
        (dict(route_grad="dense"), "unknown route_grad"),
    ],
)
def test_validation_errors(change, message):
    q, k, v = make_qkv(1, 6, 4, 3, 2)
    args = dict(q=q, k=k, v=v, keep=None)
    kwargs = dict(block_size=4)
    for name, value in change.items():
        (args if name in args else kwargs)[name] = value
    with pytest.raises(ValueError, match=message):
        routed_attention(*args.values(), **kwargs)

"""The explicit route-gradient oracles against autograd through the reference forwards."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

from natsl.reference.gated_delta import gated_delta_rule
from natsl.reference.route_grad import (
    apply_route_grad_policy,
    gated_delta_write_grad,
    routed_attention_keep_grad,
)
from natsl.reference.routed_attention import routed_attention

F64 = torch.float64


def randn(*shape, gen):
    return torch.randn(*shape, generator=gen, dtype=F64)


def route(B, NB, G, kind, gen):
    if kind == "binary":
        r = torch.randint(0, 2, (B, NB, G), generator=gen).to(F64)
        if r.numel() >= 2:
            r.view(-1)[:2] = torch.tensor([0.0, 1.0], dtype=F64)  # both options present
        return r
    return torch.rand(B, NB, G, generator=gen, dtype=F64)


def assert_close(actual, expected, tol=1e-10):
    torch.testing.assert_close(actual, expected, rtol=tol, atol=tol)


# --------------------------------------------------------------------------- the policy Function
def test_active_policy_is_identity_forward_and_masks_backward():
    r = torch.tensor([0.0, 1.0, 0.3, 0.7], dtype=F64, requires_grad=True)
    out = apply_route_grad_policy(r, "active")
    assert torch.equal(out, r.detach())
    out.backward(torch.tensor([2.0, 3.0, 4.0, 5.0], dtype=F64))
    assert torch.equal(r.grad, torch.tensor([0.0, 3.0, 0.0, 5.0], dtype=F64))
    assert apply_route_grad_policy(r, "full") is r
    with pytest.raises(ValueError, match="unknown route_grad"):
        apply_route_grad_policy(r, "none")


# --------------------------------------------------------------------------- routed attention
def attention_case(B, T, Hs, G, C, kind, seed):
    gen = torch.Generator().manual_seed(seed)
    q, k = randn(B, T, Hs, 3, gen=gen), randn(B, T, Hs, 3, gen=gen)
    v, do = randn(B, T, Hs, 2, gen=gen), randn(B, T, Hs, 2, gen=gen)
    return q, k, v, route(B, math.ceil(T / C), G, kind, gen), do


def autograd_keep_grad(q, k, v, keep, do, C, policy):
    keep = keep.clone().requires_grad_()
    o = routed_attention(q, k, v, keep, block_size=C, route_grad=policy)
    (o * do).sum().backward()
    return keep.grad, o.detach()


@pytest.mark.parametrize("kind", ["binary", "fractional"])
@pytest.mark.parametrize("B, T, Hs, G", [(1, 9, 2, 1), (2, 13, 4, 2), (1, 12, 2, 2)])
def test_keep_grad_full_matches_autograd(kind, B, T, Hs, G):
    q, k, v, keep, do = attention_case(B, T, Hs, G, 4, kind, seed=T + G)
    expected, o = autograd_keep_grad(q, k, v, keep, do, 4, "full")
    got = routed_attention_keep_grad(q, k, v, keep, o, do, block_size=4, route_grad="full")
    assert got.shape == keep.shape
    assert_close(got, expected)
    assert got[:, :-1].abs().min() > 0  # every earlier block has later queries
    assert torch.equal(got[:, -1], torch.zeros_like(got[:, -1]))  # the last block feeds no one


def test_keep_grad_active_matches_autograd_and_masks_full():
    q, k, v, keep, do = attention_case(2, 13, 4, 2, 4, "binary", seed=1)
    full, o = autograd_keep_grad(q, k, v, keep, do, 4, "full")
    active, _ = autograd_keep_grad(q, k, v, keep, do, 4, "active")
    assert torch.equal(active, full * (keep == 1))
    oracle = routed_attention_keep_grad(q, k, v, keep, o, do, block_size=4, route_grad="active")
    assert_close(oracle, active)
    assert (oracle[keep == 0] == 0).all() and (oracle[:, :-1][keep[:, :-1] == 1] != 0).all()


def test_keep_grad_default_block_size_and_keep_none():
    q, k, v, _, do = attention_case(1, 70, 2, 1, 64, "binary", seed=2)
    expected, o = autograd_keep_grad(q, k, v, torch.ones(1, 2, 1, dtype=F64), do, 64, "full")
    got = routed_attention_keep_grad(q, k, v, None, o, do)  # default block 64, keep None = ones
    assert_close(got, expected)
    assert expected[0, 0, 0].abs() > 0


def test_keep_grad_float32_inputs():
    q, k, v, keep, do = (x.float() for x in attention_case(1, 10, 2, 2, 4, "binary", seed=3))
    expected, o = autograd_keep_grad(q, k, v, keep, do, 4, "full")
    got = routed_attention_keep_grad(q, k, v, keep, o, do, block_size=4)
    assert got.dtype == torch.float32
    torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-5)


# --------------------------------------------------------------------------- gated delta rule
def gdn_case(B, T, H, C, kind, seed):
    gen = torch.Generator().manual_seed(seed)
    q = F.normalize(randn(B, T, H, 3, gen=gen), dim=-1)
    k = F.normalize(randn(B, T, H, 3, gen=gen), dim=-1)
    v, do = randn(B, T, H, 4, gen=gen), randn(B, T, H, 4, gen=gen)
    g = F.logsigmoid(randn(B, T, H, gen=gen) + 1.0)
    beta = torch.sigmoid(randn(B, T, H, gen=gen))
    s0, ds = randn(B, H, 3, 4, gen=gen), randn(B, H, 3, 4, gen=gen)
    return q, k, v, g, beta, route(B, math.ceil(T / C), H, kind, gen), do, s0, ds


def autograd_write_grad(q, k, v, g, beta, write, do, s0, ds, C, policy, decay=True):
    write = write.clone().requires_grad_()
    o, s = gated_delta_rule(q, k, v, g, beta, write, initial_state=s0, output_final_state=True,
                            block_size=C, route_grad=policy, decay_skipped_blocks=decay)
    loss = (o * do).sum() + (0.0 if ds is None else (s * ds).sum())
    loss.backward()
    return write.grad


@pytest.mark.parametrize("kind", ["binary", "fractional"])
@pytest.mark.parametrize("decay", [True, False])
@pytest.mark.parametrize("with_final", [True, False])
def test_write_grad_full_matches_autograd(kind, decay, with_final):
    q, k, v, g, beta, write, do, s0, ds = gdn_case(2, 11, 2, 4, kind, seed=4)
    ds = ds if with_final else None
    expected = autograd_write_grad(q, k, v, g, beta, write, do, s0, ds, 4, "full", decay)
    got = gated_delta_write_grad(q, k, v, g, beta, write, do, initial_state=s0, d_final_state=ds,
                                 block_size=4, decay_skipped_blocks=decay, route_grad="full")
    assert got.shape == write.shape
    assert_close(got, expected)
    assert got[:, :-1].abs().min() > 0
    if not with_final:
        assert torch.equal(got[:, -1], torch.zeros_like(got[:, -1]))
    else:
        assert got[:, -1].abs().min() > 0


def test_write_grad_active_matches_autograd_and_masks_full():
    q, k, v, g, beta, write, do, s0, ds = gdn_case(2, 13, 2, 4, "binary", seed=5)
    full = autograd_write_grad(q, k, v, g, beta, write, do, s0, ds, 4, "full")
    active = autograd_write_grad(q, k, v, g, beta, write, do, s0, ds, 4, "active")
    assert torch.equal(active, full * (write == 1))
    oracle = gated_delta_write_grad(q, k, v, g, beta, write, do, initial_state=s0, d_final_state=ds,
                                    block_size=4, route_grad="active")
    assert_close(oracle, active)
    assert (oracle[write == 1] != 0).all() and (oracle[write == 0] == 0).all()


def test_write_grad_default_block_size_no_initial_state():
    q, k, v, g, beta, write, do, _, ds = gdn_case(1, 70, 1, 64, "binary", seed=6)
    expected = autograd_write_grad(q, k, v, g, beta, write, do, None, ds, 64, "full")
    got = gated_delta_write_grad(q, k, v, g, beta, write, do, d_final_state=ds)
    assert_close(got, expected)


@pytest.mark.parametrize("T", [1, 3])
def test_write_grad_single_block(T):
    """T <= block: only the final-state gradient can reach the one route."""
    q, k, v, g, beta, write, do, s0, ds = gdn_case(1, T, 2, 4, "fractional", seed=T)
    expected = autograd_write_grad(q, k, v, g, beta, write, do, s0, ds, 4, "full")
    got = gated_delta_write_grad(q, k, v, g, beta, write, do, initial_state=s0, d_final_state=ds, block_size=4)
    assert_close(got, expected)
    assert got.abs().min() > 0


# --------------------------------------------------------------------------- properties
@settings(max_examples=10, deadline=None)
@given(T=st.integers(1, 12), C=st.integers(1, 5), G=st.sampled_from([1, 2]), seed=st.integers(0, 1000),
       policy=st.sampled_from(["full", "active"]))
def test_property_keep_grad(T, C, G, seed, policy):
    q, k, v, keep, do = attention_case(1, T, 2, G, C, "binary", seed=seed)
    expected, o = autograd_keep_grad(q, k, v, keep, do, C, policy)
    got = routed_attention_keep_grad(q, k, v, keep, o, do, block_size=C, route_grad=policy)
    assert_close(got, expected)


@settings(max_examples=10, deadline=None)
@given(T=st.integers(1, 12), C=st.integers(1, 5), seed=st.integers(0, 1000), decay=st.booleans(),
       policy=st.sampled_from(["full", "active"]))
def test_property_write_grad(T, C, seed, decay, policy):
    q, k, v, g, beta, write, do, s0, ds = gdn_case(1, T, 2, C, "binary", seed=seed)
    expected = autograd_write_grad(q, k, v, g, beta, write, do, s0, ds, C, policy, decay)
    got = gated_delta_write_grad(q, k, v, g, beta, write, do, initial_state=s0, d_final_state=ds,
                                 block_size=C, decay_skipped_blocks=decay, route_grad=policy)
    assert_close(got, expected)


def test_oracle_validation():
    q, k, v, g, beta, write, do, s0, ds = gdn_case(1, 6, 2, 4, "binary", seed=7)
    with pytest.raises(ValueError, match="d_final_state must have shape"):
        gated_delta_write_grad(q, k, v, g, beta, write, do, d_final_state=ds[..., :2], block_size=4)
    with pytest.raises(ValueError, match="keep must be"):
        routed_attention_keep_grad(q, k, v, write[:, :1], v, do, block_size=4)

"""The reference gated_delta_rule against an independent chunked (WY / UT-transform) form."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

from natsl import ops
from natsl.reference.gated_delta import gated_delta_rule

F64 = torch.float64


def make_inputs(B, T, H, K, V, *, seed=0, dtype=F64):
    """Normalised q, k; decays alpha = exp(g) in (0, 1); beta in (0, 1)."""
    gen = torch.Generator().manual_seed(seed)
    q = F.normalize(torch.randn(B, T, H, K, generator=gen, dtype=F64), dim=-1)
    k = F.normalize(torch.randn(B, T, H, K, generator=gen, dtype=F64), dim=-1)
    v = torch.randn(B, T, H, V, generator=gen, dtype=F64)
    g = F.logsigmoid(torch.randn(B, T, H, generator=gen, dtype=F64) + 1.0)
    beta = torch.sigmoid(torch.randn(B, T, H, generator=gen, dtype=F64))
    return tuple(x.to(dtype) for x in (q, k, v, g, beta))


def make_route(B, NB, H, kind, *, seed=1, dtype=F64):
    gen = torch.Generator().manual_seed(seed)
    if kind == "ones":
        return torch.ones(B, NB, H, dtype=dtype)
    if kind == "zeros":
        return torch.zeros(B, NB, H, dtype=dtype)
    if kind == "binary":
        return torch.randint(0, 2, (B, NB, H), generator=gen).to(dtype)
    return torch.rand(B, NB, H, generator=gen, dtype=F64).to(dtype)  # fractional


def chunked_gdn(q, k, v, g, beta, *, chunk, write=None, scale=None, initial_state=None,
                decay_skipped_blocks=True, intra_block=True):
    """Gated DeltaNet in matrix form, one chunk at a time, float64.

    Within a chunk with cumulative decay gamma_t = prod_{s<=t} alpha_s, the recurrence is
    S_t = gamma_t S0 + sum_{s<=t} (gamma_t / gamma_s) k_s u_s^T with pseudo-values u solving the
    unit lower-triangular system (I + A) U = diag(beta) (V - diag(gamma) K S0),
    A_ts = beta_t (gamma_t / gamma_s) k_t.k_s for s < t. The chunk then commits with `write`.
    """
    B, T, H, K = q.shape
    V = v.shape[-1]
    scale = K**-0.5 if scale is None else scale
    S = torch.zeros(B, H, K, V, dtype=F64) if initial_state is None else initial_state.to(F64)
    out = torch.zeros(B, T, H, V, dtype=F64)
    for b, lo in enumerate(range(0, T, chunk)):
        hi = min(lo + chunk, T)
        L = hi - lo
        Q, Kc, Vc = (x[:, lo:hi].to(F64).transpose(1, 2) for x in (q, k, v))  # [B,H,L,D]
        log_gamma = g[:, lo:hi].to(F64).transpose(1, 2).cumsum(-1)  # [B,H,L]
        bt = beta[:, lo:hi].to(F64).transpose(1, 2)
        ratio = torch.exp(log_gamma[..., :, None] - log_gamma[..., None, :])  # gamma_t / gamma_s
        strict = torch.tril(torch.ones(L, L, dtype=F64), -1)
        causal = torch.tril(torch.ones(L, L, dtype=F64))
        gamma = log_gamma.exp()[..., None]
        A = bt[..., None] * ratio * (Kc @ Kc.transpose(-1, -2)) * strict
        rhs = bt[..., None] * (Vc - gamma * (Kc @ S))
        U = torch.linalg.solve_triangular(torch.eye(L, dtype=F64) + A, rhs, upper=False)
        if intra_block:
            O = gamma * (Q @ S) + ((Q @ Kc.transpose(-1, -2)) * ratio * causal) @ U
        else:
            O = gamma * (Q @ S)
        out[:, lo:hi] = scale * O.transpose(1, 2)
        decay_to_end = torch.exp(log_gamma[..., -1:] - log_gamma)[..., None]  # gamma_L / gamma_s
        S_end = gamma[..., -1:, :] * S + Kc.transpose(-1, -2) @ (decay_to_end * U)
        Gamma = gamma[..., -1:, :] if decay_skipped_blocks else 1.0
        w = 1.0 if write is None else write[:, b].to(F64)[..., None, None]
        S = Gamma * S + w * (S_end - Gamma * S)
    return out, S


def assert_close(actual, expected, tol=1e-11):
    assert actual.dtype == expected.dtype
    torch.testing.assert_close(actual, expected, rtol=tol, atol=tol)


# --------------------------------------------------------------------------- plain GDN
def test_write_none_is_plain_gdn_with_states():
    """write=None and write=1 both equal plain GDN, independent of block size (chunk 3 vs 4)."""
    q, k, v, g, beta = make_inputs(2, 11, 2, 4, 3)
    s0 = torch.randn(2, 2, 4, 3, dtype=F64, generator=torch.Generator().manual_seed(5))
    expected_o, expected_s = chunked_gdn(q, k, v, g, beta, chunk=3, initial_state=s0)
    for write in (None, torch.ones(2, 3, 2, dtype=F64)):
        o, s = gated_delta_rule(q, k, v, g, beta, write, initial_state=s0, output_final_state=True, block_size=4)
        assert_close(o, expected_o)
        assert_close(s, expected_s)
    _, none_state = gated_delta_rule(q, k, v, g, beta, block_size=4)
    assert none_state is None


def test_single_token_by_hand():
    """T = 1 from zero state: o = scale * beta (q.k) v and S = beta k v^T."""
    q, k, v, g, beta = make_inputs(1, 1, 1, 3, 2)
    o, s = gated_delta_rule(q, k, v, g, beta, output_final_state=True, scale=0.7)
    qk = (q * k).sum(-1, keepdim=True)
    assert_close(o, 0.7 * beta[..., None] * qk * v)
    assert_close(s, (beta[0, 0, 0] * torch.outer(k[0, 0, 0], v[0, 0, 0]))[None, None])


def test_default_block_size_64():
    """T = 70: one full 64-token block and a partial one, random binary write."""
    q, k, v, g, beta = make_inputs(1, 70, 2, 4, 4, seed=3)
    write = make_route(1, 2, 2, "binary", seed=4)
    write[:, 0] = torch.tensor([0.0, 1.0], dtype=F64)  # both options in the block that matters
    o, s = gated_delta_rule(q, k, v, g, beta, write, output_final_state=True)
    expected_o, expected_s = chunked_gdn(q, k, v, g, beta, chunk=64, write=write)
    assert_close(o, expected_o)
    assert_close(s, expected_s)


# --------------------------------------------------------------------------- routed writes
@pytest.mark.parametrize("kind", ["zeros", "binary", "fractional"])
@pytest.mark.parametrize("decay_skipped_blocks", [True, False])
def test_write_routes_match_chunked(kind, decay_skipped_blocks):
    q, k, v, g, beta = make_inputs(2, 13, 2, 3, 4, seed=7)
    s0 = torch.randn(2, 2, 3, 4, dtype=F64, generator=torch.Generator().manual_seed(8))
    write = make_route(2, 4, 2, kind, seed=9)
    o, s = gated_delta_rule(q, k, v, g, beta, write, initial_state=s0, output_final_state=True,
                            block_size=4, decay_skipped_blocks=decay_skipped_blocks)
    expected_o, expected_s = chunked_gdn(q, k, v, g, beta, chunk=4, write=write, initial_state=s0,
                                         decay_skipped_blocks=decay_skipped_blocks)
    assert_close(o, expected_o)
    assert_close(s, expected_s)


def test_write_zeros_keeps_only_decayed_initial_state():
    """Nothing committed: the final state is S0 times the total decay (or S0 with the ablation)."""
    q, k, v, g, beta = make_inputs(1, 10, 2, 3, 3, seed=11)
    s0 = torch.randn(1, 2, 3, 3, dtype=F64)
    zeros = torch.zeros(1, 3, 2, dtype=F64)
    _, s = gated_delta_rule(q, k, v, g, beta, zeros, initial_state=s0, output_final_state=True, block_size=4)
    assert_close(s, s0 * g.sum(1).exp()[..., None, None])
    _, s = gated_delta_rule(q, k, v, g, beta, zeros, initial_state=s0, output_final_state=True,
                            block_size=4, decay_skipped_blocks=False)
    assert_close(s, s0)


def test_write_changes_output_and_decay_flag_matters():
    """Guards against a forward that ignores its flags: the routes must move the output."""
    q, k, v, g, beta = make_inputs(1, 12, 1, 3, 3, seed=12)
    ones, zeros = torch.ones(1, 3, 1, dtype=F64), torch.zeros(1, 3, 1, dtype=F64)
    o1, _ = gated_delta_rule(q, k, v, g, beta, ones, block_size=4)
    o0, _ = gated_delta_rule(q, k, v, g, beta, zeros, block_size=4)
    o0_nodecay, _ = gated_delta_rule(q, k, v, g, beta, zeros, block_size=4, decay_skipped_blocks=False)
    assert torch.equal(o1[:, :4], o0[:, :4])  # block 0 reads only its own writes either way
    assert (o1[:, 4:] - o0[:, 4:]).abs().max() > 1e-3
    # With zero writes and no initial state every block starts from 0: the decay flag is moot.
    assert torch.equal(o0, o0_nodecay)
    s0 = torch.ones(1, 1, 3, 3, dtype=F64)
    a, _ = gated_delta_rule(q, k, v, g, beta, zeros, block_size=4, initial_state=s0)
    b, _ = gated_delta_rule(q, k, v, g, beta, zeros, block_size=4, initial_state=s0, decay_skipped_blocks=False)
    assert (a[:, 4:] - b[:, 4:]).abs().max() > 1e-3


@pytest.mark.parametrize("kind", ["ones", "binary"])
def test_intra_block_false_matches_chunked(kind):
    q, k, v, g, beta = make_inputs(2, 10, 2, 3, 2, seed=13)
    s0 = torch.randn(2, 2, 3, 2, dtype=F64, generator=torch.Generator().manual_seed(14))
    write = make_route(2, 3, 2, kind, seed=15)
    o, s = gated_delta_rule(q, k, v, g, beta, write, initial_state=s0, output_final_state=True,
                            block_size=4, intra_block=False)
    expected_o, expected_s = chunked_gdn(q, k, v, g, beta, chunk=4, write=write, initial_state=s0, intra_block=False)
    assert_close(o, expected_o)
    assert_close(s, expected_s)
    o_intra, s_intra = gated_delta_rule(q, k, v, g, beta, write, initial_state=s0, output_final_state=True,
                                        block_size=4)
    assert_close(s, s_intra)  # the block's own writes still build the committed state
    assert (o - o_intra).abs().max() > 1e-3


# --------------------------------------------------------------------------- lengths and causality
@pytest.mark.parametrize("T", [1, 3, 4, 9])
def test_lengths(T):
    q, k, v, g, beta = make_inputs(1, T, 2, 3, 3, seed=T)
    NB = math.ceil(T / 4)
    write = make_route(1, NB, 2, "binary", seed=T + 1)
    o, s = gated_delta_rule(q, k, v, g, beta, write, output_final_state=True, block_size=4)
    assert o.shape == (1, T, 2, 3)
    expected_o, expected_s = chunked_gdn(q, k, v, g, beta, chunk=4, write=write)
    assert_close(o, expected_o)
    assert_close(s, expected_s)


def test_outputs_never_depend_on_current_or_later_routes():
    """Rows in blocks <= b are bit-identical whatever the routes of blocks >= b are."""
    q, k, v, g, beta = make_inputs(1, 14, 2, 3, 3, seed=21)
    write = make_route(1, 4, 2, "binary", seed=22)
    o, _ = gated_delta_rule(q, k, v, g, beta, write, block_size=4)
    for b in range(4):
        other = write.clone()
        other[:, b:] = 1 - other[:, b:]
        o_other, _ = gated_delta_rule(q, k, v, g, beta, other, block_size=4)
        end = min((b + 1) * 4, 14)
        assert torch.equal(o[:, :end], o_other[:, :end])
        if end < 14 and b < 3:
            assert not torch.equal(o[:, end:], o_other[:, end:])


# --------------------------------------------------------------------------- gradients, dtypes
def test_gradcheck_full_every_input():
    q, k, v, g, beta = make_inputs(1, 9, 2, 3, 3, seed=31)
    write = 0.2 + 0.6 * make_route(1, 3, 2, "fractional", seed=32)
    s0 = 0.5 * torch.randn(1, 2, 3, 3, dtype=F64)
    inputs = [x.clone().requires_grad_() for x in (q, k, v, g, beta, write, s0)]

    def fn(q, k, v, g, beta, write, s0):
        return gated_delta_rule(q, k, v, g, beta, write, initial_state=s0, output_final_state=True,
                                block_size=4, route_grad="full")

    assert torch.autograd.gradcheck(fn, inputs, eps=1e-6, atol=1e-7)


def test_gradcheck_full_no_decay_and_intra_block_off():
    q, k, v, g, beta = make_inputs(1, 7, 1, 3, 2, seed=33)
    write = make_route(1, 2, 1, "fractional", seed=34)
    inputs = [x.clone().requires_grad_() for x in (q, k, g, beta, write)]

    def fn(q, k, g, beta, write):
        a, _ = gated_delta_rule(q, k, v, g, beta, write, block_size=4, route_grad="full", decay_skipped_blocks=False)
        b, _ = gated_delta_rule(q, k, v, g, beta, write, block_size=4, route_grad="full", intra_block=False)
        return a, b

    assert torch.autograd.gradcheck(fn, inputs, eps=1e-6, atol=1e-7)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_low_precision_inputs(dtype):
    q, k, v, g, beta = make_inputs(1, 9, 2, 4, 4, seed=41, dtype=dtype)
    write = make_route(1, 3, 2, "binary", seed=42, dtype=dtype)
    o, s = gated_delta_rule(q, k, v, g, beta, write, output_final_state=True, block_size=4)
    assert o.dtype == dtype and s.dtype == torch.float32
    up = [x.to(F64) for x in (q, k, v, g, beta, write)]
    expected, _ = chunked_gdn(*up[:5], chunk=4, write=up[5])
    torch.testing.assert_close(o.to(F64), expected, rtol=0, atol=2e-2)


def test_float32_state_and_ops_dispatch():
    """fp32 in, fp32 out; natsl.ops with backend='reference' returns the same thing."""
    q, k, v, g, beta = make_inputs(1, 6, 1, 3, 3, seed=43, dtype=torch.float32)
    write = torch.tensor([[[1.0], [0.0]]])
    o, s = gated_delta_rule(q, k, v, g, beta, write, output_final_state=True, block_size=4)
    assert o.dtype == torch.float32 and s.dtype == torch.float32
    o2, s2 = ops.gated_delta_rule(q, k, v, g, beta, write, output_final_state=True, block_size=4, backend="reference")
    assert torch.equal(o, o2) and torch.equal(s, s2)


@settings(max_examples=12, deadline=None)
@given(
    B=st.integers(1, 2), T=st.integers(1, 12), H=st.integers(1, 2), K=st.integers(1, 4),
    V=st.integers(1, 4), C=st.integers(1, 5), decay=st.booleans(), seed=st.integers(0, 1000),
)
def test_property_matches_chunked(B, T, H, K, V, C, decay, seed):
    q, k, v, g, beta = make_inputs(B, T, H, K, V, seed=seed)
    write = make_route(B, math.ceil(T / C), H, "binary", seed=seed + 1)
    s0 = torch.randn(B, H, K, V, dtype=F64, generator=torch.Generator().manual_seed(seed + 2))
    o, s = gated_delta_rule(q, k, v, g, beta, write, initial_state=s0, output_final_state=True,
                            block_size=C, decay_skipped_blocks=decay)
    expected_o, expected_s = chunked_gdn(q, k, v, g, beta, chunk=C, write=write, initial_state=s0,
                                         decay_skipped_blocks=decay)
    assert_close(o, expected_o, tol=1e-10)
    assert_close(s, expected_s, tol=1e-10)


# --------------------------------------------------------------------------- validation
@pytest.mark.parametrize(
    "change, message",
    [
        (dict(k=torch.zeros(1, 5, 2, 4, dtype=F64)), "k must have shape"),
        (dict(g=torch.zeros(1, 5, 2, dtype=F64)), "g must have shape"),
        (dict(write=torch.ones(1, 3, 2, dtype=F64)), r"write must have shape \[B, NB, H\] = \(1, 2, 2\)"),
        (dict(initial_state=torch.zeros(1, 2, 3, 2, dtype=F64)), "initial_state must have shape"),
        (dict(block_size=0), "block_size must be a positive int"),
        (dict(route_grad="sparse"), "unknown route_grad"),
    ],
)
def test_validation_errors(change, message):
    q, k, v, g, beta = make_inputs(1, 6, 2, 3, 3)
    args = dict(q=q, k=k, v=v, g=g, beta=beta, write=None)
    kwargs = dict(block_size=4)
    for name, value in change.items():
        (args if name in args else kwargs)[name] = value
    with pytest.raises(ValueError, match=message):
        gated_delta_rule(*args.values(), **kwargs)

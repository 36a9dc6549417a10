"""The chunk-parallel PyTorch GDN equals the recurrent reference, forward and every gradient."""

import pytest
import torch

from natsl.reference.gated_delta import gated_delta_rule as recurrent
from natsl.reference.gated_delta_chunked import gated_delta_rule as chunked


def inputs(B, T, H, K, V, NB, route, seed):
    gen = torch.Generator().manual_seed(seed)
    r = lambda *s: torch.randn(*s, generator=gen, dtype=torch.float64)
    q = torch.nn.functional.normalize(r(B, T, H, K), dim=-1)
    k = torch.nn.functional.normalize(r(B, T, H, K), dim=-1)
    g = -torch.rand(B, T, H, generator=gen, dtype=torch.float64) * 0.5
    beta = torch.rand(B, T, H, generator=gen, dtype=torch.float64)
    write = {"ones": torch.ones(B, NB, H, dtype=torch.float64), "zeros": torch.zeros(B, NB, H, dtype=torch.float64),
             "random": (torch.rand(B, NB, H, generator=gen) > 0.5).double(),
             "fractional": torch.rand(B, NB, H, generator=gen, dtype=torch.float64)}[route]
    return [q, k, r(B, T, H, V), g, beta, write, r(B, H, K, V)]


@pytest.mark.parametrize("T, C", [(1, 4), (3, 4), (13, 4), (16, 4), (70, 64), (37, 8)])
@pytest.mark.parametrize("route", ["ones", "zeros", "random", "fractional"])
@pytest.mark.parametrize("decay_skipped_blocks", [True, False])
@pytest.mark.parametrize("intra_block", [True, False])
def test_chunked_matches_recurrent(T, C, route, decay_skipped_blocks, intra_block):
    B, H, K, V = 2, 2, 5, 3
    args = inputs(B, T, H, K, V, -(-T // C), route, seed=T * 7 + C)
    for x in args:
        x.requires_grad_(True)
    kw = dict(initial_state=args[6], output_final_state=True, block_size=C, decay_skipped_blocks=decay_skipped_blocks,
              route_grad="full", intra_block=intra_block)
    o_ref, s_ref = recurrent(*args[:6], **kw)
    o_chk, s_chk = chunked(*args[:6], **kw)
    torch.testing.assert_close(o_chk, o_ref, rtol=1e-10, atol=1e-10)
    torch.testing.assert_close(s_chk, s_ref, rtol=1e-10, atol=1e-10)
    do, ds = torch.randn_like(o_ref), torch.randn_like(s_ref)
    g_ref = torch.autograd.grad((o_ref * do).sum() + (s_ref * ds).sum(), args)
    g_chk = torch.autograd.grad((o_chk * do).sum() + (s_chk * ds).sum(), args)
    for name, a, b in zip("q k v g beta write h0".split(), g_chk, g_ref):
        torch.testing.assert_close(a, b, rtol=1e-9, atol=1e-9, msg=name)


def test_chunked_fp32_and_active_policy():
    B, T, H, K, V, C = 1, 50, 2, 8, 8, 16
    args = inputs(B, T, H, K, V, 4, "random", seed=3)
    args = [a.float().requires_grad_(True) for a in args]
    o_ref, _ = recurrent(*args[:6], block_size=C)
    o_chk, _ = chunked(*args[:6], block_size=C)
    assert ((o_chk - o_ref).pow(2).mean().sqrt() / o_ref.pow(2).mean().sqrt()) < 1e-5
    (dw,) = torch.autograd.grad(o_chk.sum() + 0 * args[6].sum(), args[5])
    assert torch.all(dw[args[5] < 0.5] == 0) and dw[args[5] > 0.5][:-H].abs().sum() > 0

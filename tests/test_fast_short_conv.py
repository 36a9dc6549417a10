"""The Triton short conv + SiLU (natsl.fast.short_conv) against its reference twin, forward and both gradients.

On a machine without CUDA the kernels run under TRITON_INTERPRET=1 (set before Triton is imported).
Reference: natsl.models.pointwise.conv_silu run eagerly in fp64 on the same inputs. Metric: relative
RMS error. The `gpu` test runs the 800M layer's widths in bf16.
"""

from __future__ import annotations

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402

from natsl.errors import NatslError  # noqa: E402
from natsl.fast import short_conv as sc  # noqa: E402
from natsl.models import pointwise as pw  # noqa: E402
from numerics import rel_rms  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
if DEVICE == "cpu" and type(sc._conv_fwd_kernel).__name__ != "InterpretedFunction":
    pytest.skip("natsl.fast was imported before TRITON_INTERPRET=1 was set", allow_module_level=True)

TOL = {torch.float32: (1e-6, 1e-6), torch.bfloat16: (5e-3, 1e-2)}  # (forward, gradients)


def oracle(x, weight, tail, dy):
    """Output and (dx, dw) of the eager formula in fp64 on the same inputs."""
    x64 = x.detach().double().requires_grad_(True)
    w64 = weight.detach().double().requires_grad_(True)
    t64 = torch.zeros(x.shape[0], weight.shape[-1] - 1, x.shape[2], dtype=torch.float64, device=x.device) \
        if tail is None else tail.double()
    y = pw.conv_silu.eager(x64, t64, w64)
    y.backward(dy.double())
    return y.detach(), x64.grad, w64.grad


# natsl.fast.short_conv.BACKWARD_FORM for every backward form.
BACKWARD_FORMS = {"two passes": "two_pass", "walk": "walk"}


def use_backward_form(monkeypatch, form):
    monkeypatch.setattr(sc, "BACKWARD_FORM", BACKWARD_FORMS[form])


def run_fast(x, weight, tail, dy):
    x = x.detach().clone().requires_grad_(True)
    weight = weight.detach().clone().requires_grad_(True)
    y = sc.short_conv_silu(x, weight, tail)
    y.backward(dy)
    return y.detach(), x.grad, weight.grad


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("with_tail", [False, True])
@pytest.mark.parametrize("T, C", [(1, 7), (3, 40), (37, 130), (64, 64), (100, 72)])
@pytest.mark.parametrize("form", BACKWARD_FORMS)
def test_forward_and_gradients_match_the_formula(T, C, with_tail, dtype, form, monkeypatch):
    """Odd lengths (T = 1 and T < W - 1 read the tail only), widths that cut the channel tiles and
    lengths that cut the time tiles (forward 32, backward 64 rows); every backward form."""
    use_backward_form(monkeypatch, form)
    gen = torch.Generator().manual_seed(T * 1000 + C)
    B, W = 2, 4
    x = torch.randn(B, T, C, generator=gen).to(DEVICE, dtype)
    weight = (0.5 * torch.randn(C, 1, W, generator=gen)).to(DEVICE)  # fp32 parameter, as under autocast
    tail = torch.randn(B, W - 1, C, generator=gen).to(DEVICE, dtype) if with_tail else None
    dy = torch.randn(B, T, C, generator=gen).to(DEVICE, dtype)
    y, dx, dw = run_fast(x, weight, tail, dy)
    y_ref, dx_ref, dw_ref = oracle(x, weight, tail, dy)
    fwd_tol, grad_tol = TOL[dtype]
    assert y.dtype == dtype and dx.dtype == dtype and dw.dtype == weight.dtype
    assert y.shape == x.shape and dx.shape == x.shape and dw.shape == weight.shape
    assert rel_rms(y, y_ref) < fwd_tol
    assert rel_rms(dx, dx_ref) < grad_tol
    assert rel_rms(dw, dw_ref) < grad_tol


@pytest.mark.parametrize("W", [2, 3, 5])
@pytest.mark.parametrize("form", BACKWARD_FORMS)
def test_other_conv_widths(W, form, monkeypatch):
    """Widths other than the GDN's 4 ("walk" falls back to two passes there), with a tail."""
    use_backward_form(monkeypatch, form)
    gen = torch.Generator().manual_seed(W)
    x = torch.randn(2, 37, 40, generator=gen).to(DEVICE)
    weight = (0.5 * torch.randn(40, 1, W, generator=gen)).to(DEVICE)
    tail = torch.randn(2, W - 1, 40, generator=gen).to(DEVICE)
    dy = torch.randn(2, 37, 40, generator=gen).to(DEVICE)
    for got, want in zip(run_fast(x, weight, tail, dy), oracle(x, weight, tail, dy)):
        assert rel_rms(got, want) < TOL[torch.float32][1]


@pytest.mark.parametrize("tile", [(8, 16, 1), (16, 32, 2), (5, 16, 1)])
@pytest.mark.parametrize("T", [1, 3, 37, 100])
def test_walk_chunks_cut_the_sequence(T, tile, monkeypatch):
    """"walk" with short chunks so that a sequence spans many programs: every chunk boundary needs the
    3 rows after it (read, never written), a chunk not a multiple of the 4 rows per step (5), a last
    chunk cut short, T < 4 reading the tail only; channels that cut the tiles."""
    monkeypatch.setattr(sc, "BACKWARD_FORM", "walk")
    monkeypatch.setitem(sc.BACKWARD_TILES, "walk", tile)
    gen = torch.Generator().manual_seed(T + tile[0])
    x = torch.randn(3, T, 40, generator=gen).to(DEVICE)
    weight = (0.5 * torch.randn(40, 1, 4, generator=gen)).to(DEVICE)
    tail = torch.randn(3, 3, 40, generator=gen).to(DEVICE)
    dy = torch.randn(3, T, 40, generator=gen).to(DEVICE)
    for got, want in zip(run_fast(x, weight, tail, dy), oracle(x, weight, tail, dy)):
        assert rel_rms(got, want) < TOL[torch.float32][1]


def test_a_strided_input_gives_the_contiguous_input_results():
    """x as a column slice of a wider projection output (row stride > C), as a merged product's split
    would hand it over: same output and gradients as the same values laid out contiguously."""
    gen = torch.Generator().manual_seed(9)
    wide = torch.randn(2, 45, 100, generator=gen).to(DEVICE)
    weight = torch.randn(36, 1, 4, generator=gen).to(DEVICE)
    dy = torch.randn(2, 45, 36, generator=gen).to(DEVICE)
    leaf = wide.clone().requires_grad_(True)
    w = weight.clone().requires_grad_(True)
    strided = leaf[..., 20:56]
    assert strided.stride(1) == 100
    y = sc.short_conv_silu(strided, w)
    y.backward(dy)
    y_want, dx_want, dw_want = run_fast(wide[..., 20:56].contiguous(), weight, None, dy)
    assert torch.equal(y, y_want) and torch.equal(w.grad, dw_want)
    assert torch.equal(leaf.grad[..., 20:56], dx_want) and not leaf.grad[..., :20].any()


def test_first_outputs_read_only_the_tail_and_x():
    """A change to x at row t moves outputs t .. t+W-1 only (causal, width W), and the tail moves the
    first W-1 outputs only."""
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(1, 20, 16, generator=gen).to(DEVICE)
    weight = torch.randn(16, 1, 4, generator=gen).to(DEVICE)
    tail = torch.randn(1, 3, 16, generator=gen).to(DEVICE)
    base = sc.short_conv_silu(x, weight, tail)
    bumped = x.clone()
    bumped[:, 9] += 1.0
    changed = (sc.short_conv_silu(bumped, weight, tail) != base).any(-1)[0].nonzero().flatten().tolist()
    assert changed == [9, 10, 11, 12]
    changed = (sc.short_conv_silu(x, weight, tail + 1.0) != base).any(-1)[0].nonzero().flatten().tolist()
    assert changed == [0, 1, 2]


def test_eager_path_equals_the_custom_op(monkeypatch):
    """Eager calls run the autograd.Function twin; under torch.compile the custom op runs. Same kernels,
    so the same bits (output and both gradients)."""
    from natsl.fast import eager

    gen = torch.Generator().manual_seed(5)
    x = torch.randn(2, 37, 40, generator=gen).to(DEVICE)
    weight = torch.randn(40, 1, 4, generator=gen).to(DEVICE)
    dy = torch.randn(2, 37, 40, generator=gen).to(DEVICE)
    twin = run_fast(x, weight, None, dy)
    monkeypatch.setattr(eager, "_compiling", lambda: True)
    op = run_fast(x, weight, None, dy)
    for a, b in zip(twin, op):
        assert torch.equal(a, b)


def test_an_unknown_backward_form_is_named(monkeypatch):
    monkeypatch.setattr(sc, "BACKWARD_FORM", "fastest")
    x = torch.randn(1, 5, 8, device=DEVICE, requires_grad=True)
    y = sc.short_conv_silu(x, torch.randn(8, 1, 4, device=DEVICE))
    with pytest.raises(NatslError, match="'fastest'.*NATSL_SHORT_CONV_BACKWARD.*two_pass, walk"):
        y.sum().backward()


def test_bad_shapes_and_a_tail_that_wants_a_gradient_are_refused():
    x = torch.randn(1, 5, 8, device=DEVICE)
    with pytest.raises(NatslError, match="weight"):
        sc.short_conv_silu(x, torch.randn(4, 1, 4, device=DEVICE))
    with pytest.raises(NatslError, match="tail"):
        sc.short_conv_silu(x, torch.randn(8, 1, 4, device=DEVICE), torch.randn(1, 2, 8, device=DEVICE))
    with pytest.raises(NatslError, match="no gradient for tail"):
        sc.short_conv_silu(x, torch.randn(8, 1, 4, device=DEVICE),
                           torch.randn(1, 3, 8, device=DEVICE, requires_grad=True))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
@pytest.mark.parametrize("C", [1152, 2304])
@pytest.mark.parametrize("form", BACKWARD_FORMS)
def test_gpu_800m_widths_bf16(C, form, monkeypatch):
    """The 800M GDN layer's q/k (1152) and v (2304) widths at batch 4 x 4096 in bf16, every backward form."""
    use_backward_form(monkeypatch, form)
    gen = torch.Generator().manual_seed(C)
    x = torch.randn(4, 4096, C, generator=gen).cuda().bfloat16()
    weight = (0.5 * torch.randn(C, 1, 4, generator=gen)).cuda()
    dy = torch.randn(4, 4096, C, generator=gen).cuda().bfloat16()
    y, dx, dw = run_fast(x, weight, None, dy)
    y_ref, dx_ref, dw_ref = oracle(x, weight, None, dy)
    assert rel_rms(y, y_ref) < 5e-3
    assert rel_rms(dx, dx_ref) < 1e-2
    assert rel_rms(dw, dw_ref) < 1e-2

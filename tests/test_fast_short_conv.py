"""The Triton short conv + SiLU (natsl.fast.short_conv) against its reference twin, forward and both gradients.

On a machine without CUDA the kernels run under TRITON_INTERPRET=1 (set before Triton is imported).
Reference: natsl.reference.short_conv (the reference twin) run in fp64 on the same inputs. Metric: relative
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
from natsl.reference.short_conv import short_conv_silu  # noqa: E402
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
    y = short_conv_silu(x64, w64, t64)
    y.backward(dy.double())
    return y.detach(), x64.grad, w64.grad


# The switch short_conv_backward (natsl.switches) for every backward form.
BACKWARD_FORMS = {"two passes": "two_pass", "walk": "walk"}


def use_backward_form(use_switches, form):
    use_switches(short_conv_backward=BACKWARD_FORMS[form])


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
def test_forward_and_gradients_match_the_formula(T, C, with_tail, dtype, form, monkeypatch, use_switches):
    """Odd lengths (T = 1 and T < W - 1 read the tail only), widths that cut the channel tiles and
    lengths that cut the time tiles (forward 32, backward 64 rows); every backward form."""
    use_backward_form(use_switches, form)
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
def test_other_conv_widths(W, form, monkeypatch, use_switches):
    """Widths other than the GDN's 4 ("walk" falls back to two passes there), with a tail."""
    use_backward_form(use_switches, form)
    gen = torch.Generator().manual_seed(W)
    x = torch.randn(2, 37, 40, generator=gen).to(DEVICE)
    weight = (0.5 * torch.randn(40, 1, W, generator=gen)).to(DEVICE)
    tail = torch.randn(2, W - 1, 40, generator=gen).to(DEVICE)
    dy = torch.randn(2, 37, 40, generator=gen).to(DEVICE)
    for got, want in zip(run_fast(x, weight, tail, dy), oracle(x, weight, tail, dy)):
        assert rel_rms(got, want) < TOL[torch.float32][1]


@pytest.mark.parametrize("tile", [(8, 16, 1), (16, 32, 2), (5, 16, 1)])
@pytest.mark.parametrize("T", [1, 3, 37])
def test_walk_chunks_cut_the_sequence(T, tile, monkeypatch, use_switches):
    """"walk" with short chunks so that a sequence spans many programs: every chunk boundary needs the
    3 rows after it (read, never written), a chunk not a multiple of the 4 rows per step (5), a last
    chunk cut short, T < 4 reading the tail only; channels that cut the tiles. T = 37 already spans 3-8
    chunks with a short last one for every tile: a longer sequence only adds chunks of the same kind."""
    use_switches(short_conv_backward="walk")
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


def test_an_unknown_backward_form_is_named():
    from natsl import switches

    with pytest.raises(NatslError, match="NATSL_SHORT_CONV_BACKWARD='fastest' is not one of walk, two_pass"):
        switches.from_environ({"NATSL_SHORT_CONV_BACKWARD": "fastest"})
    with pytest.raises(NatslError, match="short_conv_backward='fastest' is not one of walk, two_pass"):
        with switches.override(short_conv_backward="fastest"):
            pass


def test_bad_shapes_and_a_tail_that_wants_a_gradient_are_refused():
    x = torch.randn(1, 5, 8, device=DEVICE)
    with pytest.raises(NatslError, match="weight"):
        sc.short_conv_silu(x, torch.randn(4, 1, 4, device=DEVICE))
    with pytest.raises(NatslError, match="tail"):
        sc.short_conv_silu(x, torch.randn(8, 1, 4, device=DEVICE), torch.randn(1, 2, 8, device=DEVICE))
    with pytest.raises(NatslError, match="no gradient for tail"):
        sc.short_conv_silu(x, torch.randn(8, 1, 4, device=DEVICE),
                           torch.randn(1, 3, 8, device=DEVICE, requires_grad=True))


def small_tiles(monkeypatch, channels=16):
    """Channel tiles of `channels` in the forward and every backward form, so that small groups fit;
    16-row chunks for "walk", so that T = 37 spans three of them (the last one cut short) as it spans
    two forward tiles and three two-pass tiles: the interpreter's time grows with T, not with the chunks."""
    monkeypatch.setattr(sc, "FORWARD_TILE", (32, channels))
    monkeypatch.setitem(sc.BACKWARD_TILES, "walk", (16, channels, 1))
    monkeypatch.setitem(sc.BACKWARD_TILES, "two_pass", (16, channels, 2))


def run_split(x, weights, dys):
    x = x.detach().clone().requires_grad_(True)
    weights = [w.detach().clone().requires_grad_(True) for w in weights]
    ys = sc.short_conv_silu_split(x, weights)
    torch.autograd.backward(ys, dys)
    return [y.detach() for y in ys], x.grad, [w.grad for w in weights]


def split_inputs(T, sizes, dtype=torch.float32, seed=0):
    gen = torch.Generator().manual_seed(seed * 1000 + T)
    x = torch.randn(2, T, sum(sizes), generator=gen).to(DEVICE, dtype)
    weights = [(0.5 * torch.randn(c, 1, 4, generator=gen)).to(DEVICE) for c in sizes]
    dys = [torch.randn(2, T, c, generator=gen).to(DEVICE, dtype) for c in sizes]
    return x, weights, dys


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("T", [1, 3, 37])
@pytest.mark.parametrize("form", BACKWARD_FORMS)
def test_split_conv_matches_the_formula_and_separate_convs(T, form, dtype, monkeypatch, use_switches):
    """q, k, v convs in one launch (groups 16, 32, 48 on 16-wide tiles): every output, dx and each
    weight's gradient against the fp64 formula per group, and bitwise the three separate convs."""
    use_backward_form(use_switches, form)
    small_tiles(monkeypatch)
    sizes = [16, 32, 48]
    assert sc.split_fits(sizes)
    x, weights, dys = split_inputs(T, sizes, dtype)
    ys, dx, dws = run_split(x, weights, dys)
    edges = [0, 16, 48, 96]
    fwd_tol, grad_tol = TOL[dtype]
    for i, (a, b) in enumerate(zip(edges, edges[1:])):
        y_ref, dx_ref, dw_ref = oracle(x[..., a:b], weights[i], None, dys[i])
        assert ys[i].shape == (2, T, b - a) and ys[i].is_contiguous() and ys[i].dtype == dtype
        assert rel_rms(ys[i], y_ref) < fwd_tol
        assert rel_rms(dx[..., a:b], dx_ref) < grad_tol
        assert dws[i].shape == weights[i].shape and rel_rms(dws[i], dw_ref) < grad_tol
        y_one, dx_one, dw_one = run_fast(x[..., a:b].contiguous(), weights[i], None, dys[i])
        assert torch.equal(ys[i], y_one) and torch.equal(dx[..., a:b], dx_one) and torch.equal(dws[i], dw_one)


def test_split_conv_falls_back_where_a_tile_crosses_a_group_edge(monkeypatch):
    """Groups of 24 on 16-wide tiles: one conv per group (same values as the joined launch would give)."""
    small_tiles(monkeypatch)
    sizes = [24, 24, 48]
    assert not sc.split_fits(sizes)
    x, weights, dys = split_inputs(37, sizes, seed=1)
    ys, dx, dws = run_split(x, weights, dys)
    for i, (a, b) in enumerate(zip([0, 24, 48], [24, 48, 96])):
        y_one, dx_one, dw_one = run_fast(x[..., a:b].contiguous(), weights[i], None, dys[i])
        assert torch.equal(ys[i], y_one) and torch.equal(dx[..., a:b], dx_one) and torch.equal(dws[i], dw_one)


def test_split_conv_takes_a_strided_input_and_an_unused_output(monkeypatch):
    """x as a column slice of a wider product; only the first group's output used: the other groups'
    input gradient is zero, and the values equal those of the contiguous input."""
    small_tiles(monkeypatch)
    sizes = [16, 16, 32]
    x, weights, dys = split_inputs(45, sizes, seed=2)
    wide = torch.cat([x, torch.randn(2, 45, 8, device=DEVICE)], dim=-1).requires_grad_(True)
    strided = wide[..., :64]
    assert strided.stride(1) == 72
    ys = sc.short_conv_silu_split(strided, weights)
    ys[0].backward(dys[0])
    y_want, dx_want, _ = run_fast(x[..., :16].contiguous(), weights[0], None, dys[0])
    assert torch.equal(ys[0], y_want) and torch.equal(wide.grad[..., :16], dx_want)
    assert not wide.grad[..., 16:].any()


def test_split_conv_eager_twin_equals_the_custom_op(monkeypatch):
    from natsl.fast import eager

    small_tiles(monkeypatch)
    x, weights, dys = split_inputs(37, [16, 16, 32], seed=3)
    twin = run_split(x, weights, dys)
    monkeypatch.setattr(eager, "_compiling", lambda: True)
    op = run_split(x, weights, dys)
    assert all(torch.equal(a, b) for a, b in zip(twin[0] + [twin[1]] + twin[2], op[0] + [op[1]] + op[2]))


def test_split_conv_refuses_mismatched_weights():
    x = torch.randn(1, 5, 64, device=DEVICE)
    with pytest.raises(NatslError, match="sum C_i = C"):
        sc.short_conv_silu_split(x, [torch.randn(16, 1, 4, device=DEVICE)] * 3)


@pytest.mark.parametrize("form", BACKWARD_FORMS)
def test_split_launches_refuse_tiles_that_straddle_a_group_edge(form, monkeypatch, use_switches):
    """Called past short_conv_silu_split's check (the custom op itself), a channel tile that would read
    across a group edge is a clear error, not another group's values."""
    use_backward_form(use_switches, form)
    small_tiles(monkeypatch, channels=16)
    x, weights, dys = split_inputs(5, [8, 8, 16])
    weight = torch.cat(weights)
    with pytest.raises(NatslError, match="not multiples"):
        sc._forward_groups(x, weight, None, [8, 8, 16])
    with pytest.raises(NatslError, match="not multiples"):
        sc._backward_groups(x, weight, None, dys)


def test_a_model_takes_the_joined_convs_and_trains_the_same(monkeypatch, use_switches):
    """The tiny hybrid on the fast backend (q, k 64 and v 128 wide fit 64-wide tiles): every GDN and
    NAtS-L layer runs its q, k, v convs as one op on the joined product, and the logits and every
    parameter's gradient are bitwise those of one conv per slice (the switch joined_conv off)."""
    import dataclasses

    import natsl

    small_tiles(monkeypatch, channels=64)
    calls = []
    real = sc.short_conv_silu_split
    # natsl.ops.short_conv reaches the fast twin through natsl.ops.twin, which remembers what it loaded
    from natsl import ops

    monkeypatch.setitem(ops._LOADED, ("short_conv_silu_split", True), lambda *args: calls.append(1) or real(*args))
    config = dataclasses.replace(natsl.load_recipe("tiny_hybrid").model, backend="fast")
    torch.manual_seed(0)
    model = natsl.build_model(config).to(DEVICE)
    ids = torch.randint(0, config.vocab_size, (1, 24), device=DEVICE)

    def logits_and_grads():
        model.zero_grad()
        logits = model(ids)
        logits.square().mean().backward()
        return logits.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}

    use_switches(joined_conv=False)
    apart = logits_and_grads()
    assert calls == []
    use_switches(joined_conv=True)
    joined = logits_and_grads()
    assert len(calls) == config.num_layers
    assert torch.equal(joined[0], apart[0]) and joined[1].keys() == apart[1].keys()
    for name, grad in apart[1].items():
        assert torch.equal(joined[1][name], grad), name


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
def test_gpu_split_conv_800m_qkv_bf16():
    """The 800M GDN layer's q, k, v convs (1152, 1152, 2304) in one launch, batch 4 x 4096, bf16:
    against the formula, and bitwise the three separate convs."""
    sizes = [1152, 1152, 2304]
    assert sc.split_fits(sizes)
    gen = torch.Generator().manual_seed(11)
    x = torch.randn(4, 4096, sum(sizes), generator=gen).cuda().bfloat16()
    weights = [(0.5 * torch.randn(c, 1, 4, generator=gen)).cuda() for c in sizes]
    dys = [torch.randn(4, 4096, c, generator=gen).cuda().bfloat16() for c in sizes]
    ys, dx, dws = run_split(x, weights, dys)
    edges = [0, 1152, 2304, 4608]
    for i, (a, b) in enumerate(zip(edges, edges[1:])):
        y_ref, dx_ref, dw_ref = oracle(x[..., a:b], weights[i], None, dys[i])
        assert rel_rms(ys[i], y_ref) < 5e-3
        assert rel_rms(dx[..., a:b], dx_ref) < 1e-2
        assert rel_rms(dws[i], dw_ref) < 1e-2
        y_one, dx_one, dw_one = run_fast(x[..., a:b].contiguous(), weights[i], None, dys[i])
        assert torch.equal(ys[i], y_one) and torch.equal(dx[..., a:b], dx_one) and torch.equal(dws[i], dw_one)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
@pytest.mark.parametrize("C", [1152, 2304])
@pytest.mark.parametrize("form", BACKWARD_FORMS)
def test_gpu_800m_widths_bf16(C, form, monkeypatch, use_switches):
    """The 800M GDN layer's q/k (1152) and v (2304) widths at batch 4 x 4096 in bf16, every backward form."""
    use_backward_form(use_switches, form)
    gen = torch.Generator().manual_seed(C)
    x = torch.randn(4, 4096, C, generator=gen).cuda().bfloat16()
    weight = (0.5 * torch.randn(C, 1, 4, generator=gen)).cuda()
    dy = torch.randn(4, 4096, C, generator=gen).cuda().bfloat16()
    y, dx, dw = run_fast(x, weight, None, dy)
    y_ref, dx_ref, dw_ref = oracle(x, weight, None, dy)
    assert rel_rms(y, y_ref) < 5e-3
    assert rel_rms(dx, dx_ref) < 1e-2
    assert rel_rms(dw, dw_ref) < 1e-2

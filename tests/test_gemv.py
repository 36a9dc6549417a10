"""natsl.fast.gemv (decode-step matrix-vector products) against F.linear, and when its door
natsl.ops.gemv (through which natsl.models.linear.Linear and the SwiGLU reach it) uses it."""

import pytest
import torch
import torch.nn.functional as F

from natsl.devices import triton_interpreted
from natsl.fast import gemv as kernel
from natsl.models.linear import Linear
from natsl.models.mlp import SwiGLU
from natsl.ops import gemv


def relative_error(got, want):
    return float(((got.float() - want.float()).abs().max() / want.float().abs().max()).detach())


def device():
    if torch.cuda.is_available():
        return "cuda"
    if triton_interpreted():
        return "cpu"
    pytest.skip("needs CUDA or the Triton interpreter")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows", [1, 2, 3, 4])
def test_gemv_equals_f_linear(rows, dtype):
    """Odd N and K, K over several chunks, a strided input row; bf16 within one rounding."""
    dev = device()
    gen = torch.Generator().manual_seed(rows)
    for N, K in ((37, 5), (130, 100), (300, 1030), (20, 5000)):  # one pass, looped, K beyond one tile
        weight = torch.randn(N, K, generator=gen).to(dev, dtype)
        x = torch.randn(rows, 2 * K, generator=gen).to(dev, dtype)[:, ::2]  # rows are strided
        got = kernel.linear(x, weight)
        want = F.linear(x.float(), weight.float())  # fp32 products of the same inputs
        assert got.shape == (rows, N) and got.dtype == dtype
        # bf16: one rounding of the fp32 sum (< 2^-7 of the largest value; the interpreter truncates)
        assert relative_error(got, want) < (1e-5 if dtype == torch.float32 else 2 ** -7), (N, K)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gated_gemv_equals_swiglu_then_linear(dtype):
    """`up=`: the input is silu(x) * up, rounded once to the input dtype, as the compiled SwiGLU."""
    from natsl.models import pointwise as pw

    dev = device()
    gen = torch.Generator().manual_seed(9)
    for rows, N, K in ((1, 24, 300), (2, 40, 70)):
        gate = torch.randn(rows, K, generator=gen).to(dev, dtype)
        up = torch.randn(rows, K, generator=gen).to(dev, dtype)
        weight = torch.randn(N, K, generator=gen).to(dev, dtype)
        hidden = (pw.swiglu.__wrapped__(gate.float(), up.float())).to(dtype)  # one rounding
        want = F.linear(hidden.float(), weight.float())
        got = kernel.linear(gate, weight, up=up)
        # bf16: the rounding of the product (and of the hidden value: the interpreter truncates)
        assert relative_error(got, want) < (1e-5 if dtype == torch.float32 else 2 ** -6), (rows, N, K)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows", [1, 2, 4])
def test_norm_gated_gemv_equals_its_twin_and_the_norm_then_the_product(rows, dtype):
    """`norm=(weight, eps)` with `up=`: the input is RMSNorm(x per head) * weight * silu(up), formed as
    the kernel reads x, against the reference twin and against the norm then the product. Heads of 16-64
    columns; 3 heads (a tile wider than K), heads over several tiles, tiles narrower than a head (the
    launcher widens them), strided rows, an odd N; heads of 24, 48 and 384 (the 800M GDN's), which are not
    powers of two (each takes the next power of two's positions in a tile)."""
    from natsl.reference import gemv as reference
    from natsl.reference.norms import rms_norm

    dev = device()
    gen = torch.Generator().manual_seed(10 + rows)
    for N, H, D, tiles in ((37, 3, 16, {}), (130, 4, 32, {}), (24, 2, 64, {"block_n": 4, "block_k": 32}),
                           (9, 6, 16, {"block_n": 2, "block_k": 32}), (11, 3, 24, {}), (7, 2, 384, {}),
                           (5, 5, 48, {"block_n": 2, "block_k": 128})):
        K = H * D
        x = torch.randn(rows, 2 * K, generator=gen).to(dev, dtype)[:, ::2]  # rows are strided
        gate = torch.randn(rows, K, generator=gen).to(dev, dtype)
        norm_weight = (1 + 0.3 * torch.randn(D, generator=gen)).to(dev, dtype)
        weight = torch.randn(N, K, generator=gen).to(dev, dtype)
        got = kernel.linear(x, weight, up=gate, norm=(norm_weight, 1e-6), **tiles)
        twin = reference.linear(x, weight, up=gate, norm=(norm_weight, 1e-6))
        normed = rms_norm(x.reshape(rows, H, D), norm_weight, 1e-6, gate=gate.reshape(rows, H, D)).reshape(rows, K)
        want = F.linear(normed.float(), weight.float())
        assert got.shape == (rows, N) and got.dtype == dtype
        # bf16: the rounding of the normed input and of the product (the interpreter truncates)
        tol = 1e-5 if dtype == torch.float32 else 2 ** -6
        assert relative_error(got, want) < tol and relative_error(twin, want) < tol, (N, H, D)


def test_gated_norm_linear_runs_only_with_its_switch_where_the_kernel_applies(use_switches):
    """natsl.ops.gemv.gated_norm_linear: None (the caller's norm then product) with the switch fused_o_norm
    off, with autograd, or with a head width that does not divide the row; else the fused product, equal to
    the norm then the product, at heads of 32 and of 24 (not a power of two)."""
    from natsl.reference.norms import rms_norm

    dev = device()
    gen = torch.Generator().manual_seed(4)
    x, gate = torch.randn(1, 1, 64, generator=gen).to(dev), torch.randn(1, 1, 64, generator=gen).to(dev)
    norm_weight, weight = torch.rand(32, generator=gen).to(dev), torch.randn(24, 64, generator=gen).to(dev)
    use_switches(force_decode_gemv=True, fused_o_norm=False)
    with torch.no_grad():
        assert gemv.gated_norm_linear(x, gate, norm_weight, 1e-6, weight) is None
    use_switches(fused_o_norm=True)
    assert gemv.gated_norm_linear(x, gate, norm_weight, 1e-6, weight) is None  # autograd on
    with torch.no_grad():
        assert gemv.gated_norm_linear(x, gate, norm_weight[:24], 1e-6, weight) is None  # 24 does not divide 64
        got = gemv.gated_norm_linear(x, gate, norm_weight, 1e-6, weight)
        got24 = gemv.gated_norm_linear(x[..., :48], gate[..., :48], norm_weight[:24], 1e-6, weight[:, :48])
    want = F.linear(rms_norm(x.view(1, 1, 2, 32), norm_weight, 1e-6, gate=gate.view(1, 1, 2, 32)).view(1, 1, 64), weight)
    assert got.shape == (1, 1, 24) and relative_error(got, want) < 1e-5
    want24 = F.linear(rms_norm(x[..., :48].reshape(1, 1, 2, 24), norm_weight[:24], 1e-6,
                               gate=gate[..., :48].reshape(1, 1, 2, 24)).view(1, 1, 48), weight[:, :48])
    assert got24 is not None and relative_error(got24, want24) < 1e-5


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows", [1, 2, 3, 4])
def test_add_norm_gemv_equals_its_twin_and_the_add_norm_then_the_product(rows, dtype):
    """natsl.fast.gemv.add_norm_linear: the residual add and the RMSNorm formed as the kernel reads its
    input (the rows' sums of squares in the product's pass; the first program writes the sum) against the twin and
    against add_rms_norm then F.linear. K in one tile and over several, an odd
    K, strided rows, no residual (the first block)."""
    from natsl.reference import gemv as reference
    from natsl.reference.norms import add_rms_norm, rms_norm

    dev = device()
    gen = torch.Generator().manual_seed(20 + rows)
    for N, K, tiles in ((37, 48, {}), (130, 100, {"block_n": 8, "block_k": 32}), (300, 1030, {})):
        x = torch.randn(rows, 2 * K, generator=gen).to(dev, dtype)[:, ::2]  # rows are strided
        residual = torch.randn(rows, K, generator=gen).to(dev, dtype)
        norm_weight = (1 + 0.3 * torch.randn(K, generator=gen)).to(dev, dtype)
        weight = torch.randn(N, K, generator=gen).to(dev, dtype)
        tol = 1e-5 if dtype == torch.float32 else 2 ** -6  # bf16: the normed input's and the product's rounding
        for res in (residual, None):
            total, got = kernel.add_norm_linear(x, res, norm_weight, 1e-6, weight, **tiles)
            twin_total, twin = reference.add_norm_linear(x, res, norm_weight, 1e-6, weight)
            want_total, normed = (x, rms_norm(x, norm_weight, 1e-6)) if res is None else add_rms_norm(
                x, res, norm_weight, 1e-6)
            want = F.linear(normed.float(), weight.float())
            assert got.shape == (rows, N) and got.dtype == dtype and total.shape == x.shape
            assert torch.equal(twin_total, want_total), (N, K)
            if dtype == torch.float32 or dev == "cuda":  # one rounding of the same sum: the same bits
                assert torch.equal(total, want_total), (N, K)
            else:  # the interpreter truncates to bf16 where the GPU rounds: within one bf16 step
                assert relative_error(total, want_total) < 2 ** -7, (N, K)
            assert relative_error(got, want) < tol and relative_error(twin, want) < tol, (N, K, res is None)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows", [1, 2, 4])
def test_gated_input_norm_gemv_equals_its_twin_and_the_norm_then_the_product(rows, dtype):
    """natsl.fast.gemv.gated_input_norm_linear (Mamba2's output norm: RMSNorm of x * silu(gate) over the
    row, then the product) against the reference twin and against gated_input_rms_norm then F.linear: K in
    one tile and over several, an odd K, x and the gate as column slices of one wider row."""
    from natsl.reference import gemv as reference
    from natsl.reference.norms import gated_input_rms_norm

    dev = device()
    gen = torch.Generator().manual_seed(30 + rows)
    for N, K, tiles in ((37, 48, {}), (130, 100, {"block_n": 8, "block_k": 32}), (60, 1030, {})):
        both = torch.randn(rows, 2 * K + 3, generator=gen).to(dev, dtype)
        x, gate = both[:, :K], both[:, K + 3:]  # column slices, as Mamba2's y and z
        norm_weight = (1 + 0.3 * torch.randn(K, generator=gen)).to(dev, dtype)
        weight = torch.randn(N, K, generator=gen).to(dev, dtype)
        got = kernel.gated_input_norm_linear(x, gate, norm_weight, 1e-6, weight, **tiles)
        twin = reference.gated_input_norm_linear(x, gate, norm_weight, 1e-6, weight)
        want = F.linear(gated_input_rms_norm(x, norm_weight, 1e-6, gate).float(), weight.float())
        assert got.shape == (rows, N) and got.dtype == dtype
        tol = 1e-5 if dtype == torch.float32 else 2 ** -6  # bf16: the normed input's and the product's rounding
        assert relative_error(got, want) < tol and relative_error(twin, want) < tol, (N, K)


@pytest.mark.parametrize("rows", [1, 2])
def test_mlp_after_norm_runs_the_add_norm_in_the_gate_up_product_only_with_its_switch(rows, use_switches,
                                                                                      monkeypatch):
    """SwiGLU.after_norm: with the switch fused_add_norm and the merged gate/up buffer, the add and norm run
    in the gate/up GEMV (no add-norm kernel) at one row; without either, or at two rows (beyond
    natsl.ops.gemv.ADD_NORM_FOLD_ROWS), kernels.add_norm then the MLP; same values."""
    from natsl.models.merged import merge_
    from natsl.models.norms import RMSNorm
    from natsl.ops import kernel_set

    dev = device()
    torch.manual_seed(3)
    mlp, norm = SwiGLU(48, 80, device=dev), RMSNorm(48, 1e-6, device=dev)
    with torch.no_grad():
        norm.weight.add_(0.1 * torch.randn(48, device=dev))
    x, pending = torch.randn(rows, 1, 48, device=dev), torch.randn(rows, 1, 48, device=dev)
    kernels = kernel_set.pick("chunked", torch.device(dev))
    added = []
    real = kernels.add_norm
    monkeypatch.setattr(kernels, "add_norm", lambda *a: added.append(1) or real(*a))
    results = {}
    for merged, fused in ((False, True), (True, False), (True, True)):
        if merged:
            merge_(mlp)
        use_switches(force_decode_gemv=True, fused_add_norm=fused)
        added.clear()
        with torch.no_grad():
            results[merged, fused] = mlp.after_norm(x, pending, norm, kernels)
        assert len(added) == (0 if merged and fused and rows == 1 else 1), (merged, fused)
    want_total, want = results[True, False]
    for total, y in results.values():
        assert torch.equal(total, want_total) and relative_error(y, want) < 1e-5


def test_gemv_keeps_leading_dims():
    dev = device()
    weight = torch.randn(24, 40, device=dev)
    x = torch.randn(2, 1, 40, device=dev)
    assert kernel.linear(x, weight).shape == (2, 1, 24)
    assert relative_error(kernel.linear(x, weight), F.linear(x, weight)) < 1e-5


def test_linear_uses_gemv_only_for_grad_free_decode_sized_inputs(monkeypatch, use_switches):
    dev = device()
    calls = []
    real = gemv.kernel
    use_switches(force_decode_gemv=True)
    monkeypatch.setattr(gemv, "kernel", lambda x, w, up=None: calls.append(x.shape) or real(x, w, up=up))
    layer = Linear(40, 24, bias=False, device=dev)
    small = torch.randn(gemv.MAX_ROWS, 1, 40, device=dev)
    large = torch.randn(gemv.MAX_ROWS + 1, 1, 40, device=dev)
    with torch.no_grad():
        out_small, out_large = layer(small), layer(large)
    assert calls == [small.shape]  # MAX_ROWS rows: the kernel; one more: F.linear
    assert relative_error(out_small, F.linear(small, layer.weight)) < 1e-5
    assert relative_error(out_large, F.linear(large, layer.weight)) < 1e-6
    layer(small).sum().backward()  # with autograd: F.linear, gradients as nn.Linear's
    assert len(calls) == 1 and layer.weight.grad is not None
    use_switches(force_decode_gemv=False)
    with torch.no_grad():
        layer(small)
    assert len(calls) == 1


def test_swiglu_down_product_takes_both_halves_only_on_the_kernel(monkeypatch, use_switches):
    """natsl.ops.gemv.swiglu_linear: a decode-sized grad-free call reads gate and up on the kernel
    (no SwiGLU kernel); otherwise the compiled SwiGLU then the product (the training path), with the
    same values either way."""
    dev = device()
    calls = []
    real = gemv.kernel
    monkeypatch.setattr(gemv, "kernel", lambda x, w, up=None: calls.append(up is not None) or real(x, w, up=up))
    torch.manual_seed(2)
    mlp = SwiGLU(24, 40, device=dev)
    x = torch.randn(1, 1, 24, device=dev)
    use_switches(force_decode_gemv=False)
    with torch.no_grad():
        plain = mlp(x)
    assert calls == []
    use_switches(force_decode_gemv=True)
    with torch.no_grad():
        fast = mlp(x)
    assert calls == [False, False, True]  # gate and up products, then the down product reading both
    assert relative_error(fast, plain) < 1e-5
    mlp(x).sum().backward()  # with autograd: cuBLAS, gradients as nn.Linear's
    assert len(calls) == 3 and mlp.down_proj.weight.grad is not None


@pytest.mark.gpu
def test_gpu_gemv_at_the_800m_shapes():
    """bf16 at the decode products of the 800M models (merged q/k/v/a/b, gate+up, down, o, lm head)."""
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    gen = torch.Generator(device="cuda").manual_seed(0)
    for N, K in ((6924, 1536), (8192, 1536), (1536, 4096), (1536, 2304), (32000, 1536)):
        weight = torch.randn(N, K, device="cuda", generator=gen).to(torch.bfloat16) * 0.02
        for rows in (1, 2, 4):
            x = torch.randn(rows, K, device="cuda", generator=gen).to(torch.bfloat16)
            assert relative_error(kernel.linear(x, weight), F.linear(x.float(), weight.float())) < 2 ** -8, (N, K, rows)


@pytest.mark.gpu
def test_gpu_pdl_chain_in_a_cuda_graph_equals_plain_launches(monkeypatch, use_switches):
    """A decode-like chain (norm, products, SwiGLU down product, residual add + norm, one more
    product) replayed from a CUDA graph with programmatic dependent launch gives bitwise the
    results of plain launches: each kernel waits for its inputs before it reads them."""
    if not torch.cuda.is_available() or torch.cuda.get_device_capability()[0] < 9:
        pytest.skip("needs a CUDA device of compute capability >= 9")
    from natsl.fast import norms as kernels

    gen = torch.Generator(device="cuda").manual_seed(1)
    d, f = 1536, 4096
    norm_w = (1 + 0.1 * torch.randn(d, device="cuda", generator=gen)).to(torch.bfloat16)
    w_up = (0.02 * torch.randn(2 * f, d, device="cuda", generator=gen)).to(torch.bfloat16)
    w_down = (0.02 * torch.randn(d, f, device="cuda", generator=gen)).to(torch.bfloat16)
    w_o = (0.02 * torch.randn(8192, d, device="cuda", generator=gen)).to(torch.bfloat16)
    x = torch.randn(1, d, device="cuda", generator=gen).to(torch.bfloat16)

    def chain():
        h = kernels.rms_norm(x, norm_w, 1e-6)
        gate, up = kernel.linear(h, w_up).chunk(2, dim=-1)
        y = kernel.linear(gate.contiguous(), w_down, up=up.contiguous())
        total, h2 = kernels.add_rms_norm(y, x, norm_w, 1e-6)
        return total, kernel.linear(h2, w_o)

    def plain(new_x):
        use_switches(force_decode_pdl=False)
        x.copy_(new_x)
        return [t.clone() for t in chain()]

    from natsl.inference.cuda_graph import capture

    use_switches(force_decode_pdl=True)
    graph, got = capture(chain, warmups=2)
    # A fresh input each replay: a kernel that read a buffer before the kernel writing it had
    # finished would see the previous replay's values, which differ.
    for i in range(4):
        new_x = torch.randn(1, d, device="cuda", generator=gen).to(torch.bfloat16)
        want = plain(new_x)
        x.copy_(new_x)
        graph.replay()
        torch.cuda.synchronize()
        for a, b in zip(got, want):
            assert torch.equal(a, b), i


def test_pdl_switch(monkeypatch, use_switches):
    """PDL only on CUDA devices of compute capability >= 9, off with the switch decode_pdl off or on the
    CPU (where the launch takes no PDL keyword at all); the switch force_decode_pdl overrides the rule."""
    from natsl import switches
    from natsl.fast import cached as kernels

    cuda = torch.device("cuda", 0)
    use_switches(force_decode_pdl=None, decode_pdl=True)
    monkeypatch.setattr(kernels, "capability", lambda device: (9, 0))
    assert kernels.pdl(cuda) and kernels.launch_options(True) == {"launch_pdl": True}
    with switches.override(decode_pdl=False):
        assert not kernels.pdl(cuda)
    monkeypatch.setattr(kernels, "capability", lambda device: (8, 0))
    assert not kernels.pdl(cuda)
    use_switches(force_decode_pdl=True)
    assert kernels.pdl(cuda) and not kernels.pdl(torch.device("cpu"))
    assert kernels.launch_options(False) == {}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows", [1, 2, 4])
def test_conv_epilogue_equals_the_product_then_the_conv_steps(rows, dtype):
    """`conv=`: the GEMV runs up to three short convs + SiLU on columns of its product as it stores them (a GDN
    layer's q, k, v after its merged product; Mamba2's xBC in the middle of in_proj's), the tails shifted in
    place, against the reference twin and against the product then natsl.fast.cached.conv_steps: segments that
    start at column 0 and later, odd widths, tiles that cut across segment edges, plain and add-norm products."""
    from natsl.fast import cached
    from natsl.reference import gemv as reference

    dev = device()
    gen = torch.Generator().manual_seed(40 + rows)
    for start, widths, tail_len, tiles in ((0, (24, 24, 40), 3, {}), (7, (37,), 3, {"block_n": 8, "block_k": 32}),
                                           (0, (5, 9), 1, {"block_n": 4, "block_k": 16})):
        K, N = 48, start + sum(widths) + 11  # columns after the convs pass through (a GDN layer's a, b, g)
        x = torch.randn(rows, K, generator=gen).to(dev, dtype)
        residual = torch.randn(rows, K, generator=gen).to(dev, dtype)
        norm_weight = (1 + 0.3 * torch.randn(K, generator=gen)).to(dev, dtype)
        weight = torch.randn(N, K, generator=gen).to(dev, dtype)
        conv_weights = [torch.randn(C, 1, tail_len + 1, generator=gen).to(dev, dtype) for C in widths]
        tails = [torch.randn(rows, tail_len, C, generator=gen).to(dev, dtype) for C in widths]
        for fold in (False, True):
            def run(fn, conv_tails):
                conv = (start, conv_weights, conv_tails)
                if fold:
                    return fn.add_norm_linear(x, residual, norm_weight, 1e-6, weight, conv=conv, **tiles)[1]
                return fn.linear(x, weight, conv=conv, **tiles)

            fast_tails, twin_tails = [t.clone() for t in tails], [t.clone() for t in tails]
            got, twin = run(kernel, fast_tails), run(reference, twin_tails)
            # the same product without the conv, then the conv steps' own kernel on its columns
            plain = (kernel.add_norm_linear(x, residual, norm_weight, 1e-6, weight, **tiles)[1] if fold
                     else kernel.linear(x, weight, **tiles))
            want_tails = [t.clone() for t in tails]
            pieces = plain[:, None, start:start + sum(widths)].split(list(widths), dim=-1)
            want = plain.clone()
            want[:, start:start + sum(widths)] = torch.cat(cached.conv_steps(list(pieces), want_tails, conv_weights),
                                                           dim=-1)[:, 0]
            assert got.shape == (rows, N) and got.dtype == dtype
            assert torch.equal(got, want), (start, widths, fold)  # the same fp32 sums in the same order
            assert all(torch.equal(a, b) for a, b in zip(fast_tails, want_tails))
            # bf16: the product's rounding, carried through the conv's sum (the interpreter truncates: twice that)
            tol = 1e-5 if dtype == torch.float32 else 2 ** -6 if dev == "cuda" else 2 ** -5
            assert relative_error(got, twin) < tol, (start, widths, fold)
            assert all(relative_error(a, b) < tol for a, b in zip(fast_tails, twin_tails))
            assert not torch.equal(fast_tails[0], tails[0])  # the tails moved


HOPPER_VARIANTS = {  # the decode shapes' kernel variants: (label, constexprs beyond the plain loop's)
    "plain loop": {},
    "SwiGLU down, one pass, 2 rows": {"M": 2, "BLOCK_N": 2, "BLOCK_K": 4096, "ACC_K": 1, "GATED": True},
    "add + norm + conv, 2 rows": {"M": 2, "ROW_NORM": True, "HAS_RES": True, "CONV": True, "CONV_W": 3},
    "Mamba2 gated-input norm, one pass, 2 rows": {"M": 2, "BLOCK_N": 2, "BLOCK_K": 4096, "ACC_K": 1,
                                                  "ROW_NORM": True, "GATE_FIRST": True},
    "GDN output norm, head 384": {"BLOCK_N": 2, "BLOCK_K": 4096, "ACC_K": 1, "GATED": True, "NORM_HEAD": 384,
                                  "HEAD_P2": 512},
}


_COMPILE_FOR_HOPPER = """
import json, sys
from benchmarks.resources import usage
from natsl.fast.gemv_kernel import gemv_kernel

found = usage(gemv_kernel, json.loads(sys.argv[1]), num_warps=4, num_stages=3)
assert 0 < found["registers"] <= 255, found
print("compiled", found)
"""


@pytest.mark.parametrize("variant", list(HOPPER_VARIANTS))
def test_the_kernel_compiles_for_hopper(variant):
    """Triton's whole path to a Hopper binary (sm_90: the GPU's code generator and ptxas; benchmarks.resources'
    `usage`), on any machine, in a process without the interpreter: a construct that the interpreter runs but
    the compiler rejects fails here rather than on the first GPU."""
    import json
    import os
    import subprocess
    import sys
    from pathlib import Path

    pytest.importorskip("triton")
    constexprs = {"M": 1, "BLOCK_N": 16, "BLOCK_K": 256, "ACC_K": 256, "GATED": False, "NORM_HEAD": 0,
                  "HEAD_P2": 0, "ROW_NORM": False, "HAS_RES": False, "GATE_FIRST": False, "PDL": True,
                  "CONV": False, "CONV_W": 1, **HOPPER_VARIANTS[variant]}
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = str(Path(__file__).resolve().parents[1])
    proc = subprocess.run([sys.executable, "-c", _COMPILE_FOR_HOPPER, json.dumps(constexprs)], capture_output=True,
                          text=True, env=env, timeout=600)
    if proc.returncode and "has no NVIDIA backend tools" in proc.stderr:
        pytest.skip(proc.stderr.strip())
    assert proc.returncode == 0 and "compiled" in proc.stdout, proc.stderr[-3000:]

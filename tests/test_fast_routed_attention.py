"""Fast (Triton) routed attention against the reference: output and every gradient.

On a machine without CUDA the kernels run under TRITON_INTERPRET=1 (slow), so the CPU shapes are
tiny. Errors are relative RMS, rms(fast - ref) / rms(ref), against the reference evaluated in
float64 on the same inputs: fp32 must agree to rounding, bf16 within 5e-3 (forward) and 1e-2
(gradients). The @pytest.mark.gpu test runs the 800M shapes at T = 4096 on the GPU.
"""

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before Triton is imported

import math  # noqa: E402

import pytest  # noqa: E402

from natsl.errors import NatslError  # noqa: E402
from natsl.fast.block_sparse import config, routed_attention  # noqa: E402
from natsl.reference.route_grad import routed_attention_keep_grad  # noqa: E402
from natsl.reference.routed_attention import routed_attention as reference  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
TOL = {torch.float32: (1e-5, 1e-5), torch.bfloat16: (5e-3, 1e-2), torch.float16: (1e-3, 2e-3)}


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    """rms(a - b) / rms(b); absolute where the reference is exactly zero (e.g. dq at T = 1)."""
    a, b = a.double(), b.double()
    diff = (a - b).pow(2).mean().sqrt().item()
    ref = b.pow(2).mean().sqrt().item()
    return diff / ref if ref > 1e-12 else diff


def make_keep(kind: str, B: int, NB: int, G: int, gen: torch.Generator) -> torch.Tensor:
    if kind == "ones":
        return torch.ones(B, NB, G)
    if kind == "zeros":
        return torch.zeros(B, NB, G)
    return (torch.rand(B, NB, G, generator=gen) < 0.5).float()


def compare(B, T, Hs, G, Dk, Dv, keep_kind, route_grad, *, dtype=torch.float32, block_size=64, seed=0,
            device=DEVICE, ref_dtype=torch.float64):
    """Run fast and reference on fresh random inputs; return the errors of o, dq, dk, dv, dkeep."""
    gen = torch.Generator().manual_seed(seed)
    NB = math.ceil(T / block_size)
    q = torch.randn(B, T, Hs, Dk, generator=gen)
    k = torch.randn(B, T, Hs, Dk, generator=gen)
    v = torch.randn(B, T, Hs, Dv, generator=gen)
    do = torch.randn(B, T, Hs, Dv, generator=gen)
    keep = make_keep(keep_kind, B, NB, G, gen)
    inputs = [x.to(device) for x in (q, k, v, keep)]
    do = do.to(device)

    fast_in = [x.to(dtype).requires_grad_() for x in inputs[:3]] + [inputs[3].clone().requires_grad_()]
    o = routed_attention(*fast_in, block_size=block_size, route_grad=route_grad)
    assert o.dtype == dtype and o.shape == (B, T, Hs, Dv)
    grads = torch.autograd.grad(o, fast_in, do.to(dtype))

    # The reference sees the very values the fast path saw (rounded to dtype), in ref_dtype.
    ref_in = [x.detach().to(ref_dtype).requires_grad_() for x in fast_in]
    o_ref = reference(*ref_in, block_size=block_size, route_grad=route_grad)
    grads_ref = torch.autograd.grad(o_ref, ref_in, do.to(dtype).to(ref_dtype))
    for t in (o, *grads):
        assert torch.isfinite(t).all()
    return [rel_err(a, b) for a, b in zip((o, *grads), (o_ref, *grads_ref))]


def assert_close(errs, dtype):
    fwd_tol, grad_tol = TOL[dtype]
    names = ("o", "dq", "dk", "dv", "dkeep")
    assert errs[0] <= fwd_tol, dict(zip(names, errs))
    assert max(errs[1:]) <= grad_tol, dict(zip(names, errs))


# Each T meets each keep kind; group size and policy rotate so all of them appear.
CASES = [
    (T, kind, *[(1, "full"), (2, "active"), (4, "full"), (2, "full"), (4, "active")][(i + j) % 5])
    for i, T in enumerate((1, 37, 64, 100, 200))
    for j, kind in enumerate(("random", "ones", "zeros"))
]


@pytest.mark.parametrize("T,keep_kind,G,route_grad", CASES)
def test_fp32_matches_reference(T, keep_kind, G, route_grad):
    errs = compare(2, T, 4, G, 16, 32, keep_kind, route_grad, seed=T * 13 + G)
    assert_close(errs, torch.float32)


@pytest.mark.parametrize("G", (1, 2, 4))
@pytest.mark.parametrize("route_grad", ("active", "full"))
def test_group_sizes_and_policies(G, route_grad):
    errs = compare(2, 100, 4, G, 32, 16, "random", route_grad, block_size=32, seed=G)
    assert_close(errs, torch.float32)


@pytest.mark.parametrize("block_m,block_n", [(16, 16), (32, 16), (16, 64), (64, 32)])
def test_tilings_with_many_blocks(monkeypatch, block_m, block_n):
    """Small routing blocks give many kept/dropped runs; tiles smaller than, equal to and larger
    than a block (key tiles spanning several kept blocks, with a partly filled last one) agree."""
    for cfg in (config.FORWARD_32BIT, config.BACKWARD_DQ_32BIT):
        monkeypatch.setitem(cfg, "BLOCK_M", block_m)
        monkeypatch.setitem(cfg, "BLOCK_N", block_n)
    monkeypatch.setitem(config.BACKWARD_DKDV_32BIT, "BLOCK_N", block_n)
    monkeypatch.setitem(config.BACKWARD_DKDV_32BIT, "BLOCK_M", block_m)
    errs = compare(2, 200, 4, 2, 16, 16, "random", "full", block_size=32, seed=block_m + block_n)
    assert_close(errs, torch.float32)


@pytest.mark.parametrize("heads_first", (True, False))
def test_both_grid_orders(monkeypatch, heads_first):
    """The kernels' two program orders (every head's heaviest tiles first, or a head's tiles
    together) compute the same thing; B = 2 so that both grid axes mix heads and sequences."""
    monkeypatch.setattr(config, "HEADS_FIRST", heads_first)
    assert_close(compare(2, 300, 4, 2, 32, 48, "random", "full", seed=7), torch.float32)


def test_program_order_rule(monkeypatch):
    """Heads first for grids of at most 8 programs per SM, a head's tiles together above; the
    override wins."""
    monkeypatch.setattr(config, "HEADS_FIRST", None)
    monkeypatch.setattr(config, "sm_count", lambda device: 132)
    cuda = torch.device("cuda", 0)
    assert config.heads_first(18 * 32, cuda)  # batch 1 x 4K at the 800M shapes
    assert config.heads_first(8 * 132, cuda)
    assert not config.heads_first(8 * 132 + 1, cuda)
    assert not config.heads_first(4 * 18 * 32, cuda)  # batch 4 x 4K (training)
    monkeypatch.setattr(config, "HEADS_FIRST", True)
    assert config.heads_first(10**6, cuda)


def test_eager_path_equals_the_custom_op(monkeypatch):
    """Eager calls skip the custom-op dispatcher (host time) but run the same kernels and autograd
    formula: output and every gradient bitwise equal to the custom op's, also without autograd."""
    from natsl.fast import eager as eager_lane
    from natsl.fast.block_sparse import function

    gen = torch.Generator().manual_seed(3)
    B, T, Hs, G, D = 2, 100, 4, 2, 16
    q, k, v = (torch.randn(B, T, Hs, D, generator=gen).to(DEVICE) for _ in range(3))
    keep = (torch.rand(B, 2, G, generator=gen) < 0.5).float().to(DEVICE)
    do = torch.randn(B, T, Hs, D, generator=gen).to(DEVICE)

    def run(via_custom_op: bool):
        monkeypatch.setattr(eager_lane, "_compiling", lambda: via_custom_op)
        inputs = [x.clone().requires_grad_() for x in (q, k, v, keep)]
        o = routed_attention(*inputs, route_grad="full")
        return (o, *torch.autograd.grad(o, inputs, do))

    eager, custom = run(False), run(True)
    for a, b in zip(eager, custom):
        assert torch.equal(a, b)
    monkeypatch.setattr(eager_lane, "_compiling", lambda: False)
    with torch.no_grad():
        assert torch.equal(routed_attention(q, k, v, keep), eager[0])
    called = []
    monkeypatch.setattr(function, "routed_attention_forward", lambda *a: called.append(1) or function._forward_impl(*a))
    routed_attention(q.requires_grad_(), k, v, keep)
    assert not called  # eager autograd calls do not enter the custom op


@pytest.mark.parametrize("T", (37, 200))
def test_bf16(T):
    errs = compare(2, T, 4, 2, 32, 32, "random", "full", dtype=torch.bfloat16, block_size=16, seed=T)
    assert_close(errs, torch.bfloat16)


def test_fp16():
    errs = compare(2, 100, 4, 4, 32, 16, "random", "active", dtype=torch.float16, seed=5)
    assert_close(errs, torch.float16)


def test_odd_head_dims_and_block_128():
    errs = compare(1, 200, 2, 2, 24, 20, "random", "full", block_size=128, seed=3)
    assert_close(errs, torch.float32)


def test_keep_grad_matches_oracle():
    """dkeep against the hand-written route-gradient oracle (no autograd inside)."""
    gen = torch.Generator().manual_seed(11)
    B, T, Hs, G, C = 2, 100, 4, 2, 16
    q, k = (torch.randn(B, T, Hs, 16, generator=gen, device="cpu").to(DEVICE) for _ in range(2))
    v, do = (torch.randn(B, T, Hs, 32, generator=gen, device="cpu").to(DEVICE) for _ in range(2))
    keep = (torch.rand(B, math.ceil(T / C), G, generator=gen) < 0.5).float().to(DEVICE).requires_grad_()
    for route_grad in ("active", "full"):
        o = routed_attention(q, k, v, keep, block_size=C, route_grad=route_grad)
        (dkeep,) = torch.autograd.grad(o, keep, do)
        oracle = routed_attention_keep_grad(q, k, v, keep, o, do, scale=16**-0.5, block_size=C, route_grad=route_grad)
        assert rel_err(dkeep, oracle) < 1e-5
        assert (dkeep[:, -1] == 0).all()  # the last block feeds no later query
        if route_grad == "active":
            assert (dkeep[keep.detach() < 0.5] == 0).all()


def test_keep_none_is_all_kept_and_custom_scale():
    gen = torch.Generator().manual_seed(2)
    q, k, v = (torch.randn(1, 70, 2, 16, generator=gen).to(DEVICE) for _ in range(3))
    ones = torch.ones(1, 2, 1, device=DEVICE)
    a = routed_attention(q, k, v, None, scale=0.3)
    b = routed_attention(q, k, v, ones, scale=0.3)
    ref = reference(q.double(), k.double(), v.double(), None, scale=0.3)
    assert rel_err(a, b) == 0.0
    assert rel_err(a, ref) < 1e-5


def test_strided_inputs():
    """q, k, v cut from one fused projection (non-contiguous heads) give the same result."""
    gen = torch.Generator().manual_seed(4)
    qkv = torch.randn(2, 100, 4, 64, generator=gen).to(DEVICE)
    q, k, v = qkv[..., :16], qkv[..., 16:32], qkv[..., 32:]
    keep = (torch.rand(2, 2, 2, generator=gen) < 0.5).float().to(DEVICE)
    o = routed_attention(q, k, v, keep)
    ref = reference(q.double(), k.double(), v.double(), keep.double())
    assert rel_err(o, ref) < 1e-5


def test_bad_arguments():
    q = torch.randn(1, 10, 4, 16, device=DEVICE)
    with pytest.raises(ValueError):
        routed_attention(q, q, q, torch.ones(1, 1, 3, device=DEVICE))  # 3 groups do not divide 4 heads
    with pytest.raises(ValueError):
        routed_attention(q, q, q, torch.ones(1, 2, 1, device=DEVICE))  # NB is 1, not 2
    with pytest.raises(NatslError):
        routed_attention(q, q, q, None, block_size=48)  # not a power of two
    with pytest.raises(ValueError):
        routed_attention(q, q, q, None, route_grad="some")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("route_grad", ("active", "full"))
def test_gpu_800m_shapes_bf16(route_grad):
    """The 800M layer's softmax heads (18 x (64, 128), groups of 3) at the training length."""
    errs = compare(1, 4096, 18, 6, 64, 128, "random", route_grad, dtype=torch.bfloat16, seed=7,
                   ref_dtype=torch.float32)
    assert_close(errs, torch.bfloat16)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_gpu_bf16_batch_and_fused_layout_through_tma_tiles(monkeypatch):
    """bf16 on the H200 reads key tiles through TMA descriptors over [B*T, H*D]: batch 2 (rows of
    the second sequence start at T) and q, k, v cut from one fused projection [B, T, H*64 | H*64 |
    H*128] (a row stride wider than H*D). Against the same tiles read with pointer loads and the
    float32 reference."""
    from natsl.fast.block_sparse import forward

    gen = torch.Generator(device="cuda").manual_seed(11)
    B, T, H, G = 2, 1100, 6, 2
    proj = torch.randn(B, T, H * 256, device="cuda", generator=gen).to(torch.bfloat16)
    q = proj[..., : H * 64].view(B, T, H, 64)
    k = proj[..., H * 64: H * 128].view(B, T, H, 64)
    v = proj[..., H * 128:].view(B, T, H, 128)
    keep = (torch.rand(B, math.ceil(T / 64), G, device="cuda", generator=gen) < 0.5).float()
    assert forward._descriptors(k, v, config.FORWARD["BLOCK_N"], 64) is not None  # the TMA path is taken
    o = routed_attention(q, k, v, keep)
    monkeypatch.setattr(config, "USE_DESCRIPTORS", False)
    o_pointers = routed_attention(q, k, v, keep)
    ref = reference(q.float(), k.float(), v.float(), keep)
    assert rel_err(o, o_pointers) < 1e-3
    assert rel_err(o, ref) < 5e-3

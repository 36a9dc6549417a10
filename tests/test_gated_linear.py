"""gated_linear_rule (Mamba2's SSD with the write mask): the token-by-token reference, the chunked form and
the Triton twin (natsl.fast.gated_linear) against each other, forward and every gradient.

On a machine without CUDA the kernels run under TRITON_INTERPRET=1 (set below, before anything imports
Triton), so the shapes stay tiny. The `gpu` tests run a realistic Mamba2 shape on a GPU against the
chunked form in fp32. Metric: relative RMS error rms(twin - ref) / rms(ref).
"""

from __future__ import annotations

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402
import torch.nn.functional as F  # noqa: E402

import natsl.ops  # noqa: E402
from natsl.errors import NatslError  # noqa: E402
from natsl.fast.gated_linear import config as gla_config  # noqa: E402
from natsl.fast.gated_linear import gated_linear_rule as fast  # noqa: E402
from natsl.fast.gated_linear import state as gla_state  # noqa: E402
from natsl.fast.gated_linear.cumsum import chunk_cumsum as fast_chunk_cumsum  # noqa: E402
from natsl.fast.gated_linear.cumsum import chunk_cumsum_and_write  # noqa: E402
from natsl.fast.gated_linear.state import _state_fwd_kernel  # noqa: E402
from natsl.ops.cached import commit_state  # noqa: E402
from natsl.reference.cached import gla_token_step  # noqa: E402
from natsl.reference.gated_linear import gated_linear_rule as reference  # noqa: E402
from natsl.reference.gated_linear_chunked import chunk_cumsum  # noqa: E402
from natsl.reference.gated_linear_chunked import gated_linear_rule as chunked  # noqa: E402
from numerics import rel_rms  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
if DEVICE == "cpu" and type(_state_fwd_kernel).__name__ != "InterpretedFunction":
    pytest.skip("natsl.fast was imported before TRITON_INTERPRET=1 was set", allow_module_level=True)

FP32_TOL = 1e-4
BF16_TOL = (5e-3, 1e-2)  # (forward, gradients): flash-linear-attention's bf16 bounds
# Triton's interpreter (3.9) casts fp32 to bf16 by truncation, not round-to-nearest as the GPU does: a
# biased error per cast (6.1e-3 forward, 7.5e-3 gradients seen on the CPU case below), so the CPU run
# is held to a looser bound and the gpu tests hold the real one.
INTERPRETED_BF16_TOL = (1e-2, 1.5e-2)
NAMES = ("q", "k", "v", "g", "write", "initial_state")


def make_inputs(B, T, H, K, V, *, seed, write_kind="random", block_size=64, with_h0=True):
    """Fresh random fp32 inputs shaped like Mamba2's (q = C, k = B, v = x dt, g = A dt <= 0), the route,
    the initial state, and the upstream gradients of o and of the final state."""
    gen = torch.Generator().manual_seed(seed)
    NB = -(-T // block_size)
    x = dict(q=torch.randn(B, T, H, K, generator=gen), k=torch.randn(B, T, H, K, generator=gen),
             v=torch.randn(B, T, H, V, generator=gen), g=-F.softplus(torch.randn(B, T, H, generator=gen) - 2.0))
    x["write"] = {None: None, "ones": torch.ones(B, NB, H), "zeros": torch.zeros(B, NB, H),
                  "binary": torch.randint(0, 2, (B, NB, H), generator=gen).float(),
                  "random": torch.rand(B, NB, H, generator=gen)}[write_kind]
    x["initial_state"] = torch.randn(B, H, K, V, generator=gen) if with_h0 else None
    do, d_final = torch.randn(B, T, H, V, generator=gen), torch.randn(B, H, K, V, generator=gen)
    move = lambda t: None if t is None else t.to(DEVICE)  # noqa: E731
    return {n: move(t) for n, t in x.items()}, move(do), move(d_final)


def run(fn, inputs, do, d_final, dtype=None, **kw):
    """o, the final state and every input's gradient (None where the input is None); q, k, v cast to
    `dtype` when given."""
    leaves = {n: None if t is None else t.detach().clone().to(dtype if n in "qkv" and dtype else t.dtype)
              .requires_grad_() for n, t in inputs.items()}
    o, final = fn(leaves["q"], leaves["k"], leaves["v"], leaves["g"], leaves["write"],
                  initial_state=leaves["initial_state"], output_final_state=True, **kw)
    ((o.float() * do).sum() + (final * d_final).sum()).backward()
    return dict(o=o, final=final, **{"d" + n: None if t is None else t.grad for n, t in leaves.items()})


def errors(twin, oracle, inputs, do, d_final, dtype=None, **kw):
    """Relative errors of the twin against the oracle, both on the same input values (q, k, v rounded to
    `dtype` first when given; the oracle then computes in fp32)."""
    if dtype is not None:
        inputs = {n: t.to(dtype).float() if n in ("q", "k", "v") else t for n, t in inputs.items()}
    got, ref = run(twin, inputs, do, d_final, dtype, **kw), run(oracle, inputs, do, d_final, **kw)
    if dtype is not None:
        assert got["o"].dtype == dtype and got["final"].dtype == torch.float32
    out = {}
    for name, r in ref.items():
        if r is None:
            assert got[name] is None, name
        elif name == "dwrite" and not r.abs().max() > 0:  # all zero (e.g. active on an all-skip route)
            assert torch.equal(got[name], torch.zeros_like(got[name])), name
        else:
            assert got[name].shape == r.shape, (name, got[name].shape, r.shape)
            out[name] = rel_rms(got[name], r)
    return out


def check(errs, fwd_tol, grad_tol):
    bad = {k: v for k, v in errs.items() if not v <= (fwd_tol if k in ("o", "final") else grad_tol)}
    assert not bad, f"errors over tolerance: {bad} (all: {errs})"


# ----------------------------------------------------------------------------- chunked form vs reference
@pytest.mark.parametrize("T", [1, 37, 64, 130])
@pytest.mark.parametrize("decay_skipped_blocks", [True, False])
def test_chunked_matches_reference(T, decay_skipped_blocks):
    inputs, do, d_final = make_inputs(2, T, 2, 8, 16, seed=T)
    kw = dict(decay_skipped_blocks=decay_skipped_blocks, route_grad="full")
    check(errors(chunked, reference, inputs, do, d_final, **kw), FP32_TOL, FP32_TOL)


@pytest.mark.parametrize("write_kind", ["ones", "zeros", None, "binary"])
@pytest.mark.parametrize("route_grad", ["active", "full"])
def test_chunked_write_masks_and_policies(write_kind, route_grad):
    inputs, do, d_final = make_inputs(1, 150, 2, 8, 16, seed=3, write_kind=write_kind)
    check(errors(chunked, reference, inputs, do, d_final, route_grad=route_grad), FP32_TOL, FP32_TOL)


@pytest.mark.parametrize("fn", [chunked, fast], ids=["chunked", "fast"])
def test_intra_block_ablation(fn):
    inputs, do, d_final = make_inputs(1, 100, 2, 8, 16, seed=5)
    check(errors(fn, reference, inputs, do, d_final, intra_block=False), FP32_TOL, FP32_TOL)


def test_reference_is_the_recurrence_with_the_commit():
    """The reference against the formula written out: two blocks, the second's write dropped."""
    inputs, _, _ = make_inputs(1, 6, 1, 3, 2, seed=11, write_kind=None)
    q, k, v, g, s0 = (inputs[n].double() for n in ("q", "k", "v", "g", "initial_state"))
    write = torch.tensor([[[1.0], [0.0]]], dtype=torch.float64, device=q.device)
    o, final = reference(q, k, v, g, write, initial_state=s0, output_final_state=True, block_size=3, scale=0.5)
    state, outs = s0[0, 0], []
    for t in range(6):
        if t == 3:
            start = state
        state = g[0, t, 0].exp() * state + torch.outer(k[0, t, 0], v[0, t, 0])
        outs.append(0.5 * state.T @ q[0, t, 0])
    assert torch.allclose(o[0, :, 0], torch.stack(outs), atol=1e-12)
    assert torch.allclose(final[0, 0], g[0, 3:, 0].sum().exp() * start, atol=1e-12)  # the clock runs


def test_token_step_decodes_the_op():
    """gla_token_step token by token, committing each block, equals the op (the layer cache's path)."""
    inputs, _, _ = make_inputs(1, 20, 2, 8, 16, seed=13, write_kind="binary", block_size=8)
    q, k, v, g, write, s0 = (inputs[n] for n in NAMES)
    o_ref, final_ref = reference(q, k, v, g, write, initial_state=s0, output_final_state=True, block_size=8)
    start, outs = s0, []
    for b in range(3):
        state = start
        for t in range(8 * b, min(8 * b + 8, 20)):
            o, state = gla_token_step(state, q[:, t], k[:, t], v[:, t], g[:, t])
            outs.append(o)
        start = commit_state(start, state, g[:, 8 * b : 8 * b + 8].sum(1), write[:, b])
    assert rel_rms(torch.stack(outs, 1), o_ref) < 1e-6 and rel_rms(start, final_ref) < 1e-6


def test_ops_door_dispatches_every_backend():
    inputs, _, _ = make_inputs(1, 70, 2, 8, 16, seed=17)
    args = [inputs[n] for n in NAMES[:5]]
    outs = [natsl.ops.gated_linear_rule(*args, scale=1.0, backend=b)[0] for b in ("reference", "chunked", "fast")]
    assert rel_rms(outs[1], outs[0]) < FP32_TOL and rel_rms(outs[2], outs[0]) < FP32_TOL


# ----------------------------------------------------------------------------- Triton twin vs reference
@pytest.mark.parametrize("T", [1, 37, 64, 100, 200])
def test_fast_fp32_across_lengths(T):
    inputs, do, d_final = make_inputs(2, T, 2, 16, 32, seed=T + 1)
    check(errors(fast, reference, inputs, do, d_final, route_grad="full"), FP32_TOL, FP32_TOL)


@pytest.mark.parametrize("write_kind", ["ones", "zeros", None, "binary"])
@pytest.mark.parametrize("route_grad", ["active", "full"])
def test_fast_write_masks_and_route_grad_policies(write_kind, route_grad):
    inputs, do, d_final = make_inputs(1, 130, 2, 16, 32, seed=7, write_kind=write_kind)
    check(errors(fast, reference, inputs, do, d_final, route_grad=route_grad), FP32_TOL, FP32_TOL)


@pytest.mark.parametrize("write_kind,route_grad", [("random", "full"), ("binary", "active")])
def test_fast_no_decay_across_skipped_blocks(write_kind, route_grad):
    inputs, do, d_final = make_inputs(1, 150, 2, 16, 32, seed=11, write_kind=write_kind)
    kw = dict(route_grad=route_grad, decay_skipped_blocks=False)
    check(errors(fast, reference, inputs, do, d_final, **kw), FP32_TOL, FP32_TOL)


def test_fast_without_initial_state_block_128_and_odd_dims():
    """No initial state, 128-token blocks (two 64-token chunks each), K = 80 (two K tiles, the last masked) and V = 40, scale 1."""
    inputs, do, d_final = make_inputs(1, 300, 1, 80, 40, seed=19, with_h0=False, block_size=128)
    kw = dict(block_size=128, scale=1.0, route_grad="full")
    check(errors(fast, chunked, inputs, do, d_final, **kw), FP32_TOL, FP32_TOL)


def test_fast_bf16_within_the_bounds():
    inputs, do, d_final = make_inputs(2, 200, 2, 32, 32, seed=23, write_kind="binary")
    tol = BF16_TOL if DEVICE == "cuda" else INTERPRETED_BF16_TOL
    check(errors(fast, reference, inputs, do, d_final, dtype=torch.bfloat16, route_grad="full"), *tol)


def test_fast_route_gradient_active_only_where_written():
    inputs, do, d_final = make_inputs(1, 200, 2, 16, 16, seed=29, write_kind="binary")
    grads = run(fast, inputs, do, d_final)["dwrite"]
    assert grads[inputs["write"] < 0.5].abs().max() == 0 and grads[:, :-1][inputs["write"][:, :-1] > 0.5].abs().min() > 0
    assert grads[:, -1].abs().max() == 0  # the last block's route reaches no output


@pytest.mark.parametrize("bad,message", [(dict(block_size=48), "block_size 16, 32, 64, 128, 256, got 48"),
                                         (dict(K=272), "K <= 256")])
def test_fast_refuses_what_it_has_no_kernel_for(bad, message):
    K = bad.pop("K", 16)
    inputs, _, _ = make_inputs(1, 10, 1, K, 16, seed=31, **{k: v for k, v in bad.items() if k == "block_size"})
    with pytest.raises(NatslError, match=message):
        fast(*(inputs[n] for n in NAMES[:5]), **bad)


# ----------------------------------------------------------------------------- gc and w32 (cumsum.py)
def random_g(B, T, H, *, seed, dtype=torch.float32):
    """Fresh g shaped like make_inputs' (A dt <= 0), rounded to `dtype`."""
    gen = torch.Generator().manual_seed(seed)
    return (-F.softplus(torch.randn(B, T, H, generator=gen) - 2.0)).to(dtype).to(DEVICE)


# the chunks it runs (up to natsl.block_size.LARGEST_CHUNK; larger blocks span them), and one larger power of two
@pytest.mark.parametrize("block_size", [16, 32, 64, 128])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("H", [1, 3, 48])
@pytest.mark.parametrize("T", [1, 37, 64, 70, 130])
def test_fast_chunk_cumsum_matches_its_twin(T, H, dtype, block_size):
    """The Triton gc against its PyTorch twin: one token, a sequence shorter than a chunk, partial last
    chunks; 1 and 3 heads (one masked tile), 48 (three full tiles of config.CUMSUM's 16)."""
    g = random_g(2, T, H, seed=T * 1000 + H + block_size, dtype=dtype)
    got, want = fast_chunk_cumsum(g, block_size), chunk_cumsum(g, block_size)
    assert got.dtype == torch.float32 and got.shape == (2, T, H) and got.is_contiguous()
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)


def test_fast_chunk_cumsum_reads_any_layout_and_dtype():
    """A strided g (a slice of a wider tensor) in fp16 and in float64, and an empty sequence."""
    for dtype in (torch.float16, torch.float64):
        g = random_g(2, 100, 6, seed=3, dtype=dtype)[..., ::2]
        assert not g.is_contiguous()
        torch.testing.assert_close(fast_chunk_cumsum(g, 64), chunk_cumsum(g, 64), rtol=1e-5, atol=1e-6)
    assert fast_chunk_cumsum(random_g(2, 0, 3, seed=4), 64).shape == (2, 0, 3)


@pytest.mark.parametrize("write_kind", [None, "fp32", "bf16-transposed", "broadcast"])
def test_fast_write_mask_comes_with_gc(write_kind):
    """chunk_cumsum_and_write's w32: write in fp32 (ones for None), contiguous and in new storage whatever
    write's layout, next to the same gc as chunk_cumsum's."""
    B, T, H = 2, 130, 20
    NB = -(-T // 64)
    gen = torch.Generator().manual_seed(5)
    write = {None: None, "fp32": torch.rand(B, NB, H, generator=gen).to(DEVICE),
             "bf16-transposed": torch.rand(B, H, NB, generator=gen).to(torch.bfloat16).to(DEVICE).transpose(1, 2),
             "broadcast": torch.rand(1, 1, H, generator=gen).to(DEVICE).expand(B, NB, H)}[write_kind]
    g = random_g(B, T, H, seed=6)
    gc, w32 = chunk_cumsum_and_write(g, write, 64, gla_config.CUMSUM)
    want = torch.ones(B, NB, H, device=DEVICE) if write is None else write.float()
    assert w32.dtype == torch.float32 and w32.is_contiguous() and torch.equal(w32, want)
    assert write is None or w32.data_ptr() != write.data_ptr()
    assert torch.equal(gc, fast_chunk_cumsum(g, 64))


def test_fast_reads_a_write_mask_in_any_layout():
    """A write mask laid out [B, H, NB] and viewed as [B, NB, H] (dense, not contiguous): forward and every
    gradient as the reference's (the kernels index w32 as contiguous; cumsum.py builds it so)."""
    inputs, do, d_final = make_inputs(1, 130, 3, 16, 16, seed=73)
    inputs["write"] = inputs["write"].transpose(1, 2).contiguous().transpose(1, 2)
    assert not inputs["write"].is_contiguous()
    check(errors(fast, reference, inputs, do, d_final, route_grad="full"), FP32_TOL, FP32_TOL)


# ----------------------------------------------------------------------------- the forward state kernel's K split
# (K, T, with_h0, splits in effect for K_SPLIT = 1, 2, 4): K = 64 is one 64-row tile, so 2 and 4 narrow it to 32
# and 16 rows; K = 128 is two, dealt out whole at 2 and narrowed to 32 rows at 4; K = 48 (one masked tile)
# splits into 32-row tiles at 2 and falls back to 2 at 4 (a fourth 16-row tile would hold no real row).
K_SPLIT_CASES = [(64, 70, True, (1, 2, 4)), (128, 37, True, (1, 2, 4)), (128, 1, False, (1, 2, 4)),
                 (48, 70, True, (1, 2, 2))]


@pytest.mark.parametrize("K,T,with_h0,splits", K_SPLIT_CASES, ids=[f"K{c[0]}-T{c[1]}" for c in K_SPLIT_CASES])
def test_fast_k_split_matches_one_program_per_slice(monkeypatch, K, T, with_h0, splits):
    """config.STATE_FWD["K_SPLIT"] forced to 1, 2 and 4 on a random route: the output, the final state and
    every gradient (the backward reads the per-chunk states h the split programs stored) as with one
    program per V slice and as the reference. V = 80 is two 64-wide V slices, the second masked."""
    assert gla_config.STATE_FWD["BV"] == 64
    inputs, do, d_final = make_inputs(1, T, 2, K, 80, seed=200 + K + T, with_h0=with_h0)
    chosen, choose = [], gla_state.choose_k_split
    monkeypatch.setattr(gla_state, "choose_k_split", lambda *a, **kw: chosen.append(choose(*a, **kw)) or chosen[-1])
    got = {}
    for split in (1, 2, 4):
        monkeypatch.setitem(gla_config.STATE_FWD, "K_SPLIT", split)
        got[split] = run(fast, inputs, do, d_final, route_grad="full")
    assert tuple(chosen) == splits
    ref = run(reference, inputs, do, d_final, route_grad="full")
    for split, out in got.items():
        for name, r in ref.items():
            if r is None:
                assert out[name] is None, name
                continue
            assert rel_rms(out[name], got[1][name]) <= 1e-6, (split, name)
            if r.abs().max() == 0:  # e.g. dg of one token without an initial state: exactly 0, fp32 rounding here
                assert out[name].abs().max() <= 1e-5, (split, name)
            else:
                assert rel_rms(out[name], r) <= FP32_TOL, (split, name)


def test_k_split_tiles_cover_the_rows():
    """Each split's tiles: powers of two of at least 16 rows that together cover K, the last program
    owning a real row; None where no such tiling exists."""
    for K in (8, 16, 20, 48, 64, 80, 100, 128, 160, 192, 200, 256):
        for split in range(1, 9):
            tiles = gla_state.k_split_tiles(K, split)
            if tiles is None:
                continue
            BK, NK_LOCAL = tiles
            assert BK >= 16 and BK & (BK - 1) == 0 and 1 <= NK_LOCAL <= 4, (K, split, tiles)
            assert split * NK_LOCAL * BK >= K > (split - 1) * NK_LOCAL * BK, (K, split, tiles)
    assert gla_state.k_split_tiles(128, 1) == (64, 2) and gla_state.k_split_tiles(128, 2) == (64, 1)
    assert gla_state.k_split_tiles(128, 4) == (32, 1) and gla_state.k_split_tiles(64, 4) == (16, 1)
    assert gla_state.k_split_tiles(256, 2) == (64, 2) and gla_state.k_split_tiles(192, 3) == (64, 1)
    assert gla_state.k_split_tiles(16, 2) is None and gla_state.k_split_tiles(48, 4) is None
    assert gla_state.k_split_tiles(192, 2) is None and gla_state.k_split_tiles(80, 4) is None


def test_k_split_choice():
    """K_SPLIT 0 doubles the split while the doubled program count still fits in one wave of SMs (and the
    doubled split fits K); a fixed split falls back to the largest that fits."""
    choose = gla_state.choose_k_split
    # 800M Mamba2 (H = 48, K = 128, V = 64) on 132 SMs: BV 64 gives 48 programs at batch 1 -> 2 (96);
    # BV 32 gives 96 -> 1 (192 would be a second wave); batch 2, BV 64: 96 -> 1
    assert choose(128, 0, programs=48, sms=132) == 2 and choose(128, 0, programs=96, sms=132) == 1
    assert choose(128, 0, programs=8, sms=132) == 4  # capped at AUTO_K_SPLIT_MAX, though 8 fits
    assert choose(128, 0, programs=8, sms=132, auto_max=8) == 8
    assert choose(128, 0, programs=33, sms=132) == 4 and choose(128, 0, programs=34, sms=132) == 2
    assert choose(128, 0, programs=66, sms=132) == 2 and choose(128, 0, programs=67, sms=132) == 1
    assert choose(128, 0, programs=132, sms=132) == 1
    assert choose(64, 0, programs=2, sms=4) == 2 and choose(64, 0, programs=1, sms=4) == 4
    assert choose(48, 0, programs=1, sms=132) == 2  # 4 would leave a program only masked rows
    assert choose(16, 0, programs=1, sms=132) == 1 and choose(192, 0, programs=72, sms=132) == 1
    for K in (16, 48, 64, 80, 128, 192, 256):
        assert choose(K, 1, programs=1, sms=132) == 1
    assert choose(128, 4, 1000, 132) == 4 and choose(128, 2, 1, 132) == 2  # fixed: the SMs do not matter
    assert choose(48, 4, 1, 132) == 2 and choose(16, 4, 1, 132) == 1 and choose(192, 4, 1, 132) == 3
    assert choose(192, 2, 1, 132) == 1 and choose(80, 4, 1, 132) == 2


def test_k_split_default_is_automatic():
    assert gla_config.STATE_FWD["K_SPLIT"] == 0


def test_a_split_forward_launches_with_its_own_pipeline_depth_and_warps():
    cfg = {"BV": 64, "num_warps": 4, "num_stages": 3, "num_stages_split": 4}
    assert gla_state.split_launch(cfg, 2)["num_stages"] == 4 and gla_state.split_launch(cfg, 1)["num_stages"] == 3
    assert gla_state.split_launch({"num_warps": 4, "num_stages": 3}, 2)["num_stages"] == 3  # no key: as before
    warps = {**cfg, "num_warps_split": 8}
    assert gla_state.split_launch(warps, 2)["num_warps"] == 8 and gla_state.split_launch(warps, 1)["num_warps"] == 4
    assert gla_state.split_launch(cfg, 2)["num_warps"] == 4
    assert cfg["num_stages"] == 3  # the config itself untouched


# ----------------------------------------------------------------------------- grouped q, k (Mamba2's B, C)
def grouped_inputs(B, T, H, Hk, K, V, *, seed, write_kind="random"):
    """make_inputs with q, k cut to their first Hk heads (v, g, write and the state keep H)."""
    inputs, do, d_final = make_inputs(B, T, H, K, V, seed=seed, write_kind=write_kind)
    inputs["q"], inputs["k"] = (inputs[n][:, :, :Hk].contiguous() for n in ("q", "k"))
    return inputs, do, d_final


@pytest.mark.parametrize("Hk", [1, 2])
@pytest.mark.parametrize("T", [1, 37, 130])
@pytest.mark.parametrize("write_kind", ["ones", "zeros", "random"])
def test_fast_grouped_qk_matches_reference(Hk, T, write_kind):
    """q, k with Hk of v's H = 4 heads: forward and every gradient against the reference, dq and dk
    [B, T, Hk, K] (errors checks every shape against the reference's)."""
    inputs, do, d_final = grouped_inputs(2, T, 4, Hk, 8, 16, seed=100 + T + Hk, write_kind=write_kind)
    check(errors(fast, reference, inputs, do, d_final, route_grad="full"), FP32_TOL, FP32_TOL)
    check(errors(chunked, reference, inputs, do, d_final, route_grad="full"), FP32_TOL, FP32_TOL)


def expand(inputs, H):
    Hk = inputs["q"].shape[2]
    return {n: t.repeat_interleave(H // Hk, dim=2) if n in ("q", "k") else t for n, t in inputs.items()}


@pytest.mark.parametrize("Hk", [1, 2])
@pytest.mark.parametrize("fn", [reference, chunked, fast], ids=["reference", "chunked", "fast"])
def test_grouped_qk_is_the_expanded_call(fn, Hk):
    """The grouped call computes what the call on repeat_interleave'd q, k computes: the same outputs and
    gradients of v, g, write and the state (bit for bit), and dq, dk the expanded ones summed per group."""
    H = 4
    inputs, do, d_final = grouped_inputs(1, 70, H, Hk, 8, 16, seed=50 + Hk, write_kind="binary")
    got, want = run(fn, inputs, do, d_final, route_grad="full"), run(fn, expand(inputs, H), do, d_final,
                                                                       route_grad="full")
    for name in ("o", "final", "dv", "dg", "dwrite", "dinitial_state"):
        assert torch.equal(got[name], want[name]), name
    for name in ("dq", "dk"):
        B, T, _, K = want[name].shape
        assert got[name].shape == (B, T, Hk, K)
        torch.testing.assert_close(got[name], want[name].view(B, T, Hk, H // Hk, K).sum(3), rtol=1e-6, atol=1e-6)


def test_fast_grouped_qk_bf16_gradients_keep_the_input_dtypes():
    inputs, do, d_final = grouped_inputs(1, 100, 4, 2, 16, 16, seed=61, write_kind="binary")
    tol = BF16_TOL if DEVICE == "cuda" else INTERPRETED_BF16_TOL
    check(errors(fast, reference, inputs, do, d_final, dtype=torch.bfloat16, route_grad="full"), *tol)
    got = run(fast, inputs, do, d_final, torch.bfloat16)
    assert got["dq"].dtype == got["dk"].dtype == torch.bfloat16 and got["dq"].shape == (1, 100, 2, 16)


@pytest.mark.parametrize("backend", ["reference", "chunked", "fast"])
def test_grouped_qk_heads_must_divide_v_heads(backend):
    inputs, _, _ = grouped_inputs(1, 10, 4, 3, 8, 16, seed=67)
    with pytest.raises(ValueError, match=r"q and k have 3 heads, which do not divide v's 4: .*H % Hk == 0"):
        natsl.ops.gated_linear_rule(*(inputs[n] for n in NAMES[:5]), backend=backend)
    inputs["k"] = inputs["k"][:, :, :1]  # k must still match q
    with pytest.raises(ValueError, match=r"k must have shape \[B, T, Hk, K\] \(as q\)"):
        natsl.ops.gated_linear_rule(*(inputs[n] for n in NAMES[:5]), backend=backend)


# ----------------------------------------------------------------------------- on the H200
GPU_CASES = {  # (B, T, H, K, V, seed, write, route_grad, decay_skipped_blocks)
    "mamba2-binary": (2, 2048 + 17, 8, 128, 64, 41, "binary", "full", True),
    "mamba2-plain": (2, 2048 + 17, 8, 128, 64, 43, None, "active", True),
    "random-no-decay": (1, 1000, 4, 64, 64, 47, "random", "full", False),
}


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("case", sorted(GPU_CASES))
def test_gpu_realistic_shapes_bf16(case):
    """bf16 Triton against the chunked form in fp32, forward and every gradient."""
    B, T, H, K, V, seed, write_kind, route_grad, decay = GPU_CASES[case]
    inputs, do, d_final = make_inputs(B, T, H, K, V, seed=seed, write_kind=write_kind)
    inputs["q"], inputs["k"] = inputs["q"] * K**-0.5, inputs["k"] * K**-0.5  # keep o near unit scale
    kw = dict(route_grad=route_grad, decay_skipped_blocks=decay)
    check(errors(fast, chunked, inputs, do, d_final, dtype=torch.bfloat16, **kw), *BF16_TOL)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("Hk", [1, 2])
def test_gpu_grouped_qk_read_in_place_bf16(Hk):
    """Mamba2's one B/C group (and two) for 8 heads, read in place by every head of the group: bf16 against
    the chunked form in fp32, forward and every gradient, dq and dk [B,T,Hk,K]."""
    inputs, do, d_final = grouped_inputs(2, 2048 + 17, 8, Hk, 128, 64, seed=71, write_kind="binary")
    inputs["q"], inputs["k"] = inputs["q"] * 128**-0.5, inputs["k"] * 128**-0.5
    check(errors(fast, chunked, inputs, do, d_final, dtype=torch.bfloat16, route_grad="full"), *BF16_TOL)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_gpu_state_forward_settings_bf16():
    """The forward state kernel's batch-1 launch (8 heads of V 64: the K rows split over programs, with
    their own pipeline depth): bf16 against the chunked form in fp32, forward and every gradient."""
    inputs, do, d_final = make_inputs(1, 2048 + 17, 8, 128, 64, seed=59, write_kind="binary")
    inputs["q"], inputs["k"] = inputs["q"] * 128**-0.5, inputs["k"] * 128**-0.5
    check(errors(fast, chunked, inputs, do, d_final, dtype=torch.bfloat16, route_grad="full"), *BF16_TOL)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_gpu_fp32_against_the_reference():
    inputs, do, d_final = make_inputs(1, 700, 2, 128, 64, seed=53, write_kind="binary")
    check(errors(fast, reference, inputs, do, d_final, route_grad="active"), FP32_TOL, FP32_TOL)


# (B, H, G, K, V, l2, skip): the 800M Mamba2 layer (48 heads of 64 over one B/C group of 128, + D x) at
# batch 1 and 4, and the 800M NAtS-L Mamba2 state (6 heads of K 192 and V 384, L2-normalised q and k)
DECODE_CASES = {
    "800m-mamba2-b1": (1, 48, 1, 128, 64, False, True),
    "800m-mamba2-b4": (4, 48, 1, 128, 64, False, True),
    "800m-natsl-mamba2": (1, 6, 6, 192, 384, True, False),
}


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("case", sorted(DECODE_CASES))
def test_gpu_800m_decode_step_bf16(case):
    """natsl.fast.cached.gla_decode_step (the fused Mamba2 decode step) at the 800M shapes, bf16 inputs
    and an fp32 state, against its reference twin on the same inputs for 32 tokens in a row (the state
    carries any error on): the twins round at the same points (to nearest on the GPU), so only the order
    of the sums and the exp / softplus differ."""
    from natsl.fast.cached import gla_decode_step as fast_step
    from natsl.reference.cached import gla_decode_step as reference_step

    B, H, G, K, V, l2, skip = DECODE_CASES[case]
    gen = torch.Generator().manual_seed(61)
    A_log = torch.empty(H).uniform_(1.0, 16.0, generator=gen).log().cuda()  # A ~ U(1, 16), as Mamba2's init
    dt_bias = torch.empty(H).uniform_(-7.0, -2.0, generator=gen).cuda()  # softplus: dt in ~[1e-3, 0.13]
    D = torch.randn(H, generator=gen).cuda() if skip else None
    states = [torch.randn(B, H, K, V, generator=gen).cuda() * 0.1 for _ in range(2)]
    states[1].copy_(states[0])
    worst = {"o": 0.0, "g": 0.0, "state": 0.0}
    for _ in range(32):
        q, k = (torch.randn(B, G * K, generator=gen).cuda().bfloat16() for _ in range(2))
        v = torch.randn(B, H * V, generator=gen).cuda().bfloat16()
        a = torch.randn(B, H, generator=gen).cuda().bfloat16()
        (o_ref, g_ref), (o, g) = (fn(q, k, v, a, A_log, dt_bias, s, D=D, scale=1.0, l2=l2)
                                  for fn, s in ((reference_step, states[0]), (fast_step, states[1])))
        assert o.dtype == torch.bfloat16 and o.shape == (B, H, V)
        worst["o"] = max(worst["o"], rel_rms(o.float(), o_ref.float()))
        worst["g"] = max(worst["g"], rel_rms(g, g_ref))
        worst["state"] = max(worst["state"], rel_rms(states[1], states[0]))
    assert worst["o"] < BF16_TOL[0] and worst["g"] < 1e-5 and worst["state"] < 1e-3, worst

"""The split-K Triton decode attention (natsl.fast.decode_attention) against `attend_one`.

On a machine without CUDA the kernels run under TRITON_INTERPRET=1 (set below, before anything
imports Triton), so the shapes stay small. Keys and values are views of a larger cache buffer whose
slots past each row's `visible` (and past L) hold NaN: a kernel that reads them shows it. The
reference is `attend_one` in fp32 on the same (rounded) inputs with those slots zeroed. Metric:
relative RMS error rms(fast - ref) / rms(ref), worst row; fp32 must agree to rounding, bf16 within
5e-3 (the output's own rounding: ~1.7e-3 on the GPU, ~3.4e-3 under the interpreter, whose casts to
bf16 truncate). The `gpu` tests run the 800M decode shapes and a CUDA-graph replay.
"""

from __future__ import annotations

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402

from natsl.inference.cuda_graph import capture  # noqa: E402
from natsl.fast.decode_attention import choose_splits, decode_attention  # noqa: E402
from natsl.reference.cached import attend_one  # noqa: E402
from numerics import rel_rms  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
TOL = {torch.float32: 1e-5, torch.bfloat16: 5e-3}


def make_inputs(B, H, L, Dk, Dv, *, seed, dtype=torch.float32, device=DEVICE, visible=None):
    """q [B,1,H,Dk]; keys, values as [:, :, :L] views of a longer buffer, NaN past each row's visible;
    visible [B,H] random in [0, L] (unless given), with edge cases 0, 1 and L (as many as fit, starting
    from one the seed picks) in all rows but the last."""
    gen = torch.Generator().manual_seed(seed)
    if visible is None:
        visible = torch.randint(0, L + 1, (B * H,), generator=gen)
        edge = torch.tensor([0, 1, L]).roll(seed)[: B * H - 1]
        visible[: len(edge)] = edge
        visible = visible.view(B, H)
    visible = torch.as_tensor(visible, dtype=torch.int64).view(B, H)
    q = torch.randn(B, 1, H, Dk + 8, generator=gen)[..., :Dk]  # strided q too
    k_buf = torch.randn(B, H, L + 5, Dk, generator=gen)
    v_buf = torch.randn(B, H, L + 5, Dv, generator=gen)
    hidden = torch.arange(L + 5)[None, None, :] >= visible[..., None]
    q, k_buf, v_buf = (t.to(device=device, dtype=dtype) for t in (q, k_buf, v_buf))
    hidden, visible = hidden.to(device), visible.to(device)
    clean_k = k_buf[:, :, :L].masked_fill(hidden[:, :, :L, None], 0).float()
    clean_v = v_buf[:, :, :L].masked_fill(hidden[:, :, :L, None], 0).float()
    k_buf.masked_fill_(hidden[..., None], float("nan"))
    v_buf.masked_fill_(hidden[..., None], float("nan"))
    return (q, k_buf[:, :, :L], v_buf[:, :, :L], visible), (q.float(), clean_k, clean_v, visible)


def compare(B, H, L, Dk, Dv, *, seed, dtype=torch.float32, num_splits=None, scale=None, launch=None, **kw):
    fast_in, ref_in = make_inputs(B, H, L, Dk, Dv, seed=seed, dtype=dtype, **kw)
    out = decode_attention(*fast_in, scale=scale, num_splits=num_splits, **(launch or {}))
    ref = attend_one(*ref_in, scale=scale)
    assert out.shape == (B, 1, H, Dv) and out.dtype == dtype
    return row_error(out, ref, fast_in[3])


def row_error(out, ref, visible):
    """The worst relative RMS error over the rows that see something (a row over one key is much
    larger than one over many, so a whole-tensor RMS would hide the long rows); the others must be 0."""
    out, ref = out[:, 0].flatten(0, 1), ref[:, 0].flatten(0, 1)
    seen = visible.flatten() > 0
    assert (out[~seen] == 0).all(), "a row that sees nothing must give zeros"
    return max((rel_rms(a, b) for a, b in zip(out[seen], ref[seen])), default=0.0)


# (B, H, Dk, Dv): every L meets every pair of head dims; the batch and head counts rotate.
DIMS = [(1, 3, 64, 64), (2, 2, 64, 128), (1, 2, 192, 128)]
CASES = [(L, *DIMS[(i + j) % 3]) for i, L in enumerate((1, 37, 300, 1000)) for j in range(3)]


@pytest.mark.parametrize("L,B,H,Dk,Dv", CASES)
def test_matches_attend_one_fp32(L, B, H, Dk, Dv):
    assert compare(B, H, L, Dk, Dv, seed=L + Dk + Dv) <= TOL[torch.float32]


@pytest.mark.parametrize("L,B,H,Dk,Dv", [(37, 2, 3, 64, 128), (1000, 1, 3, 64, 64), (300, 1, 2, 192, 128)])
def test_matches_attend_one_bf16(L, B, H, Dk, Dv):
    assert compare(B, H, L, Dk, Dv, seed=7 + L, dtype=torch.bfloat16) <= TOL[torch.bfloat16]


@pytest.mark.parametrize("num_splits", [1, 2, 5, 16])
@pytest.mark.parametrize("L", [37, 300])
def test_forced_splits(L, num_splits):
    """The combine path on small L: more splits than tiles, splits left empty by small visible."""
    assert compare(2, 3, L, 64, 64, seed=num_splits, num_splits=num_splits) <= TOL[torch.float32]


@pytest.mark.parametrize("launch", [dict(slot_stats=False), dict(slot_stats=False, block_n=32),
                                    dict(block_n=256, num_warps=8, num_stages=2), dict(programs_per_sm=16)])
@pytest.mark.parametrize("L,splits", [(37, 1), (300, 5), (1000, None)])
def test_launch_settings(L, splits, launch):
    """The settings `python -m benchmarks.ops --op decode_attention --sweep` tries (the per-tile-statistics loop, tile sizes,
    more programs) compute the same thing, one split or several, fp32 and bf16."""
    assert compare(2, 3, L, 64, 128, seed=L, num_splits=splits, launch=launch) <= TOL[torch.float32]
    assert compare(1, 2, L, 64, 64, seed=L + 1, num_splits=splits, launch=launch,
                   dtype=torch.bfloat16) <= TOL[torch.bfloat16]


def test_scale_and_nothing_visible():
    assert compare(1, 2, 300, 128, 64, seed=3, scale=0.3, num_splits=3) <= TOL[torch.float32]
    fast_in, _ = make_inputs(2, 2, 300, 64, 64, seed=4, visible=[[0, 0], [0, 0]])
    for splits in (1, 4):
        for slot_stats in (False, True):
            assert (decode_attention(*fast_in, num_splits=splits, slot_stats=slot_stats) == 0).all()


def test_split_count_is_not_compiled_in():
    """The split count follows the read length, which grows through a decode: it is a runtime argument
    (not specialised), so a new count never compiles the kernels again; only the one-split flag and
    the combine's power-of-two tile (16, 32 or 64) are compile-time."""
    from triton.runtime.jit import JITFunction

    from natsl.fast import decode_attention as module

    for kernel, constexprs in zip(module._kernels(), ({"ONE_SPLIT"}, {"SPLITS_P"})):
        jit = kernel if isinstance(kernel, JITFunction) else JITFunction(kernel.fn, **kernel.kwargs)
        params = {p.name: p for p in jit.params}
        assert not params["num_splits"].is_constexpr and params["num_splits"].do_not_specialize
        assert constexprs <= {name for name, p in params.items() if p.is_constexpr}
        assert "NUM_SPLITS" not in params


def test_choose_splits():
    assert choose_splits(65536, 24, 132) == 17  # 408 programs, ~3 per SM of an H200
    assert choose_splits(65536, 48, 132) == 9
    assert choose_splits(65536, 1, 132) == 64  # capped
    assert choose_splits(65536, 4096, 132) == 1  # the rows alone fill the GPU
    assert choose_splits(600, 1, 132) == 3  # chunks of at least MIN_SPLIT_KEYS
    assert choose_splits(1, 1, 132) == 1


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("B", [1, 2])
def test_gpu_800m_decode_bf16(B):
    """24 heads of 64 at L = 65536: batch 1 sees 50000 slots; batch 2 mixes 50000 with random rows."""
    L, H = 65536, 24
    visible = torch.full((B, H), 50000)
    if B == 2:
        visible[1] = torch.randint(0, L + 1, (H,), generator=torch.Generator().manual_seed(1))
        visible[1, :3] = torch.tensor([L, 0, 1])
    assert compare(B, H, L, 64, 64, seed=B, dtype=torch.bfloat16, visible=visible) <= TOL[torch.bfloat16]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_gpu_cuda_graph_replay():
    """Captured once, replayed after `visible` changes in place: the new lengths are honoured."""
    B, H, L = 2, 24, 8192
    fast_in, _ = make_inputs(B, H, L, 64, 64, seed=5, dtype=torch.bfloat16, visible=torch.full((B, H), L))
    q, keys, values, visible = fast_in
    keys, values = keys.nan_to_num(), values.nan_to_num()  # all visible: nothing is NaN anyway
    graph, out = capture(lambda: decode_attention(q, keys, values, visible))
    for lengths in (torch.randint(0, L + 1, (B, H)), torch.full((B, H), 1), torch.zeros(B, H)):
        visible.copy_(lengths)
        graph.replay()
        ref = attend_one(q.float(), keys.float(), values.float(), visible)
        assert row_error(out, ref, visible) <= TOL[torch.bfloat16]

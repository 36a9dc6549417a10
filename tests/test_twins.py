"""Every kernel family of natsl.ops (natsl.ops.TWINS): the reference and fast functions take the same
arguments, and agree on tiny shapes, forward and, where the fast op has a backward, in their gradients
(the fast side in Triton's interpreter on the CPU; the per-kernel tests go in depth). Metric: relative
RMS error as flash-linear-attention measures it (tests/numerics.py)."""

import inspect

import pytest
import torch

from natsl import ops
from natsl.devices import triton_interpreted

from numerics import output_and_grads, rel_rms

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
TOL = 1e-5  # fp32 on both sides: only the order of the sums differs

pytestmark = pytest.mark.skipif(DEVICE == "cpu" and not triton_interpreted(),
                                reason="the fast twins need CUDA or the Triton interpreter")


def parameters(fn):
    """Names, kinds and defaults (the chunked form has no annotations; the kernels' do not differ)."""
    return [(p.name, p.kind, p.default) for p in inspect.signature(fn).parameters.values()]


def pair(family):
    return ops.twin(family, False), ops.twin(family, True)


@pytest.mark.parametrize("family", sorted(ops.TWINS))
def test_twins_take_the_same_arguments(family):
    reference, fast = pair(family)
    assert parameters(reference) == parameters(fast)
    assert reference.__module__.startswith("natsl.reference.")
    assert fast.__module__.startswith("natsl.reference." if family.endswith("_chunked") else "natsl.fast.")


@pytest.mark.parametrize("family", ["gated_delta_rule", "routed_attention"])
def test_the_public_ops_take_the_twins_arguments(family):
    public = getattr(ops, family)
    assert [p for p in parameters(public) if p[0] != "backend"] == parameters(ops.twin(family, False))


def test_every_family_of_the_issue_has_twins():
    """GDN chunk and decode step, block commit, routed and cached attention, short conv, branch mix,
    norms, GEMV, chunked cross-entropy; and every kernel of the cached paths (natsl.fast.cached)."""
    assert {"gated_delta_rule", "gated_delta_step", "commit_block", "routed_attention", "decode_attention",
            "short_conv_silu", "mix_branches", "rms_norm", "l2_normalize", "add_rms_norm", "gemv",
            "cross_entropy"} <= set(ops.TWINS)
    import natsl.fast.cached as cached

    kernels = {name for name, fn in vars(cached).items() if inspect.isfunction(fn) and fn.__module__ == cached.__name__
               and name not in ("pdl", "launch_options", "next_pow2", "step_blocks", "step_tile")
               and not name.startswith("_")}
    assert kernels == {fast.split(":")[1] for _, fast in ops.TWINS.values() if fast.startswith("natsl.fast.cached:")}


def randn(*shape, seed=0, dtype=torch.float32):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed), dtype=dtype).to(DEVICE)


def every_other(x, seed=99):
    """x's values as every other element along the last dim of a tensor twice as wide (other random
    values between them): a strided view, as a slice of a joined parameter or buffer is."""
    view = torch.stack([x, randn(*x.shape, seed=seed, dtype=x.dtype)], -1).flatten(-2)[..., ::2]
    assert torch.equal(view, x) and not view.is_contiguous()
    return view


def gdn_inputs(T, H=2, K=16, V=16, block_size=64):
    q = torch.nn.functional.normalize(randn(1, T, H, K, seed=1), dim=-1)
    k = torch.nn.functional.normalize(randn(1, T, H, K, seed=2), dim=-1)
    v = randn(1, T, H, V, seed=3)
    g = -torch.rand(1, T, H, generator=torch.Generator().manual_seed(4)).to(DEVICE) * 0.1
    beta = torch.rand(1, T, H, generator=torch.Generator().manual_seed(5)).to(DEVICE)
    blocks = -(-T // block_size)
    write = (torch.arange(blocks * H, device=DEVICE).view(1, blocks, H) % 2 == 0).float()
    return (q, k, v, g, beta, write), dict(initial_state=randn(1, H, K, V, seed=6), output_final_state=True)


@pytest.mark.parametrize("family", ["gated_delta_rule", "gated_delta_rule_chunked"])
@pytest.mark.parametrize("T,intra_block", [(64, True), (64, False), (1, True), (37, True)])
def test_gated_delta_twins_agree(family, T, intra_block):
    reference, twin = pair(family)
    args, kwargs = gdn_inputs(T)
    (o_ref, s_ref), (o, s) = (fn(*args, intra_block=intra_block, **kwargs) for fn in (reference, twin))
    assert rel_rms(o, o_ref) < 1e-4 and rel_rms(s, s_ref) < 1e-4


@pytest.mark.parametrize("T,intra_block", [(128, True), (128, False), (1, True), (37, True), (100, True)])
def test_routed_attention_twins_agree(T, intra_block):
    reference, fast = pair("routed_attention")
    q, k, v = (randn(1, T, 2, 16, seed=s) for s in range(3))
    keep = torch.tensor([[[1.0], [0.0]]], device=DEVICE)[:, :-(-T // 64)]
    o_ref, o = (fn(q, k, v, keep, intra_block=intra_block) for fn in (reference, fast))
    assert rel_rms(o, o_ref) < 1e-4


@pytest.mark.parametrize("family", ["gated_linear_rule", "gated_linear_rule_chunked"])
@pytest.mark.parametrize("T,intra_block", [(64, True), (64, False), (1, True), (37, True)])
def test_gated_linear_twins_agree(family, T, intra_block):
    reference, twin = pair(family)
    (q, k, v, g, _, write), kwargs = gdn_inputs(T)
    (o_ref, s_ref), (o, s) = (fn(q, k, v, g, write, intra_block=intra_block, **kwargs) for fn in (reference, twin))
    assert rel_rms(o, o_ref) < 1e-4 and rel_rms(s, s_ref) < 1e-4


def test_gated_delta_step_twins_agree():
    reference, fast = pair("gated_delta_step")
    B, H, K, V = 2, 2, 16, 32
    q, k = (torch.nn.functional.normalize(randn(B, H, K, seed=s), dim=-1) for s in (1, 2))
    v, state = randn(B, H, V, seed=3), randn(B, H, K, V, seed=4)
    g = -torch.rand(B, H, generator=torch.Generator().manual_seed(5)).to(DEVICE)
    beta = torch.rand(B, H, generator=torch.Generator().manual_seed(6)).to(DEVICE)
    (o_ref, s_ref), (o, s) = (fn(q, k, v, g, beta, state, scale=0.3) for fn in (reference, fast))
    assert rel_rms(o, o_ref) < TOL and rel_rms(s, s_ref) < TOL


@pytest.mark.parametrize("decay_skipped_blocks", [True, False])
def test_commit_block_twins_agree(decay_skipped_blocks):
    reference, fast = pair("commit_block")
    start, end = randn(2, 3, 8, 8, seed=1), randn(2, 3, 8, 8, seed=2)
    gamma = torch.rand(2, 3, generator=torch.Generator().manual_seed(3)).to(DEVICE)
    write = torch.tensor([[1.0, 0.0, 1.0], [0.0, 0.0, 1.0]], device=DEVICE)
    want, got = (fn(start, end, gamma, write, decay_skipped_blocks) for fn in (reference, fast))
    assert rel_rms(got, want) < TOL


@pytest.mark.parametrize("L", [1, 37, 300])
def test_decode_attention_twins_agree(L):
    reference, fast = pair("decode_attention")
    B, H, D = 2, 2, 16
    q, keys, values = randn(B, 1, H, D, seed=1), randn(B, H, L, D, seed=2), randn(B, H, L, D, seed=3)
    visible = torch.tensor([[L, (L + 1) // 2], [0, max(L - 1, 1)]], device=DEVICE)  # a row that sees nothing
    want, got = (fn(q, keys, values, visible, scale=0.2) for fn in (reference, fast))
    assert rel_rms(got, want) < TOL
    assert (got[1, :, 0] == 0).all()


def test_write_kv_twins_agree():
    reference, fast = pair("write_kv")
    k, v = randn(2, 3, 16, seed=1), randn(2, 3, 8, seed=2)
    slots = torch.tensor([[0, 4, 7], [2, 2, 5]], device=DEVICE)
    written = []
    for fn in (reference, fast):
        k_buf, v_buf = torch.zeros(2, 3, 8, 16, device=DEVICE), torch.zeros(2, 3, 8, 8, device=DEVICE)
        fn(k_buf, v_buf, slots, k, v)
        written.append((k_buf, v_buf))
    assert all(torch.equal(a, b) for a, b in zip(*written)) and written[0][0].abs().sum() > 0


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rope,norms", [(True, False), (True, True), (False, True), (False, False)])
def test_rope_write_kv_twins_agree(dtype, rope, norms):
    """q returned and K/V written, with and without RoPE (at positions from 0 to past 128K) and the q/k
    norms; q, k, v as strided views of one projection, as the decode step passes them."""
    from natsl.reference.rope import inverse_frequencies

    reference, fast = pair("rope_write_kv")
    B, heads, DK, DV, L = 3, 2, 16, 8, 6
    qkv = randn(B, heads, 2 * DK + DV, seed=1, dtype=dtype) * 2
    q, k, v = qkv[..., :DK], qkv[..., DK:2 * DK], qkv[..., 2 * DK:]
    positions = torch.tensor([0, 77, 131_071], device=DEVICE)
    inv_freq = inverse_frequencies(DK, 10000.0, DEVICE) if rope else None
    weights = dict(q_weight=randn(DK, seed=2).abs() + 0.5, k_weight=randn(DK, seed=3).abs() + 0.5) if norms else {}
    slots = torch.tensor([[0, 5], [3, 3], [1, 4]], device=DEVICE)
    results = []
    for fn in (reference, fast):
        k_buf, v_buf = torch.zeros(B, heads, L, DK, device=DEVICE), torch.zeros(B, heads, L, DV, device=DEVICE)
        out = fn(q, k, v, positions, inv_freq, k_buf, v_buf, slots, eps=1e-6, **weights)
        results.append((out, k_buf, v_buf))
    (q_ref, k_ref, v_ref), (q_fast, k_fast, v_fast) = results
    # bf16: up to two roundings (the norm's, then the rotation's), each to an ulp of 2^-8 relative; Triton's
    # interpreter truncates where the reference and the GPU round to nearest, so there they lean one way
    tol = TOL if dtype == torch.float32 else (5e-3 if DEVICE == "cuda" else 1e-2)
    assert q_fast.dtype == dtype and q_fast.shape == (B, heads, DK)
    assert rel_rms(q_fast, q_ref) < tol and rel_rms(k_fast, k_ref) < tol and torch.equal(v_fast, v_ref)
    assert k_ref.abs().sum() > 0 and (k_ref[0, 0, 0] != 0).all() and (k_ref[0, 0, 1] == 0).all()
    if not rope and not norms:  # nothing to compute: q comes back as it went in, K as it was given
        assert torch.equal(q_fast, q) and torch.equal(k_fast[0, 0, 0], k[0, 0].float())


@pytest.mark.parametrize("B,T,n,C", [(2, 1, 0, 4), (2, 11, 2, 4), (1, 5, 3, 4)])
def test_store_blocks_twins_agree(B, T, n, C):
    """Kept and dropped blocks, a chunk that starts inside a block (n > 0) and ends inside one."""
    reference, fast = pair("store_blocks")
    heads, D = 3, 8
    R = (n + T - 1) // C + 1
    gen = torch.Generator().manual_seed(T)
    valid = torch.rand(B, R, heads, generator=gen) < 0.6
    valid[:, -1] = True  # the unfinished block
    before = (valid.long().cumsum(1) - valid.long()).to(DEVICE)
    kept0 = torch.randint(0, 3, (B, heads), generator=gen).to(DEVICE)
    src, valid = randn(B, T, heads, D, seed=1), valid.to(DEVICE)
    stored = []
    for fn in (reference, fast):
        mem = torch.zeros(B, heads, 3 + C * R, D, device=DEVICE)
        fn(src, mem, valid, before, kept0, n, C)
        stored.append(mem)
    assert torch.equal(*stored) and stored[0].abs().sum() > 0


@pytest.mark.parametrize("forced", [None, 32])
def test_gdn_decode_step_twins_agree(forced, monkeypatch):
    """Output, log decay and the state (updated in place) from raw post-conv projections: V in two tiles (the
    launcher's choice for 4 programs a tile on the interpreter's nominal 4 SMs) and in one (a forced width)."""
    import natsl.fast.cached as cached

    monkeypatch.setitem(cached.STEP_TILES, "gdn", forced)
    reference, fast = pair("gdn_decode_step")
    B, H, K, V = 2, 2, 16, 32
    q, k, v = randn(B, H * K, seed=1), randn(B, H * K, seed=2), randn(B, H * V, seed=3)
    a, b, A_log, dt_bias = randn(B, H, seed=4), randn(B, H, seed=5), randn(H, seed=6) * 0.5, randn(H, seed=7)
    start = randn(B, H, K, V, seed=8)
    results = []
    for fn in (reference, fast):
        state = start.clone()
        o, g = fn(q, k, v, a, b, A_log, dt_bias, state, scale=0.3)
        results.append((o, g, state))
    assert not torch.equal(results[0][2], start)
    assert all(rel_rms(got, want) < TOL for got, want in zip(*reversed(results)))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("G,l2,skip", [(1, False, True), (2, False, False), (4, True, True)])
def test_gla_decode_step_twins_agree(G, l2, skip, dtype):
    """Output, log decay and the fp32 state (updated in place) from raw post-conv projections: B/C
    groups shared by 4, 2 or 1 heads (Mamba2's mixer, NAtS-L's Mamba2 state with its L2 norms), with
    and without + D x; bf16 inputs round the write x dt, the read and the skip as the reference does."""
    reference, fast = pair("gla_decode_step")
    B, H, K, V = 2, 4, 16, 24  # V = 24: a partial V tile
    q, k = randn(B, G * K, seed=1, dtype=dtype), randn(B, G * K, seed=2, dtype=dtype)
    v, a = randn(B, H * V, seed=3, dtype=dtype), randn(B, H, seed=4, dtype=dtype)
    A_log, dt_bias, D = randn(H, seed=5) * 0.5, randn(H, seed=6), randn(H, seed=7)
    start = randn(B, H, K, V, seed=8)
    results = []
    for fn in (reference, fast):
        state = start.clone()
        o, g = fn(q, k, v, a, A_log, dt_bias, state, D=D if skip else None, scale=0.7, l2=l2)
        assert o.dtype == dtype and g.dtype == state.dtype == torch.float32
        results.append((o, g, state))
    assert not torch.equal(results[0][2], start)
    # bf16: the roundings of x dt, the read and the skip may land an ulp apart (2^-8 relative; Triton's
    # interpreter truncates where the reference and the GPU round to nearest, so there they all lean one way)
    tol = TOL if dtype == torch.float32 else 2e-2
    (o_ref, g_ref, s_ref), (o, g, s) = results
    assert rel_rms(o.float(), o_ref.float()) < tol and rel_rms(g, g_ref) < TOL and rel_rms(s, s_ref) < tol


def test_decode_step_tiles_give_two_programs_per_sm_where_they_can():
    """The V tile the decode steps launch with: the widest giving two programs per SM, else the narrowest; a
    forced width wins; never wider than the head. The 800M shapes on an H100 (132 SMs), where
    `benchmarks.ops --op decode_step --sweep` measured 16 columns fastest at batch 1 and 32 at batch 4."""
    from natsl.fast.cached import step_blocks, step_tile

    assert step_tile(384, 6, 132) == 16  # GDN, batch 1: 144 programs at 16 columns, 72 at 32
    assert step_tile(384, 4 * 6, 132) == 32  # batch 4: 288 programs
    assert step_tile(384, 64 * 6, 132) == 64
    assert step_tile(64, 48, 132) == 16 and step_tile(64, 4 * 48, 132) == 32  # Mamba2's 48 heads of 64
    assert step_tile(24, 1, 4) == 16 and step_tile(12, 64, 4) == 16  # narrow heads: at least 16 columns
    assert step_tile(384, 6, 132, forced=64) == 64 and step_tile(24, 6, 132, forced=64) == 32
    assert step_blocks(192, 384, 16) == (256, 16) and step_blocks(128, 24, 64) == (128, 32)


@pytest.mark.parametrize("family", ["gdn_decode_step", "gla_decode_step"])
def test_decode_steps_read_strided_per_head_vectors(family):
    """A_log, dt_bias and D [H] as strided views (the kernels index them as contiguous): output, log
    decay and the state (updated in place) as the reference's on contiguous copies."""
    reference, fast = pair(family)
    B, H, K, V = 2, 4, 16, 24
    q, k, v, a, b = (randn(B, H * K, seed=1), randn(B, H * K, seed=2), randn(B, H * V, seed=3), randn(B, H, seed=4),
                     randn(B, H, seed=5))
    heads = [randn(H, seed=6) * 0.5, randn(H, seed=7), randn(H, seed=8)]  # A_log, dt_bias, D
    start = randn(B, H, K, V, seed=9)
    results = []
    for fn, (A_log, dt_bias, D) in ((reference, heads), (fast, [every_other(t) for t in heads])):
        state = start.clone()
        if family == "gdn_decode_step":
            o, g = fn(q, k, v, a, b, A_log, dt_bias, state, scale=0.3)
        else:
            o, g = fn(q, k, v, a, A_log, dt_bias, state, D=D, scale=0.3, l2=True)
        results.append((o, g, state))
    assert all(rel_rms(got, want) < TOL for got, want in zip(*reversed(results)))


@pytest.mark.parametrize("T", [1, 2, 37])
def test_conv_chunk_twins_agree(T):
    """A chunk after a cached tail (T below and above the tail's length); the tail is read only."""
    reference, fast = pair("conv_chunk")
    x, tail, weight = randn(2, T, 24, seed=1), randn(2, 3, 24, seed=2), randn(24, 1, 4, seed=3) * 0.5
    before = tail.clone()
    want, got = (fn(x, tail, weight) for fn in (reference, fast))
    assert rel_rms(got, want) < TOL and torch.equal(tail, before)


@pytest.mark.parametrize("family", ["conv_step", "conv_steps"])
def test_conv_step_twins_agree(family):
    """One token's conv + SiLU and each tail shifted by one with the token appended; conv_steps with
    three widths (a GDN layer's q, k, v) in one call."""
    reference, fast = pair(family)
    widths = (16, 16, 40) if family == "conv_steps" else (24,)
    xs = [randn(2, 1, C, seed=C) for C in widths]
    weights = [randn(C, 1, 4, seed=C + 1) * 0.5 for C in widths]
    start = [randn(2, 3, C, seed=C + 2) for C in widths]
    results = []
    for fn in (reference, fast):
        tails = [t.clone() for t in start]
        ys = fn(xs, tails, weights) if family == "conv_steps" else [fn(xs[0], tails[0], weights[0])]
        results.append((ys, tails))
    (ys_ref, tails_ref), (ys, tails) = results
    assert all(rel_rms(y, y_ref) < TOL for y, y_ref in zip(ys, ys_ref))
    assert all(torch.equal(t, t_ref) for t, t_ref in zip(tails, tails_ref))
    assert torch.equal(tails[-1][:, -1:], xs[-1]) and torch.equal(tails[-1][:, :2], start[-1][:, 1:])


@pytest.mark.parametrize("T", [1, 37, 100])
@pytest.mark.parametrize("with_tail", [False, True])
def test_short_conv_twins_agree(T, with_tail):
    """Output and the gradients of x and the weight (the tail is read-only on the fast side)."""
    reference, fast = pair("short_conv_silu")
    x, weight, dy = randn(2, T, 24, seed=1), randn(24, 1, 4, seed=2) * 0.5, randn(2, T, 24, seed=3)
    tail = randn(2, 3, 24, seed=4) if with_tail else None
    (y_ref, g_ref), (y, g) = (output_and_grads(lambda x, w: fn(x, w, tail), [x, weight], dy)
                              for fn in (reference, fast))
    assert rel_rms(y, y_ref) < TOL
    assert all(rel_rms(a, b) < TOL for a, b in zip(g, g_ref))


@pytest.mark.parametrize("T", [1, 37])
def test_short_conv_split_twins_agree(T):
    reference, fast = pair("short_conv_silu_split")
    x, weights = randn(1, T, 48, seed=1), [randn(c, 1, 4, seed=2 + c) * 0.5 for c in (16, 16, 16)]
    dys = [randn(1, T, 16, seed=10 + i) for i in range(3)]
    grads = []
    for fn in (reference, fast):
        leaves = [t.clone().requires_grad_(True) for t in (x, *weights)]
        ys = fn(leaves[0], leaves[1:])
        torch.autograd.backward(ys, dys)
        grads.append(([y.detach() for y in ys], [t.grad for t in leaves]))
    (ys_ref, g_ref), (ys, g) = grads
    assert all(rel_rms(a, b) < TOL for a, b in zip(ys + g, ys_ref + g_ref))


@pytest.mark.parametrize("T", [1, 37])
def test_mix_twins_agree(T):
    """Output and the gradients of every tensor argument."""
    reference, fast = pair("mix_branches")
    heads, D = 2, 16
    inputs = [randn(1, T, heads, D, seed=1), randn(1, T, heads, D, seed=2), randn(1, T, heads, 2, seed=3),
              randn(1, T, heads * D, seed=4), 1.0 + 0.2 * randn(D, seed=5), 1.0 + 0.2 * randn(D, seed=6)]
    dout = randn(1, T, heads * D, seed=7)
    (o_ref, g_ref), (o, g) = (output_and_grads(lambda *xs: fn(*xs, 1e-6), inputs, dout) for fn in (reference, fast))
    assert rel_rms(o, o_ref) < TOL
    assert all(rel_rms(a, b) < TOL for a, b in zip(g, g_ref))


@pytest.mark.parametrize("rows", [1, 37])
def test_norm_twins_agree(rows):
    """Forward only: the fused norms serve the cached paths (no gradient), the training norms are the
    compiled references (natsl.models.pointwise)."""
    x, r, weight, gate = randn(rows, 48, seed=1), randn(rows, 48, seed=2), randn(48, seed=3), randn(rows, 48, seed=4)
    for family, args, kwargs in (("rms_norm", (x, weight, 1e-6), {}), ("rms_norm", (x, weight, 1e-6, gate), {}),
                                 ("rms_norm", (x, None, 1e-6), dict(mean=False)), ("l2_normalize", (x,), {}),
                                 ("add_rms_norm", (x, r, weight, 1e-6), {})):
        reference, fast = pair(family)
        want, got = (fn(*args, **kwargs) for fn in (reference, fast))
        for a, b in zip(*((got, want) if family == "add_rms_norm" else ((got,), (want,)))):
            assert rel_rms(a, b) < TOL, family


def test_norm_twins_read_a_strided_weight():
    """The norm weight [D] as a strided view (the kernel indexes it as contiguous): as the reference
    with a contiguous copy."""
    x, r, weight, gate = randn(5, 48, seed=1), randn(5, 48, seed=2), randn(48, seed=3), randn(5, 48, seed=4)
    for family, args in (("rms_norm", (x, weight, 1e-6)), ("rms_norm", (x, weight, 1e-6, gate)),
                         ("add_rms_norm", (x, r, weight, 1e-6))):
        reference, fast = pair(family)
        want = reference(*args)
        got = fast(*(every_other(a) if a is weight else a for a in args))
        for a, b in zip(*((got, want) if family == "add_rms_norm" else ((got,), (want,)))):
            assert rel_rms(a, b) < TOL, family


@pytest.mark.parametrize("rows", [1, 37])
@pytest.mark.parametrize("skip", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gated_input_norm_twins_agree(rows, skip, dtype):
    """Mamba2's output norm, x, gate and skip as column slices of wider rows (as the in_proj's z and
    the conv's x are; the kernel reads them through their row strides); 48 = 4 heads of 12. In bf16
    the skip's rounding is the reference's, so only the sum's order differs."""
    wide = randn(rows, 48 * 3, seed=1, dtype=dtype)
    x, gate, skip_in = wide[:, :48], wide[:, 48:96], wide[:, 96:]
    weight, scale = 1.0 + 0.2 * randn(48, seed=3), randn(4, seed=4)
    args = (x, weight, 1e-6, gate) + ((skip_in, scale) if skip else ())
    reference, fast = pair("gated_input_rms_norm")
    want, got = reference(*args), fast(*args)
    assert got.dtype == dtype and got.shape == x.shape and got.is_contiguous()
    assert rel_rms(got, want) < (TOL if dtype == torch.float32 else 5e-3)
    if skip:  # the skip really enters: without it the result differs
        assert rel_rms(reference(x, weight, 1e-6, gate), want) > 0.05


@pytest.mark.parametrize("T", [1, 37, 130])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_step_values_twins_agree(T, dtype):
    """Mamba2's write v dt, v a column slice of the conv's output (x of x|B|C) read in place: the same
    fp32 product and rounding as the reference, so equal on the GPU; Triton's interpreter casts to bf16
    by truncation, so there a bf16 value may be one step (2^-7 relative) nearer zero."""
    H, P = 3, 40
    xbc = randn(2, T, H * P + 16, seed=1, dtype=dtype)
    v = xbc[..., : H * P].view(2, T, H, P)
    dt = torch.rand(2, T, H, generator=torch.Generator().manual_seed(2)).to(DEVICE) * 0.1
    reference, fast = pair("step_values")
    want, got = reference(v, dt), fast(v, dt)
    assert got.dtype == dtype and got.shape == v.shape
    if dtype == torch.float32 or DEVICE == "cuda":
        assert torch.equal(got, want)
    else:
        exact = (v.float() * dt[..., None]).abs()
        assert torch.all((got.float().abs() <= exact) & (exact - got.float().abs() <= exact * 2.0**-7))
        assert torch.equal(got.sign(), want.sign()) and rel_rms(got, want) < 5e-3


@pytest.mark.parametrize("rows", [1, 2])
@pytest.mark.parametrize("gated", [False, True])
def test_gemv_twins_agree(rows, gated):
    reference, fast = pair("gemv")
    x, weight, up = randn(rows, 40, seed=1), randn(24, 40, seed=2), randn(rows, 40, seed=3)
    want, got = (fn(x, weight, up=up if gated else None) for fn in (reference, fast))
    assert got.shape == want.shape == (rows, 24) and rel_rms(got, want) < TOL


@pytest.mark.parametrize("rows", [1, 37])
def test_cross_entropy_twins_agree(rows):
    """Per-row losses, the gradient written over the logits, and the logits left alone without a row
    scale; a target outside the vocabulary gives NaN on both sides."""
    reference, fast = pair("cross_entropy")
    logits = randn(rows, 101, seed=1) * 3
    targets = torch.randint(0, 101, (rows,), generator=torch.Generator().manual_seed(2)).to(DEVICE)
    row_scale = torch.rand(rows, generator=torch.Generator().manual_seed(3)).to(DEVICE)
    results = []
    for fn in (reference, fast):
        kept, grad = logits.clone(), logits.clone()
        results.append((fn(kept, targets, None), fn(grad, targets, row_scale), kept, grad))
    (loss_ref, loss_ref2, kept_ref, grad_ref), (loss, loss2, kept, grad) = results
    assert rel_rms(loss, loss_ref) < TOL and rel_rms(loss2, loss_ref2) < TOL
    assert torch.equal(kept, logits) and torch.equal(kept_ref, logits)
    assert rel_rms(grad, grad_ref) < TOL
    bad = targets.clone()
    bad[0] = 101
    assert all(fn(logits.clone(), bad)[0].isnan() for fn in (reference, fast))


def test_preload_imports_every_fast_module_for_the_fast_backend_only(monkeypatch):
    """ops.preload("fast") imports each fast twin and the cached paths' modules (so that a first call does
    not pay their imports); any other backend imports nothing."""
    import natsl.ops as ops

    calls = []
    monkeypatch.setattr(ops, "twin", lambda family, fast: calls.append((family, fast)))
    monkeypatch.setattr(ops.importlib, "import_module", lambda name: calls.append(name))
    ops.preload("reference")
    ops.preload(None)
    assert calls == []
    monkeypatch.setattr(ops, "triton_available", lambda: True)
    ops.preload("fast")
    fast_families = {f for f, (_, fast) in ops.TWINS.items() if fast.startswith("natsl.fast.")}
    assert {c[0] for c in calls if isinstance(c, tuple)} == fast_families
    assert [c for c in calls if isinstance(c, str)] == list(ops.FAST_EXTRAS)

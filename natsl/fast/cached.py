"""Fused Triton kernels for the cached paths (prefill and decode) of incremental inference.

At batch 1 a decode step of the 800M models was ~100 tiny kernels per layer (~2000 per token:
RMSNorm alone is 9 kernels in bf16 -- upcast, pow, mean, add, rsqrt, mul, weight upcast, mul,
downcast -- and each short conv is cat + conv1d + silu + a tail copy), so even a CUDA-graph replay
spent several times the weights' read time in launch gaps. In prefill the same fp32 chains make
~10 full passes over every [T, d] activation. These kernels do each of those chains in one pass
(the norms' kernels are in `natsl.fast.norms`, the fast twins of `natsl.reference.norms`):

- `conv_step(x, tail, weight)`: one token of the causal short conv + SiLU, the tail shifted in place
  (`conv_steps` does a layer's q, k and v in one launch);
  `conv_chunk(x, tail, weight)` the same over many tokens (prefill): the forward kernel of
  natsl.fast.short_conv.
- `write_kv(...)`: a decode token's K and V rows into their caches in one launch;
  `rope_write_kv(...)` the same after the softmax heads' q/k norms and RoPE (q returned);
- `store_blocks(...)`: a prefill chunk's K/V of kept (and unfinished) blocks into a NAtS-L cache's
  compacted memory, one program per (sequence, head, block).
- `gdn_decode_step(...)`: L2-norm of q, k, the decay g and beta from the raw projections, and the
  delta-rule step on the cached state, updated in place (no new state, no copy).
- `gla_decode_step(...)`: the same for a gated-linear (Mamba2 SSD) state: dt and g from the raw dt
  projection, the write x dt, the step, the read and Mamba2's + D x; the B/C groups read in place
  by the heads that share them (no repeat_interleave). The two steps' kernels, which share their
  program layout, q and k loads and state tiles, are in `natsl.fast.decode_step_kernels`.

They compute the same formulas as the modules (fp32 math, the same intermediate roundings to the
activation dtype) with a different reduction order, so results agree to rounding, not bitwise. The
full-sequence forward (training) never uses them. Whether the cached paths use them is decided in
`natsl.ops.kernel_set` (by `natsl.ops.fused.enabled`), the layers' only door to these kernels.
"""

from __future__ import annotations

import functools

import torch

from natsl import switches
from natsl.devices import capability, sm_count  # noqa: F401  (sm_count: the launchers' kernels.sm_count)

@functools.lru_cache(maxsize=None)
def _kernels():
    import triton
    import triton.language as tl

    from natsl.fast.decode_row_kernels import rope_write_kv_kernel, write_kv_kernel
    from natsl.fast.decode_step_kernels import gdn_step_kernel, gla_step_kernel

    @triton.jit
    def conv_step_kernel(x0, t0, w0, y0, C0, sx0, stb0, stw0, sy0,
                         x1, t1, w1, y1, C1, sx1, stb1, stw1, sy1,
                         x2, t2, w2, y2, C2, sx2, stb2, stw2, sy2, W: tl.constexpr, BLOCK: tl.constexpr,
                         PDL: tl.constexpr):
        # Up to three convs (a GDN layer's q, k and v) in one launch: axis 2 picks the tensor.
        if PDL:  # kernels.pdl: wait for the earlier kernels' writes, then let the next kernel start
            tl.extra.cuda.gdc_wait()
            tl.extra.cuda.gdc_launch_dependents()
        b = tl.program_id(0).to(tl.int64)
        cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        which = tl.program_id(2)
        x_ptr, tail_ptr, w_ptr, y_ptr, C, stride_xb, stride_tb, stride_tw, stride_yb = \
            x0, t0, w0, y0, C0, sx0, stb0, stw0, sy0
        if which == 1:
            x_ptr, tail_ptr, w_ptr, y_ptr, C, stride_xb, stride_tb, stride_tw, stride_yb = \
                x1, t1, w1, y1, C1, sx1, stb1, stw1, sy1
        if which == 2:
            x_ptr, tail_ptr, w_ptr, y_ptr, C, stride_xb, stride_tb, stride_tw, stride_yb = \
                x2, t2, w2, y2, C2, sx2, stb2, stw2, sy2
        mask = cols < C
        x = tl.load(x_ptr + b * stride_xb + cols, mask=mask, other=0.0)
        acc = x.to(tl.float32) * tl.load(w_ptr + cols * (W + 1) + W, mask=mask, other=0.0).to(tl.float32)
        prev = tl.load(tail_ptr + b * stride_tb + cols, mask=mask, other=0.0)
        acc += prev.to(tl.float32) * tl.load(w_ptr + cols * (W + 1), mask=mask, other=0.0).to(tl.float32)
        for j in tl.static_range(1, W):
            cur = tl.load(tail_ptr + b * stride_tb + j * stride_tw + cols, mask=mask, other=0.0)
            acc += cur.to(tl.float32) * tl.load(w_ptr + cols * (W + 1) + j, mask=mask, other=0.0).to(tl.float32)
            tl.store(tail_ptr + b * stride_tb + (j - 1) * stride_tw + cols, cur, mask=mask)
        tl.store(tail_ptr + b * stride_tb + (W - 1) * stride_tw + cols, x.to(tail_ptr.dtype.element_ty), mask=mask)
        # SiLU of the fp32 sum, one rounding (as natsl.reference.short_conv)
        tl.store(y_ptr + b * stride_yb + cols, (acc / (1.0 + tl.exp(-acc))).to(y_ptr.dtype.element_ty), mask=mask)

    @triton.jit
    def store_blocks_kernel(src_ptr, mem_ptr, valid_ptr, before_ptr, kept0_ptr, T, n, NR, HEADS,
                            s_b, s_t, s_h, m_b, m_h, m_l, D, C: tl.constexpr, BLOCK_C: tl.constexpr,
                            BLOCK_D: tl.constexpr):
        # One program per (sequence, head, relative block): a valid block's tokens go, in order, to
        # the head's kept length + C * (kept blocks before it) + their offset in the block.
        bh = tl.program_id(0)
        r = tl.program_id(1)
        b = bh // HEADS
        h = bh % HEADS
        meta = (b * NR + r) * HEADS + h
        if tl.load(valid_ptr + meta) != 0:
            dest0 = tl.load(kept0_ptr + bh) + C * tl.load(before_ptr + meta)
            offset = tl.arange(0, BLOCK_C)
            t = r * C + offset - n  # the chunk's token at this offset of the block
            ok = (offset < C) & (t >= 0) & (t < T)
            cols = tl.arange(0, BLOCK_D)
            mask = ok[:, None] & (cols < D)[None, :]
            rows = tl.load(src_ptr + b.to(tl.int64) * s_b + t.to(tl.int64)[:, None] * s_t + h * s_h + cols[None, :],
                           mask=mask, other=0.0)
            dest = (dest0 + offset).to(tl.int64)
            tl.store(mem_ptr + b.to(tl.int64) * m_b + h * m_h + dest[:, None] * m_l + cols[None, :],
                     rows.to(mem_ptr.dtype.element_ty), mask=mask)

    return conv_step_kernel, gdn_step_kernel, store_blocks_kernel, write_kv_kernel, gla_step_kernel, rope_write_kv_kernel


def pdl(device: torch.device) -> bool:
    """Whether the inference kernels launch with programmatic dependent launch (PDL) on `device`.

    With PDL a kernel may start while the kernel before it finishes: it runs what does not depend
    on that kernel (a GEMV's first weight tile) and then waits (`griddepcontrol.wait`) before it
    reads anything the earlier kernel wrote, and lets the next kernel start once all of its own
    programs have passed that wait. At batch 1 a decode step is ~300 short kernels whose ramp-up
    and tail are otherwise serial. CUDA devices of compute capability 9.0 or newer (the interpreter
    cannot run the instructions); the switch decode_pdl (NATSL_DECODE_PDL=0) turns it off,
    force_decode_pdl forces it."""
    if device.type != "cuda":
        return False
    s = switches.current()
    if s.force_decode_pdl is not None:
        return s.force_decode_pdl
    return capability(device)[0] >= 9 and s.decode_pdl


def launch_options(on: bool) -> dict:
    """Launch keywords for a kernel launched with PDL `on` (none when off: the interpreter takes no such option)."""
    return {"launch_pdl": True} if on else {}


def next_pow2(n: int) -> int:
    """As triton.next_power_of_2 for n >= 1, as a plain function (Triton's is a constexpr function,
    microseconds a call on the host: too slow for a decode step's launches)."""
    return 1 << max(0, (n - 1).bit_length())


def conv_step(x: torch.Tensor, tail: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """One token of `ShortConv` + SiLU: x [B, 1, C], tail [B, W, C] (updated in place: shifted by
    one, x appended), weight [C, 1, W+1] -> y [B, 1, C] in x's dtype."""
    return conv_steps([x], [tail], [weight])[0]


def conv_steps(xs, tails, weights) -> list[torch.Tensor]:
    """`conv_step` of up to three (x, tail, weight) triples in one launch (a GDN layer's q, k, v)."""
    assert 1 <= len(xs) <= 3 and len(xs) == len(tails) == len(weights)
    sets, widest = [], 0
    for x, tail, weight in zip(xs, tails, weights):
        B, _, C = x.shape
        W = tail.shape[1]
        x2 = x[:, 0]
        if x2.stride(-1) != 1:
            x2 = x2.contiguous()
        y = torch.empty(B, 1, C, dtype=x.dtype, device=x.device)
        w = weight.reshape(C, W + 1).contiguous()  # any float dtype: the kernel multiplies in fp32
        # one kernel body for all three: same dtypes and tail length
        assert tail.stride(-1) == 1 and tail.shape[1] == tails[0].shape[1]
        assert (x.dtype, tail.dtype, w.dtype) == (xs[0].dtype, tails[0].dtype, weights[0].dtype)
        sets.append((x2, tail, w, y, C, x2.stride(0), tail.stride(0), tail.stride(1), y.stride(0)))
        widest = max(widest, C)
    args = [a for triple in sets for a in triple]
    args += list(sets[0]) * (3 - len(sets))  # unused slots (never read: the grid stops before them)
    block = 1024
    on = pdl(xs[0].device)
    _kernels()[0][(xs[0].shape[0], -(-widest // block), len(sets))](*args, W=tails[0].shape[1], BLOCK=block,
                                                                     num_warps=4, PDL=on, **launch_options(on))
    return [triple[3] for triple in sets]


def conv_chunk(x: torch.Tensor, tail: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """`ShortConv` + SiLU over many tokens (prefill): x [B, T, C], tail [B, W, C] (the W inputs before
    x, read only), weight [C, 1, W+1] -> y [B, T, C] in x's dtype, in one pass at memory speed
    (Inductor's dynamic-shape kernel for it ran at a small fraction of the copy bandwidth in a long
    prefill). The training op natsl.fast.short_conv; ShortConv calls this without autograd, so only
    the op's forward kernel runs."""
    from natsl.fast.short_conv import short_conv_silu

    return short_conv_silu(x, weight, tail)


def store_blocks(src: torch.Tensor, mem: torch.Tensor, valid: torch.Tensor, before: torch.Tensor,
                 kept0: torch.Tensor, n: int, block_size: int) -> None:
    """Copy a prefill chunk's K or V into a NAtS-L cache's compacted memory, block by block.

    src [B, T, heads, D] (the chunk; its token 0 sits at offset n of relative block 0); mem
    [B, heads, L, D]; valid [B, R, heads] (bool: the relative block is kept, or unfinished);
    before [B, R, heads] (int64: kept blocks before it); kept0 [B, heads] (int64: slots already
    used). Blocks go to kept0 + C * before + offset. Replaces the nonzero + index_put of the plain path (a host sync, and slow at long
    contexts). No value is read on the host."""
    B, T, heads, D = src.shape
    R = valid.shape[1]
    if B * T * heads == 0 or R == 0:
        return
    assert src.stride(-1) == 1 and mem.stride(-1) == 1
    valid = valid.to(torch.int8).contiguous()
    before = before.contiguous()
    kept0 = kept0.contiguous()
    _kernels()[2][(B * heads, R)](
        src, mem, valid, before, kept0, T, n, R, heads, src.stride(0), src.stride(1), src.stride(2),
        mem.stride(0), mem.stride(1), mem.stride(2), D, C=block_size, BLOCK_C=next_pow2(block_size),
        BLOCK_D=max(16, next_pow2(D)), num_warps=4)


def write_kv(k_buf: torch.Tensor, v_buf: torch.Tensor, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
    """A decode token's K and V into their caches in one launch: k_buf [B, heads, L, Dk], v_buf
    [B, heads, L, Dv]; slots [B, heads] (int64, on the device); k [B, heads, Dk], v [B, heads, Dv]:
    buf[b, h, slots[b, h]] = row (as two `functional.write_token` scatters)."""
    B, heads = slots.shape
    assert k.stride(-1) == 1 and v.stride(-1) == 1 and k_buf.stride(-1) == 1 and v_buf.stride(-1) == 1
    DK, DV = k.shape[-1], v.shape[-1]
    on = pdl(k.device)
    _kernels()[3][(B * heads,)](
        k_buf, v_buf, slots, k, v, heads, DK, DV, k_buf.stride(0), k_buf.stride(1), k_buf.stride(2),
        v_buf.stride(0), v_buf.stride(1), v_buf.stride(2), slots.stride(0), slots.stride(1),
        k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        BLOCK_K=max(16, next_pow2(DK)), BLOCK_V=max(16, next_pow2(DV)), num_warps=1, PDL=on,
        **launch_options(on))


def rope_write_kv(q, k, v, positions, inv_freq, k_buf, v_buf, slots, *, q_weight=None, k_weight=None,
                  eps: float = 1e-6):
    """A decode token's softmax heads before the attention read, in one launch: q and k RMS-normed per
    head when their weight is given, rotated by RoPE, K and V written to their caches. (Eager, RoPE alone
    was ~15 small kernels for q and as many for k in every attention layer's decode step.)

    q, k [B, heads, Dk]; v [B, heads, Dv] (unit last stride); positions [B] (int64); inv_freq [Dk / 2]
    fp32 or None (no rotation); k_buf, v_buf [B, heads, L, D]; slots [B, heads] (int64); q_weight,
    k_weight [Dk] or None; eps the norms'. Returns q, normed and rotated, [B, heads, Dk] in q's dtype
    (natsl.reference.cached.rope_write_kv: the same roundings)."""
    B, heads, DK = q.shape
    DV = v.shape[-1]
    assert q.stride(-1) == 1 and k.stride(-1) == 1 and v.stride(-1) == 1
    assert k_buf.stride(-1) == 1 and v_buf.stride(-1) == 1
    rope = inv_freq is not None
    assert not rope or (DK % 2 == 0 and inv_freq.shape == (DK // 2,) and inv_freq.dtype == torch.float32)
    inv_freq = inv_freq.contiguous() if rope else positions  # (unread without rotation)
    q_weight_arg = q if q_weight is None else q_weight.contiguous()
    k_weight_arg = k if k_weight is None else k_weight.contiguous()
    out = torch.empty(B, heads, DK, dtype=q.dtype, device=q.device)
    half = (DK + 1) // 2
    on = pdl(q.device)
    _kernels()[5][(B * heads,)](
        q, k, v, positions, inv_freq, q_weight_arg, k_weight_arg, out, k_buf, v_buf, slots, heads, DK, DV, half,
        float(eps), q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1), positions.stride(0),
        k_buf.stride(0), k_buf.stride(1), k_buf.stride(2), v_buf.stride(0), v_buf.stride(1), v_buf.stride(2),
        slots.stride(0), slots.stride(1), BLOCK_H=max(16, next_pow2(half)), BLOCK_V=max(16, next_pow2(DV)),
        ROPE=rope, Q_NORM=q_weight is not None, K_NORM=k_weight is not None, num_warps=1, PDL=on,
        **launch_options(on))
    return out


# A decode step's grid is V tiles x B*H programs: at batch 1 an 800M GDN layer is 6 heads x 384 columns, 36
# programs of 64 columns on 132 SMs. The launcher takes the widest tile that still gives two programs per SM, else
# the narrowest (`step_tile`); an int here forces a layer's width instead (benchmarks.ops --op decode_step --sweep
# compares them; docs/performance.md, "Decode steps").
STEP_TILES: dict[str, int | None] = {"gdn": None, "gla": None}
STEP_TILE_WIDTHS = (64, 32, 16)


def step_tile(V: int, programs_per_tile: int, sms: int, forced: int | None = None) -> int:
    """The V tile width of a decode step over [K, V] states.

    Args:
        V: the state's value width (a head's columns).
        programs_per_tile: B * H, the programs that each V tile position launches.
        sms: the device's streaming multiprocessors.
        forced: a width to use instead of the choice (STEP_TILES' entry), or None.
    Returns:
        the widest of STEP_TILE_WIDTHS giving at least 2 * sms programs, else the narrowest; never wider
        than V rounded up to a power of two (and at least 16).
    """
    head = max(16, next_pow2(V))
    if forced is not None:
        return min(forced, head)
    for width in STEP_TILE_WIDTHS:
        if -(-V // width) * programs_per_tile >= 2 * sms:
            return min(width, head)
    return min(STEP_TILE_WIDTHS[-1], head)


def step_blocks(K: int, V: int, tile: int) -> tuple[int, int]:
    """(BK, BV) of a decode step's program over a [K, V] state: all of K, V tiles of at most `tile` columns."""
    return max(16, next_pow2(K)), min(tile, max(16, next_pow2(V)))


def _step_launch(tensors, state, scale, layer):
    """The set-up that gdn_decode_step and gla_decode_step share: `tensors` (q first) with unit last
    stride, the outputs o [B, H, V] in q's dtype and g [B, H] fp32, the grid (V tiles of `step_tile`'s
    width for `layer`, a key of STEP_TILES; B*H), the kernel's arguments after its head counts (each tensor's row
    stride, the state's, the scale: K^-0.5 when None) and its launch keywords."""
    B, H, K, V = state.shape
    assert state.stride(-1) == 1 and state.stride(-2) == V and state.stride(1) == K * V
    tensors = [t if t.stride(-1) == 1 else t.contiguous() for t in tensors]
    q = tensors[0]
    o = torch.empty(B, H, V, dtype=q.dtype, device=q.device)
    g = torch.empty(B, H, dtype=torch.float32, device=q.device)
    BK, BV = step_blocks(K, V, step_tile(V, B * H, sm_count(q.device), STEP_TILES[layer]))
    rows = [t.stride(0) for t in tensors] + [state.stride(0), K ** -0.5 if scale is None else float(scale)]
    on = pdl(q.device)
    launch = dict(K=K, V=V, BK=BK, BV=BV, num_warps=4, PDL=on, **launch_options(on))
    return tensors, o, g, (-(-V // BV), B * H), rows, launch


def _per_head(*vectors):
    """The per-head vectors [H] (A_log, dt_bias, D; None passes) contiguous: the kernels index them
    as h, so a strided view (a slice of a joined parameter) would be read at the wrong heads."""
    return [None if t is None else t.contiguous() for t in vectors]


def gdn_decode_step(q, k, v, a, b, A_log, dt_bias, state, *, scale=None):
    """One GDN token from the raw post-conv projections, the state updated in place.

    q, k [B, H*K]; v [B, H*V] (post conv + SiLU, before L2 norm); a, b [B, H] (a_proj, b_proj
    outputs); state [B, H, K, V] (fp32, updated in place). Returns (o [B, H, V] in q's dtype,
    g [B, H] fp32: the token's log decay).
    """
    A_log, dt_bias = _per_head(A_log, dt_bias)
    tensors, o, g, grid, rows, launch = _step_launch((q, k, v, a, b), state, scale, "gdn")
    _kernels()[1][grid](*tensors, A_log, dt_bias, state, o, g, state.shape[1], *rows, **launch)
    return o, g


def gla_decode_step(q, k, v, a, A_log, dt_bias, state, *, D=None, scale=None, l2=False):
    """One gated-linear token (Mamba2's SSD) from the raw post-conv projections, the state updated in place.

    q, k [B, G*K] (C and B: G groups, head h reads group h // (H/G)); v [B, H*V] (x); a [B, H] (the dt
    projection); A_log, dt_bias [H]; state [B, H, K, V] (fp32, updated in place); D [H] or None.
    Returns (o [B, H, V] in q's dtype, g [B, H] fp32: the token's log decay).
    """
    _, H, K, V = state.shape
    G = q.shape[-1] // K
    assert q.shape[-1] == k.shape[-1] == G * K and G >= 1 and H % G == 0 and v.shape[-1] == H * V
    A_log, dt_bias, D = _per_head(A_log, dt_bias, D)
    tensors, o, g, grid, rows, launch = _step_launch((q, k, v, a), state, scale, "gla")
    _kernels()[4][grid](*tensors, A_log, dt_bias, A_log if D is None else D, state, o, g, H, H // G, *rows,
                        L2=bool(l2), HAS_D=D is not None, **launch)
    return o, g

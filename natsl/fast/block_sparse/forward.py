"""Forward kernel: flash-style online softmax over the kept blocks only.

One program owns a query tile of one head, whose first row lies in routing block a0. It reads
  1. the kept blocks before a0 (the first `before[a0]` entries of the compacted list, read as one
     sequence of kept keys cut into key tiles), with no mask: every row of the tile sees them all;
  2. the keys from block a0 to the tile's last row: causal inside a block, gated by the key
     block's keep flag across blocks.
It writes O and the row log-sum-exp in base 2 (scaled units), which the backward reuses.
Cost is proportional to the kept blocks: dropped blocks are never loaded.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from natsl.devices import capability, triton_interpreted
from natsl.fast.block_sparse import config


# Triton's interpreter multiplies bf16 operands of tl.dot as raw uint16 bits (Triton 3.9), so on
# the CPU every dot runs on fp32 copies; that is also what the tensor cores compute (exact
# products, fp32 sums). Compiled kernels never take this branch.
_INTERPRET = tl.constexpr(triton_interpreted())


@triton.jit
def mm(a, b, PREC: tl.constexpr):
    """a @ b in fp32."""
    if _INTERPRET:
        return tl.dot(a.to(tl.float32), b.to(tl.float32), input_precision="ieee")
    else:
        return tl.dot(a, b, input_precision=PREC)


@triton.jit
def mma(a, b, acc, PREC: tl.constexpr):
    """acc + a @ b, accumulated in place by the matrix unit."""
    if _INTERPRET:
        return tl.dot(a.to(tl.float32), b.to(tl.float32), acc, input_precision="ieee")
    else:
        return tl.dot(a, b, acc, input_precision=PREC)


@triton.jit
def cast_to(x, dtype: tl.constexpr):
    """x.to(dtype), rounding to nearest even also in the interpreter (whose fp32 -> bf16 cast truncates)."""
    if _INTERPRET:
        if dtype == tl.bfloat16:
            bits = x.to(tl.float32).to(tl.uint32, bitcast=True)
            bits = bits + 0x7FFF + ((bits >> 16) & 1)
            return (bits >> 16).to(tl.uint16).to(tl.bfloat16, bitcast=True)
        else:
            return x.to(dtype)
    else:
        return x.to(dtype)


@triton.jit
def _online_softmax_step(acc, m_i, l_i, q, k, v, qk_scale, visible, MASKED: tl.constexpr, PREC: tl.constexpr):
    """Fold one key tile into the running (acc, max, sum) of each query row."""
    s = mm(q, tl.trans(k), PREC)
    if MASKED:
        s = tl.where(visible, s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, 1) * qk_scale)
    p = tl.math.exp2(s * qk_scale - m_new[:, None])
    alpha = tl.math.exp2(m_i - m_new)
    l_i = l_i * alpha + tl.sum(p, 1)
    acc = mma(cast_to(p, v.dtype), v, acc * alpha[:, None], PREC)
    return acc, m_new, l_i


@triton.jit
def kept_key_rows(blocks_ptr, row, start, offs_n, n_rows, C: tl.constexpr, BLOCK_N: tl.constexpr, MASKED: tl.constexpr):
    """Key positions of slots start + offs_n of the virtual sequence of kept keys, in which the
    i-th kept block fills slots i*C .. i*C + C - 1. MASKED: slots from n_rows on read block 0."""
    if BLOCK_N <= C:  # the tile lies inside one kept block: a single scalar lookup
        return tl.load(blocks_ptr + row + start // C) * C + start % C + offs_n
    else:
        slot = start + offs_n
        if MASKED:
            blk = tl.load(blocks_ptr + row + slot // C, mask=slot < n_rows, other=0)
        else:
            blk = tl.load(blocks_ptr + row + slot // C)
        return blk * C + slot % C


@triton.jit
def head_and_tile(HEADS_FIRST: tl.constexpr):
    """(row bh = b * H + h, tile index, tiles per row) of this program in a grid of
    config.program_grid: heads on axis 0 when HEADS_FIRST, else tiles on axis 0."""
    if HEADS_FIRST:
        bh = tl.program_id(0)
        tile = tl.program_id(1)
        n_tiles = tl.num_programs(1)
    else:
        bh = tl.program_id(1)
        tile = tl.program_id(0)
        n_tiles = tl.num_programs(0)
    return bh, tile, n_tiles


@triton.jit
def _forward_kernel(
    q_ptr, k_ptr, v_ptr, o_ptr, lse_ptr, flags_ptr, before_ptr, blocks_ptr, k_desc, v_desc,
    sq_b, sq_t, sq_h, sk_b, sk_t, sk_h, sv_b, sv_t, sv_h, so_b, so_t, so_h,
    T, NB, H, R, qk_scale,
    C: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    DK: tl.constexpr, DV: tl.constexpr, PREC: tl.constexpr, USE_DESC: tl.constexpr, HEADS_FIRST: tl.constexpr,
):
    # Latest (heaviest) tiles first. Programs start in the order of their linear id, axis 0
    # fastest. HEADS_FIRST (heads on axis 0): every head's heaviest tiles start first, so a grid of
    # few waves ends on light tiles; else a head's tiles run together, whose shared keys stay in L2.
    bh, tile, n_tiles = head_and_tile(HEADS_FIRST)
    tile = n_tiles - 1 - tile
    b = bh // H
    h = bh % H
    row = (b * (H // R) + h // R) * NB  # this head's routing group in the block lists
    b64 = b.to(tl.int64)  # batch offsets can pass 2^31 elements
    q_ptr += b64 * sq_b + h * sq_h
    k_ptr += b64 * sk_b + h * sk_h
    v_ptr += b64 * sv_b + h * sv_h
    o_ptr += b64 * so_b + h * so_h

    m0 = tile * BLOCK_M
    offs_m = m0 + tl.arange(0, BLOCK_M)
    offs_n = tl.arange(0, BLOCK_N)
    offs_dk = tl.arange(0, DK)
    offs_dv = tl.arange(0, DV)
    row_ok = offs_m < T
    q = tl.load(q_ptr + offs_m[:, None] * sq_t + offs_dk[None, :], mask=row_ok[:, None], other=0.0)

    acc = tl.zeros([BLOCK_M, DV], dtype=tl.float32)
    # A finite start: a tile in which a row sees nothing yet gives p = 0 and alpha = 1, not NaN.
    m_i = tl.full([BLOCK_M], -1.0e30, dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)

    # 1. Kept blocks before the tile's first block a0: visible to every row, no mask.
    a0 = m0 // C
    n_rows = tl.load(before_ptr + row + a0) * C
    for it in range(0, n_rows // BLOCK_N):
        if USE_DESC:  # BLOCK_N <= C: the tile is rows key0 .. key0 + BLOCK_N of one kept block (TMA loads)
            key0 = tl.load(blocks_ptr + row + (it * BLOCK_N) // C) * C + (it * BLOCK_N) % C
            k = k_desc.load([b * T + key0, h * DK])
            v = v_desc.load([b * T + key0, h * DV])
        else:
            keys = kept_key_rows(blocks_ptr, row, it * BLOCK_N, offs_n, n_rows, C, BLOCK_N, False)
            k = tl.load(k_ptr + keys[:, None] * sk_t + offs_dk[None, :])
            v = tl.load(v_ptr + keys[:, None] * sv_t + offs_dv[None, :])
        acc, m_i, l_i = _online_softmax_step(acc, m_i, l_i, q, k, v, qk_scale, None, False, PREC)
    if BLOCK_N > C:  # a key tile spans several blocks: the last one may be partly filled
        tail = n_rows % BLOCK_N
        if tail > 0:
            col_ok = (n_rows - tail) + offs_n < n_rows
            keys = kept_key_rows(blocks_ptr, row, n_rows - tail, offs_n, n_rows, C, BLOCK_N, True)
            k = tl.load(k_ptr + keys[:, None] * sk_t + offs_dk[None, :])
            v = tl.load(v_ptr + keys[:, None] * sv_t + offs_dv[None, :])
            acc, m_i, l_i = _online_softmax_step(acc, m_i, l_i, q, k, v, qk_scale, col_ok[None, :], True, PREC)

    # 2. From block a0 to the tile's last row: causal inside a block, keep-gated across blocks.
    blk_m = offs_m // C
    for start in range(a0 * C, tl.minimum(m0 + BLOCK_M, T), BLOCK_N):
        keys = start + offs_n
        key_ok = keys < T
        k = tl.load(k_ptr + keys[:, None] * sk_t + offs_dk[None, :], mask=key_ok[:, None], other=0.0)
        v = tl.load(v_ptr + keys[:, None] * sv_t + offs_dv[None, :], mask=key_ok[:, None], other=0.0)
        blk_n = keys // C
        kept_n = tl.load(flags_ptr + row + blk_n, mask=key_ok, other=0) != 0
        visible = (keys[None, :] <= offs_m[:, None]) & ((blk_n[None, :] == blk_m[:, None]) | kept_n[None, :])
        acc, m_i, l_i = _online_softmax_step(acc, m_i, l_i, q, k, v, qk_scale, visible, True, PREC)

    # Every real row saw at least itself, so l_i >= 1 there; only padding rows (never stored)
    # can have l_i = 0, and the guard keeps them finite.
    l_i = tl.where(l_i > 0.0, l_i, 1.0)
    o = acc / l_i[:, None]
    o_ptrs = o_ptr + offs_m[:, None] * so_t + offs_dv[None, :]
    tl.store(o_ptrs, cast_to(o, o_ptr.dtype.element_ty), mask=row_ok[:, None])
    tl.store(lse_ptr + bh * T + offs_m, m_i + tl.math.log2(l_i), mask=row_ok)


LOG2E = 1.4426950408889634


# Plain-int helpers: triton.cdiv / next_power_of_2 are constexpr functions, slower to call.
def ceil_div(a: int, b: int) -> int:
    return -(-a // b)


def next_pow2(n: int) -> int:
    return 1 << max(n - 1, 0).bit_length()


def dot_precision(dtype: torch.dtype) -> str:
    """32-bit inputs get fp32-accurate products from three tf32 products ("ieee" FMA code compiles
    for minutes at these tile sizes); 16-bit inputs use the tensor cores directly."""
    return "tf32x3" if dtype.itemsize >= 4 else "tf32"


def _descriptors(k, v, block_n: int, block_size: int):
    """TMA tensor descriptors of K and V as [B*T, H*D] matrices with [BLOCK_N, D] tiles, or None where
    they do not apply: off Hopper, on 32-bit inputs, for key tiles that span several routing blocks,
    or for layouts that are not [B, T, H, D] with (H, D) packed and 16-byte aligned."""
    if not config.USE_DESCRIPTORS or not k.is_cuda or k.element_size() != 2 or block_n > block_size:
        return None
    if capability(k.device)[0] < 9:
        return None
    from triton.tools.tensor_descriptor import TensorDescriptor  # Triton >= 3.4; only reached on Hopper

    descs = []
    for x in (k, v):
        B, T, H, D = x.shape
        packed = x.stride(3) == 1 and x.stride(2) == D and (B == 1 or x.stride(0) == T * x.stride(1))
        if not packed or (x.stride(1) * 2) % 16 or x.data_ptr() % 16:
            return None
        descs.append(TensorDescriptor(x, [B * T, H * D], [x.stride(1), 1], [block_n, D]))
    return descs


def attention_forward(q, k, v, lists, scale: float, block_size: int, n_groups: int):
    """O [B,T,H,Dv] in q's dtype and lse2 [B,H,T] fp32 (log2 of the row normaliser, scaled units)."""
    B, T, H, DK = q.shape
    DV = v.shape[-1]
    o = torch.empty(B, T, H, DV, dtype=q.dtype, device=q.device)
    lse = torch.empty(B, H, T, dtype=torch.float32, device=q.device)
    cfg = config.forward_config(q.element_size(), DK, DV)
    grid, heads_first = config.program_grid(B * H, ceil_div(T, cfg["BLOCK_M"]), q.device)
    descs = _descriptors(k, v, cfg["BLOCK_N"], block_size)
    _forward_kernel[grid](
        q, k, v, o, lse, lists.flags, lists.before, lists.blocks, *(descs or (k, v)),
        q.stride(0), q.stride(1), q.stride(2), k.stride(0), k.stride(1), k.stride(2),
        v.stride(0), v.stride(1), v.stride(2), o.stride(0), o.stride(1), o.stride(2),
        T, lists.flags.shape[1], H, H // n_groups, scale * LOG2E,
        C=block_size, BLOCK_M=cfg["BLOCK_M"], BLOCK_N=cfg["BLOCK_N"], DK=DK, DV=DV, PREC=dot_precision(q.dtype),
        USE_DESC=descs is not None, HEADS_FIRST=heads_first, num_warps=cfg["num_warps"], num_stages=cfg["num_stages"],
    )
    return o, lse

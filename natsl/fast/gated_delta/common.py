"""Shared pieces of the gated-delta and gated-linear kernels: the dot wrapper, masked tile loads/stores, tile
sizes, the state tile commit, the block decay and the empty-output shape.

Layouts: token-major tensors are [B, T, H, D] (contiguous), so inside one (batch, head) the rows of a
[T, D] matrix lie H * D elements apart; per-chunk states are [B, NB, H, K, V].
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from natsl.devices import triton_interpreted

# Triton's interpreter multiplies bf16 dot operands as their raw uint16 bits (seen with 3.9), so under
# TRITON_INTERPRET the operands are upcast first. bf16 x bf16 products are exact in fp32, so this is
# what the GPU's fp32-accumulating dot computes.
INTERPRET = tl.constexpr(triton_interpreted())

MIN_TILE = 16  # tl.dot needs at least 16 along every dimension
MAX_K = 256  # the sequential kernels hold the state as at most four 64-row tiles


@triton.jit
def _round_tf32(x):
    """x rounded to tf32 (10 mantissa bits), as the tensor cores read fp32 operands."""
    bits = x.to(tl.int32, bitcast=True)
    bits = (bits + 0x1000) & -8192  # -8192 = 0xFFFFE000: round half away, drop 13 low bits
    return bits.to(tl.float32, bitcast=True)


@triton.jit
def mm(a, b, PREC: tl.constexpr):
    """a @ b with an fp32 accumulator; PREC picks tf32 or ieee for fp32 operands."""
    tl.static_assert(a.dtype == b.dtype, "dot operands must share a dtype (the GPU needs it)")
    if INTERPRET:
        # Emulate tf32 operand rounding so CPU runs see the GPU's precision.
        if PREC == "tf32" and a.dtype == tl.float32:
            a = _round_tf32(a)
        if PREC == "tf32" and b.dtype == tl.float32:
            b = _round_tf32(b)
        return tl.dot(a.to(tl.float32), b.to(tl.float32))
    else:
        return tl.dot(a, b, input_precision=PREC)


@triton.jit
def load_tile(base, r0, c0, n_rows, row_stride, N_COLS: tl.constexpr, BR: tl.constexpr, BC: tl.constexpr):
    """Rows r0.., columns c0.. of a [n_rows, N_COLS] matrix with rows `row_stride` apart; zero outside."""
    rr = r0 + tl.arange(0, BR)
    rc = c0 + tl.arange(0, BC)
    ptrs = base + rr[:, None].to(tl.int64) * row_stride + rc[None, :]
    return tl.load(ptrs, mask=(rr < n_rows)[:, None] & (rc < N_COLS)[None, :], other=0.0)


@triton.jit
def group_row0(b, h, T, H, HK):
    """The row of (b, t = 0) in a token-major [B, T, HK, D] tensor read by head h of H (H % HK == 0): the
    heads of a group share their q, k (Mamba2's B and C on HK groups; HK = H where each head has its own)."""
    return b.to(tl.int64) * T * HK + h // (H // HK)


@triton.jit
def load_tile_t(base, r0, c0, n_rows, row_stride, N_COLS: tl.constexpr, BR: tl.constexpr, BC: tl.constexpr):
    """The transpose [BC, BR] of load_tile's tile, read straight from memory (no register transpose)."""
    rr = r0 + tl.arange(0, BR)
    rc = c0 + tl.arange(0, BC)
    ptrs = base + rr[None, :].to(tl.int64) * row_stride + rc[:, None]
    return tl.load(ptrs, mask=(rr < n_rows)[None, :] & (rc < N_COLS)[:, None], other=0.0)


@triton.jit
def store_tile(base, value, r0, c0, n_rows, row_stride, N_COLS: tl.constexpr, BR: tl.constexpr, BC: tl.constexpr):
    rr = r0 + tl.arange(0, BR)
    rc = c0 + tl.arange(0, BC)
    ptrs = base + rr[:, None].to(tl.int64) * row_stride + rc[None, :]
    tl.store(ptrs, value.to(base.dtype.element_ty), mask=(rr < n_rows)[:, None] & (rc < N_COLS)[None, :])


@triton.jit
def transpose_through_memory(scratch, tile, C: tl.constexpr):
    """tile [C, C]^T, in scratch's dtype: stored to this program's scratch slot and read back
    transposed after a barrier (which orders the block's stores before its loads). The backward never
    transposes a dot result in registers: Triton 3.4-3.7.0 miscompiles such chunked gated-delta
    backward kernels on Hopper (flash-linear-attention issue 640)."""
    store_tile(scratch, tile, 0, 0, C, C, C, C, C)
    tl.debug_barrier()
    return load_tile_t(scratch, 0, 0, C, C, C, C, C)


@triton.jit
def read_tile(desc, base, b, h, r0, c0, n_rows, row_stride, N_COLS: tl.constexpr, BR: tl.constexpr,
              BC: tl.constexpr, DESC: tl.constexpr):
    """load_tile's tile of (batch b, head h), read through the [B, T, H, D] tensor descriptor `desc`
    when DESC (TMA on Hopper; rows past T and columns past D come back as zeros), else from `base`."""
    if DESC:
        return desc.load([b, r0, h, c0]).reshape(BR, BC)
    else:
        return load_tile(base, r0, c0, n_rows, row_stride, N_COLS, BR, BC)


@triton.jit
def write_tile(desc, base, value, b, h, r0, c0, n_rows, row_stride, N_COLS: tl.constexpr, BR: tl.constexpr,
               BC: tl.constexpr, DESC: tl.constexpr):
    """store_tile through the descriptor when DESC (the part outside [T, D] is clipped)."""
    if DESC:
        desc.store([b, r0, h, c0], value.to(desc.dtype).reshape(1, BR, 1, BC))
    else:
        store_tile(base, value, r0, c0, n_rows, row_stride, N_COLS, BR, BC)


@triton.jit
def load_vec(base, r0, n_rows, stride, BR: tl.constexpr):
    """fp32 vector of rows r0.. of a [n_rows] column `stride` apart; zero outside."""
    rr = r0 + tl.arange(0, BR)
    return tl.load(base + rr.to(tl.int64) * stride, mask=rr < n_rows, other=0.0).to(tl.float32)


@triton.jit
def store_vec(base, value, r0, n_rows, stride, BR: tl.constexpr):
    rr = r0 + tl.arange(0, BR)
    tl.store(base + rr.to(tl.int64) * stride, value.to(base.dtype.element_ty), mask=rr < n_rows)


@triton.jit
def reverse_cumsum(x):
    """y_s = sum_{t >= s} x_t along the only axis."""
    return tl.sum(x, 0) - tl.cumsum(x, 0) + x


def dim_tile(d: int, cap: int = 64) -> int:
    """Tile width for a head dim: a power of two in [16, cap]; the last tile is masked."""
    return min(cap, max(MIN_TILE, triton.next_power_of_2(d)))


def fp32_precision(dtype) -> str:
    """Dot precision for fp32 operands: exact fp32 when the inputs are fp32, tf32 otherwise."""
    return "ieee" if dtype == torch.float32 else "tf32"


@triton.jit
def chunk_decay(gc_ptr, write_ptr, t0, n, T, H, C: tl.constexpr, DECAY_SKIPPED: tl.constexpr):
    """A chunk's decay terms: (gc over its rows, exp(G_last - gc), write, a).

    G_last is gc at the chunk's last real token, so Gamma = exp(G_last); the commit is
    S_start(n+1) = a S_start(n) + write * K_dec^T R with K_dec = diag(exp(G_last - gc)) K and
    a = Gamma (decay across skipped blocks) or 1 - write + write * Gamma (the ablation).
    gc_ptr points at (b, t=0, h) of [B, T, H]; write_ptr at (b, chunk 0, h) of [B, NB, H].
    """
    last = tl.minimum(t0 + C, T) - 1
    g_last = tl.load(gc_ptr + last.to(tl.int64) * H)
    gc = load_vec(gc_ptr, t0, T, H, C)
    wt = tl.load(write_ptr + n * H).to(tl.float32)
    gamma = tl.exp(g_last)
    if DECAY_SKIPPED:
        a = gamma
    else:
        a = 1.0 - wt + wt * gamma
    return gc, tl.exp(g_last - gc), wt, a


def token_descriptors(tensors, rows: int, cols: int, enabled: bool):
    """TensorDescriptors of token-major [B, T, H, D] tensors with [1, rows, 1, cols] blocks, for
    read_tile / write_tile, or None where they do not apply: switched off, a GPU before Hopper (no TMA),
    a non-contiguous tensor, or rows that are not a multiple of 16 bytes (e.g. D = 20 in bf16).
    A 4-D shape, not a [B*T, H*D] view, so that rows past T read as zeros, not as the next sequence's."""
    if not enabled:
        return None
    for x in tensors:
        if x.is_cuda and torch.cuda.get_device_capability(x.device)[0] < 9:
            return None
        if not x.is_contiguous() or (x.shape[-1] * x.element_size()) % 16 or x.data_ptr() % 16:
            return None
    from triton.tools.tensor_descriptor import TensorDescriptor  # Triton >= 3.4

    return [TensorDescriptor(x, list(x.shape), list(x.stride()), [1, rows, 1, cols]) for x in tensors]


def launch_options(cfg: dict, block_size: int, work_dtype) -> dict:
    """num_warps / num_stages of a launch (and `maxnreg`, a cap on registers per thread, where the dict
    sets one). 32-bit chunk intermediates (`work_dtype`) take at most two stages: their tiles are twice
    as wide, and a third stage needs more shared memory than the H200 has (242 KB of 227 KB for prepare).
    `block_size` is the kernels' chunk, at most natsl.block_size.LARGEST_CHUNK (a larger routing block
    spans several chunks: spans.py)."""
    stages = cfg["num_stages"]
    if work_dtype.itemsize >= 4:
        stages = min(stages, 2)
    options = {"num_warps": cfg["num_warps"], "num_stages": stages}
    if cfg.get("maxnreg"):
        options["maxnreg"] = cfg["maxnreg"]
    return options


# A custom op cannot return None, so the ops' absent outputs are empty tensors of this shape.
EMPTY = (0,)


@triton.jit
def commit_tile(s, a, k_ptr, rd, t0, k0, T, H, K: tl.constexpr, C: tl.constexpr, BK: tl.constexpr,
                PREC: tl.constexpr):
    """a S + K^T rd for one K tile; K^T is read transposed straight from memory."""
    kt = load_tile_t(k_ptr, t0, k0, T, H * K, K, C, BK).to(rd.dtype)
    return a * s + mm(kt, rd, PREC)


def k_tiles(K: int) -> tuple[int, int]:
    """The state's K rows as NK register tiles of BK rows: (BK, NK)."""
    BK = dim_tile(K)
    return BK, triton.cdiv(K, BK)


def chunk_gamma(gc: torch.Tensor, block_size: int) -> torch.Tensor:
    """Gamma_b = exp(sum of g over block b) [B, NB, H], read off the in-chunk cumulative decay."""
    T = gc.shape[1]
    last = torch.arange(block_size - 1, T + block_size - 1, block_size, device=gc.device).clamp_(max=T - 1)
    return gc[:, last].exp()

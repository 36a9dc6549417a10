"""The forward's first kernel: gc, the cumulative log decay inside each chunk, and the write mask in fp32.

One program per (chunk, batch, tile of BH heads) loads the chunk's [C, BH] block of g (token rows H
apart, the tile's heads adjacent in each row), sums it down the rows in fp32 (tl.cumsum) and stores
it as gc; rows past T (a partial last chunk) and heads past H are masked, so nothing is padded or
copied first. The same program writes its BH entries of the chunk's row of w32 (write in fp32, or
ones where write is None), which every later kernel of the forward and backward reads: this saves
the forward a fill or cast launch of its own.

The PyTorch twin, which the tests hold this to, is natsl.reference.gated_linear_chunked.chunk_cumsum.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from natsl.fast.gated_delta.common import load_tile, load_vec, store_tile, store_vec
from natsl.fast.gated_linear import config


@triton.jit(do_not_specialize=["T", "NB", "sw_b", "sw_n"])  # one compile for every sequence length
def _chunk_cumsum_kernel(
    g_ptr, gc_ptr, write_ptr, w32_ptr,
    T, NB, sw_b, sw_n, sw_h,
    H: tl.constexpr, C: tl.constexpr, BH: tl.constexpr, STORE_W32: tl.constexpr, HAS_WRITE: tl.constexpr,
):
    n = tl.program_id(0)
    b = tl.program_id(1)
    h0 = tl.program_id(2) * BH
    t0 = n * C
    row0 = b.to(tl.int64) * T * H  # (b, t=0, h=0) of a [B, T, H] tensor
    g = load_tile(g_ptr + row0, t0, h0, T, H, H, C, BH).to(tl.float32)  # masked rows and heads read 0
    store_tile(gc_ptr + row0, tl.cumsum(g, 0), t0, h0, T, H, H, C, BH)
    if STORE_W32:
        if HAS_WRITE:  # any float dtype, any strides: read in place
            wt = load_vec(write_ptr + b.to(tl.int64) * sw_b + n.to(tl.int64) * sw_n, h0, H, sw_h, BH)
        else:
            wt = tl.full([BH], 1.0, dtype=tl.float32)
        store_vec(w32_ptr + (b.to(tl.int64) * NB + n) * H, wt, h0, H, 1, BH)


def _launch(g: torch.Tensor, write: torch.Tensor | None, block_size: int, cfg: dict, store_w32: bool):
    B, T, H = g.shape
    NB = triton.cdiv(T, block_size)
    g = g.contiguous()
    gc = torch.empty(B, T, H, device=g.device, dtype=torch.float32)
    w32 = torch.empty(B, NB, H, device=g.device, dtype=torch.float32) if store_w32 else None
    if T == 0:
        return gc, w32
    BH = min(cfg["BH"], triton.next_power_of_2(H))
    strides = write.stride() if write is not None else (0, 0, 0)
    _chunk_cumsum_kernel[(NB, B, triton.cdiv(H, BH))](
        g, gc, write, w32, T, NB, *strides,
        H=H, C=block_size, BH=BH, STORE_W32=store_w32, HAS_WRITE=write is not None,
        num_warps=cfg["num_warps"],
    )
    return gc, w32


def chunk_cumsum(g: torch.Tensor, block_size: int) -> torch.Tensor:
    """gc [B,T,H] fp32: the cumulative sum of g [B,T,H] (any float dtype; a non-contiguous g is copied
    first) inside each chunk of `block_size` tokens (a power of two; the last chunk may be partial),
    summed in fp32."""
    return _launch(g, None, block_size, config.CUMSUM, store_w32=False)[0]


def chunk_cumsum_and_write(g: torch.Tensor, write: torch.Tensor | None, block_size: int,
                           cfg: dict) -> tuple[torch.Tensor, torch.Tensor]:
    """(chunk_cumsum's gc, w32 [B,NB,H]) from one launch: w32 is write (any float dtype, any strides) in
    fp32, a new tensor even where write is fp32 already (a custom op may not return an alias of its
    input), or all ones where write is None."""
    return _launch(g, write, block_size, cfg, store_w32=True)

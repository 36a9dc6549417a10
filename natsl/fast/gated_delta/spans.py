"""Routing blocks that span several kernel chunks (block_size 128 and 256 on 64-token chunks).

Design. The state kernels' chunk C is a tl.constexpr, and a routing block of at most 64 tokens is one
chunk (16, 32: prepare.py pads its sub-blocks). A larger block is M = block_size / 64 chunks that share one
route, so that every kernel keeps the 64-token chunk it was tuned for: the chunk-parallel kernels
(prepare, output, local dR, grad_qk, grad_wy) need no change, and the backward's [C, C] tiles at C = 128
would need more shared memory than Hopper has. Only the two sequential kernels learn the block:

    inside a block   S <- Gamma_c S + K_dec^T R                      (every chunk writes: write_c = 1)
    at its end       S <- write (Gamma_c S + K_dec^T R) + e S_block,  e = (1 - write) c_b

with S_block the state at the block's start (a second set of register tiles), c_b = Gamma_b (the
block's decay, exp of the sum of g over all its chunks) or 1 (decay_skipped_blocks=False): the spec's
commit S_start(b+1) = c_b S_start(b) + write (S_end(b) - c_b S_start(b)). So the kernels read one
write per chunk (write_c: 1, or the block's write at its last chunk) and a coefficient e per chunk
(0 but at a block's last chunk). Their reverse pass gathers e D at a block's last chunk and hands it
to the block's first chunk's gradient. With M = 1 none of this code is compiled in.

The route gradient and the decay's gradient then need q_b = <D_end(b), S_block(b)>, a product of the
stored states: dL/dwrite_b = p1 + Gamma_c p2 - c_b q_b at the block's last chunk, and the block's
decay adds (1 - write) c_b q_b to every g of the block (method only).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from natsl.block_size import LARGEST_CHUNK as CHUNK  # the chunk of a block that spans several


def chunking(block_size: int) -> tuple[int, int]:
    """(chunk C, chunks per block M) of a routing block: the block itself up to CHUNK tokens, else
    M = block_size / CHUNK chunks of CHUNK tokens (block_size a multiple of CHUNK)."""
    if block_size <= CHUNK:
        return block_size, 1
    return CHUNK, block_size // CHUNK


# The helpers touch only the NK state tiles that exist (K rows / BK): an unused tile stays a constant
# the compiler drops, instead of a live register tile carried through the chunk loop.
@triton.jit
def span_start(first, b0, b1, b2, b3, s0, s1, s2, s3, NK: tl.constexpr):
    """The block's start state: the running state S at a block's first chunk, else kept."""
    b0 = tl.where(first, s0, b0)
    if NK > 1:
        b1 = tl.where(first, s1, b1)
    if NK > 2:
        b2 = tl.where(first, s2, b2)
    if NK > 3:
        b3 = tl.where(first, s3, b3)
    return b0, b1, b2, b3


@triton.jit
def span_commit(e, s0, s1, s2, s3, b0, b1, b2, b3, NK: tl.constexpr):
    """S + e S_block, the end-of-block term of the commit (e = 0 inside a block)."""
    s0 += e * b0
    if NK > 1:
        s1 += e * b1
    if NK > 2:
        s2 += e * b2
    if NK > 3:
        s3 += e * b3
    return s0, s1, s2, s3


@triton.jit
def span_release(first, d0, d1, d2, d3, p0, p1, p2, p3, NK: tl.constexpr):
    """At a block's first chunk the gathered gradient joins D (S_block is that chunk's start state) and
    the gathering restarts for the block before. span_commit(e, P, D) gathers it: P + e D."""
    d0 = tl.where(first, d0 + p0, d0)
    p0 = tl.where(first, 0.0, p0)
    if NK > 1:
        d1 = tl.where(first, d1 + p1, d1)
        p1 = tl.where(first, 0.0, p1)
    if NK > 2:
        d2 = tl.where(first, d2 + p2, d2)
        p2 = tl.where(first, 0.0, p2)
    if NK > 3:
        d3 = tl.where(first, d3 + p3, d3)
        p3 = tl.where(first, 0.0, p3)
    return d0, d1, d2, d3, p0, p1, p2, p3


def _chunk_index(n_chunks: int, n_blocks: int, M: int, device) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(block of each chunk [NC], each block's first chunk [NB], each block's last chunk [NB])."""
    block = torch.arange(n_chunks, device=device) // M
    first = torch.arange(n_blocks, device=device) * M
    return block, first, (first + M - 1).clamp_(max=n_chunks - 1)


def chunk_log_decay(gc: torch.Tensor, C: int) -> torch.Tensor:
    """G_last of every chunk [B, NC, H] (log Gamma_c), read off the in-chunk cumulative decay gc [B, T, H]."""
    T = gc.shape[1]
    last = torch.arange(C - 1, T + C - 1, C, device=gc.device).clamp_(max=T - 1)
    return gc[:, last]


def span_routes(w32: torch.Tensor, gc: torch.Tensor, C: int, M: int, decay_skipped_blocks: bool):
    """What the sequential kernels read for blocks of M chunks of C tokens.

    Args:
        w32: the route [B, NB, H] (fp32).
        gc: the in-chunk cumulative log decay [B, T, H] (fp32).
        C, M: chunk and chunks per block (`chunking`).
        decay_skipped_blocks: False: c_b = 1.

    Returns:
        (write per chunk [B, NC, H], e per chunk [B, NC, H], c_b [B, NB, H]), fp32 and contiguous.
    """
    NB = w32.shape[1]
    g_last = chunk_log_decay(gc, C)
    NC = g_last.shape[1]
    block, _, last = _chunk_index(NC, NB, M, w32.device)
    if decay_skipped_blocks:
        c_b = torch.zeros_like(w32).index_add_(1, block, g_last).exp()
    else:
        c_b = torch.ones_like(w32)
    at_end = torch.zeros(NC, dtype=torch.bool, device=w32.device)
    at_end[last] = True
    wb = w32[:, block]
    write_c = torch.where(at_end[None, :, None], wb, 1.0).contiguous()
    e = torch.where(at_end[None, :, None], (1.0 - wb) * c_b[:, block], 0.0).contiguous()
    return write_c, e, c_b


def span_grads(w32, c_b, g_last, h, dh, p1, p2, M: int, decay_skipped_blocks: bool):
    """The route's gradient and each chunk's share of the decay's gradient, for blocks of M chunks.

    Args:
        w32: the route [B, NB, H]; c_b [B, NB, H] (span_routes); g_last [B, NC, H] (chunk_log_decay).
        h, dh: each chunk's start state and dL/dS after its commit [B, NC, H, K, V].
        p1, p2: grad_qk's <D, K_dec^T R> and <D, S> per chunk [B, NC, H], with the chunks' writes.
        M: chunks per block.
        decay_skipped_blocks: False: c_b = 1, which no g moves.

    Returns:
        (dL/dwrite [B, NB, H] before the route-gradient policy, dL/dG_last per chunk [B, NC, H]): every
        token of chunk c takes the latter (grad_wy adds it to each g of the chunk).
    """
    NB, NC = w32.shape[1], p1.shape[1]
    block, first, last = _chunk_index(NC, NB, M, w32.device)
    gamma = g_last.exp()
    # q_b = <D at the block's end, S at its start>, the new product of the span's commit
    q_b = (dh[:, last].float() * h[:, first].float()).sum((-2, -1))
    dwrite = p1[:, last] + gamma[:, last] * p2[:, last] - c_b * q_b
    write_c = torch.ones_like(p2)
    write_c[:, last] = w32
    dg_last = write_c * gamma * p2  # the chunk's own decay: a = write_c Gamma_c
    if decay_skipped_blocks:  # c_b = exp(sum of the block's g) moves with every chunk of the block
        dg_last = dg_last + ((1.0 - w32) * c_b * q_b)[:, block]
    return dwrite, dg_last

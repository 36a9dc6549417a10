"""Matrix-vector products for decode steps: `linear(x, weight)` for inputs of at most MAX_ROWS rows.

A decode step multiplies one token's vector by every weight matrix, so it is bound by reading the
weights. cuBLAS picks a different kernel for each shape at one row (gemv, split-K with a separate
reduction, narrow-tile GEMMs), and on the H200 an 800M decode step's products took about twice the
time their weights take to read at copy bandwidth. This kernel streams the weight
once: each program owns BLOCK_N output features, walks K in BLOCK_K chunks (or takes it in one
pass), multiplies in fp32 and reduces once at the end (a one-pass tile reduces its product as it forms,
so its accumulator is one column wide, not a tile's: half the registers, no spills at two rows); `tiles`
picks the shapes from measurements.
The kernel takes up to 4 rows; `Linear` sends it at most MAX_ROWS. Results agree with `F.linear`
to rounding (fp32 sums in a different order, one rounding to the input dtype). With `up=` it reads
SwiGLU's two halves and multiplies by silu(gate) * up instead (the decode step's down product); with
`norm=(weight, eps)` as well it forms RMSNorm(x) per head of weight's width, times weight and
silu(up), as it reads x (a GDN layer's gated output norm folded into its output product: one kernel
fewer a layer and token).

`natsl.ops.gemv` decides when it runs (`applies`: grad-free inputs of <= MAX_ROWS rows, `enabled`);
`natsl.models.linear.Linear` and the SwiGLU reach it only through that door.
"""

from __future__ import annotations

import functools

import torch

from natsl.fast import cached as kernels

# One and two rows beat cuBLAS at every 800M decode shape on the H200 (`python -m benchmarks.ops --op gemv`); at
# four rows cuBLAS was faster for most, so larger batches keep F.linear.
MAX_ROWS = 2

# The tiles (BLOCK_N, BLOCK_K) of the folds where a caller gives none; None: `tiles`' choice, as for a plain product
# of the (padded) row. Every program of a fold reads the whole input row (and its gate or residual) again for the
# norm, so one-pass tiles two weight rows tall make that the weights' own bytes again at the 800M o_proj (768
# programs); taller looped tiles (an output norm's a head at a time) read it fewer times. `python -m
# benchmarks.ops --op gemv_fold --sweep` compares settings.
FOLD_TILES: dict[str, tuple[int, int] | None] = {"output_norm": None, "row_norm": None}


def _kernel():
    from natsl.fast.gemv_kernel import gemv_kernel  # imports Triton: only where a kernel runs

    return gemv_kernel


@functools.lru_cache(maxsize=None)
def tiles(N: int, K: int, M: int, sm_count: int) -> tuple[int, int]:
    """(BLOCK_N, BLOCK_K). Narrow products (few output rows: o, down) take the whole K in one pass
    (no loop, all loads in flight at once), 8K weights a tile; the others the widest BLOCK_N (<= 16)
    that still gives >= 2 programs per SM and ~4K weights a tile. With weights read from memory on
    the H200 (`python -m benchmarks.ops --op gemv`) one pass wins for narrow products such as the 1536 x 4096 down
    product, but loses for wide products and for two rows beyond N = 1536; 64 x 64 tiles (the first
    version's choice for the LM head) lost to cuBLAS."""
    if (M == 1 and N <= 4608) or (M == 2 and N <= 1536):
        block_k = min(kernels.next_pow2(K), 4096)
        return max(1, 8192 // block_k), block_k
    block_n = 16
    while block_n > 1 and -(-N // block_n) < 2 * sm_count:
        block_n //= 2
    block_k = max(16, min(4096 // block_n, kernels.next_pow2(K), 1024))
    return block_n, block_k


def linear(x: torch.Tensor, weight: torch.Tensor, *, up: torch.Tensor | None = None,
           norm: tuple[torch.Tensor, float] | None = None, conv=None, block_n: int | None = None,
           block_k: int | None = None) -> torch.Tensor:
    """x [..., K] with at most 4 rows, weight [N, K] -> x @ weight.T [..., N] in x's dtype.
    `up` (x's shape): the input is SwiGLU's silu(x) * up instead of x, computed on the fly (a decode
    step's down projection without the SwiGLU kernel). `norm` = (norm_weight [D], eps) with `up`: the
    input is instead rms_norm(x per head of D columns, norm_weight, eps, gate=up) (D dividing K; a head
    that is not a power of two wide takes the next power of two's positions in a tile, the rest masked;
    natsl.reference.norms.rms_norm's formula, one rounding). `conv`: see `conv_epilogue`.
    `block_n`, `block_k` override the tiles (`python -m benchmarks.ops --op gemv` compares settings)."""
    K = x.shape[-1]
    N = weight.shape[0]
    x2 = _rows(x, K)
    M = x2.shape[0]
    assert 1 <= M <= 4 and weight.shape[1] == K, (x.shape, weight.shape)
    u2 = x2
    if up is not None:
        assert up.shape == x.shape and up.dtype == x.dtype
        u2 = _rows(up, K)
    weight = _rows(weight, K)
    head, norm_weight, eps = 0, weight, 0.0
    if norm is not None:
        norm_weight, eps = norm[0].contiguous(), float(norm[1])
        head = norm_weight.numel()
        assert up is not None and K % head == 0, (head, K)
    y = torch.empty(M, N, dtype=x.dtype, device=x.device)
    _launch(x2, u2, weight, y, norm_weight, y, eps, M, N, K, block_n, block_k, gated=up is not None, head=head,
            conv=conv)
    return y.view(*x.shape[:-1], N)


def add_norm_linear(x: torch.Tensor, residual: torch.Tensor | None, norm_weight: torch.Tensor, eps: float,
                    weight: torch.Tensor, *, conv=None, block_n: int | None = None,
                    block_k: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(x + residual, rms_norm(x + residual, norm_weight, eps) @ weight.T) in one kernel: the residual
    add and the RMSNorm of `natsl.fast.norms.add_rms_norm` formed as the GEMV reads its input: each row's
    sum of squares is gathered in the same pass as the product, whose fp32 sum the row's norm scale then
    multiplies (so the normed input is not rounded before the product, as add_rms_norm rounds it: within
    one rounding of the twin); the first program writes the sum. residual None: (x, the product of x's norm).

    Args:
        x, residual: [..., K], at most 4 rows, one dtype; norm_weight [K]; weight [N, K]; conv: see
            `conv_epilogue`.

    Returns:
        (the sum [..., K] (x itself where residual is None), the product [..., N]), in x's dtype.
    """
    K = x.shape[-1]
    N = weight.shape[0]
    x2 = _rows(x, K)
    M = x2.shape[0]
    assert 1 <= M <= 4 and weight.shape[1] == K and norm_weight.numel() == K, (x.shape, weight.shape)
    has_res = residual is not None
    r2 = x2
    if has_res:
        assert residual.shape == x.shape and residual.dtype == x.dtype
        r2 = _rows(residual, K)
    weight = _rows(weight, K)
    y = torch.empty(M, N, dtype=x.dtype, device=x.device)
    total = torch.empty(M, K, dtype=x.dtype, device=x.device) if has_res else x2
    _launch(x2, r2, weight, y, norm_weight.contiguous(), total, float(eps), M, N, K, block_n, block_k,
            row_norm=True, has_res=has_res, conv=conv)
    total = total.view(x.shape) if has_res else x
    return total, y.view(*x.shape[:-1], N)


def gated_input_norm_linear(x: torch.Tensor, gate: torch.Tensor, norm_weight: torch.Tensor, eps: float,
                            weight: torch.Tensor, *, block_n: int | None = None,
                            block_k: int | None = None) -> torch.Tensor:
    """gated_input_rms_norm(x, norm_weight, eps, gate) @ weight.T in one kernel: Mamba2's output norm
    (RMSNorm of x * silu(gate) over the row, times the weight, fp32) formed as the GEMV reads x, in one
    pass as `add_norm_linear`'s (the row's scale multiplies the finished product).

    Args:
        x, gate: [..., K], at most 4 rows (column slices read in place); norm_weight [K]; weight [N, K].

    Returns:
        [..., N] in x's dtype.
    """
    K = x.shape[-1]
    N = weight.shape[0]
    x2, g2 = _rows(x, K), _rows(gate, K)
    M = x2.shape[0]
    assert 1 <= M <= 4 and weight.shape[1] == K and norm_weight.numel() == K and gate.shape == x.shape
    y = torch.empty(M, N, dtype=x.dtype, device=x.device)
    _launch(x2, g2, _rows(weight, K), y, norm_weight.contiguous(), y, float(eps), M, N, K, block_n, block_k,
            row_norm=True, gate_first=True)
    return y.view(*x.shape[:-1], N)


def conv_epilogue(conv, rows: int, N: int, like: torch.Tensor) -> dict:
    """The kernel's arguments for `conv` = (start, weights, tails): the product's columns start .. start +
    sum(C) are the inputs of up to three short convs + SiLU, one token each (natsl.reference.cached.conv_steps:
    weights [C, 1, W + 1], tails [B, W, C] of one dtype and W, unit column stride, B = the product's rows),
    which the kernel runs as it stores them, the tails shifted in place; the product holds their outputs there.
    None: no conv (the arguments that keep the kernel's CONV off)."""
    if conv is None:
        return dict(c0=0, C0=0, C1=0, C2=0, cw0=like, cw1=like, cw2=like, ct0=like, ct1=like, ct2=like, tb0=0, tb1=0,
                    tb2=0, tw0=0, tw1=0, tw2=0, CONV=False, CONV_W=1)
    start, weights, tails = conv
    assert 1 <= len(weights) == len(tails) <= 3
    W = tails[0].shape[1]
    widths = [w.shape[0] for w in weights]
    for w, t, C in zip(weights, tails, widths):
        assert w.shape == (C, 1, W + 1) and w.is_contiguous() and t.shape == (rows, W, C) and t.stride(-1) == 1
        assert t.dtype == tails[0].dtype
    assert 0 <= start and start + sum(widths) <= N
    pad = 3 - len(weights)
    weights, tails, widths = [*weights, *weights[:1] * pad], [*tails, *tails[:1] * pad], [*widths, *[0] * pad]
    return dict(c0=start, C0=widths[0], C1=widths[1], C2=widths[2], cw0=weights[0], cw1=weights[1], cw2=weights[2],
                ct0=tails[0], ct1=tails[1], ct2=tails[2], tb0=tails[0].stride(0), tb1=tails[1].stride(0),
                tb2=tails[2].stride(0), tw0=tails[0].stride(1), tw1=tails[1].stride(1), tw2=tails[2].stride(1),
                CONV=True, CONV_W=W)


def _rows(t: torch.Tensor, K: int) -> torch.Tensor:
    """t as rows [n, K] of unit column stride (a view where it can be, else a copy): the kernel's layout."""
    rows = t.reshape(-1, K)
    return rows if rows.stride(-1) == 1 else rows.contiguous()


def launch_tiles(N: int, K: int, M: int, head: int, sm_count: int, block_n: int | None = None,
                 block_k: int | None = None) -> dict:
    """The kernel's tile constexprs for an [N, K] product of M rows (`head`: the output norm's head width, 0
    without): BLOCK_N and BLOCK_K (`tiles`' unless both are given), HEAD_P2 and ACC_K. A head that is not a
    power of two wide takes the next power of two's positions in a tile (the kernel's `_columns`); a tile
    holds whole heads; ACC_K is 1 where one tile holds the whole row (its product reduced as it forms)."""
    head_p2 = kernels.next_pow2(head) if head else 0
    positions = K // head * head_p2 if head else K
    if block_n is None or block_k is None:
        block_n, block_k = tiles(N, positions, M, sm_count)
    if block_k < head_p2:  # the tile keeps its size in weights
        block_n, block_k = max(1, block_n * block_k // head_p2), head_p2
    return {"BLOCK_N": block_n, "BLOCK_K": block_k, "HEAD_P2": head_p2,
            "ACC_K": 1 if block_k >= positions else block_k}


def _launch(x2, u2, weight, y, norm_weight, total, eps, M, N, K, block_n, block_k, *, gated=False, head=0,
            row_norm=False, has_res=False, gate_first=False, conv=None) -> None:
    fold = FOLD_TILES["output_norm" if head else "row_norm"] if head or row_norm else None
    if fold is not None and block_n is None and block_k is None:
        block_n, block_k = fold
    shape = launch_tiles(N, K, M, head, kernels.sm_count(x2.device), block_n, block_k)
    on = kernels.pdl(x2.device)
    _kernel()[(-(-N // shape["BLOCK_N"]),)](x2, u2, weight, y, norm_weight, total, eps, N, K, x2.stride(0),
                                            u2.stride(0), weight.stride(0), y.stride(0), total.stride(0), M=M,
                                            GATED=gated, NORM_HEAD=head, ROW_NORM=row_norm, HAS_RES=has_res,
                                            GATE_FIRST=gate_first, num_warps=4, PDL=on, **shape,
                                            **conv_epilogue(conv, M, N, y), **kernels.launch_options(on))

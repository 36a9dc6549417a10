"""Tile shapes and launch settings of the routed-attention kernels.

Tiles are decoupled from the routing block C (all powers of two):
  forward and dq: a query tile of BLOCK_M rows walks key tiles of BLOCK_N rows, first over the
    kept blocks before the tile (read through the compacted list as one virtual sequence of
    kept keys, so BLOCK_N may be smaller or larger than C), then over its own blocks;
  dk/dv: a key tile of BLOCK_N <= C rows (inside one routing block, so it has one keep flag)
    walks query tiles of BLOCK_M <= BLOCK_N rows.
The 16-bit settings were picked on the H200 (docs/kernels/routed_attention.md says why);
32-bit inputs get small tiles and one stage, since their fp32-accurate products ("tf32x3") need
three times the shared memory; head dims over 128 get smaller tiles to stay in registers.
`python -m benchmarks.ops --op routed_attention --sweep` overrides these dicts to compare settings.
"""

from __future__ import annotations

from natsl.devices import sm_count

# Key tiles of the forward read through TMA tensor descriptors where they apply (Hopper, 16-bit,
# BLOCK_N <= C, packed [B, T, H, D] layouts); forward._descriptors says when. Benchmarks and tests
# set it to False to compare with pointer loads (slightly slower at long contexts, equal at 4K).
USE_DESCRIPTORS = True

# 16-bit inputs, Dv = 128 (the 800M layer: Dk 64, Dv 128). One warp group per 128-row query tile:
# faster than 128 x 128 tiles on 8 warps, whose two warp groups split the rows
# (`python -m benchmarks.ops --op routed_attention --sweep`).
FORWARD = {"BLOCK_M": 128, "BLOCK_N": 64, "num_warps": 4, "num_stages": 3}
# 16-bit inputs, Dv <= 64 (plain 64-dim heads): 128-key tiles (pointer loads) beat 64-key tiles with
# TMA at every length (same script): twice the keys per softmax step.
FORWARD_SMALL_DV = {"BLOCK_M": 128, "BLOCK_N": 128, "num_warps": 4, "num_stages": 2}
BACKWARD_DQ = {"BLOCK_M": 128, "BLOCK_N": 64, "num_warps": 4, "num_stages": 2}
BACKWARD_DKDV = {"BLOCK_N": 64, "BLOCK_M": 64, "num_warps": 4, "num_stages": 3}

# Head dims over 128 (16-bit).
FORWARD_LARGE_DIM = {"BLOCK_M": 64, "BLOCK_N": 64, "num_warps": 4, "num_stages": 2}
BACKWARD_DQ_LARGE_DIM = {"BLOCK_M": 64, "BLOCK_N": 64, "num_warps": 4, "num_stages": 2}
BACKWARD_DKDV_LARGE_DIM = {"BLOCK_N": 64, "BLOCK_M": 32, "num_warps": 4, "num_stages": 2}

# 32-bit inputs.
FORWARD_32BIT = {"BLOCK_M": 64, "BLOCK_N": 32, "num_warps": 4, "num_stages": 1}
BACKWARD_DQ_32BIT = {"BLOCK_M": 64, "BLOCK_N": 32, "num_warps": 4, "num_stages": 1}
BACKWARD_DKDV_32BIT = {"BLOCK_N": 32, "BLOCK_M": 32, "num_warps": 4, "num_stages": 1}


# Benchmarks and tests set this to True / False; None = by `heads_first`'s rule.
HEADS_FIRST: bool | None = None


def heads_first(n_programs: int, device) -> bool:
    """Program order of a kernel whose tiles are scheduled heaviest first within each head: heads on
    grid axis 0, so that every head's heaviest tiles start first, for grids of at most 8 programs
    per SM (about four waves), where a head's tiles alone would end the grid on one head's heavy
    tiles; above that a head's tiles together, whose shared keys stay in L2. On the H200 heads first
    wins at batch 1 x 4K, and a head's tiles together at batch 4 x 4K, 16K and 64K, forward and
    backward."""
    if HEADS_FIRST is not None:
        return HEADS_FIRST
    return n_programs <= 8 * sm_count(device)


def program_grid(rows: int, n_tiles: int, device) -> tuple[tuple[int, int], bool]:
    """(grid, heads_first) of a kernel with `n_tiles` programs for each of `rows` (batch x heads),
    in the order `heads_first` picks; the kernel reads its ids with forward.head_and_tile."""
    first = heads_first(rows * n_tiles, device)
    return ((rows, n_tiles) if first else (n_tiles, rows)), first


def _pick(element_size: int, dk: int, dv: int, normal: dict, large: dict, wide: dict, small_dv=None) -> dict:
    if element_size >= 4:
        return wide
    if max(dk, dv) > 128:
        return large
    if small_dv is not None and dv <= 64:
        return small_dv
    return normal


def forward_config(element_size: int, dk: int, dv: int) -> dict:
    return _pick(element_size, dk, dv, FORWARD, FORWARD_LARGE_DIM, FORWARD_32BIT, FORWARD_SMALL_DV)


def dq_config(element_size: int, dk: int, dv: int) -> dict:
    return _pick(element_size, dk, dv, BACKWARD_DQ, BACKWARD_DQ_LARGE_DIM, BACKWARD_DQ_32BIT)


def dkdv_config(element_size: int, dk: int, dv: int) -> dict:
    return _pick(element_size, dk, dv, BACKWARD_DKDV, BACKWARD_DKDV_LARGE_DIM, BACKWARD_DKDV_32BIT)


def dkdv_tiles(cfg: dict, block_size: int) -> tuple[int, int]:
    """(BLOCK_N, BLOCK_M) with BLOCK_M <= BLOCK_N <= C, so that a key tile has one keep flag and
    the causal and later-query ranges split into whole query tiles."""
    block_n = min(cfg["BLOCK_N"], block_size)
    return block_n, min(cfg["BLOCK_M"], block_n)

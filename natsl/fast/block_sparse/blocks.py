"""Per (batch, routing group) compacted lists of kept blocks, built on the device in one launch.

The attention kernels loop only over kept blocks, so they need, for every (b, g):
  flags[b, g, c]  1 if block c is kept (keep > 0.5), else 0;
  before[b, g, a] how many kept blocks precede block a (an exclusive prefix count);
  blocks[b, g, :] the kept block indices in increasing order, zero-padded after the last one.
A query tile whose first block is a0 visits blocks[b, g, :before[b, g, a0]]: the sorted order
makes that prefix exactly the kept blocks earlier than a0. Nothing here syncs with the host.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl


class BlockLists(NamedTuple):
    flags: torch.Tensor  # int32 [B * G, NB]
    before: torch.Tensor  # int32 [B * G, NB]
    blocks: torch.Tensor  # int32 [B * G, NB]


@triton.jit
def _block_lists_kernel(
    keep_ptr, flags_ptr, before_ptr, blocks_ptr,
    n_blocks, n_groups, stride_kb, stride_kn, stride_kg,
    HAS_KEEP: tl.constexpr, NB_POW2: tl.constexpr,
):
    row = tl.program_id(0)  # b * G + g
    b = row // n_groups
    g = row % n_groups
    offs = tl.arange(0, NB_POW2)
    valid = offs < n_blocks
    if HAS_KEEP:
        kv = tl.load(keep_ptr + b * stride_kb + offs * stride_kn + g * stride_kg, mask=valid, other=0.0)
        kept = (kv.to(tl.float32) > 0.5) & valid
    else:
        kept = valid
    kept_i = kept.to(tl.int32)
    excl = tl.cumsum(kept_i, axis=0) - kept_i
    total = tl.sum(kept_i, axis=0)
    base = row * n_blocks
    tl.store(flags_ptr + base + offs, kept_i, mask=valid)
    tl.store(before_ptr + base + offs, excl, mask=valid)
    # Kept block c goes to slot excl[c]; the slots past the last one get 0, so a masked gather
    # that reads one slot too far still points at a real block. The two stores are disjoint.
    tl.store(blocks_ptr + base + excl, offs, mask=kept)
    tl.store(blocks_ptr + base + offs, tl.zeros_like(offs), mask=valid & (offs >= total))


def build_block_lists(keep: torch.Tensor | None, batch: int, n_blocks: int, n_groups: int, device) -> BlockLists:
    """Flags, prefix counts and compacted kept-block lists for keep [B, NB, G] (None: all kept)."""
    shape = (batch * n_groups, n_blocks)
    flags = torch.empty(shape, dtype=torch.int32, device=device)
    before = torch.empty(shape, dtype=torch.int32, device=device)
    blocks = torch.empty(shape, dtype=torch.int32, device=device)
    if keep is not None and keep.dtype == torch.bool:
        keep = keep.to(torch.float32)
    strides = keep.stride() if keep is not None else (0, 0, 0)
    _block_lists_kernel[(batch * n_groups,)](
        keep if keep is not None else flags, flags, before, blocks,
        n_blocks, n_groups, *strides,
        HAS_KEEP=keep is not None, NB_POW2=1 << max(n_blocks - 1, 0).bit_length(),
    )
    return BlockLists(flags, before, blocks)

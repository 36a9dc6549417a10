"""The routing block size of NAtS-L layers: its default and the sizes each path takes, in one place.

The block size (tokens per routing block: one route per block and routing group) is a free
parameter. `DEFAULT_BLOCK_SIZE` is the paper's 64 and is written only here: natsl.config, the ops
(natsl.ops, natsl.reference, natsl.fast) and the kernels read it.

Which sizes run where:
- reference and chunked backends: any positive size; a model (a recipe, a checkpoint) takes a
  multiple of 16 from 16 to 256 (`MODEL_BLOCK_SIZES`), or a power of two below 16 for the tiny
  test models, whose short sequences then span several blocks.
- fast gated_delta_rule / gated_linear_rule (Triton): `FAST_STATE_BLOCK_SIZES`. The kernels' chunk is
  the routing block (C is a tl.constexpr; docs/kernels/gated_delta.md says why). On a GPU their
  backward takes chunks up to `GPU_BACKWARD_LARGEST`; a larger block's GPU backward runs the
  chunk-parallel PyTorch form on the GPU instead (natsl.ops decides).
- fast routed_attention (Triton): any power of two from 16 to 256.
"""

from __future__ import annotations

DEFAULT_BLOCK_SIZE = 64
MODEL_BLOCK_SIZES = tuple(range(16, 257, 16))
SMALL_BLOCK_SIZES = (1, 2, 4, 8)  # tiny test models on the reference / chunked backends only
# What the Triton state kernels compile for (their chunk is the block), not a default.
FAST_STATE_BLOCK_SIZES = (32, 64, 128, 192, 256)
# Their backward's [C, C] tiles at C = 128 need more shared memory than Hopper has (docs/kernels/gated_delta.md).
GPU_BACKWARD_LARGEST = 64


def model_block_size_problem(block_size, backend: str | None) -> str | None:
    """Why a model cannot take `block_size` (as the end of a one-line error), or None where it can.

    Args:
        block_size: the model's `block_size`.
        backend: the model's `backend` ("fast" narrows the sizes to the Triton state kernels'), or None.

    Returns:
        "must be ..., got X" naming the allowed values, or None.
    """
    if isinstance(block_size, bool) or not isinstance(block_size, int) or (
            block_size not in MODEL_BLOCK_SIZES and block_size not in SMALL_BLOCK_SIZES):
        return (f"must be a multiple of 16 from 16 to 256 ({', '.join(map(str, MODEL_BLOCK_SIZES))}), or 1, 2, 4 "
                f"or 8 for small test models on the reference and chunked backends, got {block_size!r}")
    if backend == "fast" and block_size not in FAST_STATE_BLOCK_SIZES:
        return (f"must be one of {', '.join(map(str, FAST_STATE_BLOCK_SIZES))} with backend fast (its Triton state "
                f"kernels), got {block_size}; pick one of those, or backend chunked / reference for any multiple of 16")
    return None

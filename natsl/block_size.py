"""The routing block size of NAtS-L layers: its default and the sizes each path takes, in one place.

The block size (tokens per routing block: one route per block and routing group) is a free
parameter. `DEFAULT_BLOCK_SIZE` is the paper's 64 and is written only here: natsl.config, the ops
(natsl.ops, natsl.reference, natsl.fast) and the kernels read it.

Which sizes run where:
- reference and chunked backends: any positive size; a model (a recipe, a checkpoint) takes a
  multiple of 16 from 16 to 256 (`MODEL_BLOCK_SIZES`), or a power of two below 16 for the tiny
  test models, whose short sequences then span several blocks.
- fast backend (Triton): `FAST_BLOCK_SIZES`, forward and backward, on the GPU and in the interpreter.
  The state kernels (gated_delta_rule, gated_linear_rule) run chunks of at most `LARGEST_CHUNK`
  tokens: a block up to that is one chunk (C a tl.constexpr), a larger one spans whole chunks that
  share its route (natsl/fast/gated_delta/spans.py says why); routed_attention takes any power of two
  from 16 to 256.
"""

from __future__ import annotations

DEFAULT_BLOCK_SIZE = 64
MODEL_BLOCK_SIZES = tuple(range(16, 257, 16))
SMALL_BLOCK_SIZES = (1, 2, 4, 8)  # tiny test models on the reference / chunked backends only
# What the fast backend takes (its Triton kernels' limits, not a default): powers of two, as routed
# attention's query and key tiles must nest in a block.
FAST_BLOCK_SIZES = (16, 32, 64, 128, 256)
# The state kernels' largest chunk: the backward's [C, C] tiles at C = 128 need more shared memory than
# Hopper has, and the kernels were tuned at 64 (docs/kernels/gated_delta.md).
LARGEST_CHUNK = 64

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
    if backend == "fast" and block_size not in FAST_BLOCK_SIZES:
        return (f"must be one of {', '.join(map(str, FAST_BLOCK_SIZES))} with backend fast (its Triton kernels), "
                f"got {block_size}; pick one of those, or backend chunked / reference for any multiple of 16")
    return None

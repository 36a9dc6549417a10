"""The routing block size of NAtS-L layers: its default and the sizes each path takes, in one place.

The block size (tokens per routing block: one route per block and routing group) is a free
parameter. `DEFAULT_BLOCK_SIZE` is the paper's 64 and is written only here: natsl.config, the ops
(natsl.ops, natsl.reference, natsl.fast) and the kernels read it.

Which sizes run where:
- reference and chunked backends: any positive size; a model (a recipe, a checkpoint) takes a
  multiple of 16 from 16 to 256 (`MODEL_BLOCK_SIZES`), or a power of two below 16 for the tiny
  test models, whose short sequences then span several blocks.
- fast backend (Triton): `FAST_BLOCK_SIZES`, forward and backward, in the interpreter; on a GPU each state
  kernel takes its `GPU_CHECKED_BLOCK_SIZES` (those that passed natsl's GPU twin tests, tests/test_block_sizes.py
  `-m gpu`) and refuses the others in one line: `NATSL_GPU_BLOCK_SIZES=all` runs every fast size on a GPU
  (those tests set it). Not a speed switch: it guards against the Hopper miscompiles that gated-delta backward
  kernels have met (fla issue 640), read where it is used.
  The state kernels (gated_delta_rule, gated_linear_rule) run chunks of at most `LARGEST_CHUNK`
  tokens: a block up to that is one chunk (C a tl.constexpr), a larger one spans whole chunks that
  share its route (natsl/fast/gated_delta/spans.py says why); routed_attention takes any power of two
  from 16 to 256.
"""

from __future__ import annotations

import os

DEFAULT_BLOCK_SIZE = 64
MODEL_BLOCK_SIZES = tuple(range(16, 257, 16))
SMALL_BLOCK_SIZES = (1, 2, 4, 8)  # tiny test models on the reference / chunked backends only
# What the fast backend takes (its Triton kernels' limits, not a default): powers of two, as routed
# attention's query and key tiles must nest in a block.
FAST_BLOCK_SIZES = (16, 32, 64, 128, 256)
# The state kernels' largest chunk: the backward's [C, C] tiles at C = 128 need more shared memory than
# Hopper has, and the kernels were tuned at 64 (docs/kernels/gated_delta.md).
LARGEST_CHUNK = 64

MODEL_ALLOWED = (f"a multiple of 16 from 16 to 256 ({', '.join(map(str, MODEL_BLOCK_SIZES))}), or 1, 2, 4 or 8 "
                 "for small test models on the reference and chunked backends")


def model_takes(block_size) -> bool:
    """Whether a model (a recipe, a checkpoint) may have `block_size` (MODEL_ALLOWED says which)."""
    return block_size in MODEL_BLOCK_SIZES or block_size in SMALL_BLOCK_SIZES


def fast_problem(block_size: int) -> str | None:
    """Why a model on backend fast cannot take `block_size` (the end of a one-line error naming the
    allowed values), or None where it can."""
    if block_size in FAST_BLOCK_SIZES:
        return None
    return (f"must be one of {', '.join(map(str, FAST_BLOCK_SIZES))} with backend fast (its Triton kernels), got "
            f"{block_size}; pick one of those, or backend chunked / reference for any multiple of 16")


# Each state kernel's sizes that have passed the GPU twin tests (tests/test_block_sizes.py -m gpu, forward and
# every gradient against the chunked reference, and a model's training step). The others are built (and pass
# the same tests in Triton's interpreter) but have not run on a GPU.
GPU_CHECKED_BLOCK_SIZES = {"gated_delta_rule": (32, 64, 128, 256), "gated_linear_rule": (32, 64, 128)}


def gpu_problem(op: str, block_size: int) -> str | None:
    """Why the fast state rule `op` does not run `block_size` on a GPU yet, or None where it does (see the
    module doc; NATSL_GPU_BLOCK_SIZES=all lifts the limit)."""
    checked = GPU_CHECKED_BLOCK_SIZES.get(op, (DEFAULT_BLOCK_SIZE,))
    if block_size in checked or os.environ.get("NATSL_GPU_BLOCK_SIZES") == "all":
        return None
    return (f"the fast {op} at block_size {block_size} on a GPU has not yet passed natsl's GPU twin tests "
            f"(tests/test_block_sizes.py -m gpu); use backend='chunked', or set NATSL_GPU_BLOCK_SIZES=all "
            "to run it anyway")

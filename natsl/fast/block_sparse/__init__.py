"""Triton block-sparse routed attention (docs/spec.md section 3), forward and backward.

Modules: `blocks` (compacted kept-block lists on the device), `forward` (flash-style forward
kernel), `backward` (dq, dk/dv/dkeep kernels), `function` (custom ops with their autograd formula, and the entry point),
`config` (tile shapes).
"""

from natsl.fast.block_sparse.function import routed_attention

__all__ = ["routed_attention"]

"""Triton chunked gated linear attention (Mamba2's SSD) with a per-block write mask (docs/spec.md
section 3, "gated_linear_rule"), forward and backward.

`gated_linear_rule` has the reference's exact signature. It shares the gated-delta package's chunk
output, intra-chunk dV and dq/dk kernels (the delta rule's pseudo values R are plain V here) and has
its own two sequential state kernels (no W S product: no delta erase) and the forward's first kernel,
the in-chunk cumulative decay (cumsum.py).
"""

from natsl.fast.gated_linear.function import gated_linear_rule

__all__ = ["gated_linear_rule"]

"""Triton chunked Gated DeltaNet with a per-block write mask (docs/spec.md section 3), forward and backward.

`gated_delta_rule` has the reference's exact signature; `gated_delta_step` is the one-token decode
kernel and `commit_block` the route commit at a block boundary, both for incremental inference.
"""

from natsl.fast.gated_delta.commit import commit_block
from natsl.fast.gated_delta.decode import gated_delta_step
from natsl.fast.gated_delta.function import gated_delta_rule

__all__ = ["commit_block", "gated_delta_rule", "gated_delta_step"]

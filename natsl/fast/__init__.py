"""Triton implementations of the NAtS-L ops, with exactly the reference's signatures.

On a CPU tensor the kernels run under TRITON_INTERPRET=1 (set it before Triton is imported).
Subpackages: `gated_delta` (chunked Gated DeltaNet with the write mask, and the decode step),
`gated_linear` (chunked gated linear attention, Mamba2's SSD, with the write mask) and
`block_sparse` (routed attention over the kept blocks); each op's package name differs from the
op's so that `natsl.fast.<op>` is always the function.
"""

from natsl.fast.toolchain import pin_ptxas

pin_ptxas()  # every natsl kernel assembled by one ptxas, however Inductor compiles (natsl/fast/toolchain.py)

__all__ = ["gated_delta_rule", "gated_linear_rule", "routed_attention"]


def __getattr__(name):
    # Imported on first use: a submodule without Triton at import time (natsl.fast.cached,
    # decode_attention, gemv) must not pull in every kernel package through this one.
    if name == "gated_delta_rule":
        from natsl.fast.gated_delta import gated_delta_rule

        return gated_delta_rule
    if name == "gated_linear_rule":
        from natsl.fast.gated_linear import gated_linear_rule

        return gated_linear_rule
    if name == "routed_attention":
        from natsl.fast.block_sparse import routed_attention

        return routed_attention
    raise AttributeError(f"module 'natsl.fast' has no attribute {name!r}")

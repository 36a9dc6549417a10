"""Triton implementations of the NAtS-L ops, with exactly the reference's signatures.

On a CPU tensor the kernels run under TRITON_INTERPRET=1 (set it before Triton is imported).
"""

from natsl.fast.gated_delta import gated_delta_rule
from natsl.fast.routed_attention import routed_attention

__all__ = ["gated_delta_rule", "routed_attention"]

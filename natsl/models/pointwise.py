"""The elementwise pieces of the layers, as pure functions that torch.compile fuses on the GPU.

Eager PyTorch runs an fp32 RMSNorm as about nine kernels, a short conv + SiLU as a copy, two
transposes, a depthwise convolution and an activation, and their backward passes as many again;
at the 800M shapes these memory passes cost more than the GDN op of the layer they sit in. Each
function here is written so that Inductor turns it into one or two kernels forward and backward.

`pointwise(fn)` (natsl.ops.compiled) keeps fn's eager behaviour on the CPU (tests, the quick start:
compiling needs a C++ toolchain there and buys little) and calls `torch.compile(fn)` on CUDA tensors. The compiled
and eager forms compute the same formula (fp32 inside, one rounding to the activation dtype at the
end); tests/test_pointwise.py holds the formulas against plain PyTorch on the CPU and the compiled
forms against the eager ones (on the GPU, and on the CPU with NATSL_COMPILE_POINTWISE=all).
`NATSL_COMPILE_POINTWISE=0` turns compilation off.
"""

from __future__ import annotations

import torch

from natsl.ops.cached import gdn_gates  # noqa: F401
from natsl.ops.compiled import compile_dynamic, compile_for, pointwise, RECOMPILE_LIMIT  # noqa: F401
from natsl.ops.gemv import swiglu  # noqa: F401
from natsl.ops.mix import compiled_reference as mix_read  # noqa: F401
from natsl.ops.norms import gated_input_rms_norm, gated_rms_norm, l2_normalize, rms_norm  # noqa: F401
from natsl.ops.short_conv import compiled_reference as conv_silu, conv_tail  # noqa: F401
from natsl.reference.gates import decay as _decay

# rms_norm, gated_rms_norm, gated_input_rms_norm (Mamba2's: the gate before the norm) and
# l2_normalize (natsl.ops.norms), conv_silu (SiLU of the causal depthwise conv) and conv_tail
# (natsl.ops.short_conv), mix_read (the NAtS-L read of its two memories, natsl.ops.mix), gdn_gates
# (natsl.ops.cached) and swiglu (natsl.ops.gemv) are compiled below the models, where the doors of
# natsl.ops run them as the reference side of a fused kernel; they are the same objects, named here too.


@pointwise
def mamba2_gates(a: torch.Tensor, A_log: torch.Tensor, dt_bias: torch.Tensor):
    """Mamba2's discretisation from the dt projection a [B, T, H]: g = A dt with A = -exp(A_log) and
    dt = softplus(a + dt_bias), both fp32 (the decay is the GDN's; dt also scales the write)."""
    return _decay(a, A_log, dt_bias)


"""The elementwise pieces of the layers, as pure functions that torch.compile fuses on the GPU.

Eager PyTorch runs an fp32 RMSNorm as about nine kernels, a short conv + SiLU as a copy, two
transposes, a depthwise convolution and an activation, and their backward passes as many again;
at the 800M shapes these memory passes cost more than the GDN op of the layer they sit in. Each
function here is written so that Inductor turns it into one or two kernels forward and backward.

`pointwise(fn)` keeps fn's eager behaviour on the CPU (tests, the quick start: compiling needs a
C++ toolchain there and buys little) and calls `torch.compile(fn)` on CUDA tensors. The compiled
and eager forms compute the same formula (fp32 inside, one rounding to the activation dtype at the
end); tests/test_pointwise.py holds the formulas against plain PyTorch on the CPU and the compiled
forms against the eager ones (on the GPU, and on the CPU with NATSL_COMPILE_POINTWISE=all).
`NATSL_COMPILE_POINTWISE=0` turns compilation off.
"""

from __future__ import annotations

from natsl import switches

import functools
import torch
import torch.nn.functional as F

from natsl.reference import mix, norms, short_conv


def compile_for(x: torch.Tensor) -> bool:
    """NATSL_COMPILE_POINTWISE: "1" (default) compiles for CUDA tensors, "0" never, "all" on every
    device (the CPU tests use it to check the compiled forms without a GPU)."""
    mode = switches.current().compile_pointwise
    return mode == "all" or (mode != "0" and x.is_cuda)


RECOMPILE_LIMIT = 64


def _allow_recompiles() -> None:
    """Each function here is traced once per input rank, dtype, grad mode and None-ness of its
    optional arguments, and once more when a size first changes (it becomes symbolic then), which
    can pass dynamo's default limit of 8 graphs per function in one process (tests, prefill +
    decode); past the limit dynamo would run the function eagerly. Raise the limit, never lower it."""
    config = torch._dynamo.config
    config.recompile_limit = max(config.recompile_limit, RECOMPILE_LIMIT)


def compile_dynamic() -> bool | None:
    """NATSL_POINTWISE_DYNAMIC: "auto" (default) keeps every tensor's last (feature) dim a constant and
    lets torch.compile make the other sizes symbolic only once they change (automatic dynamic
    shapes); "1" makes every size symbolic from the start, "0" none. Symbolic sizes cost speed: a kernel's index
    arithmetic then divides by runtime values (the short conv's kernel ran at a small fraction of
    the copy bandwidth with all sizes symbolic)."""
    mode = switches.current().pointwise_dynamic
    return None if mode == "auto" else mode != "0"


def _mark_feature_dims_static(args) -> None:
    """The last dim of every tensor argument is a model width: keep it a constant in the kernels,
    so that only batch and length may become symbolic (the conv's q/k and v widths differ, which
    would otherwise make the width symbolic on the second call)."""
    for arg in args:
        if isinstance(arg, torch.Tensor) and arg.dim() > 0:
            torch._dynamo.mark_static(arg, arg.dim() - 1)


def _mark_length_dynamic(args) -> None:
    """Without gradients (prefill, evaluation), the length dim (dim 1) of every activation argument
    ([B, T, ...], as the first argument) is symbolic from the first call: one graph serves every
    length, in this process and, through Inductor's on-disk cache, in the next ones, where
    automatic dynamic shapes would compile a static graph at the first length (keyed on it on
    disk) and a symbolic one at the second. Length 1 (decode) stays its own graph (dynamo always
    specialises sizes 0 and 1). Training keeps its static length (one length per run)."""
    first = args[0]
    if first.dim() < 3 or torch.is_grad_enabled():
        return
    for arg in args:
        if isinstance(arg, torch.Tensor) and arg.dim() >= 3 and arg.shape[:2] == first.shape[:2]:
            torch._dynamo.maybe_mark_dynamic(arg, 1)


def pointwise(fn):
    """fn, run through torch.compile where `compile_for(first argument)` says so (CUDA, by default)."""
    compiled = dynamic = None

    @functools.wraps(fn)
    def run(*args, **kwargs):
        nonlocal compiled, dynamic
        # Inside a model that is itself being compiled, dynamo inlines the plain function.
        if not torch.compiler.is_compiling() and compile_for(args[0]):
            if compiled is None:
                _allow_recompiles()
                dynamic = compile_dynamic()
                compiled = torch.compile(fn, dynamic=dynamic)
            if dynamic is None:
                _mark_feature_dims_static(args)
                _mark_length_dynamic(args)
            return compiled(*args, **kwargs)
        return fn(*args, **kwargs)

    run.eager = fn
    return run


@pointwise
def rms_norm(x: torch.Tensor, weight: torch.Tensor | None, eps: float, out_dtype: torch.dtype | None = None):
    """RMSNorm over the last dim in fp32, times `weight` when given, in `out_dtype` (default x's dtype)."""
    return norms.normed(x, weight, eps).to(out_dtype or x.dtype)


@pointwise
def gated_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, gate: torch.Tensor) -> torch.Tensor:
    """RMSNorm(x) * weight * silu(gate), all in fp32, one rounding to x's dtype (gate broadcasts as x)."""
    return norms.rms_norm(x, weight, eps, gate)


l2_normalize = pointwise(norms.l2_normalize)
# SiLU(causal depthwise conv): (x [B, T, C], weight [C, 1, W], tail [B, W-1, C] or None) -> [B, T, C]
conv_silu = pointwise(short_conv.short_conv_silu)


def conv_tail(x: torch.Tensor, tail: torch.Tensor, valid: torch.Tensor | None = None) -> torch.Tensor:
    """The last W-1 inputs after x: the tail [B, W-1, C] that the conv of the next tokens needs.
    Eager and small: only the last W-1 rows of x are read. `valid` ([1] int64 on the device, a
    padded prefill call's prompt length): the W-1 inputs before token `valid` instead, gathered
    on the device (no host read, so a CUDA graph serves every valid)."""
    width = tail.shape[1] + 1
    if valid is not None:
        recent = torch.cat([tail.to(x.dtype), x], dim=1)  # token t of x is row t + W-1
        return recent.index_select(1, valid + torch.arange(width - 1, device=x.device))
    recent = torch.cat([tail.to(x.dtype), x[:, max(x.shape[1] - (width - 1), 0):]], dim=1)
    return recent[:, recent.shape[1] - (width - 1):]


def _decay(a: torch.Tensor, A_log: torch.Tensor, dt_bias: torch.Tensor):
    """(log decay g = -exp(A_log) dt, step dt = softplus(a + dt_bias)), both fp32 [B, T, H]."""
    dt = F.softplus(norms.up(a) + norms.up(dt_bias))
    return -norms.up(A_log).exp() * dt, dt


@pointwise
def gdn_gates(a: torch.Tensor, b: torch.Tensor, A_log: torch.Tensor, dt_bias: torch.Tensor):
    """Gated DeltaNet's gates from the a and b projections [B, T, H]: log decay
    g = -exp(A_log) softplus(a + dt_bias) in fp32, and write strength beta = sigmoid(b) in b's dtype."""
    return _decay(a, A_log, dt_bias)[0], torch.sigmoid(norms.up(b)).to(b.dtype)


@pointwise
def mamba2_gates(a: torch.Tensor, A_log: torch.Tensor, dt_bias: torch.Tensor):
    """Mamba2's discretisation from the dt projection a [B, T, H]: g = A dt with A = -exp(A_log) and
    dt = softplus(a + dt_bias), both fp32 (the decay is the GDN's; dt also scales the write)."""
    return _decay(a, A_log, dt_bias)


@pointwise
def gated_input_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, gate: torch.Tensor) -> torch.Tensor:
    """RMSNorm(x * silu(gate)) * weight over the last dim, fp32 inside, in x's dtype: Mamba2's gated
    norm (norm_before_gate=False), where gated_rms_norm gates after the norm."""
    y = norms.normalize(norms.up(x) * F.silu(norms.up(gate)), eps, mean=True) * norms.up(weight)
    return y.to(x.dtype)


@pointwise
def swiglu(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    return F.silu(gate) * up


# The NAtS-L read of its two memories, every variant of the layer (natsl.reference.mix.mix_read).
mix_read = pointwise(mix.mix_read)

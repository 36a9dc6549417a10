"""The models' matrix products: the door from `natsl.models.linear.Linear` and the SwiGLU to the GEMV
kernel `natsl.fast.gemv.linear` (its reference twin `natsl.reference.gemv.linear`) and to cuBLAS.

`linear(x, weight, bias)` is `F.linear`, on the fast twin where it applies: grad-free, at most
MAX_ROWS rows (decode steps), no bias, x in the weight's dtype, and `enabled(x)`: CUDA tensors (or the
Triton interpreter when the switch force_decode_gemv or force_fused_inference is set, for tests),
unless the switch decode_gemv is off (NATSL_DECODE_GEMV=0). `swiglu_linear(gate, up, weight, bias)`
is the SwiGLU's down product: on the fast twin with `up=` where it applies (silu(gate) * up formed as
the weight is read), else the compiled SwiGLU then `linear` -- the path of every training step, so its
reference side is that path, not one call of the twin (which rounds the hidden value once, as the
compiled SwiGLU does).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from natsl import switches
from natsl.fast.gemv import MAX_ROWS  # noqa: F401  (imports the kernel's launcher: see natsl.ops.twin)
from natsl.ops import fused, twin
from natsl.ops.compiled import pointwise


@pointwise
def swiglu(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up, compiled on CUDA (natsl.models.pointwise.swiglu is this object)."""
    return F.silu(gate) * up


def enabled_why(x: torch.Tensor) -> tuple[bool, str]:
    """`enabled` and the rule that decided it (natsl.inference.kernel_table prints it).

    Args:
        x: an input of the product (only its device is read).

    Returns:
        (on, why): why a constant string naming the switch or condition.
    """
    s = switches.current()
    # the fused-kernel tests force both
    force = s.force_decode_gemv if s.force_decode_gemv is not None else s.force_fused_inference
    if force is not None:
        return force and fused.triton_available(), "switch force_decode_gemv / force_fused_inference (override only)"
    if not x.is_cuda:
        return False, "not CUDA: the GEMV kernel runs on CUDA"
    if not s.decode_gemv:
        return False, "NATSL_DECODE_GEMV=0"
    return fused.triton_available(), "CUDA, NATSL_DECODE_GEMV on, Triton installed"


def enabled(x: torch.Tensor) -> bool:
    """Whether the GEMV kernel is enabled for products with x (on its device, by the switches)."""
    return enabled_why(x)[0]


def applies(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> bool:
    """Whether a product of x with weight runs on the GEMV kernel: grad-free, at most MAX_ROWS rows, no
    bias, same dtype, and the kernel enabled for x's device."""
    # enabled(x) first: a Hugging Face export's bundle has no natsl.fast, hence no MAX_ROWS (natsl.hf.bundle)
    return (enabled(x) and bias is None and not torch.is_grad_enabled() and 0 < x.numel() <= MAX_ROWS * x.shape[-1]
            and x.dtype == weight.dtype)


def kernel(x: torch.Tensor, weight: torch.Tensor, *, up: torch.Tensor | None = None,
           norm: tuple[torch.Tensor, float] | None = None) -> torch.Tensor:
    """The fast twin, `natsl.fast.gemv.linear` (tests count its calls here)."""
    return twin("gemv", True)(x, weight, up=up, norm=norm)


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, *, pad: int = 0) -> torch.Tensor:
    """F.linear(x, weight, bias), on the GEMV kernel where `applies`. `pad` > 0: elsewhere the weight
    (and bias) get `pad` zero rows for cuBLAS and the result is a strided view of the first
    out_features columns (natsl.models.linear.aligned_linear: 16-byte-aligned output rows)."""
    if applies(x, weight, bias):
        return kernel(x, weight)
    if pad:
        y = F.linear(x, F.pad(weight, (0, 0, 0, pad)), None if bias is None else F.pad(bias, (0, pad)))
        return y[..., :weight.shape[0]]
    return F.linear(x, weight, bias)


def swiglu_linear(gate: torch.Tensor, up: torch.Tensor, weight: torch.Tensor,
                  bias: torch.Tensor | None = None) -> torch.Tensor:
    """linear(silu(gate) * up, weight, bias): on the GEMV kernel reading both halves where `applies`
    (a decode step: no SwiGLU kernel), else the compiled `swiglu` then `linear`."""
    if applies(gate, weight, bias):
        return kernel(gate, weight, up=up)
    return linear(swiglu(gate, up), weight, bias)


def gated_norm_linear(x: torch.Tensor, gate: torch.Tensor, norm_weight: torch.Tensor, eps: float,
                      weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor | None:
    """linear(rms_norm(x per head, norm_weight, eps, gate=gate), weight, bias) on one GEMV kernel that
    forms the norm and gate as it reads x, where `applies` and the switch fused_o_norm is on; None
    elsewhere (the caller runs its norm, then its product).

    Args:
        x, gate: [..., H * D] (a GDN layer's read and its gate input); norm_weight [D], D dividing H * D.
        weight [N, H * D], bias: the output product's.

    Returns:
        [..., N] in x's dtype, or None.
    """
    head = norm_weight.numel()
    if not (_folds_output_norm(x, gate, weight, bias) and x.shape[-1] % head == 0):
        return None
    return kernel(x, weight, up=gate, norm=(norm_weight, eps))


def add_norm_linear(x: torch.Tensor, residual: torch.Tensor | None, norm_weight: torch.Tensor, eps: float,
                    weight: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor] | None:
    """(x + residual, linear(rms_norm(x + residual, norm_weight, eps), weight)) on one GEMV kernel that adds
    and normalises as it reads x, where `applies` and the switch fused_add_norm is on; None elsewhere (the
    caller runs its add-norm, then its product).

    Args:
        x, residual: [..., K] (the residual stream and a block's pending output; residual may be None);
        norm_weight [K]; weight [N, K] (the product's, no bias; None, as `merged_weight` gives where the
        group is not merged: no fold).

    Returns:
        (the sum [..., K], the product [..., N]) in x's dtype, or None.
    """
    if not _folds_add_norm(x, residual, norm_weight, weight):
        return None
    return twin("add_norm_gemv", True)(x, residual, norm_weight, eps, weight)


# The add-norm fold (and the conv epilogue, which rides on it) runs at one row only: at two rows the folded GDN
# input product took 1.5x the norm kernel and the product apart (docs/performance.md, "Decode launches").
ADD_NORM_FOLD_ROWS = 1


def _folds_add_norm(x: torch.Tensor, residual: torch.Tensor | None, norm_weight: torch.Tensor,
                    weight: torch.Tensor | None) -> bool:
    """Whether a block's add and pre-norm may run inside the product's GEMV: a merged weight, the switch
    fused_add_norm, the kernel `applies`, at most ADD_NORM_FOLD_ROWS rows, and a norm weight and residual that
    fit x."""
    return (weight is not None and switches.current().fused_add_norm and applies(x, weight)
            and x.numel() <= ADD_NORM_FOLD_ROWS * x.shape[-1]
            and norm_weight.shape == x.shape[-1:]
            and (residual is None or (residual.shape == x.shape and residual.dtype == x.dtype)))


def add_norm_conv_linear(x: torch.Tensor, residual: torch.Tensor | None, norm_weight: torch.Tensor, eps: float,
                         weight: torch.Tensor | None, conv) -> tuple[torch.Tensor, torch.Tensor, bool] | None:
    """`add_norm_linear`, with the short convs of `conv` = (start, weights, tails) run on the product's columns
    in the same kernel (natsl.fast.gemv.conv_epilogue; the tails shifted in place) where the switch fused_conv
    is on and the tails fit; None where add_norm_linear would not run (the caller runs its add-norm, then its
    product and convs).

    Args:
        x, residual, norm_weight, eps, weight: as add_norm_linear's; conv: weights [C, 1, W + 1] (no bias),
            tails [rows, W, C] with unit column stride; None: no conv here (a biased one).

    Returns:
        (the sum, the product, whether its conv columns hold the convs' outputs: else they are the convs'
        inputs, as add_norm_linear's), or None.
    """
    if not _folds_add_norm(x, residual, norm_weight, weight):
        return None
    fold = twin("add_norm_gemv", True)
    if conv is None or not (switches.current().fused_conv and _conv_fits(x, conv)):
        return (*fold(x, residual, norm_weight, eps, weight), False)
    return (*fold(x, residual, norm_weight, eps, weight, conv=conv), True)


def _conv_fits(x: torch.Tensor, conv) -> bool:
    """Whether the GEMV kernel's conv epilogue takes `conv` for a product of x: a tail row per row of x, all
    tails of one dtype and length with unit column stride, contiguous weights."""
    _, weights, tails = conv
    rows = x.numel() // x.shape[-1]
    return (all(t.shape[0] == rows and t.stride(-1) == 1 and t.dtype == tails[0].dtype
                and t.shape[1] == tails[0].shape[1] for t in tails) and all(w.is_contiguous() for w in weights))


def gated_input_norm_linear(x: torch.Tensor, gate: torch.Tensor, norm_weight: torch.Tensor, eps: float,
                            weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor | None:
    """linear(gated_input_rms_norm(x, norm_weight, eps, gate), weight, bias) (Mamba2's output norm, then its
    out_proj) on one GEMV kernel that forms the norm as it reads x, where `applies` and the switch
    fused_o_norm is on; None elsewhere (the caller runs its norm, then its product).

    Args:
        x, gate: [..., K] (the read and its gate z); norm_weight [K]; weight [N, K], bias: the product's.

    Returns:
        [..., N] in x's dtype, or None.
    """
    if not (_folds_output_norm(x, gate, weight, bias) and norm_weight.shape == x.shape[-1:]):
        return None
    return twin("gated_input_norm_gemv", True)(x, gate, norm_weight, eps, weight)


def _folds_output_norm(x: torch.Tensor, gate: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> bool:
    """Whether an output norm with its gate may run inside the product's GEMV: the switch fused_o_norm, the
    kernel `applies`, and a gate of x's shape and dtype."""
    return (switches.current().fused_o_norm and applies(x, weight, bias) and gate.shape == x.shape
            and gate.dtype == x.dtype)

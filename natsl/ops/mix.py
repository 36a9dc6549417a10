"""The NAtS-L read of its two memories: the door from `natsl.models.natsl_layer` to its twins,
`natsl.fast.mix.mix_branches` (the paper's variant: separate norms, softmax weights) and
`natsl.reference.mix` (natsl.ops.TWINS), which it runs compiled on CUDA (`compiled_reference`, every
variant of the layer). The Triton module is imported on first use."""

from __future__ import annotations

import torch

from natsl import switches
from natsl.ops import resolve_backend, twin
from natsl.ops.compiled import pointwise
from natsl.reference import mix as reference

# The reference through torch.compile on CUDA tensors (natsl.ops.compiled): every variant's read
# wherever the fast twin does not run; natsl.models.pointwise.mix_read is this object.
compiled_reference = pointwise(reference.mix_read)


def fused_applies_why(o_nla: torch.Tensor, logits, kind: str, out_weight, backend: str | None) -> tuple[bool, str]:
    """`fused_applies` and the rule that decided it (natsl.inference.kernel_table prints it).

    Args:
        o_nla: the softmax branch's output [..., heads, Dv] (its head dim and device are read).
        logits: the mixing logits, or None (mix_weights "none").
        kind: the layer's mix_weights.
        out_weight: the after-sum norm's weight, or None (separate norms).
        backend: the layer's backend.

    Returns:
        (fused, why): why a constant string naming the switch or condition.
    """
    if logits is None or kind != "softmax" or out_weight is not None:
        return False, "a Table 4 variant (mix_weights, branch_norm): no kernel"
    if not switches.current().fused_mix:
        return False, "NATSL_FUSED_MIX=0"
    if resolve_backend(backend, o_nla.device) != "fast":
        return False, "the fast backend only"
    from natsl.fast.mix import supports  # (an import statement: see `twin`)

    return supports(o_nla), "fast backend, the paper's layer, a head dim the kernel takes"


def fused_applies(o_nla: torch.Tensor, logits, kind: str, out_weight, backend: str | None) -> bool:
    """Whether the read runs on the fast twin: softmax weights and separate norms (out_weight None:
    the paper's layer), the fast backend, a head dim the kernels take; the switch fused_mix off
    (NATSL_FUSED_MIX=0) keeps the compiled formula."""
    return fused_applies_why(o_nla, logits, kind, out_weight, backend)[0]


def mix_read(o_la: torch.Tensor, o_nla: torch.Tensor, logits, kind: str, gate: torch.Tensor, la_weight,
             nla_weight, out_weight, eps: float, *, backend: str | None = None) -> torch.Tensor:
    """`natsl.reference.mix.mix_read` (its arguments, the result): on the fast twin where
    `fused_applies`, else on `compiled_reference`."""
    if fused_applies(o_nla, logits, kind, out_weight, backend):
        return twin("mix_branches", True)(o_la, o_nla, logits, gate, la_weight, nla_weight, eps)
    return compiled_reference(o_la, o_nla, logits, kind, gate, la_weight, nla_weight, out_weight, eps)

"""The NAtS-L read of its two memories (docs/spec.md section 2, step 6): `mix_read`, every variant of
the layer (the formula `natsl.models.pointwise.mix_read` compiles), and `mix_branches`, the paper's
variant (separate norms, softmax weights) with the signature of its fast twin `natsl.fast.mix`."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from natsl.reference.norms import normalize
from natsl.reference.precision import up


def mix_weights(logits: torch.Tensor, kind: str) -> torch.Tensor:
    """Mixing logits [..., 2] (index 0: the softmax memory, 1: the GDN state) -> the two read weights, fp32."""
    if kind == "softmax":
        return torch.softmax(up(logits), dim=-1)
    if kind == "sigmoid":
        return torch.sigmoid(up(logits))
    if kind == "linear":
        return up(logits)
    raise ValueError(f"no mixing weights for kind {kind!r}")


def mix_read(o_la: torch.Tensor, o_nla: torch.Tensor, logits, kind: str, gate: torch.Tensor,
             la_weight, nla_weight, out_weight, eps: float) -> torch.Tensor:
    """The read of the branch outputs o_la, o_nla [B, T, heads, Dv]: w_la RMSNorm_1(o_la) +
    w_nla RMSNorm_2(o_nla) with separate norms (la_weight, nla_weight; out_weight None), or
    RMSNorm(w_la o_la + w_nla o_nla) with one (out_weight), over out_weight's size: one head's Dv, or
    several heads' channels together (a state head's V = R softmax heads of V/R: branch_norm
    after_sum_state_head); w from `logits` [B, T, heads, 2] by `kind` (mix_weights), or 1 when logits
    is None; times silu(gate) [B, T, heads * Dv]. fp32 inside, rounded once to o_nla's dtype."""
    la, nla = up(o_la), up(o_nla)
    if logits is None:
        w_nla = w_la = 1.0
    else:
        w = mix_weights(logits, kind)
        w_nla, w_la = w[..., 0:1], w[..., 1:2]
    if out_weight is None:
        o = (w_la * (normalize(la, eps, True) * up(la_weight))
             + w_nla * (normalize(nla, eps, True) * up(nla_weight)))
    else:
        total = w_la * la + w_nla * nla
        total = total.reshape(*total.shape[:-2], -1, out_weight.shape[-1])  # the norm's groups of channels
        o = normalize(total, eps, True) * up(out_weight)
    o = o.reshape(gate.shape) * F.silu(up(gate))
    return o.to(o_nla.dtype)


def mix_branches(o_la: torch.Tensor, o_nla: torch.Tensor, logits: torch.Tensor, gate: torch.Tensor,
                 la_weight: torch.Tensor, nla_weight: torch.Tensor, eps: float) -> torch.Tensor:
    """`mix_read` with separate norms and softmax weights (the paper's layer): o_la, o_nla
    [B, T, heads, D], logits [B, T, heads, 2], gate [B, T, heads * D] -> [B, T, heads * D]."""
    return mix_read(o_la, o_nla, logits, "softmax", gate, la_weight, nla_weight, None, eps)

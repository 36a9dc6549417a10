"""The gates of a linear memory from its H-wide projections, in fp32: the Gated DeltaNet's log decay
and write strength, and the decay and step shared with Mamba2 (with Mamba2's write x dt and its
skip + D x, which the SSD's full forward and decode step share). The formulas of the fused GDN
decode kernel (`natsl.fast.cached.gdn_decode_step`, whose twin `natsl.reference.cached` calls
them) and of the layers' gates (compiled on CUDA through `natsl.ops.cached.gdn_gates`)."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from natsl.reference.precision import up


def decay(a: torch.Tensor, A_log: torch.Tensor, dt_bias: torch.Tensor):
    """(log decay g = -exp(A_log) dt, step dt = softplus(a + dt_bias)), both fp32 [B, T, H]."""
    dt = F.softplus(up(a) + up(dt_bias))
    return -up(A_log).exp() * dt, dt


def step_values(v: torch.Tensor, dt: torch.Tensor) -> torch.Tensor:
    """v [..., H, P] scaled by the step dt [..., H] (fp32): the SSD's write x dt, in v's dtype."""
    return (v * dt[..., None]).to(v.dtype)


def add_skip(o: torch.Tensor, v: torch.Tensor, D: torch.Tensor) -> torch.Tensor:
    """o + D v per head (o, v [..., H, P]; D [H]), in fp32 (or wider), rounded to o's dtype.
    v enters the product in its own dtype (type promotion computes it in D's wider one, the same
    values): so D's gradient reads v itself, not an fp32 copy of it, which autograd would otherwise
    save (and which torch.compile's partitioner keeps too, since v's upcast follows the opaque SSD op;
    the 800M Mamba2 saved 12 KiB a token a layer for it)."""
    dtype = torch.promote_types(o.dtype, torch.float32)
    v = v if torch.promote_types(v.dtype, dtype) == dtype else v.to(dtype)  # (a wider v is cut, as before)
    return (o.to(dtype) + D.to(dtype)[:, None] * v).to(o.dtype)


def add_head_skip(o: torch.Tensor, v: torch.Tensor, D: torch.Tensor) -> torch.Tensor:
    """`add_skip` on rows [..., H P] (o, v) whose last dim is cut into D's H heads."""
    heads = D.shape[0]
    return add_skip(o.unflatten(-1, (heads, -1)), v.unflatten(-1, (heads, -1)), D).flatten(-2)


def gdn_gates(a: torch.Tensor, b: torch.Tensor, A_log: torch.Tensor, dt_bias: torch.Tensor):
    """Gated DeltaNet's gates from the a and b projections [B, T, H]: log decay
    g = -exp(A_log) softplus(a + dt_bias) in fp32, and write strength beta = sigmoid(b) in b's dtype."""
    return decay(a, A_log, dt_bias)[0], torch.sigmoid(up(b)).to(b.dtype)

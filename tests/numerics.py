"""What the kernel tests share: the error metric (as flash-linear-attention measures it) and a
forward + backward runner."""

import torch


def rel_rms(a: torch.Tensor, b: torch.Tensor) -> float:
    """Relative RMS error of `a` against the reference `b`, in fp64; a non-finite `a` fails outright."""
    a, b = a.double(), b.double()
    assert torch.isfinite(a).all(), "non-finite values in the fast result"
    return ((a - b).pow(2).mean().sqrt() / b.pow(2).mean().sqrt().clamp_min(1e-300)).item()


def output_and_grads(fn, inputs, dout, dtype=None):
    """fn(*leaves) and every leaf's gradient for the upstream gradient `dout`; the leaves are fresh
    copies of `inputs`, cast to `dtype` when given (the fp64 oracles)."""
    leaves = [x.detach().clone().to(dtype or x.dtype).requires_grad_(True) for x in inputs]
    out = fn(*leaves)
    out.backward(dout.to(out.dtype))
    return out.detach(), [x.grad for x in leaves]

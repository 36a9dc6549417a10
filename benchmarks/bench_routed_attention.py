"""Time the fast routed attention beside causal SDPA (flash backend) on a CUDA device.

    PYTHONPATH=. python benchmarks/bench_routed_attention.py --T 4096 16384 --keep 1 0.5 0.25

FLOP count (dense causal equivalent, whatever the keep fraction):
    forward = 2 * B * H * (T^2 / 2) * (Dk + Dv)      (QK^T and PV over the causal half)
    backward = 2.5 * forward                         (five matmuls instead of two)
so for Dk = Dv = D the forward is the usual 2*2*B*H*T*T/2*D. Times are medians of
triton.testing.do_bench (CUDA events, L2 flushed between runs).
"""

from __future__ import annotations

import argparse
import math

import torch
from triton.testing import do_bench


def random_keep(B: int, NB: int, G: int, frac: float, device, gen=None) -> torch.Tensor:
    """keep [B, NB, G] with exactly round(frac * NB) kept blocks per (batch, group), at random places."""
    n = round(frac * NB)
    order = torch.rand(B, NB, G, generator=gen).argsort(dim=1).argsort(dim=1)  # a random rank per block
    return (order < n).float().to(device)


def attention_inputs(B, T, H, Dk, Dv, dtype, device, requires_grad=False, seed=0):
    gen = torch.Generator(device=device).manual_seed(seed)
    q = torch.randn(B, T, H, Dk, device=device, dtype=dtype, generator=gen)
    k = torch.randn(B, T, H, Dk, device=device, dtype=dtype, generator=gen)
    v = torch.randn(B, T, H, Dv, device=device, dtype=dtype, generator=gen)
    do = torch.randn(B, T, H, Dv, device=device, dtype=dtype, generator=gen)
    return [x.requires_grad_(requires_grad) for x in (q, k, v)] + [do]


def causal_flops(B, T, H, Dk, Dv, backward=False) -> float:
    fwd = 2.0 * B * H * (T * T / 2) * (Dk + Dv)
    return fwd * (3.5 if backward else 1.0)


def bench(fn) -> float:
    """Median milliseconds."""
    return do_bench(fn, warmup=25, rep=100, return_mode="median")


def time_routed(B, T, H, G, Dk, Dv, frac, dtype=torch.bfloat16, block_size=64, backward=False):
    from natsl.fast.block_sparse import routed_attention

    q, k, v, do = attention_inputs(B, T, H, Dk, Dv, dtype, "cuda", requires_grad=backward)
    keep = random_keep(B, math.ceil(T / block_size), G, frac, "cuda").requires_grad_(backward)
    if not backward:
        return bench(lambda: routed_attention(q, k, v, keep, block_size=block_size))

    def step():
        o = routed_attention(q, k, v, keep, block_size=block_size)
        torch.autograd.grad(o, (q, k, v, keep), do)

    return bench(step)


SDPA_BACKENDS = {"flash": "FLASH_ATTENTION", "cudnn": "CUDNN_ATTENTION", "efficient": "EFFICIENT_ATTENTION"}


def time_sdpa(B, T, H, Dk, Dv, dtype=torch.bfloat16, backward=False, backend="flash"):
    """Causal SDPA in its own [B, H, T, D] layout; backend flash, cudnn, efficient or default (PyTorch's choice)."""
    from torch.nn.attention import SDPBackend, sdpa_kernel
    from torch.nn.functional import scaled_dot_product_attention as sdpa

    q, k, v, do = (x.transpose(1, 2).contiguous().requires_grad_(backward and i < 3)
                   for i, x in enumerate(attention_inputs(B, T, H, Dk, Dv, dtype, "cuda")))

    def fwd():
        if backend == "default":  # whatever PyTorch picks for these tensors
            return sdpa(q, k, v, is_causal=True)
        with sdpa_kernel([getattr(SDPBackend, SDPA_BACKENDS[backend])]):
            return sdpa(q, k, v, is_causal=True)

    if not backward:
        return bench(fwd)
    return bench(lambda: torch.autograd.grad(fwd(), (q, k, v), do))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--T", type=int, nargs="+", default=[4096, 16384])
    ap.add_argument("--keep", type=float, nargs="+", default=[1.0, 0.5, 0.25])
    ap.add_argument("--heads", type=int, default=18)
    ap.add_argument("--groups", type=int, default=6)
    ap.add_argument("--dk", type=int, default=64)
    ap.add_argument("--dv", type=int, default=128)
    ap.add_argument("--batch", type=int, default=1)
    args = ap.parse_args()
    B, H, G, Dk, Dv = args.batch, args.heads, args.groups, args.dk, args.dv
    print(f"routed attention B={B} H={H} G={G} Dk={Dk} Dv={Dv} bf16; TFLOP/s = dense-causal FLOPs / time")
    print(f"{'T':>7} {'what':>14} {'fwd ms':>9} {'TF/s':>6} {'fwd+bwd ms':>11} {'TF/s':>6}")
    for T in args.T:
        rows = [(f"sdpa flash D={Dk}", lambda bw: time_sdpa(B, T, H, Dk, Dk, backward=bw), Dk)]
        rows += [(f"keep {f:g}", lambda bw, f=f: time_routed(B, T, H, G, Dk, Dv, f, backward=bw), Dv)
                 for f in args.keep]
        for name, fn, dv in rows:
            f_ms, b_ms = fn(False), fn(True)
            tf = causal_flops(B, T, H, Dk, dv) / f_ms / 1e9
            tb = causal_flops(B, T, H, Dk, dv, True) / b_ms / 1e9
            print(f"{T:>7} {name:>14} {f_ms:>9.3f} {tf:>6.0f} {b_ms:>11.3f} {tb:>6.0f}")


if __name__ == "__main__":
    main()

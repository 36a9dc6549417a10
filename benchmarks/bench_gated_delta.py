"""Time the Triton gated_delta_rule (forward, forward+backward) and the decode step on a CUDA GPU.

    python benchmarks/bench_gated_delta.py --lengths 4096 16384 --heads 6 --key-dim 192 --value-dim 384

Medians of triton.testing.do_bench; bf16 inputs, a random binary write mask. `--intermediate`
picks config.INTERMEDIATE ("input" = the inputs' dtype, the default; "fp32"). `--fla` adds
flash-linear-attention's chunk_gated_delta_rule forward when it is installed. For the one-call
H200 run (correctness, a launch-setting sweep and this table) see device_gated_delta.py.
"""

from __future__ import annotations

import argparse
import os
import sys

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--lengths", type=int, nargs="+", default=[4096, 16384, 65536])
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--heads", type=int, default=6)
    ap.add_argument("--key-dim", type=int, default=192)
    ap.add_argument("--value-dim", type=int, default=384)
    ap.add_argument("--block-size", type=int, default=64)
    ap.add_argument("--intermediate", choices=["input", "fp32"], default="input")
    ap.add_argument("--fla", action="store_true", help="also time flash-linear-attention's forward")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        sys.exit("bench_gated_delta.py times GPU kernels: no CUDA device here (the CPU tests live in tests/)")

    from triton.testing import do_bench

    from natsl.fast.gated_delta import config, gated_delta_rule, gated_delta_step

    config.INTERMEDIATE = args.intermediate
    fla = None
    if args.fla:
        from fla.ops.gated_delta_rule import chunk_gated_delta_rule as fla

    B, H, K, V, C = args.batch, args.heads, args.key_dim, args.value_dim, args.block_size

    def bench(fn, grads=None):
        return do_bench(fn, warmup=25, rep=100, grad_to_none=grads, return_mode="median")

    print(f"B={B} H={H} K={K} V={V} block={C} bf16, intermediates={args.intermediate}; medians in ms")
    print(f"{'T':>8} {'fwd':>9} {'fwd+bwd':>9} {'FLA fwd':>9}")
    for T in args.lengths:
        q = F.normalize(torch.randn(B, T, H, K, device="cuda"), dim=-1).bfloat16().requires_grad_()
        k = F.normalize(torch.randn(B, T, H, K, device="cuda"), dim=-1).bfloat16().requires_grad_()
        v = torch.randn(B, T, H, V, device="cuda").bfloat16().requires_grad_()
        g = F.logsigmoid(torch.randn(B, T, H, device="cuda") + 2.0).requires_grad_()
        beta = torch.sigmoid(torch.randn(B, T, H, device="cuda")).bfloat16().requires_grad_()
        write = torch.randint(0, 2, (B, -(-T // C), H), device="cuda").float()
        do = torch.randn(B, T, H, V, device="cuda").bfloat16()
        xs = [q, k, v, g, beta]

        def fwd_bwd():
            o, _ = gated_delta_rule(*xs, write, block_size=C)
            o.backward(do)

        with torch.no_grad():
            fwd = bench(lambda: gated_delta_rule(*xs, write, block_size=C))
            fla_ms = bench(lambda: fla(*xs, scale=K**-0.5)) if fla is not None else float("nan")
        print(f"{T:>8} {fwd:>9.3f} {bench(fwd_bwd, xs):>9.3f} {fla_ms:>9.3f}")
    q1, k1 = (F.normalize(torch.randn(B, H, K, device="cuda"), dim=-1).bfloat16() for _ in range(2))
    v1 = torch.randn(B, H, V, device="cuda").bfloat16()
    g1, b1 = F.logsigmoid(torch.randn(B, H, device="cuda")), torch.rand(B, H, device="cuda")
    state = torch.randn(B, H, K, V, device="cuda")
    print(f"decode step: {bench(lambda: gated_delta_step(q1, k1, v1, g1, b1, state)):.4f} ms")


if __name__ == "__main__":
    main()

"""The compiled elementwise pieces with static and symbolic sizes, and the prefill conv kernel (GPU).

    PYTHONPATH=. python3 benchmarks/bench_pointwise.py [--out bench_pointwise.json]

Medians of triton.testing.do_bench, bf16, at an 800M training micro-batch ([4, 4096, C]: forward
and forward+backward) and a 128K prefill ([1, 131072, C]: forward): the short conv + SiLU for
C = 1152 (q, k) and 2304 (v), RMSNorm at d = 1536 and SwiGLU at 4096, each compiled with
dynamic=True (every size symbolic, natsl before 2026-11-30) and dynamic=False (specialised), and the
conv's Triton prefill kernel (natsl.fast.cached.conv_chunk). GB/s counts the bytes the
forward must move (inputs read + output written) over the time.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default="bench_pointwise.json")
    args = parser.parse_args()
    import torch
    from triton.testing import do_bench

    from natsl.fast import cached as kernels
    from natsl.models import pointwise as pw
    from natsl.provenance import provenance

    torch._dynamo.config.recompile_limit = 256
    dev, bf = "cuda", torch.bfloat16
    rows = []

    def record(name, shape, variant, ms, nbytes):
        rows.append({"piece": name, "shape": list(shape), "variant": variant, "ms": ms,
                     "GB/s": nbytes / ms / 1e6 if nbytes else None})
        print(f"{name:8s} {str(list(shape)):22s} {variant:28s} {ms:8.3f} ms" +
              (f"  {nbytes / ms / 1e6:7.0f} GB/s" if nbytes else ""), flush=True)

    def pieces(B, T, C):
        x = torch.randn(B, T, C, device=dev, dtype=bf)
        tail = torch.zeros(B, 3, C, device=dev, dtype=bf)
        w = torch.randn(C, 1, 4, device=dev) * 0.5
        return x, tail, w

    for B, T in ((4, 4096), (1, 131072)):
        training = B == 4
        for C in (1152, 2304):
            x, tail, w = pieces(B, T, C)
            nbytes = 2 * x.numel() * x.element_size()
            for dynamic in (True, False):
                fn = torch.compile(pw.conv_silu.eager, dynamic=dynamic)
                label = f"compiled dynamic={dynamic}"
                with torch.no_grad():
                    record("conv", x.shape, label + " fwd", do_bench(lambda: fn(x, tail, w)), nbytes)
                if training:
                    xg, wg = x.clone().requires_grad_(), w.clone().requires_grad_()
                    dy = torch.randn_like(x)

                    def fwd_bwd():
                        y = fn(xg, tail, wg)
                        torch.autograd.grad(y, (xg, wg), dy)
                    record("conv", x.shape, label + " fwd+bwd", do_bench(fwd_bwd), None)
            if not training:
                with torch.no_grad():
                    record("conv", x.shape, "triton conv_chunk fwd", do_bench(lambda: kernels.conv_chunk(x, tail, w)),
                           nbytes)
        d = 1536
        x = torch.randn(B, T, d, device=dev, dtype=bf, requires_grad=training)
        weight = torch.ones(d, device=dev, dtype=bf, requires_grad=training)
        g = torch.randn(B, T, 4096, device=dev, dtype=bf, requires_grad=training)
        u = torch.randn(B, T, 4096, device=dev, dtype=bf, requires_grad=training)
        for dynamic in (True, False):
            norm = torch.compile(pw.rms_norm.eager, dynamic=dynamic)
            swiglu = torch.compile(pw.swiglu.eager, dynamic=dynamic)
            label = f"compiled dynamic={dynamic}"
            record("rmsnorm", x.shape, label + " fwd", do_bench(lambda: norm(x, weight, 1e-6)), 2 * x.numel() * 2)
            record("swiglu", g.shape, label + " fwd", do_bench(lambda: swiglu(g, u)), 3 * g.numel() * 2)
            if training:
                dy = torch.randn_like(x)
                record("rmsnorm", x.shape, label + " fwd+bwd",
                       do_bench(lambda: torch.autograd.grad(norm(x, weight, 1e-6), (x, weight), dy)), None)
    with open(args.out, "w") as fh:
        json.dump({"provenance": provenance(), "rows": rows}, fh, indent=1)


if __name__ == "__main__":
    main()

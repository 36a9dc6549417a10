"""A GDN layer's output norm and gate on its Triton kernels (natsl.fast.gated_norm) against Inductor's
compiled formula (GPU).

    PYTHONPATH=. python3 benchmarks/bench_gated_norm.py [--out bench_gated_norm.json]

The 800M GDN layer's read-out (6 heads x Dv 384), bf16: a training micro-batch [8, 4096] (forward, and
forward + backward through torch.autograd.grad) and a 128K prefill [1, 131072] (forward). Medians of
triton.testing.do_bench, after comparing the two forms' outputs and gradients (relative RMS; the
helpers are bench_mix.py's). GB/s counts the bytes each direction must move: forward o and gate
read, out written; backward o, gate and dout read, d o and d gate written. The op alone: in a
compiled step Inductor fuses the formula with its neighbours (docs/benchmarks.md has the profile).
"""

from __future__ import annotations

import argparse
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))
sys.path.insert(0, HERE)

from bench_mix import report, time_forms  # noqa: E402

HEADS, DV = 6, 384
SHAPES = {"train 8x4096": (8, 4096, True), "prefill 1x131072": (1, 131072, False)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default="bench_gated_norm.json")
    args = parser.parse_args()
    import torch

    from natsl.fast import gated_norm
    from natsl.models import pointwise as pw

    dev, bf = "cuda", torch.bfloat16
    compiled = torch.compile(pw.gated_rms_norm.eager)
    forms = {"compiled formula": lambda x, w, gate: compiled(x, w, 1e-6, gate),
             "fused kernels": lambda x, w, gate: gated_norm.gated_rms_norm(x, w, 1e-6, gate)}
    rows = []
    for label, (b, t, backward) in SHAPES.items():
        torch.manual_seed(0)
        inputs = [torch.randn(b, t, HEADS, DV, device=dev, dtype=bf), 1 + 0.1 * torch.randn(DV, device=dev),
                  torch.randn(b, t, HEADS, DV, device=dev, dtype=bf)]
        dout = torch.randn(b, t, HEADS, DV, device=dev, dtype=bf)
        big = b * t * HEADS * DV * 2  # bytes of one [rows, Dv] bf16 tensor
        time_forms(label, forms, inputs, dout, backward, 3 * big, 5 * big, rows)
    report(rows, args.out)


if __name__ == "__main__":
    main()

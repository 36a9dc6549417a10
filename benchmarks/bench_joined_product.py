"""What joining a GDN layer's input products into one matmul would save, forward + backward, on the GPU.

    python3 benchmarks/bench_joined_product.py [--rows 32768] [--out DIR]

A GDN (or NAtS-L) layer multiplies the same normed input x [rows, d] by W_qkv (q|k|v, joined in
training), by W_ab (the two H-wide gate inputs a and b, padded to 16 rows) and by W_g (the output
gate). Each product is timed forward + backward (dx and dW) as autograd runs it, with the
gradient of every output given, in three layouts:

- apart:        x W_qkv^T, x W_ab^T, x W_g^T (three products; autograd sums the three dx)
- qkv+ab:       x [W_qkv; W_ab]^T, x W_g^T (the gate inputs folded into the q|k|v product)
- qkv+ab+g:     x [W_qkv; W_ab; W_g]^T (one product)

The joined layouts get their output gradient as one tensor, as an op that writes every column's
gradient itself would hand it over. Medians of triton.testing.do_bench, bf16, 800M widths by
default (d 1536, q|k|v 4608, a|b 12, g 2304).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from natsl.provenance import provenance  # noqa: E402

ALIGN = 8  # natsl.models.linear.ALIGN_ROWS: output rows padded to a multiple of this


def padded(width: int) -> int:
    return width + (-width % ALIGN)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rows", type=int, default=8 * 4096, help="batch x tokens (micro-batch 8 x 4096)")
    ap.add_argument("--hidden", type=int, default=1536)
    ap.add_argument("--widths", default="4608,12,2304", help="q|k|v, a|b and g output widths")
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    args = ap.parse_args()
    if not torch.cuda.is_available():
        sys.exit("bench_joined_product.py times cuBLAS products on a CUDA GPU; none is visible here")
    from triton.testing import do_bench

    qkv, ab, g = (int(w) for w in args.widths.split(","))
    d, rows = args.hidden, args.rows
    bf16 = dict(device="cuda", dtype=torch.bfloat16)
    x = torch.randn(rows, d, **bf16).requires_grad_()
    weights = {name: (torch.randn(padded(w), d, **bf16) * d**-0.5).requires_grad_()
               for name, w in (("qkv", qkv), ("ab", ab), ("g", g))}
    layouts = {"apart": [["qkv"], ["ab"], ["g"]], "qkv+ab": [["qkv", "ab"], ["g"]], "qkv+ab+g": [["qkv", "ab", "g"]]}
    grads = {name: torch.randn(rows, w.shape[0], **bf16) for name, w in weights.items()}

    def run(groups):
        def step():
            outs, dys = [], []
            for group in groups:
                w = torch.cat([weights[n] for n in group]) if len(group) > 1 else weights[group[0]]
                outs.append(x @ w.t())
                dys.append(torch.cat([grads[n] for n in group], dim=1) if len(group) > 1 else grads[group[0]])
            torch.autograd.backward(outs, dys)
            x.grad = None
            for w in weights.values():
                w.grad = None
        return step

    results = {"provenance": provenance(), "rows": rows, "hidden": d, "widths": [qkv, ab, g], "layouts": {}}
    for name, groups in layouts.items():
        ms = do_bench(run(groups), warmup=25, rep=200, return_mode="median")
        results["layouts"][name] = ms
    base = results["layouts"]["apart"]
    for name, ms in results["layouts"].items():
        print(f"{name:10s} forward+backward {ms:.3f} ms  ({ms / base:.3f}x apart)", flush=True)
    out = Path(args.out) / "bench_joined_product.json"
    out.write_text(json.dumps(results, indent=1))
    print("wrote", out)


if __name__ == "__main__":
    main()

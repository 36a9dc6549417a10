"""Decode-step products at the 800M shapes: cuBLAS (F.linear) against natsl's GEMV kernel (GPU).

    PYTHONPATH=. python3 benchmarks/bench_gemv.py [--out bench_gemv.json]

Each product [rows, K] x [N, K]^T in bf16 is captured 50 times in a CUDA graph and replayed (as a
decode step runs it: no launch overhead); the median of 20 replays over 50 gives us per product.
The 50 calls cycle through enough copies of the weight (>= 256 MB) that each reads from memory, not
from the 50 MB L2, as in a real decode step. GB/s counts the weight bytes read. Besides the default
tiles, two alternatives: "one pass" (BLOCK_K = the whole K, no loop; BLOCK_N = 8192 // BLOCK_K)
and "64 rows" (BLOCK_N = 64, BLOCK_K = 64, the first version's setting for wide products). Shapes: the merged q/k/v/a/b of a GDN layer (6924 x 1536),
gate+up (8192 x 1536), down (1536 x 4096), o and g (1536 x 2304, 2304 x 1536), the Transformer's
merged q/k/v (4608 x 1536) and o (1536 x 1536), and the LM head (32000 x 1536).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

SHAPES = {"gdn qkvab": (6924, 1536), "gate+up": (8192, 1536), "down": (1536, 4096), "o": (1536, 2304),
          "g": (2304, 1536), "attn qkv": (4608, 1536), "attn o": (1536, 1536), "lm head": (32000, 1536)}


def graph_time_us(fn, calls: int = 50, replays: int = 20) -> float:
    import torch

    from natsl.inference.cuda_graph import capture

    graph, _ = capture(fn, warmups=3, calls=calls)
    times = []
    for _ in range(replays):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1000 / calls)
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default="bench_gemv.json")
    args = parser.parse_args()
    import torch
    import torch.nn.functional as F

    from natsl.fast import gemv
    from natsl.provenance import provenance

    rows_out = []
    print(f"{'product':10s} {'N x K':>12s} rows {'cuBLAS':>8s} {'natsl':>8s} {'one pass':>8s} {'64 rows':>8s}  "
          f"(us per product; GB/s of cuBLAS / natsl)")
    for name, (N, K) in SHAPES.items():
        nbytes = N * K * 2
        copies = [torch.randn(N, K, device="cuda", dtype=torch.bfloat16) for _ in range(max(1, -(-(256 << 20) // nbytes)))]
        one_k = gemv.kernels.next_pow2(K)
        variants = {"cublas": lambda x, w: F.linear(x, w), "natsl": lambda x, w: gemv.linear(x, w),
                    "one_pass": lambda x, w: gemv.linear(x, w, block_n=max(1, 8192 // one_k), block_k=one_k),
                    "rows64": lambda x, w: gemv.linear(x, w, block_n=64, block_k=64)}
        for rows in (1, 2):
            x = torch.randn(rows, K, device="cuda", dtype=torch.bfloat16)
            times = {}
            for label, fn in variants.items():
                turn = iter(range(10 ** 9))

                def call(fn=fn):
                    fn(x, copies[next(turn) % len(copies)])
                with torch.no_grad():
                    times[label] = graph_time_us(call)
            rows_out.append({"product": name, "N": N, "K": K, "rows": rows, **{f"{k}_us": v for k, v in times.items()},
                             "cublas_GBps": nbytes / times["cublas"] / 1e3, "natsl_GBps": nbytes / times["natsl"] / 1e3})
            print(f"{name:10s} {f'{N} x {K}':>12s} {rows:4d} {times['cublas']:8.2f} {times['natsl']:8.2f} "
                  f"{times['one_pass']:8.2f} {times['rows64']:8.2f}  ({nbytes / times['cublas'] / 1e3:.0f} / "
                  f"{nbytes / times['natsl'] / 1e3:.0f})", flush=True)
    with open(args.out, "w") as fh:
        json.dump({"provenance": provenance(), "rows": rows_out}, fh, indent=1)


if __name__ == "__main__":
    main()

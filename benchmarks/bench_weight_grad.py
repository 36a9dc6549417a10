"""The weight gradients of the 800M products, each computed a few equivalent ways, timed side by side.

    python benchmarks/bench_weight_grad.py            # on the GPU; --tokens 32768 is micro-batch 8 at 4K

Why: the matmul-by-shape profile of the hybrid's training step (profile_training_step.py --matmul-shapes,
twentieth session) runs the weight gradients of the GDN products (q|k|v 1536 -> 4608, g 1536 -> 2304,
o 2304 -> 1536) at ~650 TFLOP/s on cuBLAS's 128x256 cluster kernel, where the MLP's of the same
token count run at ~755. The weight gradient dW = dY^T X ([N, K] from dY [M, N] and X [M, K]) can be
asked of cuBLAS as that product, as its transpose (X^T dY, then a transposed copy), or in column slices;
cuBLAS picks its kernel per call, so the ways can differ in speed while agreeing to rounding.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from natsl.provenance import provenance  # noqa: E402

# (name, N = the product's output width, K = its input width) at the 800M recipes' sizes
PRODUCTS = [("gdn q|k|v", 4608, 1536), ("gdn g", 2304, 1536), ("gdn o", 1536, 2304),
            ("mlp gate/up", 4096, 1536), ("mlp down", 1536, 4096), ("attention q/k/v/o", 1536, 1536)]


def as_product(dy: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    return dy.t() @ x


def as_transpose(dy: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    return (x.t() @ dy).t().contiguous()


def in_halves(dy: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    n = dy.shape[1] // 2
    return torch.cat([dy[:, :n].t() @ x, dy[:, n:].t() @ x])


def in_k_halves(dy: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    k = x.shape[1] // 2
    return torch.cat([dy.t() @ x[:, :k], dy.t() @ x[:, k:]], dim=1)


WAYS = {"dY^T X": as_product, "(X^T dY)^T": as_transpose, "N halves": in_halves, "K halves": in_k_halves}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tokens", type=int, default=32768)
    parser.add_argument("--rounds", type=int, default=3, help="interleaved rounds (medians reported)")
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    from triton.testing import do_bench

    torch.manual_seed(0)
    rows = []
    libraries = ["cublas", "cublaslt"]
    print(f"weight gradients at M = {args.tokens} tokens, bf16, medians of {args.rounds} interleaved rounds "
          "(ms, TFLOP/s)")
    for name, n, k in PRODUCTS:
        dy = torch.randn(args.tokens, n, device="cuda", dtype=torch.bfloat16)
        x = torch.randn(args.tokens, k, device="cuda", dtype=torch.bfloat16)
        w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16) / k ** 0.5
        # the forward and the input gradient too, for the library comparison (one way each)
        others = {"forward X W^T": (lambda: x @ w.t(), x.float() @ w.float().t()),
                  "input grad dY W": (lambda: dy @ w, dy.float() @ w.float())}
        reference = as_product(dy.float(), x.float())
        flop = 2 * args.tokens * n * k
        times: dict = {}
        for _ in range(args.rounds):
            for library in libraries:
                torch.backends.cuda.preferred_blas_library(library)
                for way, fn in WAYS.items():
                    times.setdefault((library, way), []).append(do_bench(lambda: fn(dy, x), warmup=10, rep=50))
                for way, (fn, _) in others.items():
                    times.setdefault((library, way), []).append(do_bench(fn, warmup=10, rep=50))
        for (library, way), ms in times.items():
            torch.backends.cuda.preferred_blas_library(library)
            got, want = (WAYS[way](dy, x), reference) if way in WAYS else (others[way][0](), others[way][1])
            error = ((got.float() - want).norm() / want.norm()).item()
            ms = statistics.median(ms)
            rows.append({"product": name, "n": n, "k": k, "library": library, "way": way, "ms": ms,
                         "tflops": flop / ms / 1e9, "rel_error": error})
            print(f"{name:18s} {n:5d} x {k:5d}  {library:9s} {way:11s} {ms:7.3f} ms {flop / ms / 1e9:6.0f}  "
                  f"err {error:.1e}", flush=True)
    torch.backends.cuda.preferred_blas_library("cublas")
    if args.out:
        Path(args.out).write_text(json.dumps({"provenance": provenance(), "tokens": args.tokens, "rows": rows},
                                             indent=1))


if __name__ == "__main__":
    main()

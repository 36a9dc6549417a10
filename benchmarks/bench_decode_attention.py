"""Decode attention (one query per sequence over a KV cache) on the GPU: natsl's split-K Triton
kernel beside SDPA (the anchor's `decode 1 query` column: flash backend, no mask) and the matmul
path `attend_one` it replaces, 24 heads x 64 (the 800M attention), batch 1, bf16.

    PYTHONPATH=. python3 benchmarks/bench_decode_attention.py [--lengths 4096 16384 65536 131072]

Prints a markdown table (median ms of triton.testing.do_bench, and the K/V read rate in TB/s) and
writes --out JSON with provenance.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--lengths", type=int, nargs="+", default=[4096, 16384, 65536, 131072])
    parser.add_argument("--heads", type=int, default=24)
    parser.add_argument("--head-dim", type=int, default=64)
    parser.add_argument("--out", default="bench_decode_attention.json")
    args = parser.parse_args()
    import torch
    import torch.nn.functional as F
    from triton.testing import do_bench

    from natsl.fast.decode_attention import decode_attention
    from natsl.reference.cached import attend_one
    from natsl.provenance import provenance

    H, D, dev, dt = args.heads, args.head_dim, "cuda", torch.bfloat16
    rows = []
    print("| T | natsl split-K ms | SDPA ms | attend_one ms | natsl TB/s | SDPA TB/s | max rel diff vs SDPA |")
    print("|---|---|---|---|---|---|---|")
    for T in args.lengths:
        q = torch.randn(1, 1, H, D, device=dev, dtype=dt)
        k = torch.randn(1, H, T, D, device=dev, dtype=dt)
        v = torch.randn(1, H, T, D, device=dev, dtype=dt)
        visible = torch.full((1, H), T, device=dev, dtype=torch.long)
        ours = decode_attention(q, k, v, visible)
        sdpa = F.scaled_dot_product_attention(q.transpose(1, 2), k, v).transpose(1, 2)
        diff = float((ours.float() - sdpa.float()).abs().max() / sdpa.float().abs().max())
        t_ours = do_bench(lambda: decode_attention(q, k, v, visible), return_mode="median")
        t_sdpa = do_bench(lambda: F.scaled_dot_product_attention(q.transpose(1, 2), k, v), return_mode="median")
        t_mm = do_bench(lambda: attend_one(q, k, v, visible), return_mode="median")
        nbytes = 2 * k.numel() * k.element_size()
        row = {"T": T, "natsl_ms": t_ours, "sdpa_ms": t_sdpa, "attend_one_ms": t_mm, "kv_bytes": nbytes,
               "max_rel_diff_vs_sdpa": diff}
        rows.append(row)
        print(f"| {T} | {t_ours:.4f} | {t_sdpa:.4f} | {t_mm:.4f} | {nbytes / t_ours / 1e9:.2f} | "
              f"{nbytes / t_sdpa / 1e9:.2f} | {diff:.1e} |", flush=True)
    with open(args.out, "w") as fh:
        json.dump({"provenance": provenance(), "heads": H, "head_dim": D, "rows": rows}, fh, indent=1)


if __name__ == "__main__":
    main()

"""Routed-attention backward launch settings at the training shape (H200, ~3 min).

    PYTHONPATH=. PYTHONUNBUFFERED=1 python3 benchmarks/device_attention_backward_sweep.py [--batch 8] [--length 4096]
        [--keep 0.55]

The dk/dv and dq kernels' settings were picked at B=1, T=16K, keep 1 (docs/notes/fast_routed_attention.md);
a compiled 800M hybrid step runs them at B=8, T=4096 with ~55% of the blocks kept (dk/dv 1.27 ms, dq 0.81
ms per layer in the twelfth session's profile). This times `attention_backward` (800M shapes, bf16,
random routes of exactly that fraction) under each setting of one kernel at a time, the other at its
default, after checking dq, dk, dv and dkeep against the defaults' (max abs difference, reported).
Medians of triton.testing.do_bench; JSON to $OUT/attention_backward_sweep.json.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.dirname(HERE))

KEYS = ("BLOCK_N", "BLOCK_M", "num_warps", "num_stages")
DKDV = [(64, 64, 4, 3), (64, 64, 4, 2), (64, 64, 4, 4), (64, 32, 4, 3), (64, 32, 2, 3), (64, 64, 8, 3),
        (32, 32, 4, 3), (32, 32, 2, 3)]
DQ_KEYS = ("BLOCK_M", "BLOCK_N", "num_warps", "num_stages")
DQ = [(128, 64, 4, 2), (128, 64, 4, 3), (64, 64, 4, 2), (64, 64, 4, 3), (128, 32, 4, 3), (128, 128, 8, 2),
      (64, 128, 4, 2)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--length", type=int, default=4096)
    parser.add_argument("--keep", type=float, default=0.55)
    args = parser.parse_args()
    import torch
    from triton.testing import do_bench

    import bench_routed_attention as bench
    from natsl.fast.block_sparse import config
    from natsl.fast.block_sparse.backward import attention_backward
    from natsl.fast.block_sparse.blocks import build_block_lists
    from natsl.fast.block_sparse.forward import attention_forward
    from natsl.provenance import provenance

    out_dir = os.environ.get("OUT", "/tmp/attention_backward_sweep")
    os.makedirs(out_dir, exist_ok=True)
    B, T, H, G, DK, DV = args.batch, args.length, 18, 6, 64, 128
    q, k, v, do = bench.attention_inputs(B, T, H, DK, DV, torch.bfloat16, "cuda")
    NB = -(-T // 64)
    lists = build_block_lists(bench.random_keep(B, NB, G, args.keep, "cuda"), B, NB, G, "cuda")
    o, lse = attention_forward(q, k, v, lists, 0.125, 64, G)

    def run():
        return attention_backward(q, k, v, o, lse, do, lists, 0.125, 64, G, False)

    result = {"provenance": provenance(), "shape": [B, T, H, G, DK, DV], "keep": args.keep, "rows": []}
    want = [x.float() for x in run()]
    for name, cfg, keys, variants in (("dkdv", config.BACKWARD_DKDV, KEYS, DKDV),
                                      ("dq", config.BACKWARD_DQ, DQ_KEYS, DQ)):
        saved = dict(cfg)
        for values in variants:
            cfg.update(zip(keys, values))
            row = {"kernel": name, "setting": dict(zip(keys, values))}
            try:
                got = [x.float() for x in run()]
                row["max_abs_diff_vs_default"] = [float((a - b).abs().max()) for a, b in zip(got, want)]
                row["ms"] = do_bench(run, warmup=25, rep=200, return_mode="median")
            except Exception as e:  # a setting that does not compile or fit is reported, not fatal
                row["error"] = repr(e)[:200]
            result["rows"].append(row)
            print(row, flush=True)
        cfg.clear()
        cfg.update(saved)
        with open(os.path.join(out_dir, "attention_backward_sweep.json"), "w") as f:
            json.dump(result, f, indent=1)
    print("\n| kernel | setting | whole backward ms |\n|---|---|---|")
    for r in result["rows"]:
        if "ms" in r:
            print(f"| {r['kernel']} | {' '.join(f'{k}={v}' for k, v in r['setting'].items())} | {r['ms']:.3f} |")


if __name__ == "__main__":
    main()

"""Routed-attention kernels under both program orders, side by side in one run (H200).

    PYTHONPATH=. python3 benchmarks/device_grid_order.py

800M shapes (18 heads of 64/128, groups of 3), keep 0.55 (what an untrained router keeps in the
training benchmark), bf16: forward and backward kernels alone with `config.HEADS_FIRST` True
(every head's heaviest tiles first), False (a head's tiles together) and None (the rule of
`config.heads_first`), at the training shape (batch 4 x 4096) and at 16K and 64K. Checks that the
orders give the same outputs. Medians of triton.testing.do_bench; JSON to $OUT/grid_order.json.
"""

from __future__ import annotations

import json
import os
import sys

import torch
from triton.testing import do_bench

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.dirname(HERE))

import bench_routed_attention as bench  # noqa: E402
from natsl.fast.block_sparse import config  # noqa: E402
from natsl.fast.block_sparse.backward import attention_backward  # noqa: E402
from natsl.fast.block_sparse.blocks import build_block_lists  # noqa: E402
from natsl.fast.block_sparse.forward import attention_forward  # noqa: E402

H, G, DK, DV = 18, 6, 64, 128


def main() -> None:
    out_dir = os.environ.get("OUT", "/tmp/natsl_out")
    os.makedirs(out_dir, exist_ok=True)
    rows = []
    for B, T in ((4, 4096), (1, 16384), (1, 65536)):
        q, k, v, do = bench.attention_inputs(B, T, H, DK, DV, torch.bfloat16, "cuda")
        keep = bench.random_keep(B, T // 64, G, 0.55, "cuda")
        lists = build_block_lists(keep, B, T // 64, G, "cuda")
        first = None
        for order in (True, False, None):
            config.HEADS_FIRST = order
            o, lse = attention_forward(q, k, v, lists, 0.125, 64, G)
            grads = attention_backward(q, k, v, o, lse, do, lists, 0.125, 64, G, False)
            same = None
            if first is None:
                first = [o, *grads]
            else:
                same = all(torch.equal(a, b) for a, b in zip(first, [o, *grads]))
            fwd = do_bench(lambda: attention_forward(q, k, v, lists, 0.125, 64, G), return_mode="median")
            bwd = do_bench(lambda: attention_backward(q, k, v, o, lse, do, lists, 0.125, 64, G, False),
                           return_mode="median")
            row = {"B": B, "T": T, "heads_first": order, "fwd_ms": fwd, "bwd_ms": bwd, "same_as_first": same}
            rows.append(row)
            print(row, flush=True)
        config.HEADS_FIRST = None
        del q, k, v, do
        torch.cuda.empty_cache()
    with open(os.path.join(out_dir, "grid_order.json"), "w") as f:
        json.dump({"gpu": torch.cuda.get_device_name(), "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()

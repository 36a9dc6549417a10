"""Where the host time of one routed-attention call goes (H200, ~20 s).

    PYTHONPATH=. python3 benchmarks/device_host_profile.py [--length 4096]

800M shapes, batch 1, bf16, keep 0.5, inputs that require grad (as in training): 200 forward
calls under cProfile, then 100 forward+backward calls; the top functions by own time go to stdout
and $OUT/host_profile.txt. At 4K and batch 1 the op is bound by this host time, not by its kernels.
"""

from __future__ import annotations

import argparse
import cProfile
import io
import os
import pstats
import sys

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.dirname(HERE))

import bench_routed_attention as bench  # noqa: E402
from natsl.fast.block_sparse import routed_attention  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--length", type=int, default=4096)
    args = parser.parse_args()
    out = os.environ.get("OUT", "/tmp/natsl_out")
    os.makedirs(out, exist_ok=True)
    T = args.length
    q, k, v, do = bench.attention_inputs(1, T, 18, 64, 128, torch.bfloat16, "cuda", requires_grad=True)
    keep = bench.random_keep(1, T // 64, 6, 0.5, "cuda").requires_grad_()
    steps = {"fwd": (200, lambda: routed_attention(q, k, v, keep)),
             "fwd_bwd": (100, lambda: torch.autograd.grad(routed_attention(q, k, v, keep), (q, k, v, keep), do))}
    report = io.StringIO()
    for name, (n, step) in steps.items():
        for _ in range(5):
            step()
        torch.cuda.synchronize()
        profiler = cProfile.Profile()
        profiler.enable()
        for _ in range(n):
            step()
        profiler.disable()
        torch.cuda.synchronize()
        report.write(f"==== {name}: {n} calls, T={T} (cumulative and own times in s over all calls)\n")
        pstats.Stats(profiler, stream=report).sort_stats("tottime").print_stats(22)
    text = report.getvalue()
    print(text)
    open(os.path.join(out, "host_profile.txt"), "w").write(text)


if __name__ == "__main__":
    main()

"""Where one decode step of the 800M models goes on the GPU (< 90 s).

    PYTHONPATH=. python3 benchmarks/device_decode_profile.py [--context 32768] [--out decode_profile.json]

For 800m_gdn and 800m_hybrid (keep 0.5, bf16, fast backend, batch 1): prefill --context tokens,
then time 50 CUDA-graph decode steps (median, CUDA events) and profile 10 replays with
torch.profiler: kernels per step and the top kernels by GPU time per step. The JSON holds both; the
table is printed. Per-layer cost follows from the two models: the hybrid has 15 GDN and 6 NAtS-L
layers, the GDN model 21 GDN layers.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--context", type=int, default=32768)
    parser.add_argument("--out", default="decode_profile.json")
    args = parser.parse_args()

    import torch
    from torch.profiler import ProfilerActivity, profile

    from natsl.inference import bench
    from natsl.inference.decode import DecodeRunner
    from natsl.provenance import provenance

    began = time.monotonic()
    result = {"provenance": provenance(), "context": args.context, "models": {}}
    for name in ("800m_gdn", "800m_hybrid"):
        model, _, _ = bench.load_model(bench.BenchModel("recipe", name, 0.5), torch.device("cuda"),
                                       torch.bfloat16, "fast", 0)
        ids = torch.randint(0, model.config.vocab_size, (1, args.context + 80), device="cuda")
        with torch.no_grad():
            cache = model.new_cache(1, max_len=args.context + 80)
            model.forward_cached(ids[:, :args.context], cache, last_only=True)
        runner = DecodeRunner(model, cache, cuda_graphs=True)
        t = args.context
        for _ in range(5):  # eager step + capture, then replays
            runner.step(ids[:, t]); t += 1
        times = []
        for _ in range(50):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            runner.step(ids[:, t]); t += 1
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end))
        steps = 10
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            for _ in range(steps):
                runner.step(ids[:, t]); t += 1
            torch.cuda.synchronize()
        kernels = {}
        for event in prof.key_averages():
            if event.device_type == torch.autograd.DeviceType.CUDA and event.self_device_time_total > 0:
                kernels[event.key] = (event.count / steps, event.self_device_time_total / steps)
        top = sorted(kernels.items(), key=lambda kv: -kv[1][1])
        launches = sum(count for count, _ in kernels.values())
        gpu_us = sum(us for _, us in kernels.values())
        result["models"][name] = {"decode_ms_median": statistics.median(times), "kernels_per_step": launches,
                                  "kernel_us_per_step": gpu_us,
                                  "top": [{"kernel": k[:120], "per_step": c, "us_per_step": us} for k, (c, us) in top[:40]]}
        print(f"{name}: decode {statistics.median(times):.3f} ms/token at {args.context}, {launches:.0f} kernels "
              f"per step, {gpu_us / 1000:.3f} ms of kernel time")
        for k, (c, us) in top[:25]:
            print(f"   {us:8.1f} us  {c:5.1f}x  {k[:110]}")
        with open(args.out, "w") as fh:
            json.dump(result, fh, indent=1)
        del model, cache, runner
        torch.cuda.empty_cache()
    print(f"done in {time.monotonic() - began:.0f} s")


if __name__ == "__main__":
    main()

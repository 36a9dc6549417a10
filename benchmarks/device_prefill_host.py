"""Where a short prefill's time goes: host or GPU (H200, ~2 min).

    PYTHONPATH=. PYTHONUNBUFFERED=1 python3 benchmarks/device_prefill_host.py [--lengths 1024 4096]
        [--models 800m_gdn,800m_hybrid,800m_transformer]

The fourteenth session's latency ladder (2026-12-01, call 6) gave 58 ms for a 1K-token prefill of the
800M GDN model and 94 ms for the hybrid, flat up to 16K, against compute floors of 2 ms: the time to the
first token of a short prompt is bound by something other than the GPU's work. For each model and
length (random weights, bf16, fast backend, keep 0.5): five timed prefills after three warm-ups, then
one under torch.profiler (CPU and CUDA: wall time, the GPU's kernel time, the number of kernels, the
host ops that synchronise with the device) and one under cProfile (the host functions by own time).
Tables in $OUT/prefill_host.txt, figures in $OUT/prefill_host.json.
"""

from __future__ import annotations

import argparse
import cProfile
import io
import json
import os
import pstats
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))
OUT = os.environ.get("OUT", "/tmp/prefill_host_out")
SYNC_OPS = ("cudaStreamSynchronize", "cudaDeviceSynchronize", "cudaMemcpyAsync", "cudaEventSynchronize",
            "aten::item", "aten::_local_scalar_dense", "aten::nonzero")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--lengths", type=int, nargs="+", default=[1024, 4096])
    parser.add_argument("--models", default="800m_gdn,800m_hybrid,800m_transformer")
    args = parser.parse_args()
    import torch
    from torch.profiler import ProfilerActivity, profile

    from natsl.inference import bench
    from natsl.provenance import provenance

    os.makedirs(OUT, exist_ok=True)
    device = torch.device("cuda")
    result = {"provenance": provenance(), "rows": []}
    text = open(os.path.join(OUT, "prefill_host.txt"), "w")
    for name in args.models.split(","):
        model, _, _ = bench.load_model(bench.BenchModel("recipe", name, 0.5), device, torch.bfloat16, "fast", 0)
        for L in args.lengths:
            ids = torch.randint(0, model.config.vocab_size, (1, L), device=device)
            cache = model.new_cache(1, max_len=L + 8)

            def prefill():
                cache.reset()
                model.forward_cached(ids, cache, last_only=True)
                torch.cuda.synchronize()

            with torch.no_grad():
                for _ in range(3):
                    prefill()
                walls = []
                for _ in range(5):
                    start = time.perf_counter()
                    prefill()
                    walls.append(1000 * (time.perf_counter() - start))
                with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
                    prefill()
                events = prof.key_averages()
                gpu_ms = sum(e.self_device_time_total for e in events if e.device_type == torch.autograd.DeviceType.CUDA) / 1e3
                kernels = sum(e.count for e in events if e.device_type == torch.autograd.DeviceType.CUDA)
                syncs = {e.key: e.count for e in events if e.key in SYNC_OPS}
                host = cProfile.Profile()
                host.enable()
                prefill()
                host.disable()
            buf = io.StringIO()
            pstats.Stats(host, stream=buf).sort_stats("tottime").print_stats(30)
            top_ops = sorted((e for e in events if e.device_type == torch.autograd.DeviceType.CPU),
                             key=lambda e: -e.self_cpu_time_total)[:25]
            row = {"model": name, "length": L, "wall_ms": walls, "gpu_kernel_ms": gpu_ms, "kernels": kernels,
                   "syncs": syncs}
            result["rows"].append(row)
            print(f"{name} @ {L}: wall {sorted(walls)[2]:.1f} ms (median of 5), GPU kernels {gpu_ms:.1f} ms in "
                  f"{kernels} kernels, syncs {syncs}", flush=True)
            text.write(f"==== {name} @ {L}: wall {walls} ms, GPU kernels {gpu_ms:.1f} ms, {kernels} kernels, "
                       f"syncs {syncs}\n-- host ops by own CPU time (us, count):\n")
            text.writelines(f"{e.self_cpu_time_total:10.0f} {e.count:6d}  {e.key[:120]}\n" for e in top_ops)
            text.write("-- cProfile, own time:\n" + buf.getvalue() + "\n")
            text.flush()
            del cache
        del model
        torch.cuda.empty_cache()
    with open(os.path.join(OUT, "prefill_host.json"), "w") as f:
        json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()

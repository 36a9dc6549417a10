"""Where a 128K prefill of the 800M GDN and NAtS-L Hybrid models spends its time (H200, < 4 min).

    PYTHONPATH=. PYTHONUNBUFFERED=1 python3 benchmarks/device_prefill_profile.py [--length 131072]

For each model (random weights, bf16, fast backend, NAtS-L routes forced to --keep-fraction, 0.5): the best of
two prefills with separate projection weights, then the same after `merge_` (the decode runner's
merged q/k/v... buffers, forced on for the prefill too), then one profiled prefill (default: merged only
for decode-sized inputs):
CUDA time per kernel, summed by kind (matmul, GDN kernels, attention kernels, compiled pointwise,
other). Tables in $OUT/prefill_profile.txt, figures in $OUT/prefill_profile.json.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))
OUT = os.environ.get("OUT", "/tmp/prefill_profile_out")

KINDS = (("matmul", ("gemm", "nvjet", "cutlass", "sm90_xmma", "matmul")),
         ("gdn kernels", ("_state", "_prepare", "_output", "_wy", "gated_delta", "_chunk")),
         ("attention kernels", ("_attn", "routed", "flash", "attention", "block_sparse", "_forward_kernel")),
         ("fused-inference norms", ("rms_kernel", "conv_step", "gdn_step")),
         ("compiled pointwise", ("triton_",)),)


def kind_of(name: str) -> str:
    low = name.lower()
    for kind, marks in KINDS:
        if any(m in low for m in marks):
            return kind
    return "other"


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--length", type=int, default=131072)
    parser.add_argument("--models", default="800m_gdn,800m_hybrid")
    parser.add_argument("--keep-fraction", type=float, default=0.5, help="the NAtS-L layers' forced keep fraction")
    args = parser.parse_args()
    import torch
    from torch.profiler import ProfilerActivity, profile

    from natsl.inference import bench
    from natsl.models import merged
    from natsl.models.merged import merge_
    from natsl.provenance import provenance

    os.makedirs(OUT, exist_ok=True)
    default_rows = merged.MERGE_MAX_ROWS
    device, L = torch.device("cuda"), args.length
    result = {"provenance": provenance(), "length": L, "keep_fraction": args.keep_fraction, "models": {}}
    tables = open(os.path.join(OUT, "prefill_profile.txt"), "w")
    for name in args.models.split(","):
        began = time.monotonic()
        model, _, _ = bench.load_model(bench.BenchModel("recipe", name, args.keep_fraction), device, torch.bfloat16, "fast", 0)
        ids = torch.randint(0, model.config.vocab_size, (1, L), device=device)
        cache = model.new_cache(1, max_len=L + 8)
        entry = {}
        with torch.no_grad():
            for tag in ("separate", "merged"):
                if tag == "merged":  # the merged products also for the prefill (decode-only by default)
                    merged.MERGE_MAX_ROWS = 1 << 40
                    merge_(model)
                cache.reset()
                model.forward_cached(ids[:, :4096 + 37], cache, last_only=True)  # compile / autotune warm-up
                entry[f"prefill_s_{tag}"] = bench.time_prefill(model, ids, cache, 2, device)
                print(f"{name} prefill {L} {tag}: {entry[f'prefill_s_{tag}']:.4f} s", flush=True)
            merged.MERGE_MAX_ROWS = default_rows
            cache.reset()
            torch.cuda.synchronize()
            with profile(activities=[ProfilerActivity.CUDA]) as prof:
                model.forward_cached(ids, cache, last_only=True)
                torch.cuda.synchronize()
        rows = []
        for e in prof.key_averages():
            t = getattr(e, "device_time_total", 0) or getattr(e, "cuda_time_total", 0)
            if t > 0 and e.key and not e.key.startswith("ProfilerStep"):
                rows.append((e.key, e.count, t / 1e3))
        rows.sort(key=lambda r: -r[2])
        by_kind: dict[str, float] = {}
        for key, _, ms in rows:
            by_kind[kind_of(key)] = by_kind.get(kind_of(key), 0.0) + ms
        entry["ms_by_kind"] = by_kind
        entry["top_kernels"] = rows[:40]
        result["models"][name] = entry
        tables.write(f"==== {name} prefill {L}: kernels by CUDA time (ms) ====\n")
        tables.writelines(f"{ms:10.2f} {count:6d}  {key[:150]}\n" for key, count, ms in rows[:60])
        tables.flush()
        print(f"{name}: by kind (ms) " + ", ".join(f"{k} {v:.1f}" for k, v in sorted(by_kind.items(), key=lambda kv: -kv[1])),
              flush=True)
        for key, count, ms in rows[:14]:
            print(f"   {ms:9.2f} ms {count:5d}x  {key[:110]}", flush=True)
        print(f"   ({time.monotonic() - began:.0f} s)", flush=True)
        del model, cache
        torch.cuda.empty_cache()
    with open(os.path.join(OUT, "prefill_profile.json"), "w") as fh:
        json.dump(result, fh, indent=1)


if __name__ == "__main__":
    main()

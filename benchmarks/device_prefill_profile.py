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


# Host ops whose own kernels are memory passes beside the model's compute (copies, scans, fills,
# reductions, indexing): --stacks lists them with the natsl source lines that called them.
PASS_OPS = ("aten::copy_", "aten::cat", "aten::clone", "aten::index_put_", "aten::index", "aten::sum", "aten::cumsum",
            "aten::fill_", "aten::zero_", "aten::mul", "aten::add", "aten::add_", "aten::sub", "aten::exp",
            "aten::where", "aten::repeat_interleave", "aten::nonzero", "aten::gt", "aten::ones", "aten::zeros")


def ops_by_stack(prof, top: int = 40) -> list[dict]:
    """The PASS_OPS by the CUDA time of their own kernels, grouped by input shapes and call site."""
    rows = []
    for e in prof.key_averages(group_by_input_shape=True, group_by_stack_n=8):
        if e.key not in PASS_OPS:
            continue
        ms = (getattr(e, "self_device_time_total", 0) or getattr(e, "self_cuda_time_total", 0)) / 1e3
        if ms <= 0.01:
            continue
        stack = [f for f in (e.stack or []) if "natsl" in f][:4]
        rows.append({"op": e.key, "count": e.count, "ms": ms, "shapes": str(e.input_shapes)[:160], "stack": stack})
    rows.sort(key=lambda r: -r["ms"])
    return rows[:top]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--length", type=int, default=131072)
    parser.add_argument("--models", default="800m_gdn,800m_hybrid")
    parser.add_argument("--keep-fraction", type=float, default=0.5, help="the NAtS-L layers' forced keep fraction")
    parser.add_argument("--stacks", action="store_true",
                        help="also record host ops with shapes and call stacks: copies, scans and other passes by source line")
    parser.add_argument("--tags", default="separate,merged", help="which prefill forms to time before the profile")
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
            for tag in args.tags.split(","):
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
            activities = [ProfilerActivity.CUDA] + ([ProfilerActivity.CPU] if args.stacks else [])
            # verbose: without it key_averages(group_by_stack_n=) returns no frames (torch 2.11 - 2.13)
            extra = {"experimental_config": torch._C._profiler._ExperimentalConfig(verbose=True)} if args.stacks else {}
            with profile(activities=activities, record_shapes=args.stacks, with_stack=args.stacks, **extra) as prof:
                model.forward_cached(ids, cache, last_only=True)
                torch.cuda.synchronize()
        if args.stacks:
            entry["ops_with_stacks"] = ops_by_stack(prof)
            tables.write(f"==== {name}: PyTorch ops by their kernels' CUDA time, with the natsl frames that called them ====\n")
            tables.writelines(f"{r['ms']:10.2f} {r['count']:6d}  {r['op']} {r['shapes']}\n{'':18s}{' <- '.join(r['stack'])}\n"
                              for r in entry["ops_with_stacks"])
        rows = []
        for e in prof.key_averages():
            t = getattr(e, "device_time_total", 0) or getattr(e, "cuda_time_total", 0)
            if e.device_type == torch.autograd.DeviceType.CPU:
                continue  # --stacks also records the host's ops; the kinds sum the kernels only
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

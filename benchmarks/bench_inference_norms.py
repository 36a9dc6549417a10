"""The fused inference norms (natsl.fast.cached.rms_kernel) at the shapes of a 128K prefill of the
800M models, under several launch settings, against a plain copy of the same bytes (GPU).

    PYTHONPATH=. python3 benchmarks/bench_inference_norms.py [--length 131072] [--out bench_inference_norms.json]

Shapes (bf16): the block norms [T, 1536] (weight), the GDN q/k L2 norms [T, 6, 192], the GDN output
norm times silu(gate) [T, 6, 384], and the NAtS-L softmax branch's q/k norms [T, 18, 64] (weight),
whose 64-value rows gave the hybrid's 128K prefill ~8 ms more norm time than the GDN model's
(2026-12-01, fourteenth session, call 1). Each setting (rows per program, warps, programmatic dependent
launch) is checked against the default's output first. Medians of triton.testing.do_bench; GB/s counts
the bytes read and written; "copy" is x.clone() plus, with a gate, a second clone (the same bytes).
"""

from __future__ import annotations

import argparse
import json
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))

# label: (row shape after T, has weight, has gate, L2 (sum instead of mean))
SHAPES = {"block norm [T, 1536]": ((1536,), True, False, False),
          "GDN q/k L2 [T, 6, 192]": ((6, 192), False, False, True),
          "GDN out norm x silu(gate) [T, 6, 384]": ((6, 384), True, True, False),
          "softmax q/k norm [T, 18, 64]": ((18, 64), True, False, False)}
SETTINGS = [None, {"pdl": False}, {"rows": 32}, {"rows": 64}, {"rows": 128}, {"rows": 64, "warps": 8},
            {"rows": 128, "warps": 8}, {"rows": 4}, {"rows": 8}, {"rows": 2}, {"rows": 1}]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--length", type=int, default=131072)
    parser.add_argument("--out", default="bench_inference_norms.json")
    args = parser.parse_args()
    import torch
    from triton.testing import do_bench

    from natsl.fast import cached as kernels
    from natsl.provenance import provenance

    dev, bf, T = "cuda", torch.bfloat16, args.length
    rows = []
    for label, (shape, has_w, has_gate, l2) in SHAPES.items():
        torch.manual_seed(0)
        x = torch.randn(T, *shape, device=dev, dtype=bf)
        w = (1 + 0.1 * torch.randn(shape[-1], device=dev)) if has_w else None
        gate = torch.randn_like(x) if has_gate else None
        moved = x.numel() * 2 * (3 if has_gate else 2)

        def norm():
            return kernels.rms_norm(x, w, 1e-6, gate, mean=not l2)

        copy_ms = do_bench(lambda: (x.clone(), gate.clone()) if has_gate else x.clone(), warmup=25, rep=100)
        rows.append({"shape": label, "setting": "copy", "ms": copy_ms, "GB/s": moved / copy_ms / 1e6})
        want = None
        for setting in SETTINGS:
            # the kernel's row tile is next_pow2(D) wide (at least 16): skip tiles past 16K values
            if setting is not None and "rows" in setting and setting["rows"] * max(16, kernels.next_pow2(shape[-1])) > 16384:
                continue
            kernels.RMS_LAUNCH.clear()
            kernels.RMS_LAUNCH.update(setting or {})
            name = "default" if setting is None else ",".join(f"{k}={v}" for k, v in setting.items())
            row = {"shape": label, "setting": name}
            try:
                out = norm().float()
                if want is None:
                    want = out
                row["max_abs_diff_vs_default"] = float((out - want).abs().max())
                ms = do_bench(norm, warmup=25, rep=100)
                row.update(ms=ms, **{"GB/s": moved / ms / 1e6})
            except Exception as e:  # a setting that does not compile is reported, not fatal
                row["error"] = repr(e)[:200]
            rows.append(row)
            print(row, flush=True)
        kernels.RMS_LAUNCH.clear()
        del x, gate
        torch.cuda.empty_cache()
    print(f"\n{'shape':40s} {'setting':22s} {'ms':>8s} {'GB/s':>8s}")
    for r in rows:
        if "ms" in r:
            print(f"{r['shape']:40s} {r['setting']:22s} {r['ms']:8.3f} {r['GB/s']:8.0f}")
    with open(args.out, "w") as f:
        json.dump({"provenance": provenance(), "length": T, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()

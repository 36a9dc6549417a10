#!/usr/bin/env bash
# A short device call (nvidia-h200, about 1.5 minutes), 2026-11-30 fourth session, call 6: the
# routed-attention GPU tests at the final tree, and the op (routed_attention, as a user calls it)
# at 4K and 16K beside SDPA flash and cuDNN, after the host-side caching of the launch decisions.
#   bash benchmarks/device_next.sh        (results: $OUT/op_4k_16k.json, $OUT/tests.txt)
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/natsl_out}; mkdir -p "$OUT"
timeout 60 python3 -m pytest -q tests/test_fast_routed_attention.py -k "gpu or grid_orders" 2>&1 \
    | tee "$OUT/tests.txt" | tail -1
timeout 60 python3 - <<'PY'
import json, os, sys
sys.path.insert(0, "benchmarks")
import bench_routed_attention as b
rows = []
for T in (4096, 16384):
    for name, fn, flops in (
        ("sdpa flash 24x64", lambda: b.time_sdpa(1, T, 24, 64, 64), b.causal_flops(1, T, 24, 64, 64)),
        ("sdpa cudnn 24x64", lambda: b.time_sdpa(1, T, 24, 64, 64, backend="cudnn"), b.causal_flops(1, T, 24, 64, 64)),
        ("routed 24x64 keep 1", lambda: b.time_routed(1, T, 24, 8, 64, 64, 1.0), b.causal_flops(1, T, 24, 64, 64)),
        ("routed 800M keep 1", lambda: b.time_routed(1, T, 18, 6, 64, 128, 1.0), b.causal_flops(1, T, 18, 64, 128)),
    ):
        ms = fn()
        rows.append({"T": T, "what": name, "fwd_ms": ms, "tflops": flops / ms / 1e9})
        print(rows[-1], flush=True)
json.dump(rows, open(os.path.join(os.environ["OUT"], "op_4k_16k.json"), "w"), indent=1)
PY

#!/usr/bin/env bash
# A short device call (nvidia-h200, about 2 minutes), 2026-11-30 fourth session, call 5: the
# routed-attention GPU tests with the program order chosen by length in the backward too, and
# both orders side by side (forward and backward kernels, training shape, 16K, 64K).
#   bash benchmarks/device_next.sh        (results: $OUT/grid_order.json, $OUT/tests.txt)
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/natsl_out}; mkdir -p "$OUT"
timeout 60 python3 -m pytest -q tests/test_fast_routed_attention.py -k "gpu or grid_orders" 2>&1 \
    | tee "$OUT/tests.txt" | tail -2
timeout 60 python3 benchmarks/device_grid_order.py 2>&1 | grep "^{" | cut -c1-200

#!/usr/bin/env bash
# Every @gpu test on the H200 in one call (about 6 minutes; the first compile of the pointwise
# pieces and the Triton kernels is most of it). Per-test lines on stdout, the whole log in $OUT.
#   bash benchmarks/device_gpu_tests.sh
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/natsl_out}; mkdir -p "$OUT"
timeout ${TEST_TIMEOUT:-540} python3 -m pytest -v -m gpu tests/ 2>&1 | tee "$OUT/gpu_tests.txt" \
    | grep -E "PASSED|FAILED|ERROR|passed|failed|^E " | cut -c1-200 | head -60

#!/usr/bin/env bash
# The nineteenth session's first call: the output folded into the gated-delta recurrence
# (config.STATE_FWD["FOLD_OUTPUT"], "SCORES_PASS") checked and timed on the H200; the training runs follow in
# calls of their own (device_next.sh with NATSL_FOLD_OUTPUT=1 / 0).
#   bash benchmarks/device_fold_output.sh      (writes under $OUT)
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/natsl_out}; mkdir -p $OUT
timeout 240 python3 -m pytest -v -m gpu tests/test_fast_gated_delta.py 2>&1 | tee $OUT/gpu_tests.txt \
    | grep -E "PASSED|FAILED|ERROR|passed|failed|^E " | cut -c1-200 | head -40
timeout 150 python3 benchmarks/bench_fold_output.py --out $OUT/fold_output.json 2>&1 | tee $OUT/fold_output.txt

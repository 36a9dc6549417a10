#!/usr/bin/env bash
# One device call after a change to the training path: the GDN kernels' gradients on the H200
# (Triton 3.6 hazard) and their timings beside FLA, the @gpu tests, then the 128K latency point.
#   bash benchmarks/device_check.sh        (the fla wheels in .whl/ carried; results in $OUT)
# SWEEP=1 also sweeps the GDN launch settings (device_gated_delta.py).
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/natsl_out}; mkdir -p "$OUT"
echo "== GDN: gradients on the H200, timings beside FLA"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl/*.whl 2>&1 | tail -2
SKIP=sweep; [ "${SWEEP:-0}" = 1 ] && SKIP=""
PYTHONPATH=$PWD:/tmp/site timeout 150 python3 benchmarks/device_gated_delta.py --modes input --skip "$SKIP" \
    --sweep-budget 150 --out "$OUT" 2>&1 | grep -E "CHECK|SWEEP|TIME|best|^ *[0-9]+ " | tail -30
echo "== GPU tests"
timeout ${TEST_TIMEOUT:-220} python3 -m pytest -v -m gpu tests/ 2>&1 | tee "$OUT/gpu_tests.txt" | grep -E "PASSED|FAILED|ERROR|passed|failed" | cut -c1-160
echo "== latency at 128K"
timeout ${LATENCY_TIMEOUT:-130} python3 benchmarks/device_latency.py --skip-tests --budget 125 --min-len 32768 \
    --max-len 131072 --repeats 1 2>&1 | tail -12

#!/usr/bin/env bash
# The measurements the 2026-11-30 session left open, as one device call (about 9 minutes):
#   1. the CUDA-graph decode test with the compiled pointwise pieces (it ran out of time on 11-30);
#   2. latency of the three 800M systems from 32K to 128K at keep 0.5 (side by side, 2 repeats),
#      and the hybrid at keep 0.25;
#   3. the layer at 64K and 128K (forward) with the compiled pieces;
#   4. training throughput of the two recipes not yet measured (800m_gdn, 800m_natsl);
#   (SKIP_TRAIN=1 leaves out 4.) then, as a second call, benchmarks/device_train_compile.sh.
#   bash benchmarks/device_next.sh        (results in $OUT)
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/natsl_out}; mkdir -p "$OUT"
echo "== CUDA-graph decode test"
timeout 100 python3 -m pytest -v -m gpu tests/test_inference.py -k cuda_graph 2>&1 | tee "$OUT/gpu_cuda_graph_test.txt" \
    | grep -E "PASSED|FAILED|ERROR|passed|failed|^E " | cut -c1-200 | head
echo "== latency, keep 0.5"
mkdir -p "$OUT/keep050" "$OUT/keep025"
OUT=$OUT/keep050 timeout 250 python3 benchmarks/device_latency.py --skip-tests --budget 240 --min-len 32768 \
    --max-len 131072 --repeats 2 2>&1 | tail -13
echo "== latency, hybrid at keep 0.25"
OUT=$OUT/keep025 timeout 90 python3 benchmarks/device_latency.py --skip-tests --budget 85 --min-len 131072 \
    --max-len 131072 --repeats 2 --recipes 800m_hybrid --keep-fraction 0.25 2>&1 | tail -4
echo "== layer at 64K and 128K (forward)"
timeout 70 python3 benchmarks/bench_layer.py --lengths 65536 131072 --no-backward-above 16384 \
    --out "$OUT/layer_long.json" 2>&1 | grep "^|"
if [ "${SKIP_TRAIN:-0}" != 1 ]; then
  echo "== training throughput, the two remaining recipes"
  timeout 140 python3 benchmarks/bench_training.py --recipes 800m_gdn 800m_natsl --max-steps 7 --warmup-steps 3 \
      --micro-batch-size 4 --out "$OUT/train" 2>&1 | tail -5
fi

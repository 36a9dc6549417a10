#!/usr/bin/env bash
# A device call (nvidia-h200-x2, about 7 minutes), 2026-11-30 fourth session, call 4:
#   GPU 0: routed-attention GPU tests and checks with the grid order chosen by length (forward) and
#          the backward back on per-head order, the speed table;
#   GPU 1: the fast-model GPU tests, 128K latency (keep 0.5 three models, keep 0.25 hybrid),
#          training throughput at 4096 (hybrid, Transformer).
#   bash benchmarks/device_next.sh        (results: $OUT/results.tar and one log per GPU)
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export TRAIN="--max-steps 7 --warmup-steps 3 --micro-batch-size 4"
FINAL=${OUT:-/tmp/natsl_out}; WORK=/tmp/natsl_work; mkdir -p "$WORK" "$FINAL"
OUT=$WORK TAIL_LINES=50 bash benchmarks/device_pair.sh '
  timeout 100 python3 -m pytest -q tests/test_fast_routed_attention.py -k "gpu or grid_orders" 2>&1 | tail -2
  STEPS=correct,table BUDGET_S=200 timeout 270 python3 benchmarks/device_routed_attention.py 2>&1 \
      | grep -v "^{" | tail -36' '
  timeout 110 python3 -m pytest -q -m gpu tests/test_fast_model.py 2>&1 | tail -2
  mkdir -p $OUT/keep050 $OUT/keep025
  OUT=$OUT/keep050 timeout 100 python3 benchmarks/device_latency.py --skip-tests --budget 95 \
      --min-len 131072 --max-len 131072 --repeats 2 --recipes 800m_hybrid,800m_transformer,800m_gdn 2>&1 | tail -6
  OUT=$OUT/keep025 timeout 55 python3 benchmarks/device_latency.py --skip-tests --budget 50 --min-len 131072 \
      --max-len 131072 --repeats 2 --recipes 800m_hybrid --keep-fraction 0.25 2>&1 | tail -3
  for r in 800m_hybrid 800m_transformer; do
    timeout 90 python3 benchmarks/bench_training.py --recipes $r $TRAIN --out $OUT/train_$r 2>&1 | tail -1
  done'
cp $WORK/gpu0.log $WORK/gpu1.log "$FINAL/" 2>/dev/null
(cd $WORK && find . -type f \( -name "*.json" -o -name "*.txt" -o -name "*.png" \) | tar cf "$FINAL/results.tar" -T -)

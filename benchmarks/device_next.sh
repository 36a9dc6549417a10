#!/usr/bin/env bash
# The next device call (nvidia-h200-x2, about 7 minutes), 2026-11-30 third session, call 4:
#   GPU 0: GPU tests (GEMV tiles, pointwise pieces with static feature dims, whole tiny models fast
#          vs PyTorch, inference); 128K latency of the three 800M models, then the hybrid at keep 0.25;
#   GPU 1: cuBLAS vs GEMV at the decode shapes; hybrid training throughput with static feature dims
#          (default) and with NATSL_POINTWISE_DYNAMIC=1 (every size symbolic, as before).
#   bash benchmarks/device_next.sh        (results: $OUT/results.tar and one log per GPU)
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
FINAL=${OUT:-/tmp/natsl_out}; WORK=/tmp/natsl_work; mkdir -p "$WORK" "$FINAL"
export TRAIN="--max-steps 7 --warmup-steps 3 --micro-batch-size 4"
OUT=$WORK TAIL_LINES=60 bash benchmarks/device_pair.sh '
  timeout 230 python3 -m pytest -v tests/test_gemv.py tests/test_pointwise.py tests/test_fast_model.py \
      tests/test_inference.py -k "gpu" 2>&1 | grep -E "PASSED|FAILED|ERROR|passed|failed|^E " | cut -c1-160 | head -30
  mkdir -p $OUT/keep050 $OUT/keep025
  OUT=$OUT/keep050 timeout 100 python3 benchmarks/device_latency.py --skip-tests --budget 95 --min-len 131072 \
      --max-len 131072 --repeats 2 --recipes 800m_hybrid,800m_transformer,800m_gdn 2>&1 | tail -6
  OUT=$OUT/keep025 timeout 80 python3 benchmarks/device_latency.py --skip-tests --budget 75 --min-len 131072 \
      --max-len 131072 --repeats 2 --recipes 800m_hybrid --keep-fraction 0.25 2>&1 | tail -3' '
  timeout 40 python3 benchmarks/bench_gemv.py --out $OUT/bench_gemv.json 2>&1 | tail -26
  timeout 150 python3 benchmarks/bench_training.py --recipes 800m_hybrid $TRAIN --out $OUT/train_hybrid_static \
      2>&1 | tail -4
  NATSL_POINTWISE_DYNAMIC=1 timeout 150 python3 benchmarks/bench_training.py --recipes 800m_hybrid $TRAIN \
      --out $OUT/train_hybrid_dynamic 2>&1 | tail -4'
cp $WORK/gpu0.log $WORK/gpu1.log "$FINAL/" 2>/dev/null
(cd $WORK && find . -type f \( -name "*.json" -o -name "*.txt" -o -name "*.png" \) | tar cf "$FINAL/results.tar" -T -)

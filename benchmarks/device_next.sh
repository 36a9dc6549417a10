#!/usr/bin/env bash
# The next device call (nvidia-h200-x2, about 8 minutes), 2026-11-30 third session, call 3:
#   GPU 0: GPU tests of the decode GEMV, the fused add+norm, the three-conv decode launch, automatic
#          dynamic shapes of the pointwise pieces; 128K latency of the three 800M models (hybrid at
#          keep 0.5 and 0.25); cuBLAS vs GEMV at the decode shapes; Transformer training throughput;
#   GPU 1: pointwise pieces static vs symbolic sizes; decode-step profile; hybrid training
#          throughput with automatic dynamic shapes and with NATSL_POINTWISE_DYNAMIC=1 (the old way).
#   bash benchmarks/device_next.sh        (results: $OUT/results.tar and one log per GPU)
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
FINAL=${OUT:-/tmp/natsl_out}; WORK=/tmp/natsl_work; mkdir -p "$WORK" "$FINAL"
export TRAIN="--max-steps 7 --warmup-steps 3 --micro-batch-size 4"
OUT=$WORK TAIL_LINES=80 bash benchmarks/device_pair.sh '
  timeout 200 python3 -m pytest -v tests/test_gemv.py tests/test_inference.py tests/test_decode_attention.py \
      tests/test_pointwise.py -k "gpu or conv_chunk or conv_steps or norm_kernel or block_end" 2>&1 \
      | grep -E "PASSED|FAILED|ERROR|passed|failed|^E " | cut -c1-160 | head -40
  mkdir -p $OUT/keep050 $OUT/keep025
  OUT=$OUT/keep050 timeout 100 python3 benchmarks/device_latency.py --skip-tests --budget 95 --min-len 131072 \
      --max-len 131072 --repeats 2 --recipes 800m_hybrid,800m_transformer,800m_gdn 2>&1 | tail -6
  OUT=$OUT/keep025 timeout 45 python3 benchmarks/device_latency.py --skip-tests --budget 40 --min-len 131072 \
      --max-len 131072 --repeats 2 --recipes 800m_hybrid --keep-fraction 0.25 2>&1 | tail -3
  timeout 40 python3 benchmarks/bench_gemv.py --out $OUT/bench_gemv.json 2>&1 | tail -26
  timeout 150 python3 benchmarks/bench_training.py --recipes 800m_transformer $TRAIN --out $OUT/train_transformer \
      2>&1 | tail -4' '
  timeout 100 python3 benchmarks/bench_pointwise.py --out $OUT/bench_pointwise.json 2>&1 | grep -v Warn | tail -24
  timeout 60 python3 benchmarks/device_decode_profile.py --out $OUT/decode_profile.json 2>&1 | grep -v Warn | tail -56
  timeout 150 python3 benchmarks/bench_training.py --recipes 800m_hybrid $TRAIN --out $OUT/train_hybrid_auto \
      2>&1 | tail -4
  NATSL_POINTWISE_DYNAMIC=1 timeout 150 python3 benchmarks/bench_training.py --recipes 800m_hybrid $TRAIN \
      --out $OUT/train_hybrid_dynamic 2>&1 | tail -4'
cp $WORK/gpu0.log $WORK/gpu1.log "$FINAL/" 2>/dev/null
(cd $WORK && find . -type f \( -name "*.json" -o -name "*.jsonl" -o -name "*.txt" -o -name "*.png" \) | tar cf "$FINAL/results.tar" -T -)

#!/usr/bin/env bash
# The next device call (nvidia-h200-x2, about 4 minutes), 2026-11-30 third session, call 5:
#   GPU 0: GPU tests of the inference path (cross-block add+norm fusion, one-launch K/V write, GEMV
#          one-pass tiles, decode attention, compiled decode bookkeeping);
#   GPU 1: 128K latency of the three 800M models (hybrid at keep 0.5 and 0.25), then cuBLAS vs GEMV.
#   bash benchmarks/device_next.sh        (results: $OUT/results.tar and one log per GPU)
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
FINAL=${OUT:-/tmp/natsl_out}; WORK=/tmp/natsl_work; mkdir -p "$WORK" "$FINAL"
OUT=$WORK TAIL_LINES=60 bash benchmarks/device_pair.sh '
  timeout 220 python3 -m pytest -v tests/test_gemv.py tests/test_inference.py tests/test_decode_attention.py \
      -k "gpu or conv_chunk or conv_steps or norm_kernel or block_end or write_kv" 2>&1 \
      | grep -E "PASSED|FAILED|ERROR|passed|failed|^E " | cut -c1-160 | head -40' '
  mkdir -p $OUT/keep050 $OUT/keep025
  OUT=$OUT/keep050 timeout 100 python3 benchmarks/device_latency.py --skip-tests --budget 95 --min-len 131072 \
      --max-len 131072 --repeats 2 --recipes 800m_hybrid,800m_transformer,800m_gdn 2>&1 | tail -6
  OUT=$OUT/keep025 timeout 80 python3 benchmarks/device_latency.py --skip-tests --budget 75 --min-len 131072 \
      --max-len 131072 --repeats 2 --recipes 800m_hybrid --keep-fraction 0.25 2>&1 | tail -3
  timeout 40 python3 benchmarks/bench_gemv.py --out $OUT/bench_gemv.json 2>&1 | tail -18'
cp $WORK/gpu0.log $WORK/gpu1.log "$FINAL/" 2>/dev/null
(cd $WORK && find . -type f \( -name "*.json" -o -name "*.txt" -o -name "*.png" \) | tar cf "$FINAL/results.tar" -T -)

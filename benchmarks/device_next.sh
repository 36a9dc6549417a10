#!/usr/bin/env bash
# A device call (nvidia-h200-x2, about 2.5 minutes), 2026-11-30 third session, call 6:
#   GPU 0: GPU tests of the inference path (the decay folded into the compiled block end, the gated
#          down GEMV);
#   GPU 1: 128K latency of the three 800M models (hybrid at keep 0.5, then at 0.25).
#   bash benchmarks/device_next.sh        (results: $OUT/results.tar and one log per GPU)
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
FINAL=${OUT:-/tmp/natsl_out}; WORK=/tmp/natsl_work; mkdir -p "$WORK" "$FINAL"
OUT=$WORK TAIL_LINES=40 bash benchmarks/device_pair.sh '
  timeout 150 python3 -m pytest -v tests/test_inference.py tests/test_gemv.py \
      -k "gpu or block_end or write_kv or conv_steps or gated" 2>&1 \
      | grep -E "PASSED|FAILED|ERROR|passed|failed|^E " | cut -c1-160 | head -30' '
  mkdir -p $OUT/keep050
  OUT=$OUT/keep050 timeout 100 python3 benchmarks/device_latency.py --skip-tests --budget 95 --min-len 131072 \
      --max-len 131072 --repeats 2 --recipes 800m_hybrid,800m_transformer,800m_gdn 2>&1 | tail -6
  mkdir -p $OUT/keep025
  OUT=$OUT/keep025 timeout 60 python3 benchmarks/device_latency.py --skip-tests --budget 55 --min-len 131072 \
      --max-len 131072 --repeats 2 --recipes 800m_hybrid --keep-fraction 0.25 2>&1 | tail -3'
cp $WORK/gpu0.log $WORK/gpu1.log "$FINAL/" 2>/dev/null
(cd $WORK && find . -type f \( -name "*.json" -o -name "*.txt" -o -name "*.png" \) | tar cf "$FINAL/results.tar" -T -)

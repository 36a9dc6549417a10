#!/usr/bin/env bash
# The next device call (nvidia-h200-x2, about 8 minutes), left by the 2026-11-30 second session:
#   GPU 0: the @gpu tests touched since commit 47a339f (short conv as pads, multi-row norm kernel,
#          decode-attention launch settings), then the decode-attention launch sweep;
#   GPU 1: latency of the three 800M models at 128K (the hybrid at keep 0.5 and 0.25) with the
#          split-K decode attention, then the 128K prefill profile and the decode-step profile.
#   bash benchmarks/device_next.sh        (results: $OUT/results.tar and one log per GPU)
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
FINAL=${OUT:-/tmp/natsl_out}; WORK=/tmp/natsl_work; mkdir -p "$WORK" "$FINAL"
OUT=$WORK TAIL_LINES=60 bash benchmarks/device_pair.sh '
  timeout 200 python3 -m pytest -v -m gpu tests/test_decode_attention.py tests/test_inference.py \
      tests/test_pointwise.py tests/test_fast_model.py 2>&1 | grep -E "PASSED|FAILED|ERROR|passed|failed|^E " \
      | cut -c1-160 | head -30
  timeout 230 python3 benchmarks/device_decode_sweep.py --budget 150 --out $OUT/decode_sweep.json 2>&1 \
      | grep -E "^best|default_ms" | cut -c1-400' '
  mkdir -p $OUT/keep050 $OUT/keep025
  OUT=$OUT/keep050 timeout 150 python3 benchmarks/device_latency.py --skip-tests --budget 140 --min-len 131072 \
      --max-len 131072 --repeats 2 --recipes 800m_hybrid,800m_transformer,800m_gdn 2>&1 | tail -6
  OUT=$OUT/keep025 timeout 60 python3 benchmarks/device_latency.py --skip-tests --budget 55 --min-len 131072 \
      --max-len 131072 --repeats 2 --recipes 800m_hybrid --keep-fraction 0.25 2>&1 | tail -3
  timeout 120 python3 benchmarks/device_prefill_profile.py 2>&1 | tail -36
  PROFILE_BUDGET_S=100 timeout 110 python3 benchmarks/device_profile_inference.py 2>&1 | tail -30'
cp $WORK/gpu0.log $WORK/gpu1.log "$FINAL/" 2>/dev/null
(cd $WORK && find . -type f \( -name "*.json" -o -name "*.txt" -o -name "*.png" \) | tar cf "$FINAL/results.tar" -T -)

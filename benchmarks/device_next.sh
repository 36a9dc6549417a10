#!/usr/bin/env bash
# The next device call (nvidia-h200-x2, about 8 minutes), 2026-11-30 third session:
#   GPU 0: the GPU tests of the new prefill/decode kernels (conv_chunk, store_blocks, the compiled
#          decode bookkeeping, decode attention defaults), then the 128K latency of the three 800M
#          models (hybrid at keep 0.5 and 0.25);
#   GPU 1: the 128K prefill profile, then the decode-step profile at 32K.
#   bash benchmarks/device_next.sh        (results: $OUT/results.tar and one log per GPU)
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
FINAL=${OUT:-/tmp/natsl_out}; WORK=/tmp/natsl_work; mkdir -p "$WORK" "$FINAL"
OUT=$WORK TAIL_LINES=70 bash benchmarks/device_pair.sh '
  timeout 240 python3 -m pytest -v tests/test_inference.py tests/test_decode_attention.py \
      -k "gpu or conv_chunk or norm_kernel or block_end" 2>&1 | grep -E "PASSED|FAILED|ERROR|passed|failed|^E " \
      | cut -c1-160 | head -30
  mkdir -p $OUT/keep050 $OUT/keep025
  OUT=$OUT/keep050 timeout 150 python3 benchmarks/device_latency.py --skip-tests --budget 140 --min-len 131072 \
      --max-len 131072 --repeats 2 --recipes 800m_hybrid,800m_transformer,800m_gdn 2>&1 | tail -6
  OUT=$OUT/keep025 timeout 60 python3 benchmarks/device_latency.py --skip-tests --budget 55 --min-len 131072 \
      --max-len 131072 --repeats 2 --recipes 800m_hybrid --keep-fraction 0.25 2>&1 | tail -3' '
  timeout 120 python3 benchmarks/device_prefill_profile.py 2>&1 | tail -36
  timeout 120 python3 benchmarks/device_decode_profile.py --out $OUT/decode_profile.json 2>&1 | tail -56'
cp $WORK/gpu0.log $WORK/gpu1.log "$FINAL/" 2>/dev/null
(cd $WORK && find . -type f \( -name "*.json" -o -name "*.txt" -o -name "*.png" \) | tar cf "$FINAL/results.tar" -T -)

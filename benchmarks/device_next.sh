#!/usr/bin/env bash
# A device call (nvidia-h200-x2, about 8 minutes), 2026-11-30 fourth session, call 1:
#   GPU 0: every @gpu test (the review mends of 0115885 and programmatic dependent launch, PDL, of
#          the decode kernels, on by default), then the device-agnostic inference kernel tests;
#   GPU 1: 128K latency with PDL on (three models) and off (hybrid, Transformer), then the
#          routed-attention forward variants (launch settings, TMA key tiles) beside SDPA.
#   bash benchmarks/device_next.sh        (results: $OUT/results.tar and one log per GPU)
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
FINAL=${OUT:-/tmp/natsl_out}; WORK=/tmp/natsl_work; mkdir -p "$WORK" "$FINAL"
OUT=$WORK TAIL_LINES=70 bash benchmarks/device_pair.sh '
  TEST_TIMEOUT=400 bash benchmarks/device_gpu_tests.sh
  timeout 60 python3 -m pytest -q tests/test_inference.py \
      -k "block_end or write_kv or conv_steps or conv_chunk or gated or add_rms" 2>&1 | tail -3' '
  mkdir -p $OUT/pdl_on $OUT/pdl_off
  NATSL_DECODE_PDL=1 OUT=$OUT/pdl_on timeout 100 python3 benchmarks/device_latency.py --skip-tests --budget 95 \
      --min-len 131072 --max-len 131072 --repeats 2 --recipes 800m_hybrid,800m_transformer,800m_gdn 2>&1 | tail -6
  NATSL_DECODE_PDL=0 OUT=$OUT/pdl_off timeout 80 python3 benchmarks/device_latency.py --skip-tests --budget 75 \
      --min-len 131072 --max-len 131072 --repeats 2 --recipes 800m_hybrid,800m_transformer 2>&1 | tail -5
  timeout 260 python3 benchmarks/device_attention_variants.py 2>&1 | grep -v "^{" | tail -45'
cp $WORK/gpu0.log $WORK/gpu1.log "$FINAL/" 2>/dev/null
(cd $WORK && find . -type f \( -name "*.json" -o -name "*.txt" -o -name "*.png" \) | tar cf "$FINAL/results.tar" -T -)

#!/usr/bin/env bash
# A device call (nvidia-h200-x2, about 8 minutes), 2026-11-30 fourth session, call 2:
#   GPU 0: the routed-attention GPU tests and checks with the new forward setting (128 x 64 tiles,
#          4 warps, TMA key tiles), its speed table (fwd, fwd+bwd, 4K-128K, keep 1/0.5/0.25, SDPA),
#          then round 2 of the forward variants;
#   GPU 1: the fast-model and inference GPU tests, 128K latency (keep 0.5 three models, keep 0.25
#          hybrid, PDL off for the decode comparison), the decode-step profile at 32K.
#   bash benchmarks/device_next.sh        (results: $OUT/results.tar and one log per GPU)
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
FINAL=${OUT:-/tmp/natsl_out}; WORK=/tmp/natsl_work; mkdir -p "$WORK" "$FINAL"
OUT=$WORK TAIL_LINES=75 bash benchmarks/device_pair.sh '
  STEPS=pytest,correct,correct2,table BUDGET_S=210 timeout 280 python3 benchmarks/device_routed_attention.py 2>&1 \
      | grep -v "^{" | tail -40
  timeout 170 python3 benchmarks/device_attention_variants.py 2>&1 | grep "^|" | tail -40' '
  timeout 150 python3 -m pytest -q -m gpu tests/test_fast_model.py tests/test_inference.py 2>&1 | tail -2
  mkdir -p $OUT/keep050 $OUT/keep025 $OUT/pdl_off
  OUT=$OUT/keep050 timeout 100 python3 benchmarks/device_latency.py --skip-tests --budget 95 \
      --min-len 131072 --max-len 131072 --repeats 2 --recipes 800m_hybrid,800m_transformer,800m_gdn 2>&1 | tail -6
  OUT=$OUT/keep025 timeout 60 python3 benchmarks/device_latency.py --skip-tests --budget 55 --min-len 131072 \
      --max-len 131072 --repeats 2 --recipes 800m_hybrid --keep-fraction 0.25 2>&1 | tail -3
  NATSL_DECODE_PDL=0 OUT=$OUT/pdl_off timeout 80 python3 benchmarks/device_latency.py --skip-tests --budget 75 \
      --min-len 131072 --max-len 131072 --repeats 2 --recipes 800m_hybrid,800m_transformer 2>&1 | tail -5
  timeout 100 python3 benchmarks/device_decode_profile.py --out $OUT/decode_profile.json 2>&1 | tail -40'
cp $WORK/gpu0.log $WORK/gpu1.log "$FINAL/" 2>/dev/null
(cd $WORK && find . -type f \( -name "*.json" -o -name "*.txt" -o -name "*.png" \) | tar cf "$FINAL/results.tar" -T -)

#!/usr/bin/env bash
# A device call (nvidia-h200-x2, about 7 minutes), 2026-11-30 fourth session, call 3:
#   GPU 0: routed-attention GPU tests and checks after the grid-order change (forward and both
#          backward kernels: every head's heaviest tiles first) and the 64-dim setting (128-key
#          tiles), the speed table, round 3 of the forward variants;
#   GPU 1: the fast-model GPU tests, training throughput at 4096 (hybrid, GDN Hybrid, Transformer),
#          the one-layer benchmark at 4K and 16K.
#   bash benchmarks/device_next.sh        (results: $OUT/results.tar and one log per GPU)
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export TRAIN="--max-steps 7 --warmup-steps 3 --micro-batch-size 4"
FINAL=${OUT:-/tmp/natsl_out}; WORK=/tmp/natsl_work; mkdir -p "$WORK" "$FINAL"
OUT=$WORK TAIL_LINES=60 bash benchmarks/device_pair.sh '
  STEPS=pytest,correct,table BUDGET_S=190 timeout 260 python3 benchmarks/device_routed_attention.py 2>&1 \
      | grep -v "^{" | tail -36
  timeout 130 python3 benchmarks/device_attention_variants.py 2>&1 | grep "^|" | tail -30' '
  timeout 120 python3 -m pytest -q -m gpu tests/test_fast_model.py 2>&1 | tail -2
  for r in 800m_hybrid 800m_gdn_hybrid 800m_transformer; do
    timeout 110 python3 benchmarks/bench_training.py --recipes $r $TRAIN --out $OUT/train_$r 2>&1 | tail -2
  done
  timeout 80 python3 benchmarks/bench_layer.py --lengths 4096 16384 --no-backward-above 16384 \
      --out $OUT/layer.json 2>&1 | tail -8'
cp $WORK/gpu0.log $WORK/gpu1.log "$FINAL/" 2>/dev/null
(cd $WORK && find . -type f \( -name "*.json" -o -name "*.txt" -o -name "*.png" \) | tar cf "$FINAL/results.tar" -T -)

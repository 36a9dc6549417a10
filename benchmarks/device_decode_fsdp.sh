#!/usr/bin/env bash
# One nvidia-h200-x2 call (about 8 minutes): GPU 0 checks the split-K decode-attention kernel and the
# cached paths (@gpu tests), times decode attention beside SDPA, the three 800M models' latency at
# 128K (keep 0.5; the hybrid also at 0.25) and a 128K prefill profile; GPU 1 measures training with
# whole-model torch.compile for the Transformer and GDN Hybrid; then the hybrid trains under FSDP2 on
# both GPUs. Everything lands in $OUT/results.tar plus one log per GPU.
#   bash benchmarks/device_decode_fsdp.sh
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
FINAL=${OUT:-/tmp/natsl_out}; WORK=/tmp/natsl_work; mkdir -p "$WORK" "$FINAL"
OUT=$WORK TAIL_LINES=70 bash benchmarks/device_pair.sh '
  timeout 150 python3 -m pytest -v -m gpu tests/test_decode_attention.py tests/test_inference.py 2>&1 \
      | grep -E "PASSED|FAILED|ERROR|passed|failed|^E " | cut -c1-160 | head -30
  timeout 45 python3 benchmarks/bench_decode_attention.py --out $OUT/decode_attention.json
  mkdir -p $OUT/keep050 $OUT/keep025
  OUT=$OUT/keep050 timeout 100 python3 benchmarks/device_latency.py --skip-tests --budget 95 --min-len 131072 \
      --max-len 131072 --repeats 2 2>&1 | tail -6
  OUT=$OUT/keep025 timeout 45 python3 benchmarks/device_latency.py --skip-tests --budget 42 --min-len 131072 \
      --max-len 131072 --repeats 2 --recipes 800m_hybrid --keep-fraction 0.25 2>&1 | tail -3
  timeout 100 python3 benchmarks/device_prefill_profile.py 2>&1 | tail -36' '
  timeout 320 python3 benchmarks/bench_training.py --recipes 800m_transformer 800m_gdn_hybrid --compile \
      --max-steps 7 --warmup-steps 3 --micro-batch-size 4 --out $OUT/train_compile 2>&1 | tail -5'
echo "== FSDP2, 800m_hybrid on two GPUs"
timeout 120 python3 benchmarks/bench_training.py --recipes 800m_hybrid --nproc 2 --parallel fsdp --max-steps 7 \
    --warmup-steps 3 --micro-batch-size 4 --out $WORK/train_2gpu_fsdp 2>&1 | tail -4
cp $WORK/gpu0.log $WORK/gpu1.log "$FINAL/" 2>/dev/null
(cd $WORK && find . -type f \( -name "*.json" -o -name "*.txt" -o -name "*.png" \) | tar cf "$FINAL/results.tar" -T -)

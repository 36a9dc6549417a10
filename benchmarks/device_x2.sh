#!/usr/bin/env bash
# One call on nvidia-h200-x2: the compiled-pointwise and inference @gpu tests, training throughput
# of three 800M recipes on one GPU, then the NAtS-L Hybrid under torchrun DDP on both GPUs.
#   bash benchmarks/device_x2.sh        (results in $OUT; FSDP=1 also runs the hybrid under FSDP2)
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/natsl_out}; mkdir -p "$OUT"
nvidia-smi --query-gpu=index,name --format=csv,noheader
echo "== GPU tests: compiled pointwise, inference"
timeout 150 python3 -m pytest -v -m gpu tests/test_pointwise.py tests/test_inference.py 2>&1 | tee "$OUT/gpu_tests.txt" \
    | grep -E "PASSED|FAILED|ERROR|passed|failed|^E " | cut -c1-200 | head -30
echo "== training throughput, one GPU"
CUDA_VISIBLE_DEVICES=0 timeout 170 python3 benchmarks/bench_training.py --recipes 800m_hybrid 800m_gdn_hybrid \
    800m_transformer --max-steps 7 --warmup-steps 3 --micro-batch-size 4 --out "$OUT/train_1gpu" 2>&1 | tail -6
echo "== training throughput, 800m_hybrid, DDP on two GPUs"
timeout 100 python3 benchmarks/bench_training.py --recipes 800m_hybrid --nproc 2 --max-steps 7 --warmup-steps 3 \
    --micro-batch-size 4 --out "$OUT/train_2gpu" 2>&1 | tail -4
if [ "${FSDP:-0}" = 1 ]; then
  echo "== training throughput, 800m_hybrid, FSDP2 on two GPUs"
  timeout 120 python3 benchmarks/bench_training.py --recipes 800m_hybrid --nproc 2 --parallel fsdp --max-steps 7 \
      --warmup-steps 3 --micro-batch-size 4 --out "$OUT/train_2gpu_fsdp" 2>&1 | tail -4
fi

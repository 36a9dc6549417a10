#!/usr/bin/env bash
# The next device call (nvidia-h200-x2, about 8 minutes), left by the 2026-11-30 seventh session:
#   GPU 0: every @gpu test (the seventh session ran them in parts: 24 at 19cb75b's code, the conv and
#          fast-model ones again at 4eea5cf; this is the whole set at one tree);
#   GPU 1: where the compiled hybrid's step goes with the "held" conv backward (the seventh session's
#          profile had the two-pass one), then the compiled hybrid and Transformer side by side again.
# Everything is written under $OUT as it runs, so a call cut at its limit still returns its files.
#   bash benchmarks/device_next.sh
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
OUT=${OUT:-/tmp/natsl_out} TAIL_LINES=40 bash benchmarks/device_pair.sh '
  TEST_TIMEOUT=540 bash benchmarks/device_gpu_tests.sh' '
  timeout -k 5 200 python3 benchmarks/profile_training_step.py --recipe 800m_hybrid --compile --top 30 \
      --out $OUT/profile_hybrid.json | grep -A8 "GPU kernel time"
  timeout -k 10 330 python3 benchmarks/bench_training.py --recipes 800m_hybrid 800m_transformer \
      --compile --max-steps 7 --warmup-steps 3 --micro-batch-size 4 --out $OUT/train_compile > $OUT/train.txt 2>&1
  tail -5 $OUT/train.txt'

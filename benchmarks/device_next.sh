#!/usr/bin/env bash
# The eighth session's first device call (nvidia-h200-x2, about 9 minutes):
#   GPU 0: every @gpu test at one tree (incl. the inference test's gdn_hybrid case, never run on a GPU);
#   GPU 1: the short conv's "held" backward over tiles, spans and program orders (bench_short_conv.py),
#          then where the compiled hybrid's step goes, then its compiled training throughput.
# Everything is written under $OUT as it runs, so a call cut at its limit still returns its files.
#   bash benchmarks/device_next.sh
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
OUT=${OUT:-/tmp/natsl_out} TAIL_LINES=70 bash benchmarks/device_pair.sh '
  TEST_TIMEOUT=540 bash benchmarks/device_gpu_tests.sh' '
  timeout -k 5 150 python3 benchmarks/bench_short_conv.py --out $OUT/bench_short_conv.json > $OUT/conv.txt 2>&1
  grep -E "bwd|fwd" $OUT/conv.txt | cut -c1-110
  timeout -k 5 200 python3 benchmarks/profile_training_step.py --recipe 800m_hybrid --compile --top 30 \
      --out $OUT/profile_hybrid.json | grep -A8 "GPU kernel time"
  timeout -k 10 200 python3 benchmarks/bench_training.py --recipes 800m_hybrid \
      --compile --max-steps 7 --warmup-steps 3 --micro-batch-size 4 --out $OUT/train_compile > $OUT/train.txt 2>&1
  tail -3 $OUT/train.txt'

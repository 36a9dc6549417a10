#!/usr/bin/env bash
# The next device call (nvidia-h200-x2, about 8 minutes), left by the 2026-11-30 fifth session,
# whose compiled-training measurement was lost to a hang (bench_training's workers outlived its
# `timeout`; fixed since: they now end with the script):
#   GPU 0: every @gpu test at this tree;
#   GPU 1: training throughput of the three main 800M recipes with whole-model --compile (issue 6).
# Everything is written under $OUT as it runs, so a call cut at its limit still returns its files.
# After it, the two-GPU FSDP2 figure (issue 6), in a call of its own:
#   python3 benchmarks/bench_training.py --nproc 2 --parallel fsdp --recipes 800m_hybrid \
#       --max-steps 7 --warmup-steps 3 --micro-batch-size 4 --out $OUT/fsdp
#   bash benchmarks/device_next.sh
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
OUT=${OUT:-/tmp/natsl_out} TAIL_LINES=40 bash benchmarks/device_pair.sh '
  TEST_TIMEOUT=480 bash benchmarks/device_gpu_tests.sh' '
  timeout -k 10 500 python3 benchmarks/bench_training.py --recipes 800m_hybrid 800m_gdn_hybrid 800m_transformer \
      --compile --max-steps 7 --warmup-steps 3 --micro-batch-size 4 --out $OUT/train_compile > $OUT/train.txt 2>&1
  tail -8 $OUT/train.txt'

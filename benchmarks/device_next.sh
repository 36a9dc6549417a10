#!/usr/bin/env bash
# The next device call (nvidia-h200-x2, about 8 minutes), left by the 2026-11-30 sixth session:
#   GPU 0: the short-conv op's backward settings timed without autograd (bench_short_conv.py; the
#          sixth session's autograd timings were host-bound), then where the compiled hybrid's
#          training step goes now that the conv is an op (profile_training_step.py --compile);
#   GPU 1: compiled training throughput of the three main 800M recipes in one run (issue 6's ratios;
#          the first figures with RoPE's angles made once per step, natsl.models.rope.RopeTable).
# Everything is written under $OUT as it runs, so a call cut at its limit still returns its files.
# After it, the two-GPU FSDP2 figure (issue 6), in a call of its own:
#   python3 benchmarks/bench_training.py --nproc 2 --parallel fsdp --recipes 800m_hybrid \
#       --max-steps 7 --warmup-steps 3 --micro-batch-size 4 --out $OUT/fsdp
#   bash benchmarks/device_next.sh
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
OUT=${OUT:-/tmp/natsl_out} TAIL_LINES=50 bash benchmarks/device_pair.sh '
  timeout -k 5 150 python3 benchmarks/bench_short_conv.py --out $OUT/bench_short_conv.json
  timeout -k 5 240 python3 benchmarks/profile_training_step.py --recipe 800m_hybrid --compile --top 30 \
      --out $OUT/profile_hybrid.json' '
  timeout -k 10 500 python3 benchmarks/bench_training.py --recipes 800m_hybrid 800m_gdn_hybrid 800m_transformer \
      --compile --max-steps 7 --warmup-steps 3 --micro-batch-size 4 --out $OUT/train_compile > $OUT/train.txt 2>&1
  tail -8 $OUT/train.txt'

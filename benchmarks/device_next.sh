#!/usr/bin/env bash
# The eighth session's second device call (nvidia-h200-x2, about 8 minutes):
#   GPU 0: the short conv's GPU tests (every backward form, incl. the new "scratch" one, whose
#          scratch-slot barriers only a GPU can test), where the compiled hybrid's step goes with
#          "scratch", then the compiled Transformer's throughput (beside GPU 1's runs);
#   GPU 1: the conv backward forms and settings alone (bench_short_conv.py), then the compiled
#          hybrid's throughput with "scratch" and with "held".
#   bash benchmarks/device_next.sh
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
OUT=${OUT:-/tmp/natsl_out} TAIL_LINES=60 bash benchmarks/device_pair.sh '
  timeout -k 5 120 python3 -m pytest -q -m gpu tests/test_fast_short_conv.py 2>&1 | tail -4
  NATSL_SHORT_CONV_BACKWARD=scratch timeout -k 5 200 python3 benchmarks/profile_training_step.py \
      --recipe 800m_hybrid --compile --top 30 --out $OUT/profile_hybrid.json | grep -A9 "GPU kernel time"
  timeout -k 10 220 python3 benchmarks/bench_training.py --recipes 800m_transformer \
      --compile --max-steps 7 --warmup-steps 3 --micro-batch-size 4 --out $OUT/train_compile > $OUT/train.txt 2>&1
  tail -2 $OUT/train.txt' '
  timeout -k 5 120 python3 benchmarks/bench_short_conv.py --out $OUT/bench_short_conv.json > $OUT/conv.txt 2>&1
  grep -E "bwd|fwd|sum" $OUT/conv.txt | cut -c1-100
  for form in scratch held; do
    NATSL_SHORT_CONV_BACKWARD=$form timeout -k 10 200 python3 benchmarks/bench_training.py --recipes 800m_hybrid \
        --compile --max-steps 7 --warmup-steps 3 --micro-batch-size 4 --out $OUT/train_$form > $OUT/train_$form.txt 2>&1
    echo $form; tail -2 $OUT/train_$form.txt
  done'

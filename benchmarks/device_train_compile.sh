#!/usr/bin/env bash
# Training throughput of the three main 800M recipes with whole-model torch.compile (`--compile`;
# the fast ops are torch.library custom ops, so the model compiles around them), beside the same
# recipes without it, in one call (about 8 minutes).   bash benchmarks/device_train_compile.sh
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/natsl_out}; mkdir -p "$OUT"
for flag in "" --compile; do
  echo "== training throughput ${flag:-(compiled pointwise pieces only)}"
  timeout 280 python3 benchmarks/bench_training.py --recipes 800m_hybrid 800m_gdn_hybrid 800m_transformer $flag \
      --max-steps 7 --warmup-steps 3 --micro-batch-size 4 --out "$OUT/train${flag/--/_}" 2>&1 | tail -6
done

#!/usr/bin/env bash
# The eighth session's last device call (one H200, about 7 minutes): the short conv's GPU tests (every
# backward form; "scratch"'s slot barriers only a GPU can test), its forms and settings alone
# (bench_short_conv.py), then compiled training of the hybrid with "scratch" and with "held" and of
# the Transformer, one after the other, and where the hybrid's compiled step goes with "scratch".
#   bash benchmarks/device_next.sh
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/natsl_out}; mkdir -p $OUT
python3 -c "from natsl.provenance import source_hash; print('natsl sources', source_hash())"
timeout -k 5 100 python3 -m pytest -q -m gpu tests/test_fast_short_conv.py 2>&1 | tail -3
timeout -k 5 150 python3 benchmarks/bench_short_conv.py --out $OUT/bench_short_conv.json > $OUT/conv.txt 2>&1
grep -E "bwd|fwd|sum" $OUT/conv.txt | cut -c1-100
train() {  # name, env, recipe
  env $2 timeout -k 10 150 python3 benchmarks/bench_training.py --recipes $3 --compile --max-steps 7 \
      --warmup-steps 3 --micro-batch-size 4 --out $OUT/train_$1 > $OUT/train_$1.txt 2>&1
  echo "$1: $(grep -E "^$3 " $OUT/train_$1.txt | tail -1 | cut -c1-120)"
}
train hybrid_scratch NATSL_SHORT_CONV_BACKWARD=scratch 800m_hybrid
train hybrid_held NATSL_SHORT_CONV_BACKWARD=held 800m_hybrid
train transformer NATSL_SHORT_CONV_BACKWARD=scratch 800m_transformer
timeout -k 5 150 python3 benchmarks/profile_training_step.py --recipe 800m_hybrid --compile --top 30 \
    --out $OUT/profile_hybrid.json | grep -A9 "GPU kernel time"

#!/usr/bin/env bash
# The eighth session's closing device call (one H200, about 6 minutes): compiled training of the
# hybrid with the "scratch" conv backward (the previous call's run hit its time cap while compiling),
# then the Transformer, one after the other.
#   bash benchmarks/device_next.sh
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/natsl_out}; mkdir -p $OUT
python3 -c "from natsl.provenance import source_hash; print('natsl sources', source_hash())"
train() {  # name, seconds, recipe
  timeout -k 10 $2 python3 benchmarks/bench_training.py --recipes $3 --compile --max-steps 7 \
      --warmup-steps 3 --micro-batch-size 4 --out $OUT/train_$1 > $OUT/train_$1.txt 2>&1
  echo "$1: $(grep -E "^$3 " $OUT/train_$1.txt | tail -1 | cut -c1-120)"
}
train hybrid_scratch 220 800m_hybrid
train transformer 140 800m_transformer

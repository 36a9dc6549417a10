#!/usr/bin/env bash
# The eighth session's second device call (one H200, about 8 minutes; the x2 host was not lent):
# the short conv's GPU tests (every backward form, incl. the new "scratch" one, whose scratch-slot
# barriers only a GPU can test), the conv backward forms and settings alone (bench_short_conv.py),
# then the compiled hybrid's training throughput with "scratch" and with "held", one after the other.
#   bash benchmarks/device_next.sh
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/natsl_out}; mkdir -p $OUT
python3 -c "from natsl.provenance import source_hash; print('natsl sources', source_hash())"
timeout -k 5 100 python3 -m pytest -q -m gpu tests/test_fast_short_conv.py 2>&1 | tail -3
timeout -k 5 120 python3 benchmarks/bench_short_conv.py --out $OUT/bench_short_conv.json > $OUT/conv.txt 2>&1
grep -E "bwd|fwd|sum" $OUT/conv.txt | cut -c1-100
for form in scratch held; do
  NATSL_SHORT_CONV_BACKWARD=$form timeout -k 10 170 python3 benchmarks/bench_training.py --recipes 800m_hybrid \
      --compile --max-steps 7 --warmup-steps 3 --micro-batch-size 4 --out $OUT/train_$form > $OUT/train_$form.txt 2>&1
  echo $form; tail -2 $OUT/train_$form.txt | cut -c1-150
done

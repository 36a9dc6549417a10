#!/usr/bin/env bash
# The call the ninth session leaves for the next (one H200, about 8 minutes, not run yet): the three
# compiled training runs in one call with the final code ("walk" conv backward, the clip folded into
# the fused AdamW step, 64-wide forward state slices) for same-call ratios; the ninth session measured
# the hybrid with "walk" (74,971 tokens/s) only in a call of its own. Then, in a second call, every
# @gpu test at that tree: bash benchmarks/device_gpu_tests.sh. The other two systems (GDN, NAtS-L, last
# measured in the seventh session) in a third: RUNS="800m_gdn:170 800m_natsl:200" bash benchmarks/device_next.sh
# MBS=8 gives the recipes' own micro-batch (the tables so far use 4). 30 steps, 5 untimed (the tables so far
# timed 4 of 7: a step is ~0.2 s, compiling ~1-2 min, so the "few dozen steps" cost ~5 s more).
#   bash benchmarks/device_next.sh      (writes under $OUT; everything printed also lands in $OUT/log.txt)
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/natsl_out}; mkdir -p $OUT
{
python3 -c "from natsl.provenance import source_hash; print('natsl sources', source_hash())"
for r in ${RUNS:-800m_hybrid:200 800m_transformer:160 800m_gdn_hybrid:170}; do
  timeout -k 10 ${r#*:} python3 benchmarks/bench_training.py --recipes ${r%:*} --compile --max-steps 30 --warmup-steps 5 \
      --micro-batch-size ${MBS:-4} --out /tmp/train_${r%:*} > /tmp/train_${r%:*}.txt 2>&1
  grep -E "^800m|recipe" /tmp/train_${r%:*}.txt | tail -2 | cut -c1-160
  cp /tmp/train_${r%:*}/bench_training.json $OUT/train_${r%:*}.json
done
} 2>&1 | tee $OUT/log.txt

#!/usr/bin/env bash
# The ninth session's fifth call (one H200, about 4 minutes): the "walk" conv backward (built on the CPU
# in the ninth session): its GPU tests at the 800M widths, its settings beside "scratch" (each checked
# against the default's result), then the whole compiled hybrid step with it (compare call 3's profile:
# conv kernels 14.84 ms, step 234.1 ms).
#   bash benchmarks/device_next.sh      (writes under $OUT; everything printed also lands in $OUT/log.txt)
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/natsl_out}; mkdir -p $OUT
{
python3 -c "from natsl.provenance import source_hash; print('natsl sources', source_hash())"
timeout -k 5 60 python3 -m pytest -q -m gpu tests/test_fast_short_conv.py 2>&1 | tail -3
timeout -k 5 60 python3 benchmarks/bench_short_conv.py --out $OUT/bench_short_conv.json 2>&1 | grep -E "bwd|rror"
NATSL_SHORT_CONV_BACKWARD=walk timeout -k 5 140 python3 benchmarks/profile_training_step.py --recipe 800m_hybrid \
    --compile --optimizer --top 6 --out $OUT/profile_step_walk.json 2>&1 \
    | grep -v -i "warn\|online softmax\|split the\|important use\|^$" | head -22
} 2>&1 | tee $OUT/log.txt

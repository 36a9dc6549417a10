#!/usr/bin/env bash
# The eighth session's third device call (one H200, about 5 minutes): the short conv's GPU tests,
# then its backward forms and settings alone (bench_short_conv.py), the "held" and "scratch" loops
# with one and three software-pipelining stages.
#   bash benchmarks/device_next.sh
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/natsl_out}; mkdir -p $OUT
python3 -c "from natsl.provenance import source_hash; print('natsl sources', source_hash())"
timeout -k 5 100 python3 -m pytest -q -m gpu tests/test_fast_short_conv.py 2>&1 | tail -3
timeout -k 5 280 python3 benchmarks/bench_short_conv.py --out $OUT/bench_short_conv.json > $OUT/conv.txt 2>&1
grep -E "bwd|fwd|sum" $OUT/conv.txt | cut -c1-100

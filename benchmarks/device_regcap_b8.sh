#!/usr/bin/env bash
# The two sequential gated-delta kernels at the 800M training micro-batch (B=8, T=4096) under register caps
# (maxnreg 168 / 128: three / four programs per SM instead of two; device_gated_delta.SWEEP_REGCAP), each
# variant checked against the default's output and timed beside it; one stage per process (a faulting
# setting poisons the CUDA context). About 3 minutes. Writes under $OUT.
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/natsl_out}
for s in STATE_BWD STATE_FWD; do
  mkdir -p $OUT/regcap_$s
  timeout 120 python3 benchmarks/device_gated_delta.py --skip check,time --modes input --sweep-shape 8,4096 \
      --sweep-set regcap --stages $s --sweep-budget 90 --out $OUT/regcap_$s > $OUT/regcap_$s/log.txt 2>&1
  grep -E "SWEEP|ms" $OUT/regcap_$s/log.txt | tail -10
done

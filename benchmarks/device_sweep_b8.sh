#!/usr/bin/env bash
# Launch-setting sweeps at the 800M training micro-batch (B=8, T=4096), one call (~8 min): the NAtS-L
# read's backward (bench_mix.py --sweep), then each gated-delta stage in a process of its own (a setting that
# faults poisons the CUDA context). Writes under $OUT.
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
python3 benchmarks/bench_mix.py --sweep --out $OUT/bench_mix_sweep.json > $OUT/mix_sweep.txt 2>&1; tail -2 $OUT/mix_sweep.txt
for s in STATE_BWD GRAD_QK STATE_FWD GRAD_WY OUTPUT PREPARE; do
  mkdir -p $OUT/$s; timeout 110 python3 benchmarks/device_gated_delta.py --skip check,time --modes input --sweep-shape 8,4096 --stages $s --sweep-budget 55 --out $OUT/$s > $OUT/$s/log.txt 2>&1; grep "^SWEEP" $OUT/$s/log.txt | tail -1
done

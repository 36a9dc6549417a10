#!/usr/bin/env bash
# One call (~7 minutes cold) for dq inside the routed attention's dk/dv kernel (config.DQ_IN_DKDV): the GPU
# tests at the 800M shapes both ways, the whole backward at B=8 x 4096, keep 0.55 with the separate dq kernel
# against the fused one under several dk/dv settings (device_attention_backward_sweep.py --dq-inside), then
# the compiled hybrid's training step with it on and off, one after the other (the second compile finds
# Inductor's cache: the switch only changes kernels inside the custom op). Writes under $OUT.
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/natsl_out}; mkdir -p $OUT
timeout 150 python3 -m pytest -q -m gpu tests/test_fast_routed_attention.py -k "800m and dq_inside" 2>&1 | tail -3 | tee $OUT/gpu_tests.txt
OUT=$OUT timeout 150 python3 benchmarks/device_attention_backward_sweep.py --dq-inside --rounds 3 > $OUT/sweep.txt 2>&1
grep "^|" $OUT/sweep.txt
for setting in 1:${FIRST_S:-220} 0:${SECOND_S:-150}; do
  on=${setting%:*}
  NATSL_DQ_IN_DKDV=$on timeout -k 10 ${setting#*:} python3 benchmarks/bench_training.py --recipes 800m_hybrid --compile \
      --max-steps 30 --warmup-steps 5 --micro-batch-size 8 --out /tmp/train_dq$on > $OUT/train_dq$on.txt 2>&1
  echo "NATSL_DQ_IN_DKDV=$on"; grep -E "^800m|recipe" $OUT/train_dq$on.txt | tail -2 | cut -c1-170
  cp /tmp/train_dq$on/bench_training.json $OUT/train_dq$on.json 2>/dev/null
done

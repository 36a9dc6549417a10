#!/usr/bin/env bash
# The ninth session's second call (one H200, about 8 minutes):
#   1. the gated-delta kernels' launch settings at the training shape (B=4, T=4096), one process per
#      stage (a launch setting that faults poisons its process's CUDA context: call 1 lost its sweep so);
#   2. the conv backward's "scratch" settings, each checked against the default's output (Nsight Compute
#      in call 1: 12.5% occupancy, limited by registers);
#   3. the whole compiled training step (NATSL_FOLD_CLIP=0, the default) with the GPU's idle gaps.
#   bash benchmarks/device_next.sh      (writes under $OUT; everything printed also lands in $OUT/log.txt)
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/natsl_out}; mkdir -p $OUT /tmp/gdn
{
python3 -c "from natsl.provenance import source_hash; print('natsl sources', source_hash())"
for stage in STATE_BWD GRAD_WY GRAD_QK STATE_FWD PREPARE OUTPUT LOCAL_DR; do
  mkdir -p /tmp/gdn/$stage
  timeout -k 5 90 python3 benchmarks/device_gated_delta.py --skip check,time --modes input --sweep-shape 4,4096 \
      --stages $stage --sweep-budget 75 --out /tmp/gdn/$stage 2>&1 | grep -E "SWEEP|ms|ERROR" | grep -v "^SWEEP input" | cut -c1-150
done
python3 - <<'PY'
import glob, json, os
merged = [e for f in sorted(glob.glob("/tmp/gdn/*/gated_delta.json")) for e in json.load(open(f))["sweep"]]
json.dump(merged, open(os.environ.get("OUT", "/tmp/natsl_out") + "/gdn_sweep_train_shape.json", "w"), indent=1)
PY
timeout -k 5 120 python3 benchmarks/bench_short_conv.py --out $OUT/bench_short_conv.json 2>&1 | grep -E "bwd|error|Error"
NATSL_FOLD_CLIP=0 timeout -k 5 200 python3 benchmarks/profile_training_step.py --recipe 800m_hybrid --compile \
    --optimizer --top 12 --out $OUT/profile_step_fold0.json 2>&1 | grep -v -i "warn\|online softmax\|split the\|important use\|^$"
} 2>&1 | tee $OUT/log.txt

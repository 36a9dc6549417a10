#!/usr/bin/env bash
# The ninth session's third call (one H200, about 6 minutes):
#   1. the gated-delta GPU tests, with the new B=4 case that takes the 64-wide forward state slices;
#   2. the state backward's settings at the training shape that call 2 lost (8 warps faulted and took
#      the process's CUDA context down; the faulting setting now runs last);
#   3. the whole compiled training step with the clip folded into the fused AdamW step and without,
#      interleaved in one process (--compare-fold), then its profile and idle gaps.
#   bash benchmarks/device_next.sh      (writes under $OUT; everything printed also lands in $OUT/log.txt)
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/natsl_out}; mkdir -p $OUT /tmp/gdn
{
python3 -c "from natsl.provenance import source_hash; print('natsl sources', source_hash())"
timeout -k 5 200 python3 -m pytest -q -m gpu tests/test_fast_gated_delta.py 2>&1 | tail -4
timeout -k 5 90 python3 - <<'PY' 2>&1 | grep -v "^$" | tail -14
import sys; sys.argv = ["x"]; sys.path.insert(0, "benchmarks")
import device_gated_delta as d
d.SWEEP_TRAIN["input"]["STATE_BWD"] = d._grid((64,), (4,), (2, 1)) + d._grid((32, 64), (8,), (2,)) + \
    d._grid((16,), (4,), (2,)) + d._grid((32,), (8,), (1,))
res = {"sweep": []}
print(d.sweep(res, 4096, "input", 80, 4, d.SWEEP_TRAIN, {"STATE_BWD"}))
import json; json.dump(res, open(__import__("os").environ["OUT"] + "/state_bwd_sweep.json", "w"), indent=1, default=str)
PY
timeout -k 5 240 python3 benchmarks/profile_training_step.py --recipe 800m_hybrid --compile --optimizer \
    --compare-fold --repeats 6 --top 12 --out $OUT/profile_step_compare_fold.json 2>&1 \
    | grep -v -i "warn\|online softmax\|split the\|important use\|^$"
} 2>&1 | tee $OUT/log.txt

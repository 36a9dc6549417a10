#!/usr/bin/env bash
# The call the eighth session leaves for the next (one H200, about 9 minutes; not run yet):
#   1. the compiled hybrid trained with the clip and finite check inside the fused AdamW step
#      (NATSL_FOLD_CLIP=1, built after the session's device time ran out) and without, side by side;
#   2. where the ~19 ms between the profiled forward + backward (209 ms) and the loop's step (228 ms)
#      go: the whole compiled step (clipping, the host's finite check, AdamW) both ways;
#   3. an instruction-level look at the conv backward ("scratch", ~0.9 TB/s): Nsight Compute, where
#      the runtime lets it read counters (device/KINDS.md; --clock-control none per METHOD.md).
#   bash benchmarks/device_next.sh
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/natsl_out}; mkdir -p $OUT
python3 -c "from natsl.provenance import source_hash; print('natsl sources', source_hash())"
for fold in 0 1 0 1; do
  NATSL_FOLD_CLIP=$fold timeout -k 10 200 python3 benchmarks/bench_training.py --recipes 800m_hybrid --compile \
      --max-steps 7 --warmup-steps 3 --micro-batch-size 4 --out $OUT/train_fold$fold > $OUT/train_fold$fold.txt 2>&1
  echo "fold $fold: $(grep -E '^800m_hybrid ' $OUT/train_fold$fold.txt | tail -1 | cut -c1-120)"
done
for fold in 0 1; do
  NATSL_FOLD_CLIP=$fold timeout -k 5 150 python3 benchmarks/profile_training_step.py --recipe 800m_hybrid --compile \
      --optimizer --top 20 --out $OUT/profile_step_fold$fold.json > $OUT/profile_step_fold$fold.txt 2>&1
  grep -E "step |GPU kernel time|^ +[0-9.]+ ms +[0-9.]+%  " $OUT/profile_step_fold$fold.txt | head -10
done
cat > $OUT/conv_one.py <<'PY'
import torch
from natsl.fast import short_conv as sc
x = torch.randn(4, 4096, 2304, device="cuda", dtype=torch.bfloat16)
dy = torch.randn_like(x)
w = torch.randn(2304, 1, 4, device="cuda")
for _ in range(3):
    sc.backward(x, w, None, dy)
torch.cuda.synchronize()
PY
timeout -k 5 100 ncu --clock-control none --kernel-name regex:_conv_bwd_scratch_kernel --launch-count 1 \
    --section SpeedOfLight --section MemoryWorkloadAnalysis --section Occupancy --section WarpStateStats \
    python3 $OUT/conv_one.py > $OUT/ncu_conv.txt 2>&1
tail -80 $OUT/ncu_conv.txt | cut -c1-160

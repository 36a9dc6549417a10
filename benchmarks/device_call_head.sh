#!/usr/bin/env bash
# One H200 call (~5 min): the compiled 800M hybrid and Transformer steps at micro-batch 8, each with
# phase clocks (--phases) and the host's time before its first kernel (--host-head), then the kernel
# profile: the side-by-side breakdown of where the hybrid's extra time against the Transformer goes.
#   bash benchmarks/device_call_head.sh      (everything printed lands in $OUT/log.txt)
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/natsl_out}; mkdir -p "$OUT"
{
python3 -c "from natsl.provenance import source_hash; print('natsl sources', source_hash())"
for r in 800m_hybrid 800m_transformer; do
  timeout -k 10 220 python3 benchmarks/profile_training_step.py --recipe $r --compile --optimizer --batch 8 \
      --phases --host-head --top 40 --out "$OUT/profile_$r.json" > "$OUT/profile_$r.txt" 2>&1
  grep -vi "warn" "$OUT/profile_$r.txt" | grep -E "step|phases|head|^  |GPU|%" | head -60
done
} 2>&1 | tee "$OUT/log.txt"

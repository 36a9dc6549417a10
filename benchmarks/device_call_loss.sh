#!/usr/bin/env bash
# One H200 call (~8 min warm): the fused LM-loss kernel checked and timed, the GDN / mix / loss @gpu
# tests, the fused read standalone, and a profiled 800M hybrid step at micro-batch 8 with phase clocks
# (where the step's wall time beyond its kernels goes). Everything printed lands in $OUT/log.txt.
#   bash benchmarks/device_call_loss.sh
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/natsl_out}; mkdir -p "$OUT"
{
python3 -c "from natsl.provenance import source_hash; print('natsl sources', source_hash())"
nvidia-smi --query-gpu=name,clocks.max.sm,memory.total --format=csv,noheader
timeout -k 10 230 python3 -m pytest -q -m gpu tests/test_fast_cross_entropy.py tests/test_fast_gated_delta.py \
    tests/test_fast_mix.py 2>&1 | tail -15
timeout -k 10 60 python3 benchmarks/bench_cross_entropy.py --out "$OUT/bench_cross_entropy.json" 2>&1 | tail -8
timeout -k 10 90 python3 benchmarks/bench_mix.py --out "$OUT/bench_mix.json" 2>&1 | grep -v Warning | tail -10
timeout -k 10 200 python3 benchmarks/profile_training_step.py --recipe 800m_hybrid --compile --optimizer --batch 8 \
    --phases --out "$OUT/profile_hybrid.json" > "$OUT/profile_hybrid.txt" 2>&1
grep -E "step|phases|GPU|ms " "$OUT/profile_hybrid.txt" | grep -v Warn | head -40
} 2>&1 | tee "$OUT/log.txt"

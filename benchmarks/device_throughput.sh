#!/usr/bin/env bash
# One device call for the training-path work: the compiled pointwise pieces checked on the GPU and
# measured (layer and whole-step profile, eager vs compiled), then the GDN forward launch sweep.
# Run from the repository root on the H200 with the fla wheels in .whl/ (carried):
#   bash benchmarks/device_throughput.sh        (results in $OUT)
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/natsl_out}; mkdir -p "$OUT"
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
echo "== GPU tests: compiled pointwise vs eager, whole fast model, inference"
timeout 170 python3 -m pytest -q -m gpu tests/test_pointwise.py tests/test_fast_model.py tests/test_inference.py \
    2>&1 | tee "$OUT/gpu_tests.txt" | tail -5
for c in 0 1; do
  echo "== layer, NATSL_COMPILE_POINTWISE=$c"
  NATSL_COMPILE_POINTWISE=$c timeout 70 python3 benchmarks/bench_layer.py --lengths 4096 16384 --fractions 1.0 0.5 \
      --no-backward-above 16384 --out "$OUT/layer_compile$c.json" 2>&1 | tail -4
done
for c in 0 1; do
  echo "== training step profile, 800m_hybrid B=4, NATSL_COMPILE_POINTWISE=$c"
  NATSL_COMPILE_POINTWISE=$c timeout 80 python3 benchmarks/profile_training_step.py --recipe 800m_hybrid --batch 4 \
      --top 22 --out "$OUT/profile_hybrid_compile$c.json" 2>&1 | grep -v USDT
done
echo "== GDN forward sweep (bf16 intermediates) and timings beside FLA"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl/*.whl 2>&1 | tail -2
PYTHONPATH=$PWD:/tmp/site timeout 170 python3 benchmarks/device_gated_delta.py --skip check --modes input \
    --sweep-budget 110 --out "$OUT" 2>&1 | grep -v "^  " | tail -22

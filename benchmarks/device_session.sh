#!/usr/bin/env bash
# One device call that checks the fast path end to end and measures the layer and the latency.
# Run from the repository root on the H200:  bash benchmarks/device_session.sh
# Each stage has its own time cap so that one call fits the lease; results land in $OUT.
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/natsl_out}; mkdir -p "$OUT"
nvidia-smi --query-gpu=name,driver_version,clocks.sm --format=csv,noheader
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)"
echo "== whole tiny hybrid, fast vs PyTorch, on the GPU"
timeout 110 python3 -m pytest -q -m gpu tests/test_fast_model.py 2>&1 | tee "$OUT/gpu_model.txt" | tail -4
echo "== layer benchmark"
timeout 120 python3 benchmarks/bench_layer.py --lengths 4096 16384 65536 131072 --no-backward-above 16384 \
    --out "$OUT/layer.json" 2>&1 | tail -8
echo "== latency (GPU inference tests first)"
timeout 230 python3 benchmarks/device_latency.py --budget 215 --min-len 8192 --max-len 131072 --repeats 2 2>&1 | tail -25

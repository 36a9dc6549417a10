#!/usr/bin/env bash
# One call (~7 minutes) of what the nineteenth session prepared and could not run: the sequential gated-delta
# kernels under register caps at B=8 (device_regcap_b8.sh), then the ms and joules of one GDN, NAtS-L and
# softmax block (energy_blocks.py, compiled; NVML through nvidia-ml-py). Then, in a call of its own, the
# training runs, whose JSON now carries joules per step: MBS=8 RUNS="800m_hybrid:200 800m_transformer:160"
# bash benchmarks/device_next.sh. Writes under $OUT.
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/natsl_out}; mkdir -p $OUT
OUT=$OUT bash benchmarks/device_regcap_b8.sh
timeout 300 python3 benchmarks/energy_blocks.py --recipes 800m_hybrid 800m_transformer --out $OUT/energy_blocks.json \
    2>&1 | tee $OUT/energy_blocks.txt | tail -12

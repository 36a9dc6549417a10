#!/usr/bin/env bash
# Two device jobs at once on nvidia-h200-x2, one per GPU, so one call does two calls' work:
#   bash benchmarks/device_pair.sh "bash benchmarks/device_gpu_tests.sh" "bash benchmarks/device_next.sh"
# Each job sees one GPU (CUDA_VISIBLE_DEVICES), writes under $OUT/gpu0 or $OUT/gpu1 and logs to
# $OUT/gpuN.log; the logs are printed one after the other when both are done. Timings of the two
# jobs share the host's CPUs, so host-bound figures (batch-1 decode) are taken with a sibling running.
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
# NVLink multicast stays off on the lent hosts (KINDS.md).
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
OUT=${OUT:-/tmp/natsl_out}; mkdir -p "$OUT/gpu0" "$OUT/gpu1"
nvidia-smi --query-gpu=index,name --format=csv,noheader
# the code that runs (the copy's .git can be older than its files): match it with
# python -c "from natsl.provenance import source_hash; print(source_hash())" at a local commit
python3 -c "from natsl.provenance import source_hash; print('natsl sources', source_hash())"
start=$(date +%s)
CUDA_VISIBLE_DEVICES=0 OUT=$OUT/gpu0 bash -c "$1" > "$OUT/gpu0.log" 2>&1 &
CUDA_VISIBLE_DEVICES=1 OUT=$OUT/gpu1 bash -c "$2" > "$OUT/gpu1.log" 2>&1 &
wait
echo "both done in $(( $(date +%s) - start )) s"
for n in 0 1; do echo "======== GPU $n"; cut -c1-220 "$OUT/gpu$n.log" | tail -n ${TAIL_LINES:-60}; done

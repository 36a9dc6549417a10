#!/usr/bin/env bash
# The next device call (nvidia-h200-x2, about 8 minutes), left by the 2026-11-30 fourth session,
# whose device time ran out before its last changes (the program-order rule of the routed-attention
# kernels at 8 programs per SM, host-side caching of the launch decisions) ran on the GPU:
#   GPU 0: every @gpu test at this tree;
#   GPU 1: the routed-attention op at 4K-128K beside SDPA (fwd, fwd+bwd), both program orders side
#          by side, the 128K latency of the three 800M models.
#   bash benchmarks/device_next.sh        (results: $OUT/results.tar and one log per GPU)
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
FINAL=${OUT:-/tmp/natsl_out}; WORK=/tmp/natsl_work; mkdir -p "$WORK" "$FINAL"
OUT=$WORK TAIL_LINES=60 bash benchmarks/device_pair.sh '
  TEST_TIMEOUT=420 bash benchmarks/device_gpu_tests.sh' '
  STEPS=correct,table BUDGET_S=200 timeout 260 python3 benchmarks/device_routed_attention.py 2>&1 \
      | grep -v "^{" | tail -30
  timeout 60 python3 benchmarks/device_grid_order.py 2>&1 | grep "^{" | cut -c1-200
  mkdir -p $OUT/keep050
  OUT=$OUT/keep050 timeout 100 python3 benchmarks/device_latency.py --skip-tests --budget 95 \
      --min-len 131072 --max-len 131072 --repeats 2 --recipes 800m_hybrid,800m_transformer,800m_gdn 2>&1 | tail -6'
cp $WORK/gpu0.log $WORK/gpu1.log "$FINAL/" 2>/dev/null
(cd $WORK && find . -type f \( -name "*.json" -o -name "*.txt" -o -name "*.png" \) | tar cf "$FINAL/results.tar" -T -)

#!/usr/bin/env bash
# One H200 call (~7 min): the routed-attention forward with every n-th kept key tile's exponentials
# on the FMA pipe (config.FMA_EXP_EVERY, forward.exp2_fma). 1) the GPU tests of the op (bf16 800M
# shapes with n = 1 and 3 against the reference); 2) the forward alone at 16K and 128K, keep 1 / 0.5 /
# 0.25, n = 0 (off), 1, 2, 3, 4; 3) the 128K latency stand (issue 5) with the n fastest at 128K keep
# 0.5, the hybrid also with n = 0 in the same call.
#   bash benchmarks/device_call_fma.sh        (writes under $OUT; the log also lands in $OUT/log.txt)
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/natsl_out}; mkdir -p $OUT
{
python3 -c "from natsl.provenance import source_hash; print('natsl sources', source_hash())"
timeout -k 10 170 python3 -m pytest -q -m gpu tests/test_fast_routed_attention.py 2>&1 | tail -4
OUT=$OUT/variants timeout -k 10 200 python3 benchmarks/device_attention_variants.py --lengths 16384 131072 \
    --keep-fractions 1 0.5 0.25 --shapes 800M --fma-every 0 1 2 3 4 --skip-sdpa 2>&1 | grep "^|"
BEST=$(python3 -c "
import json, re
rows = json.load(open('$OUT/variants/attention_variants.json'))['rows']
rows = [r for r in rows if r['T'] == 131072 and r['keep'] == 0.5 and 'ms' in r and r['rel_rms_vs_first'] < 2e-3]
print(int(re.search(r'fma(\d+)', min(rows, key=lambda r: r['ms'])['what']).group(1)) if rows else 0)")
echo "fastest FMA_EXP_EVERY at 128K keep 0.5: $BEST"
lat="python3 benchmarks/device_latency.py --skip-tests --min-len 131072 --max-len 131072 --repeats 2"
NATSL_FMA_EXP_EVERY=$BEST OUT=$OUT/k0.5 timeout -k 10 110 $lat --recipes 800m_hybrid,800m_transformer,800m_gdn 2>&1 | tail -6
NATSL_FMA_EXP_EVERY=$BEST OUT=$OUT/k0.25 timeout -k 10 50 $lat --recipes 800m_hybrid --keep-fraction 0.25 2>&1 | tail -6
NATSL_FMA_EXP_EVERY=0 OUT=$OUT/k0.5_off timeout -k 10 50 $lat --recipes 800m_hybrid 2>&1 | tail -6
} 2>&1 | tee $OUT/log.txt

#!/usr/bin/env bash
# One H200 call (~6 min): the routed-attention forward's softmax variants "n,lazy": every n-th kept
# key tile's exponentials on the FMA pipe (config.FMA_EXP_EVERY, forward.exp2_fma) and lazy
# rescaling (config.LAZY_RESCALE). 1) the op's GPU tests (bf16 800M shapes with the variants against
# the reference); 2) the forward alone at 16K keep 1 and 128K keep 0.5 / 0.25 per variant; 3) the
# 128K latency stand (issue 5) with the variant fastest at 128K keep 0.5.
# (First run, 2026-12-01 call 1: the variants did not compile on Triton 3.6, a global constant
# annotated instead of instantiated as tl.constexpr; the stand ran with both off.)
#   bash benchmarks/device_call_fma.sh        (writes under $OUT; the log also lands in $OUT/log.txt)
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/natsl_out}; mkdir -p $OUT
{
python3 -c "from natsl.provenance import source_hash; print('natsl sources', source_hash())"
timeout -k 10 170 python3 -m pytest -q -m gpu tests/test_fast_routed_attention.py 2>&1 | tail -4
variants="python3 benchmarks/device_attention_variants.py --shapes 800M --softmax 0,0 0,1 2,1 3,1 4,1 4,0 --skip-sdpa"
OUT=$OUT/v16k timeout -k 10 60 $variants --lengths 16384 --keep-fractions 1 2>&1 | grep "^| 1"
OUT=$OUT/v128k timeout -k 10 150 $variants --lengths 131072 --keep-fractions 0.5 0.25 2>&1 | grep "^| 1"
BEST=$(python3 -c "
import json, re
rows = json.load(open('$OUT/v128k/attention_variants.json'))['rows']
rows = [r for r in rows if r['keep'] == 0.5 and 'ms' in r and r['rel_rms_vs_first'] < 2e-3]
best = min(rows, key=lambda r: r['ms'])['what'] if rows else 'fma0'
print(re.search(r'fma(\d+)', best).group(1), int('lazy' in best))")
set -- $BEST
echo "fastest at 128K keep 0.5: FMA_EXP_EVERY=$1 LAZY_RESCALE=$2"
export NATSL_FMA_EXP_EVERY=$1 NATSL_LAZY_RESCALE=$2
lat="python3 benchmarks/device_latency.py --skip-tests --min-len 131072 --max-len 131072 --repeats 2"
OUT=$OUT/k0.5 timeout -k 10 110 $lat --recipes 800m_hybrid,800m_transformer,800m_gdn 2>&1 | tail -6
OUT=$OUT/k0.25 timeout -k 10 50 $lat --recipes 800m_hybrid --keep-fraction 0.25 2>&1 | tail -4
} 2>&1 | tee $OUT/log.txt

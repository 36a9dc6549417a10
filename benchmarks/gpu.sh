#!/usr/bin/env bash
# The one shell entry for the H200: named stages, each with its own time cap, run from the repository root.
#   bash benchmarks/gpu.sh tests|ops|layer|training|latency|profile|all [more stages...]
# Results go to $OUT when set (the device tool's folder), else bench_results/; each stage's log to
# OUT/<stage>.log (its tail printed). Caps: TESTS_S, OPS_S, LAYER_S, TRAINING_S, LATENCY_S, PROFILE_S seconds.
# Options per stage through variables: OPS="gated_delta routed_attention ..." (ops to run), SWEEP=1 (their
# launch-setting sweeps), RECIPES="800m_hybrid 800m_transformer" (training), MBS (micro-batch, default 8),
# TRAIN_FLAGS (e.g. --free-attention), KEEP="0.5 0.25" (latency). flash-linear-attention is timed where
# importable: carry its wheels and add them to PYTHONPATH before calling.
set -u
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
OUT=${OUT:-bench_results}; export OUT; mkdir -p "$OUT"
[ $# -gt 0 ] || { echo "usage: bash benchmarks/gpu.sh tests|ops|layer|training|latency|profile|all ..." >&2; exit 2; }

run() {  # run STAGE CAP COMMAND...: the command under its cap, its log in $OUT/STAGE.log
  local stage=$1 cap=$2; shift 2
  echo "== $stage (cap ${cap}s): $*"
  timeout -k 10 "$cap" "$@" > "$OUT/$stage.log" 2>&1; local code=$?
  grep -v -i "warn" "$OUT/$stage.log" | tail -n 40 | cut -c1-220
  [ $code -eq 0 ] || echo "== $stage: exit code $code"
}

stage() {
  case $1 in
    tests)    run tests "${TESTS_S:-540}" python3 -m pytest -v -m gpu tests/ ;;
    ops)      for op in ${OPS:-gated_delta routed_attention short_conv mix cross_entropy decode_attention gemv pointwise}; do
                run "ops_$op" "${OPS_S:-150}" python3 -m benchmarks.ops --op "$op" ${SWEEP:+--sweep} --out "$OUT"
              done ;;
    layer)    run layer "${LAYER_S:-240}" python3 -m benchmarks.layer --energy --out "$OUT" ;;
    training) run training "${TRAINING_S:-540}" python3 -m benchmarks.training --recipes ${RECIPES:-800m_hybrid 800m_transformer} \
                --compile --micro-batch-size "${MBS:-8}" ${TRAIN_FLAGS:-} --out "$OUT" ;;
    latency)  run latency "${LATENCY_S:-540}" python3 -m benchmarks.latency --keep ${KEEP:-0.5} \
                --budget $(( ${LATENCY_S:-540} - 30 )) --out "$OUT" ;;
    profile)  run profile_train "${PROFILE_S:-240}" python3 -m benchmarks.profile --recipe 800m_hybrid --compile --optimizer \
                --phases --matmul-shapes --out "$OUT"
              run profile_prefill "${PROFILE_S:-240}" python3 -m benchmarks.profile --recipe 800m_hybrid --inference prefill \
                --seq-len 131072 --out "$OUT"
              run profile_decode "${PROFILE_S:-240}" python3 -m benchmarks.profile --recipe 800m_hybrid --inference decode \
                --seq-len 32768 --out "$OUT" ;;
    all)      for s in tests ops layer training latency profile; do stage $s; done ;;
    *)        echo "unknown stage $1: use tests, ops, layer, training, latency, profile or all" >&2; exit 2 ;;
  esac
}

command -v nvidia-smi > /dev/null && nvidia-smi --query-gpu=name,driver_version,clocks.max.sm --format=csv,noheader
python3 -c "from natsl.provenance import source_hash; print('natsl sources', source_hash())"
for s in "$@"; do stage "$s"; done

#!/usr/bin/env bash
# The one shell entry for a GPU machine (tuned on an H200): named stages, each with its own time cap, run from the repository root.
#   bash benchmarks/gpu.sh tests|ops|layer|training|microbatch|small|latency|firstcall|profile|compare|all [more stages...]
#   bash benchmarks/gpu.sh recall          # alone: the recall sweeps fill the GPU for about 10 minutes
# Results go to $OUT when set, else bench_results/; each stage's log to
# OUT/<stage>.log (its tail printed). Caps: TESTS_S, OPS_S, LAYER_S, TRAINING_S, MICROBATCH_S, LATENCY_S, PROFILE_S,
# COMPARE_S, RECALL_S seconds.
# microbatch (docs/training.md, "Micro-batch auto"): the 800M recipes that outgrow an 80 GB card at micro-batch 8,
# each at 8 and at `auto` side by side (the same tokens per step; tokens/s, peak GiB, auto's micro-batch x
# accumulation), eager (TRAIN_FLAGS=--compile compiles, ~2 minutes per run), one process per run.
# small (docs/training.md, "Small models"): the d=128 recall recipes' training steps, one process each, compile + graphs.
# firstcall (docs/performance.md, "First calls"): `natsl warmup` at 128K for three 800M models, then a fresh
# `natsl bench-latency` process each at 128K (its cold column against its warm one).
# compare (docs/performance.md, "Matched-memory comparison"): natsl compare on the 800M recipes (random weights:
# latency and memory only) at 32K, 64K and 128K, NAtS-L's kept fraction and the presses' budget at 0.125-1, into
# OUT/compare/; its --time-budget (COMPARE_S - 60) records the points it cannot reach as skipped.
# recall (docs/recall.md, "The sweep"): the sweep specs of RECALL_SPECS (default sweep_h200_widths.yaml), one
# runner each, all at once under one CUDA MPS daemon, each with the deadline RECALL_DEADLINE (default
# RECALL_S - 60) inside the hard cap RECALL_S (default 540: the whole stage within 10 minutes); their run folders
# (checkpoints) stay in RECALL_WORK (default /tmp/natsl_recall) and, as soon as a sweep ends, its
# summary.json / summary.png / sweep.json and a tarball of its runs' result.json, run.json, metrics.jsonl,
# recall.json and log.txt go to OUT/recall_<spec>/; at the end all of them and the logs are packed into
# OUT/recall_results.tar.gz (RECALL_PACK=0: left as folders), and the bf16 models of the runs whose id matches
# RECALL_MODELS (a regex; default all) into OUT/recall_models_N.tar.gz (<= ~15 MiB each: RUN/model folders that
# `natsl compare` reads). Not in `all`, and never beside other stages (the @gpu tests and the 22 workers slow
# each other down).
# Options per stage through variables: OPS="gated_delta routed_attention ..." (ops to run), SWEEP=1 (their
# launch-setting sweeps), RECIPES="800m_hybrid 800m_transformer" (training, microbatch), MBS (micro-batch, default 8;
# microbatch: 8,auto),
# TRAIN_FLAGS (e.g. --free-attention), KEEP="0.5 0.25" (latency). flash-linear-attention is timed where
# importable: install it (pip install 'natsl[fla]') or add its wheels to PYTHONPATH first.
set -u
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
OUT=${OUT:-bench_results}; export OUT; mkdir -p "$OUT"
[ $# -gt 0 ] || { echo "usage: bash benchmarks/gpu.sh tests|ops|layer|training|microbatch|small|latency|firstcall|profile|compare|recall|all ..." >&2; exit 2; }
case " $* " in *" recall "*) [ $# -eq 1 ] || { echo "recall runs alone: give no other stage beside it" >&2; exit 2; } ;; esac

run() {  # run STAGE CAP COMMAND...: the command under its cap, its log in $OUT/STAGE.log
  local stage=$1 cap=$2; shift 2
  echo "== $stage (cap ${cap}s): $*"
  timeout -k 10 "$cap" "$@" > "$OUT/$stage.log" 2>&1; local code=$?
  grep -v -i "warn" "$OUT/$stage.log" | tail -n 40 | cut -c1-220
  [ $code -eq 0 ] || echo "== $stage: exit code $code"
}

collect() {  # collect WORK DEST: a sweep's summary, figure and spec, and its runs' small files as a tarball
  local work=$1 dest=$2
  mkdir -p "$dest"
  for f in summary.json summary.png sweep.json; do [ -f "$work/$f" ] && cp "$work/$f" "$dest/"; done
  [ -d "$work/runs" ] && (cd "$work" && find runs \( -name result.json -o -name run.json -o -name metrics.jsonl \
    -o -name recall.json -o -name log.txt \) -print0 | tar -czf "$dest/runs.tar.gz" --null -T -)
  echo "== $(basename "$dest"): $(ls "$dest" | tr '\n' ' ')"
  [ -f "$dest/summary.json" ] && python3 - "$dest/summary.json" <<'PY'
import json, sys
summary = json.load(open(sys.argv[1]))
print(f"stopped: {summary.get('stopped')}; runs: " + ", ".join(
    f"{s} {sum(r['status'] == s for r in summary['runs'])}" for s in sorted({r["status"] for r in summary["runs"]})))
print(f"matched in {summary.get('match', 'time')}, seeds {summary.get('seeds', [0])}")
for p in summary["best"]:
    seeds = p.get("seeds") or []
    spread = (f" [{p['accuracy_min']:.3f}-{p['accuracy_max']:.3f}], {p['seeds_finished']}/{p['seeds_total']} seeds"
              f" finished" if "seeds_total" in p else "")
    short = p.get("short") and f"; SHORT: {p['short']} seed(s) stopped at {[s['steps'] for s in seeds if s['short']]} steps"
    print(f"{p['task']} {p['system']:>22} d={p['width']:<4} lr={p['best_lr']:g} accuracy {p['accuracy']:.3f}{spread}"
          f" (recall {p['recall_accuracy']}, kept {p['keep_fraction']}){short or ''}")
PY
}

recall() {  # the recall sweeps: see the header
  local cap=${RECALL_S:-540} work=${RECALL_WORK:-/tmp/natsl_recall} daemon="" pids="" spec name
  local deadline=${RECALL_DEADLINE:-$(( ${RECALL_S:-540} - 60 ))}
  mkdir -p "$work"
  if command -v nvidia-cuda-mps-control > /dev/null; then  # its own pipe folder: the workers inherit it
    export CUDA_MPS_PIPE_DIRECTORY=$work/mps/pipe CUDA_MPS_LOG_DIRECTORY=$work/mps/log
    mkdir -p "$CUDA_MPS_PIPE_DIRECTORY" "$CUDA_MPS_LOG_DIRECTORY"
    if timeout 30 nvidia-cuda-mps-control -d < /dev/null > "$work/mps/start.log" 2>&1; then daemon=1
      echo "== recall: MPS daemon started"
    else echo "== recall: no MPS daemon ($(head -c 200 "$work/mps/start.log")); the workers time-slice the GPU"; fi
  fi
  for spec in ${RECALL_SPECS:-recipes/recall/sweep_h200_widths.yaml}; do
    name=$(basename "$spec" .yaml)
    ( run "recall_$name" "$cap" python3 -m natsl.training.sweep "$spec" --deadline "$deadline" --no-progress \
        --out "$work/$name"
      collect "$work/$name" "$OUT/recall_$name" ) &
    pids="$pids $!"
  done
  wait $pids
  # `quit` waits for the daemon's clients; a worker stuck in the driver must not hold the stage past its cap
  [ -n "$daemon" ] && { echo quit | timeout 10 nvidia-cuda-mps-control > /dev/null 2>&1; }
  if [ "${RECALL_PACK:-1}" = 1 ]; then  # one tarball of every sweep's folder and log: one file to copy off the machine
    (cd "$OUT" && tar -czf recall_results.tar.gz recall_* && rm -rf $(ls -d recall_* | grep -vx recall_results.tar.gz))
  fi
  pack_models "$work"
  echo "== recall: $(ls "$OUT" | tr '\n' ' ')"
  return 0
}

pack_models() {  # pack_models WORK: the runs' bf16 inference folders (RUN/model, natsl.cli.sweep.export_model)
  # whose run id matches RECALL_MODELS (an extended regex, default every run), into OUT/recall_models_N.tar.gz
  # of at most ~15 MiB each (files small enough to copy off a remote machine one by one), for `natsl compare RUN/model`
  local work=$1 i=0 size=0 group=() m id bytes
  for m in "$work"/*/runs/*/model; do
    [ -f "$m/model.safetensors" ] || continue
    id=$(basename "$(dirname "$m")")
    [[ $id =~ ${RECALL_MODELS:-.} ]] || continue
    bytes=$(du -sb "$m" | cut -f1)
    if [ ${#group[@]} -gt 0 ] && [ $((size + bytes)) -gt 15000000 ]; then
      tar -czf "$OUT/recall_models_$i.tar.gz" "${group[@]}"; i=$((i + 1)); size=0; group=()
    fi
    group+=(-C "$(dirname "$(dirname "$m")")" "$id/model"); size=$((size + bytes))
  done
  [ ${#group[@]} -gt 0 ] && tar -czf "$OUT/recall_models_$i.tar.gz" "${group[@]}"
  return 0
}

stage() {
  case $1 in
    tests)    # xdist: the compiles of the tests run side by side on the host's cores (45 tests in 220 s on 4 workers)
              run tests "${TESTS_S:-540}" python3 -m pytest -v -m gpu tests/ -n "${TESTS_WORKERS:-4}" ;;
    ops)      for op in ${OPS:-gated_delta routed_attention short_conv mix cross_entropy decode_attention gemv pointwise}; do
                run "ops_$op" "${OPS_S:-150}" python3 -m benchmarks.ops --op "$op" ${SWEEP:+--sweep} --out "$OUT"
              done ;;
    layer)    run layer "${LAYER_S:-240}" python3 -m benchmarks.layer --energy --out "$OUT" ;;
    training) run training "${TRAINING_S:-540}" python3 -m benchmarks.training --recipes ${RECIPES:-800m_hybrid 800m_transformer} \
                --compile --micro-batch-size "${MBS:-8}" ${TRAIN_FLAGS:-} --out "$OUT" ;;
    microbatch) run microbatch "${MICROBATCH_S:-540}" python3 -m benchmarks.training --recipes \
                ${RECIPES:-800m_natsl 800m_mamba2 800m_hybrid} --micro-batch-size "${MBS:-8,auto}" --max-steps 12 \
                --warmup-steps 4 ${TRAIN_FLAGS:-} --out "$OUT" ;;
    small)    run small "${SMALL_S:-300}" python3 -m benchmarks.training --recipes recall/natsl_hybrid recall/transformer \
                recall/gdn --seq-len 512 --micro-batch-size 64 --max-steps 50 --warmup-steps 15 --compile --cuda-graphs --out "$OUT" ;;
    firstcall) for r in 800m_hybrid 800m_transformer 800m_gdn; do
                run "warmup_$r" "${FIRSTCALL_S:-150}" python3 -m natsl.cli.main warmup "$r" --lengths 128k
                run "firstcall_$r" "${FIRSTCALL_S:-150}" python3 -m natsl.cli.main bench-latency --recipe "$r" \
                  --min-len 131072 --max-len 131072 --repeats 3 --decode-tokens 8 --no-progress --out "$OUT/firstcall_$r"
              done ;;
    latency)  run latency "${LATENCY_S:-540}" python3 -m benchmarks.latency --keep ${KEEP:-0.5} \
                --budget $(( ${LATENCY_S:-540} - 30 )) --out "$OUT" ;;
    profile)  run profile_train "${PROFILE_S:-240}" python3 -m benchmarks.profile --recipe 800m_hybrid --compile --optimizer \
                --phases --matmul-shapes --out "$OUT"
              run profile_prefill "${PROFILE_S:-240}" python3 -m benchmarks.profile --recipe 800m_hybrid --inference prefill \
                --seq-len 131072 --out "$OUT"
              run profile_decode "${PROFILE_S:-240}" python3 -m benchmarks.profile --recipe 800m_hybrid --inference decode \
                --seq-len 32768 --out "$OUT" ;;
    compare)  run compare "${COMPARE_S:-540}" python3 -m natsl.cli.main compare 800m_hybrid 800m_transformer \
                800m_gdn_hybrid 800m_gdn_swa 800m_gdn --no-quality --context 32768,65536,131072 \
                --budgets 0.125,0.25,0.5,1 --repeats 2 --time-budget $(( ${COMPARE_S:-540} - 60 )) --no-progress --out "$OUT/compare" ;;
    recall)   recall ;;
    all)      for s in tests ops layer training microbatch small latency firstcall profile compare; do stage $s; done ;;
    *)        echo "unknown stage $1: use tests, ops, layer, training, microbatch, small, latency, firstcall, profile, compare, recall or all" >&2; exit 2 ;;
  esac
}

command -v nvidia-smi > /dev/null && nvidia-smi --query-gpu=name,driver_version,clocks.max.sm --format=csv,noheader
python3 -c "from natsl.provenance import source_hash; print('natsl sources', source_hash())"
for s in "$@"; do stage "$s"; done

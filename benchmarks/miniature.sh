#!/usr/bin/env bash
# One GPU call of the miniature (docs/miniature.md): `natsl miniature` with a deadline, from the repository root,
# then its small results (summaries, specs, metrics, evaluations, the corpus's meta.json and tokenizer; no
# checkpoints, no token shards) packed into $OUT/miniature_results.tgz. The same command again continues
# where the deadline stopped it, while the machine (and its runs/ and data/ folders) is still there.
#   MINI_DEADLINE=540 bash benchmarks/miniature.sh [natsl miniature options...]
# On a machine that stays up between calls but lets no call run longer than some minutes, MINI_DETACH=1 starts
# `natsl miniature` in a process session of its own, which runs on after the call returns; the call waits up to
# MINI_WAIT seconds (default 540) for it and packs what is there. The same command again starts nothing new
# while that run lives (it waits on it and packs again); once the run has ended, it starts the next one.
#   MINI_DETACH=1 MINI_WAIT=540 bash benchmarks/miniature.sh [natsl miniature options...]
set -u
OUT=${OUT:-bench_results/miniature}
MINI=${MINI_DIR:-runs/miniature}
mkdir -p "$OUT" "$MINI"
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader 2>/dev/null | tee -a "$OUT/miniature.log"
quiet='^(sweep|tokenize|train BPE).*\|'

pack() {
    tar czf "$OUT/miniature_results.tgz" --exclude=checkpoints --exclude='*.safetensors' --exclude='*.bin' \
        "$MINI" data/mini/meta.json data/mini/tokenizer.json 2>/dev/null
    ls -la "$OUT"
}

if [ "${MINI_DETACH:-0}" != 1 ]; then
    python3 -m natsl.cli.main miniature --out "$MINI" --deadline "${MINI_DEADLINE:-540}" "$@" 2>&1 \
        | tee -a "$OUT/miniature.log" | grep --line-buffered -v -E "$quiet"
    code=${PIPESTATUS[0]}
    pack
    exit "$code"
fi

pidfile=$MINI/detached.pid rcfile=$MINI/detached.rc logfile=$MINI/detached.log
if [ -f "$pidfile" ] && kill -0 "$(cat "$pidfile")" 2>/dev/null; then
    echo "miniature.sh: natsl miniature (pid $(cat "$pidfile")) is running: waiting on it" | tee -a "$OUT/miniature.log"
else
    rm -f "$rcfile"
    rm -f "$pidfile"
    # setsid: its own session, so that the end of this call does not end it; it writes its pid, then its exit code
    setsid nohup bash -c 'echo $$ >"$0/detached.pid"; python3 -m natsl.cli.main miniature --out "$0" "${@:1}" \
        >>"$0/detached.log" 2>&1; echo $? >"$0/detached.rc"' "$MINI" "$@" </dev/null >/dev/null 2>&1 &
    for _ in 1 2 3 4 5 6 7 8 9 10; do [ -f "$pidfile" ] && break; sleep 0.5; done
    echo "miniature.sh: started natsl miniature $* (pid $(cat "$pidfile" 2>/dev/null)), log $logfile" \
        | tee -a "$OUT/miniature.log"
fi
waited=0
until [ -f "$rcfile" ] || [ "$waited" -ge "${MINI_WAIT:-540}" ]; do
    sleep 5
    waited=$((waited + 5))
done
grep -v -E "$quiet" "$logfile" 2>/dev/null | tail -n 60 | tee -a "$OUT/miniature.log"
cp "$logfile" "$OUT/detached.log" 2>/dev/null
code=0
if [ -f "$rcfile" ]; then
    code=$(cat "$rcfile")
    echo "miniature.sh: natsl miniature ended with exit code $code" | tee -a "$OUT/miniature.log"
else
    echo "miniature.sh: natsl miniature still running after ${waited} s; the same command again waits on it" \
        | tee -a "$OUT/miniature.log"
fi
pack
exit "$code"

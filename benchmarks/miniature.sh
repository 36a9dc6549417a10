#!/usr/bin/env bash
# One GPU call of the miniature (docs/miniature.md): `natsl miniature` with a deadline, from the repository root,
# then its small results (summaries, specs, metrics, evaluations, the corpus's meta.json and tokenizer; no
# checkpoints, no token shards) packed into $OUT/miniature_results.tgz. The same command again continues
# where the deadline stopped it, while the machine (and its runs/ and data/ folders) is still there.
#   MINI_DEADLINE=540 bash benchmarks/miniature.sh [natsl miniature options...]
set -u
OUT=${OUT:-bench_results/miniature}
MINI=${MINI_DIR:-runs/miniature}
mkdir -p "$OUT"
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader 2>/dev/null | tee -a "$OUT/miniature.log"
python3 -m natsl.cli.main miniature --out "$MINI" --deadline "${MINI_DEADLINE:-540}" "$@" 2>&1 \
    | tee -a "$OUT/miniature.log" | grep --line-buffered -v -E '^(sweep|tokenize|train BPE).*\|'
code=${PIPESTATUS[0]}
tar czf "$OUT/miniature_results.tgz" --exclude=checkpoints --exclude='*.safetensors' --exclude='*.bin' \
    "$MINI" data/mini/meta.json data/mini/tokenizer.json 2>/dev/null
ls -la "$OUT"
exit "$code"

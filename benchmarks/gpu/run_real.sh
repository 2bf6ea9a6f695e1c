#!/usr/bin/env bash
# The evaluate-model flow on a real model on the GPU machine: the GGUF demo model dequantized,
# AWQ and GPTQ built by llm-compressor on the GPU, lm-eval through its vLLM backend, Transformers
# and vLLM benchmarked, decisions made. After the GPU lock's install (lock_kit.py) and stage_demo_model.sh, from the
# repository root (carry [".gpu-carry/data"] for the offline eval data):
#
#     bash benchmarks/gpu/run_real.sh [MODEL [quantgate run options]]   # default smollm2-135m
#     e.g. bash benchmarks/gpu/run_real.sh smollm2-135m --scenarios gpu-throughput
#
# QG_TIMEOUT_S (default 540) stops the flow with SIGINT so that the export below still runs.
# Writes to $OUT: summary.md, summary.json (benchmarks/summarize.py), log.txt and real_results.tar.gz (the
# warehouse, its tables as Parquet in parquet/, the summary and log.txt).
set -uo pipefail
REPO="$(cd "$(dirname "$0")/../.." && pwd)"
cd "$REPO"
OUT="${OUT:-$REPO/gpu-out}"
WORK="${QG_WORKDIR:-/tmp/quantgate-real}"
RESULTS="$WORK/results"
mkdir -p "$OUT" "$RESULTS"
LOG="$OUT/log.txt"
. "$REPO/benchmarks/gpu/env.sh"

WH="$RESULTS/real.ducklake"
QG=(python3 -m quantgate.flows.cli)
MODEL="${1:-smollm2-135m}"
shift || true
{
    echo "== $(date -u +%FT%TZ) quantgate run $MODEL $* on $(nvidia-smi --query-gpu=name --format=csv,noheader | head -1)"
    timeout -s INT -k 20 "${QG_TIMEOUT_S:-540}" "${QG[@]}" run "$MODEL" --warehouse "$WH" --workdir "$WORK" "$@"
    echo "== flow exit code $? at $(date -u +%FT%TZ)"
} 2>&1 | tee "$LOG"

# The tables only (views are derived from them), then summary.md + summary.json of every run they hold.
{ "${QG[@]}" export "$RESULTS/parquet" --tables-only --warehouse "$WH" \
    && python3 benchmarks/summarize.py "$RESULTS/parquet" --out "$OUT"; } >>"$LOG" 2>&1 \
    || echo "summary failed (see log.txt)" | tee -a "$LOG"
cp "$OUT/summary.md" "$OUT/summary.json" "$LOG" "$RESULTS/"
tar czf "$OUT/real_results.tar.gz" -C "$WORK" results
ls -la "$OUT"

#!/usr/bin/env bash
# The GPU suite as one command, on the device, after the GPU lock is installed (vLLM, Prefect, DuckDB
# in /root/qg-lock/site-packages). From the repository root:
#
#     bash benchmarks/gpu/run_suite.sh
#
# Writes to $OUT (default ./gpu-out): summary.md, summary.json (benchmarks/summarize.py), log.txt and
# h200_results.tar.gz (the warehouse, its tables as Parquet in parquet/, the vLLM server/bench logs, the summary, log.txt).
# Knobs (environment): QG_DEADLINE_S (330: no step starts later), QG_GRACE_S (75: how far a started
# step may run past it), QG_PARTS (comma-separated parts of catalog/gpu.yaml; default all), QG_GPUS (e.g. 0,1:
# steps side by side, one per GPU, tensor-parallel ones after them; default one GPU at a time),
# QG_SHAPE (qwen2.5-7b-instruct), QG_SUITE (catalog/gpu.yaml), QG_WORKDIR (/tmp/quantgate-gpu).
set -uo pipefail
REPO="$(cd "$(dirname "$0")/../.." && pwd)"
cd "$REPO"
OUT="${OUT:-$REPO/gpu-out}"
WORK="${QG_WORKDIR:-/tmp/quantgate-gpu}"
DEADLINE_S="${QG_DEADLINE_S:-330}"
GRACE_S="${QG_GRACE_S:-75}"
RESULTS="$WORK/results"
mkdir -p "$OUT" "$RESULTS"
LOG="$OUT/log.txt"
: > "$LOG"

. "$REPO/benchmarks/gpu/env.sh"

{
    echo "== $(date -u +%FT%TZ) quantgate GPU suite: deadline ${DEADLINE_S}s + grace ${GRACE_S}s"
    nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader 2>&1
    python3 -c "import sys, torch, vllm, transformers, prefect, duckdb; print(sys.version.split()[0], 'torch', torch.__version__, 'vllm', vllm.__version__, 'transformers', transformers.__version__, 'prefect', prefect.__version__, 'duckdb', duckdb.__version__)" 2>&1
} | tee -a "$LOG"

WH="$RESULTS/gpu.ducklake"
# SIGINT first (the flow stops its servers in `finally`), SIGKILL 20 s later as a last resort. The flow's clock
# starts once Prefect's temporary server is up (~40 s on a fresh machine), so the margin past deadline + grace
# covers that start and a step ending at its own time limit (seen cut off with 45 s).
timeout -s INT -k 20 "$((DEADLINE_S + GRACE_S + 120))" \
    python3 -m quantgate.flows.gpu_suite --warehouse "$WH" --workdir "$WORK" \
    --shape "${QG_SHAPE:-qwen2.5-7b-instruct}" ${QG_SUITE:+--suite "$QG_SUITE"} ${QG_PARTS:+--parts "$QG_PARTS"} ${QG_GPUS:+--gpus "$QG_GPUS"} \
    --deadline-s "$DEADLINE_S" --grace-s "$GRACE_S" 2>&1 | tee -a "$LOG"
RC=${PIPESTATUS[0]}
echo "== flow exit code $RC at $(date -u +%FT%TZ)" | tee -a "$LOG"
stop_sessions

# The tables only (views are derived from them), then summary.md + summary.json of every run they hold.
{ python3 -m quantgate.flows.cli export "$RESULTS/parquet" --tables-only --warehouse "$WH" \
    && python3 benchmarks/summarize.py "$RESULTS/parquet" --out "$OUT"; } >>"$LOG" 2>&1 \
    || echo "summary failed (see log.txt)" | tee -a "$LOG"
mkdir -p "$RESULTS/logs"
find "$WORK/gpu" -path '*/logs/*' -type f \( -name '*.log' -o -name '*.json' \) -exec cp --parents {} "$RESULTS/logs" \; 2>/dev/null
cp "$OUT/summary.md" "$OUT/summary.json" "$LOG" "$RESULTS/" 2>/dev/null
tar czf "$OUT/h200_results.tar.gz" -C "$WORK" results
ls -la "$OUT" | tee -a "$LOG"
exit "$RC"

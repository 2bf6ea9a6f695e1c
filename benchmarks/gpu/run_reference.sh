#!/usr/bin/env bash
# The reference run on the GPU machine: Qwen2.5-Coder-1.5B-Instruct (assembled from its 22 registry parts, staged
# in $QUANTGATE_WHEELHOUSE by stage_reference_model.sh) and pulled into the work dir (`quantgate pull`, timed on its
# own: a nightly finds its models pulled), its variants, the reference suite and scenarios, decided by
# `quantgate run`, timed from start to exit. After the GPU lock's install (lock_kit.py) and the staging, from
# the repository root (carry [".gpu-carry/data"] for the offline eval data), under background.sh:
#
#     bash benchmarks/gpu/run_reference.sh [quantgate run options, e.g. --gpus 0,1]
#
# QG_MODEL runs another model (default the reference), e.g. a shape: QG_MODEL=shape:qwen2.5-7b-instruct
# QG_TOKENIZER=/path/to/a/family/model bash benchmarks/gpu/run_reference.sh --template qwen2.5-coder-1.5b-instruct.
# QG_TIMEOUT_S (default 900) stops the run with SIGINT so that the export below still runs.
# Writes to $OUT: run.md (wall time, stage times, verdicts), summary.md + summary.json (benchmarks/summarize.py
# over the tables), engine-starts.md (benchmarks/engine_starts.py), log.txt, and reference_results.tar.gz (the tables
# as Parquet, the run's, engine and server logs).
set -uo pipefail
REPO="$(cd "$(dirname "$0")/../.." && pwd)"
cd "$REPO"
OUT="${OUT:-$REPO/gpu-out}"
WORK="${QG_WORKDIR:-/tmp/quantgate-reference}"
RESULTS="$WORK/results"
mkdir -p "$OUT" "$RESULTS"
LOG="$OUT/log.txt"
. "$REPO/benchmarks/gpu/env.sh"
require_eval_data run_reference.sh
export QUANTGATE_WHEELHOUSE="${QUANTGATE_WHEELHOUSE:-/root/qg-wheelhouse}"

WH="$RESULTS/reference.ducklake"
QG=(python3 -m quantgate.flows.cli)
MODEL="${QG_MODEL:-qwen2.5-coder-1.5b-instruct}"
# A shape (QG_MODEL=shape:NAME) takes its family's tokenizer from the folder QG_TOKENIZER names, in its pull and run.
SHAPE_ARGS=()
[ -n "${QG_TOKENIZER:-}" ] && SHAPE_ARGS=(--tokenizer "$QG_TOKENIZER")
{
    echo "== $(date -u +%FT%TZ) quantgate pull $MODEL"
    pull_started=$(date +%s.%N)
    "${QG[@]}" pull "$MODEL" --workdir "$WORK" "${SHAPE_ARGS[@]}"
    echo "== pull exit code $? after $(python3 -c "print(f'{$(date +%s.%N) - $pull_started:.1f}')") s"
    echo "== $(date -u +%FT%TZ) quantgate run $MODEL $* on $(nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | head -1)"
} > "$LOG" 2>&1
pull_line=$(grep '^== pull exit code' "$LOG")
started=$(date +%s.%N)
{
    timeout -s INT -k 90 "${QG_TIMEOUT_S:-900}" "${QG[@]}" run "$MODEL" --warehouse "$WH" --workdir "$WORK" "${SHAPE_ARGS[@]}" "$@"
    echo "== exit code $? at $(date -u +%FT%TZ)"
} >> "$LOG" 2>&1
ended=$(date +%s.%N)
wall=$(python3 -c "print(f'{$ended - $started:.1f}')")
tail -n 40 "$LOG"

sql() { "${QG[@]}" sql "$1" -w "$WH" -f markdown; }
{
    echo "# $MODEL on the GPU machine"
    echo
    echo "\`bash benchmarks/gpu/run_reference.sh $*\` on $(nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | head -1)."
    echo "Wall time of \`quantgate run\`, from start to exit: **${wall} s** (measured by this script)."
    echo "Before it, \`quantgate pull\` put the model in the work dir (registry parts assembled, GGUF dequantized to bf16): ${pull_line#== }."
    echo
    echo "## Where the time went (from the warehouse)"
    python3 benchmarks/stage_times.py "$WH"
    sql "select stage, checkpoint, round(seconds, 1) as seconds, engine_starts, reused, strftime(started_at, '%H:%M:%S') as started, strftime(ended_at, '%H:%M:%S') as ended from stage_times order by started_at, stage"
    echo
    echo "## Measurements, each with the GPU alone (view measurement_windows)"
    sql "select checkpoint, engine, scenario, status, compile_cache, round(waited_s, 1) as waited_s, round(memory_wait_s, 1) as memory_wait_s, round(seconds, 1) as seconds, strftime(measured_from, '%H:%M:%S') as began, overlapping_work, overlapping_measurements from measurement_windows order by measured_from"
    echo
    echo "## Verdicts"
    sql "select variant, decision, reason from variant_scorecard"
} > "$OUT/run.md" 2>>"$LOG"
# The tables only (views are derived from them), then summary.md + summary.json of the run they hold.
{ "${QG[@]}" export "$RESULTS/parquet" --tables-only --warehouse "$WH" \
    && python3 benchmarks/summarize.py "$RESULTS/parquet" --out "$OUT"; } >>"$LOG" 2>&1 \
    || echo "summary failed (see log.txt)" | tee -a "$LOG"
# Each speed engine's and server's start as vLLM logged it (weights, compile, graphs, KV cache): engine-starts.md.
python3 benchmarks/engine_starts.py "$WORK" --out "$OUT/engine-starts.md" >>"$LOG" 2>&1 \
    || echo "engine starts failed (see log.txt)" | tee -a "$LOG"
cp "$OUT"/run.md "$OUT"/summary.* "$OUT"/engine-starts.md "$RESULTS/" 2>/dev/null
# The run's own log (library output, progress bars) compressed beside the summary; of each engine and server
# log its last 300 lines (what a failure's cause is in), so that every file comes back within the call's limits.
runlog=$(sed -n 's/^log: //p' "$LOG" | head -1)
[ -n "$runlog" ] && [ -f "$runlog" ] && gzip -c "$runlog" > "$OUT/run-log.txt.gz"
find "$WORK" -name '*.log' -not -path "$RESULTS/*" -not -path "$WORK/logs/*" | while read -r f; do
    mkdir -p "$RESULTS/logs/$(dirname "${f#"$WORK"/}")" && tail -n 300 "$f" > "$RESULTS/logs/${f#"$WORK"/}"
done
tar czf "$OUT/reference_results.tar.gz" -C "$WORK" results
[ "$(stat -c%s "$LOG")" -gt 10000000 ] && gzip -f "$LOG"
ls -la "$OUT"

#!/usr/bin/env bash
# The reference run on the GPU machine: Qwen2.5-Coder-1.5B-Instruct (assembled from its 22 registry parts, staged
# in $QUANTGATE_WHEELHOUSE by stage_reference_model.sh), its AWQ, GPTQ and FP8 variants, the reference suite and
# scenarios, decided by `quantgate run`, timed from start to exit. After the devkit install and the staging, from
# the repository root (carry [".gpu-carry/data"] for the offline eval data), under background.sh:
#
#     bash benchmarks/gpu/run_reference.sh [quantgate run options, e.g. --gpus 0,1]
#
# QG_TIMEOUT_S (default 900) stops the run with SIGINT so that the export below still runs.
# Writes to $OUT: summary.md (wall time, stage times, scorecard, quality, speed), log.txt, and
# reference_results.tar.gz (the warehouse's tables as Parquet, the engine and server logs).
set -uo pipefail
REPO="$(cd "$(dirname "$0")/../.." && pwd)"
cd "$REPO"
OUT="${OUT:-$REPO/gpu-out}"
WORK="${QG_WORKDIR:-/tmp/quantgate-reference}"
RESULTS="$WORK/results"
mkdir -p "$OUT" "$RESULTS"
LOG="$OUT/log.txt"
. "$REPO/benchmarks/gpu/env.sh"
export QUANTGATE_WHEELHOUSE="${QUANTGATE_WHEELHOUSE:-/root/qg-wheelhouse}"

WH="$RESULTS/reference.duckdb"
QG=(python3 -m quantgate.flows.cli)
MODEL="${QG_MODEL:-qwen2.5-coder-1.5b-instruct}"
started=$(date +%s.%N)
{
    echo "== $(date -u +%FT%TZ) quantgate run $MODEL $* on $(nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | head -1)"
    timeout -s INT -k 30 "${QG_TIMEOUT_S:-900}" "${QG[@]}" run "$MODEL" --warehouse "$WH" --workdir "$WORK" "$@"
    echo "== exit code $? at $(date -u +%FT%TZ)"
} > "$LOG" 2>&1
ended=$(date +%s.%N)
wall=$(python3 -c "print(f'{$ended - $started:.1f}')")
tail -n 40 "$LOG"

sql() { "${QG[@]}" sql "$1" -w "$WH" -f markdown; }
{
    echo "# The reference run on the GPU machine"
    echo
    echo "Produced by \`bash benchmarks/gpu/run_reference.sh $*\` on $(nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | head -1);"
    echo "every figure below is read from the warehouse the run wrote. Wall time of \`quantgate run\`, from start to exit: **${wall} s**."
    echo
    echo "## Where the time went"
    python3 benchmarks/stage_times.py "$WH"
    sql "select stage, checkpoint, round(seconds, 1) as seconds, engine_starts, reused, strftime(started_at, '%H:%M:%S') as started, strftime(ended_at, '%H:%M:%S') as ended from stage_times order by started_at, stage"
    sql "select run_id, status, round(wall_seconds, 1) as wall_s, round(stage_seconds, 1) as stage_s, engine_starts from run_timeline"
    echo
    echo "## Scorecard"
    sql "select * from variant_scorecard"
    echo
    echo "## Quality (lm-eval)"
    sql "select v.name as variant, q.task, q.metric, q.filter, round(q.value, 4) as value, round(q.stderr, 4) as stderr, q.n_samples from quality_results q join variants v using (variant_uid) where q.task not like 'qg_mmlu_%' order by q.task, q.metric, q.filter, v.name"
    echo
    echo "## Speed"
    sql "select v.name as variant, s.engine, s.scenario, s.status, round(s.tokens_per_s, 1) as tokens_per_s, round(s.ttft_ms, 2) as ttft_ms, round(s.tpot_ms, 3) as tpot_ms, round(s.peak_memory_bytes / 2^30, 2) as peak_gib, round(s.energy_j_per_token, 4) as j_per_token, s.details->>'engine_starts' as starts, s.reason from speed_results s join variants v using (variant_uid) order by s.scenario, s.engine, v.name"
    echo
    echo "## Cross-check with vllm bench throughput"
    sql "select * from vllm_crosscheck"
    echo
    echo "## Builds"
    sql "select name, method, scheme, group_size, round(size_bytes / 2^20, 1) as size_mib, round(build_seconds, 1) as build_s, round(peak_memory_bytes / 2^30, 2) as peak_gib, status, error from variants order by name"
} > "$OUT/summary.md" 2>>"$LOG"

python3 -c "import sys; from quantgate.warehouse import store; con = store.connect(sys.argv[1]); store.export_parquet(con, sys.argv[2])" "$WH" "$RESULTS/parquet" 2>>"$LOG"
cp "$OUT/summary.md" "$RESULTS/"
find "$WORK" -name '*.log' -size -20M -exec cp --parents {} "$RESULTS/" \; 2>/dev/null
tar czf "$OUT/reference_results.tar.gz" -C "$WORK" results
[ "$(stat -c%s "$LOG")" -gt 10000000 ] && gzip -f "$LOG"
ls -la "$OUT"

#!/usr/bin/env bash
# The evaluate-model flow on a real model on the GPU machine: the GGUF demo model dequantized,
# AWQ and GPTQ built by llm-compressor on the GPU, lm-eval through its vLLM backend, Transformers
# and vLLM benchmarked, decisions made. After the devkit install and stage_demo_model.sh, from the
# repository root (carry [".gpu-carry/data"] for the offline eval data):
#
#     bash benchmarks/gpu/run_real.sh [MODEL [quantgate run options]]   # default smollm2-135m
#     e.g. bash benchmarks/gpu/run_real.sh smollm2-135m --scenarios gpu-throughput
#
# QG_TIMEOUT_S (default 540) stops the flow with SIGINT so that the export below still runs.
# Writes to $OUT: summary.md, log.txt and real_results.tar.gz (the warehouse and its Parquet export).
set -uo pipefail
REPO="$(cd "$(dirname "$0")/../.." && pwd)"
cd "$REPO"
OUT="${OUT:-$REPO/gpu-out}"
WORK="${QG_WORKDIR:-/tmp/quantgate-real}"
RESULTS="$WORK/results"
mkdir -p "$OUT" "$RESULTS"
LOG="$OUT/log.txt"
. "$REPO/benchmarks/gpu/env.sh"

WH="$RESULTS/real.duckdb"
QG=(python3 -m quantgate.flows.cli)
MODEL="${1:-smollm2-135m}"
shift || true
{
    echo "== $(date -u +%FT%TZ) quantgate run $MODEL $* on $(nvidia-smi --query-gpu=name --format=csv,noheader | head -1)"
    timeout -s INT -k 20 "${QG_TIMEOUT_S:-540}" "${QG[@]}" run "$MODEL" --warehouse "$WH" --workdir "$WORK" "$@"
    echo "== flow exit code $? at $(date -u +%FT%TZ)"
} 2>&1 | tee "$LOG"

{
    echo "# evaluate-model on the GPU machine"
    echo
    echo "Produced by \`bash benchmarks/gpu/run_real.sh $MODEL $*\`; every figure below is read from the warehouse."
    echo
    echo "## Scorecard"
    "${QG[@]}" sql "select variant, method, bits, group_size, size_ratio, quality_recovery, speedup, decision, reason from variant_scorecard" -w "$WH" -f markdown
    echo
    echo "## Quality (lm-eval)"
    "${QG[@]}" sql "select v.name as variant, q.task, q.metric, q.value, q.stderr, q.n_samples, e.config->>'backend' as backend from quality_results q join variants v using (variant_uid) join quality_evals e using (variant_uid, eval_key) where q.metric in ('acc', 'acc_norm', 'bits_per_byte', 'word_perplexity') order by q.task, q.metric, v.name" -w "$WH" -f markdown
    echo
    echo "## Speed"
    "${QG[@]}" sql "select v.name as variant, s.engine, s.scenario, s.status, round(s.tokens_per_s, 1) as tokens_per_s, round(s.ttft_ms, 2) as ttft_ms, round(s.tpot_ms, 3) as tpot_ms, round(s.peak_memory_bytes / 2^30, 2) as peak_gib, round(s.energy_j_per_token, 4) as j_per_token, s.reason from speed_results s join variants v using (variant_uid) order by s.scenario, s.engine, v.name" -w "$WH" -f markdown
    echo
    echo "## Builds"
    "${QG[@]}" sql "select name, method, scheme, group_size, round(size_bytes / 2^20, 1) as size_mib, round(build_seconds, 1) as build_s, round(peak_memory_bytes / 2^30, 2) as peak_gib, status, error from variants order by name" -w "$WH" -f markdown
} > "$OUT/summary.md" 2>>"$LOG"

python3 -c "import sys; from quantgate.warehouse import store; con = store.connect(sys.argv[1]); store.export_parquet(con, sys.argv[2])" "$WH" "$RESULTS/parquet" 2>>"$LOG"
cp "$OUT/summary.md" "$LOG" "$RESULTS/"
tar czf "$OUT/real_results.tar.gz" -C "$WORK" results
ls -la "$OUT"

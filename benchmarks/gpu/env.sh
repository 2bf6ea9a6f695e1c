# Sourced by the device scripts: the GPU lock's packages on the path (benchmarks/gpu/lock_kit.py), quantgate importable without installing,
# offline flags, Prefect's ephemeral API, and a pid file through which servers are stopped by id.
# Expects REPO and WORK to be set.
# The GPU lock's folder (lock_kit.py says why its path holds "site-packages").
lock_site="${QG_LOCK_SITE:-/root/qg-lock/site-packages}"
if [ -d "$lock_site" ]; then
    export PYTHONPATH="$lock_site${PYTHONPATH:+:$PYTHONPATH}" PATH="$lock_site/bin:$PATH"
fi
# The package maps the repo's folders to quantgate.* (setuptools package-dir); a folder of links gives
# the same imports without installing anything.
mkdir -p "$WORK/shim/quantgate"
for d in flows tasks catalog warehouse; do ln -sfn "$REPO/$d" "$WORK/shim/quantgate/$d"; done
export PYTHONPATH="$WORK/shim${PYTHONPATH:+:$PYTHONPATH}"
export HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1 TRANSFORMERS_OFFLINE=1 VLLM_NO_USAGE_STATS=1 DO_NOT_TRACK=1 \
    VLLM_USE_FLASHINFER_SAMPLER=0 PREFECT_SERVER_ANALYTICS_ENABLED=false PREFECT_HOME="$WORK/prefect" \
    PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
unset PREFECT_API_URL  # Prefect's ephemeral local API: no server to run
# Data that does not live in the repo travels in the ignored .gpu-carry/data (see benchmarks/gpu/README.md).
if [ -d "$REPO/.gpu-carry/data" ]; then
    export QUANTGATE_SHARED_DATA="$REPO/.gpu-carry/data" QUANTGATE_EVAL_DATA="$REPO/.gpu-carry/data/eval"
fi
# The suite's items, without which every evaluation would fail after the builds: carried in .gpu-carry/data by the
# call that starts the job, or staged earlier and named by QUANTGATE_SHARED_DATA and QUANTGATE_EVAL_DATA.
require_eval_data() {
    if [ ! -d "${QUANTGATE_EVAL_DATA:-}" ]; then
        echo "$1: no eval data at .gpu-carry/data or \$QUANTGATE_EVAL_DATA: carry it in the call that starts this job" | tee "$LOG"
        exit 2
    fi
}
# vllm serve / vllm bench start their own sessions; their ids land here so that an abrupt end can
# still stop them by id (never by name: a pattern would match this shell too).
export QUANTGATE_PIDFILE="$WORK/sessions.pid"
: > "$QUANTGATE_PIDFILE"
stop_sessions() {
    while read -r pid; do
        [ -n "$pid" ] && kill -KILL -- "-$pid" 2>/dev/null
    done < "$QUANTGATE_PIDFILE"
}
trap stop_sessions EXIT

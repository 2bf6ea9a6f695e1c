#!/usr/bin/env bash
# The GPU tests (pytest -m gpu) on the device, after the devkit is installed. From the repository root:
#     bash benchmarks/gpu/run_tests.sh [pytest args]
# Writes $OUT/gpu_tests.txt (default ./gpu-out) besides printing.
set -uo pipefail
REPO="$(cd "$(dirname "$0")/../.." && pwd)"
cd "$REPO"
OUT="${OUT:-$REPO/gpu-out}"
WORK="${QG_WORKDIR:-/tmp/quantgate-gpu-tests}"
mkdir -p "$OUT" "$WORK/shim/quantgate"
DEVKIT="${DEVKIT_SITE:-/root/devkit-site}"
if [ -d "$DEVKIT" ]; then
    export PYTHONPATH="$DEVKIT${PYTHONPATH:+:$PYTHONPATH}" PATH="$DEVKIT/bin:$PATH"
fi
for d in flows tasks catalog warehouse; do ln -sfn "$REPO/$d" "$WORK/shim/quantgate/$d"; done
export PYTHONPATH="$WORK/shim${PYTHONPATH:+:$PYTHONPATH}"
export HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1 VLLM_NO_USAGE_STATS=1 DO_NOT_TRACK=1 \
    PREFECT_SERVER_ANALYTICS_ENABLED=false PREFECT_HOME="$WORK/prefect" PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
unset PREFECT_API_URL
export QUANTGATE_PIDFILE="$WORK/sessions.pid"
: > "$QUANTGATE_PIDFILE"
trap 'while read -r pid; do [ -n "$pid" ] && kill -KILL -- "-$pid" 2>/dev/null; done < "$QUANTGATE_PIDFILE"' EXIT
python3 -m pytest -m gpu -q -p no:cacheprovider -o addopts="-ra" "${@:-tests}" 2>&1 | tee "$OUT/gpu_tests.txt"
exit "${PIPESTATUS[0]}"

#!/usr/bin/env bash
# The GPU tests (pytest -m gpu) on the device, after the GPU lock is installed (lock_kit.py). From the repository root:
#     bash benchmarks/gpu/run_tests.sh [pytest args]
# Writes $OUT/gpu_tests.txt (default ./gpu-out) besides printing, one line per test as it ends (-v), so a run cut
# short by a call's limit still says which tests passed. Needs pytest-xdist (in the device image).
set -uo pipefail
REPO="$(cd "$(dirname "$0")/../.." && pwd)"
cd "$REPO"
OUT="${OUT:-$REPO/gpu-out}"
WORK="${QG_WORKDIR:-/tmp/quantgate-gpu-tests}"
mkdir -p "$OUT"
. "$REPO/benchmarks/gpu/env.sh"
# QG_TEST_WORKERS_PER_GPU pytest-xdist workers per GPU (those of CUDA_VISIBLE_DEVICES where set, so that parallel.sh
# can give it one), each pinned to a GPU by tests/conftest.py (QUANTGATE_TEST_GPUS, worker i on GPU i mod count).
# The GPU tests check what is stored, not how fast: each engine takes at most 0.3 of the GPU or a KV cache sized
# to its load, so three share an H200 (the suite then takes about a third of its ~25 serial minutes).
GPUS="${CUDA_VISIBLE_DEVICES:-$(nvidia-smi --query-gpu=index --format=csv,noheader | paste -sd, -)}"
WORKERS=$(( $(echo "$GPUS" | tr ',' '\n' | grep -c .) * ${QG_TEST_WORKERS_PER_GPU:-1} ))
export QUANTGATE_TEST_GPUS="$GPUS"
python3 -m pytest -m gpu -v -p no:cacheprovider -o addopts="-ra" -n "$WORKERS" --durations=0 "${@:-tests}" 2>&1 \
    | tee "$OUT/gpu_tests.txt"
exit "${PIPESTATUS[0]}"

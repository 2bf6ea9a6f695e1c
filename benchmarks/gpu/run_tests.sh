#!/usr/bin/env bash
# The GPU tests (pytest -m gpu) on the device, after the devkit is installed. From the repository root:
#     bash benchmarks/gpu/run_tests.sh [pytest args]
# Writes $OUT/gpu_tests.txt (default ./gpu-out) besides printing.
set -uo pipefail
REPO="$(cd "$(dirname "$0")/../.." && pwd)"
cd "$REPO"
OUT="${OUT:-$REPO/gpu-out}"
WORK="${QG_WORKDIR:-/tmp/quantgate-gpu-tests}"
mkdir -p "$OUT"
. "$REPO/benchmarks/gpu/env.sh"
python3 -m pytest -m gpu -q -p no:cacheprovider -o addopts="-ra" "${@:-tests}" 2>&1 | tee "$OUT/gpu_tests.txt"
exit "${PIPESTATUS[0]}"

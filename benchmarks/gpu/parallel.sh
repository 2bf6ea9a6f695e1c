#!/usr/bin/env bash
# One command per GPU, side by side, on a multi-GPU device (kind nvidia-h200-x2): command i runs with
# CUDA_VISIBLE_DEVICES=i and OUT=$OUT/gpu<i>, and its output goes to $OUT/gpu<i>/console.txt.
# The commands must use different work dirs (QG_WORKDIR); each script already defaults to its own.
#     bash benchmarks/gpu/parallel.sh 'QG_PARTS=crosscheck bash benchmarks/gpu/run_suite.sh' \
#                                     'bash benchmarks/gpu/run_real.sh smollm2-135m --scenarios gpu-throughput'
set -uo pipefail
OUT="${OUT:-$PWD/gpu-out}"
pids=()
for i in $(seq 0 $(($# - 1))); do
    cmd="${@:$((i + 1)):1}"
    mkdir -p "$OUT/gpu$i"
    CUDA_VISIBLE_DEVICES="$i" OUT="$OUT/gpu$i" bash -c "$cmd" > "$OUT/gpu$i/console.txt" 2>&1 &
    pids+=("$!")
done
rc=0
for i in "${!pids[@]}"; do
    wait "${pids[$i]}"; code=$?
    echo "gpu$i exit $code: ${@:$((i + 1)):1}"
    [ "$code" -eq 0 ] || rc=$code
done
exit "$rc"

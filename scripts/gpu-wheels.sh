#!/usr/bin/env bash
# Fills .whl/ with what the GPU check (bench/gpu_check.sh) needs on a CUDA machine that has torch
# and transformers but no network: the project's other imports and DeepSpeed (an sdist, built
# there with --no-build-isolation). Python 3.12, x86_64 manylinux; run here, where PyPI is reachable.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
pin() { grep -i "^${1//[-_]/[-_]}==" requirements/lock.txt | head -1; }
mkdir -p .whl
rm -f .whl/*
platforms=()
for n in 28 27 17 5; do platforms+=(--platform "manylinux_2_${n}_x86_64"); done
platforms+=(--platform manylinux2014_x86_64 --platform manylinux1_x86_64)
for pkg in pydantic pydantic_core annotated-types typing-inspection typing-extensions hjson; do
  "$PY" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    "${platforms[@]}" -d .whl "$(pin "$pkg")"
done
"$PY" -m pip download -q --no-deps --no-binary=:all: -d .whl "$(pin deepspeed)"
ls -la .whl
du -sh .whl

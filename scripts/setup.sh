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
# pip byte-compiles one file after another (~90 of its ~190 s here); compileall shares that out
# over the cores (~55 s on 2). Python never writes the bytecode later where PYTHONDONTWRITEBYTECODE
# is set (as on this project's machines), so it is made now. Its status is ignored: a file this
# Python cannot compile (torch ships a 3.12-only one) fails at import, as pip leaves it too.
pip install --no-compile --no-deps -r requirements/lock.txt
.venv/bin/python -m compileall -qq -j 0 "$(.venv/bin/python -c 'import sysconfig; print(sysconfig.get_path("purelib"))')" || true
pip install --no-deps -e .
echo "$want" > "$stamp"

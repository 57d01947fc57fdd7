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
fail() { echo "error: $*" >&2; exit 1; }
"$PY" -c 'import sys; sys.exit(sys.version_info[:2] != (3, 11))' 2>/dev/null ||
  fail "Python 3.11 is needed ($PY is $("$PY" -V 2>&1)): install it (deadsnakes, pyenv, uv python install 3.11) or set PYTHON="
# vLLM's CPU build links libnuma (not in its wheel): without it the generator fails at its first step
"$PY" -c 'import ctypes; ctypes.CDLL("libnuma.so.1")' 2>/dev/null ||
  fail "libnuma.so.1 is missing (vLLM's CPU build needs it): sudo apt-get install libnuma1 (Fedora: numactl-libs)"
echo "setting up .venv (first time: ~2-3 minutes)..." >&2
# A venv whose pip never came (Debian without python3.11-venv) is made again, not reused
.venv/bin/python -m pip --version >/dev/null 2>&1 || { rm -rf .venv && "$PY" -m venv .venv; } ||
  fail "could not make .venv with $PY (Debian/Ubuntu: sudo apt-get install python3.11-venv)"
pip() { .venv/bin/python -m pip --disable-pip-version-check -q "$@"; }
pip install pip==26.3  # pinned as the lock pins the rest (a newer pip may resolve or build differently)
# pip byte-compiles one file after another (~90 of its ~190 s here); compileall shares that out
# over the cores (~55 s on 2). Python never writes the bytecode later where PYTHONDONTWRITEBYTECODE
# is set (as on this project's machines), so it is made now. Its status is ignored: a file this
# Python cannot compile (torch ships a 3.12-only one) fails at import, as pip leaves it too.
# torch's CPU build (torch==...+cpu) is on PyTorch's own index, not PyPI: asked there where the
# machine's own indexes lack it (TORCH_INDEX_URL to use a mirror).
pip install --no-compile --no-deps -r requirements/lock.txt ||
  pip install --no-compile --no-deps --extra-index-url "${TORCH_INDEX_URL:-https://download.pytorch.org/whl/cpu}" \
    -r requirements/lock.txt
.venv/bin/python -m compileall -qq -j 0 "$(.venv/bin/python -c 'import sysconfig; print(sysconfig.get_path("purelib"))')" || true
pip install --no-deps -e .
echo "$want" > "$stamp"

#!/usr/bin/env bash
# Creates .venv with everything the project, its services and its tests need, at the exact
# versions of requirements/lock.txt (no resolution: a fresh machine next month gets the same
# set). Idempotent: re-runs only when the requirement files change. scripts/lock.sh refreshes
# the lock from the loose requirements.
set -euo pipefail
cd "$(dirname "$0")/.."

# The monitoring tests run the real Prometheus and promtool (Debian's `prometheus` package; no
# registry this project reaches ships them otherwise). Installed here when missing; where that
# cannot be done (no root, no apt-get) setup fails with what to run, rather than the tests later.
if ! command -v prometheus >/dev/null || ! command -v promtool >/dev/null; then
  echo "installing prometheus and promtool (Debian's prometheus package)..." >&2
  sudo=""
  [ "$(id -u)" -eq 0 ] || sudo="sudo -n"
  if ! command -v apt-get >/dev/null || ! { $sudo apt-get update -qq && DEBIAN_FRONTEND=noninteractive \
      $sudo apt-get install -y -qq --no-install-recommends prometheus >/dev/null; }; then
    echo "error: could not install Prometheus; the monitoring tests need prometheus and promtool on PATH" >&2
    echo "       (Debian/Ubuntu: sudo apt-get install prometheus)" >&2
    exit 1
  fi
fi
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

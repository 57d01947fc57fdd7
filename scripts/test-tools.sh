#!/usr/bin/env bash
# What the tests need beyond .venv (scripts/setup.sh): the real Prometheus and promtool, for the
# alerting-rule and dashboard tests (Debian's `prometheus` package; no registry this project
# reaches ships them otherwise). Installed when missing; where that cannot be done (no root, no
# apt-get) it fails with what to run, rather than the tests later. `make run` does not need them.
set -euo pipefail
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

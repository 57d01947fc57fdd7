#!/usr/bin/env bash
# `make images`: the operator image and the CPU services image, built with buildah (no daemon)
# on a base made from Debian's packages (scripts/base-image.sh), tagged localhost/...:$TAG. The
# GPU Dockerfile's base (vLLM's CUDA image) is a registry pull, so it is checked as far as it can
# be without it: its steps' package pins resolve (the Dockerfiles' parse: tests/containers).
# To push: `buildah push localhost/pipelinerl-services:$TAG docker://REGISTRY/...`, then point
# the chart at it (services.image.repository/tag; operator.image.repository/tag).
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/container-tools.sh
export BASE=${BASE:-localhost/pipelinerl-base:bookworm}
TAG=${TAG:-dev}
scripts/base-image.sh
# This machine's way to the package index, for the builds' RUN steps only (mounted read-only,
# never stored in a layer): its CA bundle (a TLS-intercepting proxy's CA, if any) and its pip
# configuration with the local folders that names (a mirror, a wheel folder).
mounts=()
user_conf=$(ls "$HOME/.config/pip/pip.conf" "$HOME/.pip/pip.conf" 2>/dev/null | head -1 || true)
[ -n "$user_conf" ] && mounts+=(-v "$user_conf:/root/.config/pip/pip.conf:ro")
for f in /etc/ssl/certs/ca-certificates.crt /etc/pip.conf; do [ -f "$f" ] && mounts+=(-v "$f:$f:ro"); done
for d in $(cat /etc/pip.conf $user_conf 2>/dev/null | grep -oE '(file://)?/[^ ]+' | sed -e 's#^file://##' -e 's#/simple/*$##' | sort -u); do  # a mirror's root: its pages link to files beside simple/
  [ -d "$d" ] && mounts+=(-v "$d:$d:ro")
done
# Where this machine's pip is configured, torch's CPU build comes the way scripts/setup.sh gets it.
torch_index=()
[ -n "$user_conf" ] || [ -f /etc/pip.conf ] && torch_index=(--build-arg TORCH_INDEX=)
build() {  # --layers: an unchanged step (the locked packages) is reused by the next build
  echo "building $2..." >&2
  buildah bud --quiet --layers "${mounts[@]}" "${torch_index[@]}" --build-arg BASE="$BASE" -f "$1" -t "$2" . >/dev/null
}
build docker/operator.Dockerfile "localhost/pipelinerl-operator:$TAG"
build docker/services-cpu.Dockerfile "localhost/pipelinerl-services:$TAG"
# The GPU image's pins, less those its base brings (the same filter its Dockerfile applies).
filter=$(sed -n 's/.*grep -v -E \x27\([^\x27]*\)\x27.*/\1/p' docker/services-gpu.Dockerfile)
[ -n "$filter" ] || { echo "error: docker/services-gpu.Dockerfile: no package filter found" >&2; exit 1; }
grep -v -E "$filter" requirements/lock.txt | grep -v '^#' > "${TMPDIR:-/tmp}/pipelinerl-lock-gpu.txt"
.venv/bin/python -m pip --disable-pip-version-check -q install --dry-run --no-deps --ignore-installed \
  -r "${TMPDIR:-/tmp}/pipelinerl-lock-gpu.txt"
echo "images: localhost/pipelinerl-operator:$TAG localhost/pipelinerl-services:$TAG (GPU Dockerfile's pins resolve)" >&2

#!/usr/bin/env bash
# What `make images` and the rendered-pods test need beyond .venv: buildah (builds without a
# daemon), podman with runc (Debian's crun refuses hybrid cgroups), and debootstrap (the base
# image from Debian's packages: no registry needed). Installed with apt-get when missing.
set -euo pipefail
missing=""
for tool in buildah podman runc debootstrap; do command -v "$tool" >/dev/null || missing="$missing $tool"; done
[ -z "$missing" ] && exit 0
echo "installing$missing (Debian's packages)..." >&2
sudo=""
[ "$(id -u)" -eq 0 ] || sudo="sudo -n"
if ! command -v apt-get >/dev/null || ! { $sudo apt-get update -qq && DEBIAN_FRONTEND=noninteractive \
    $sudo apt-get install -y -qq buildah podman runc debootstrap >/dev/null; }; then
  echo "error: could not install$missing; building and running the images needs them" >&2
  echo "       (Debian/Ubuntu: sudo apt-get install buildah podman runc debootstrap)" >&2
  exit 1
fi

#!/usr/bin/env bash
# A base image made from Debian's packages alone, for machines that reach Debian's archive but
# no container registry: Debian 12's minimal system with its Python 3.11 (the version the lock
# is made for), venv and headers (DeepSpeed and inductor compile against them at first use).
# The images' Dockerfiles take it as `--build-arg BASE=...`; their published default is
# python:3.11-slim, the same Debian release. Skips the work when the image already exists.
set -euo pipefail
BASE=${BASE:-localhost/pipelinerl-base:bookworm}
MIRROR=${DEBIAN_MIRROR:-http://deb.debian.org/debian}
if podman image exists "$BASE"; then exit 0; fi
root=$(mktemp -d -p "${TMPDIR:-/var/tmp}" pipelinerl-rootfs-XXXXXX)
trap 'rm -rf "$root"' EXIT
echo "building $BASE from Debian's packages (debootstrap, ~3-5 minutes)..." >&2
debootstrap --variant=minbase --include=python3,python3-venv,python3-dev,ca-certificates \
  bookworm "$root" "$MIRROR" >"$root.log" 2>&1 || { tail -20 "$root.log" >&2; exit 1; }
rm -f "$root.log"
chroot "$root" apt-get clean
rm -rf "$root"/var/lib/apt/lists/* "$root"/var/cache/apt/*.bin
tar -C "$root" -c . | podman import --change 'CMD ["/bin/bash"]' - "$BASE" >/dev/null
echo "built $BASE" >&2

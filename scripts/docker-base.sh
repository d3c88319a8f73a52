#!/usr/bin/env bash
# Makes a Debian bookworm base image for the Dockerfile from Debian's own packages, for hosts
# that reach Debian's mirror but not Docker Hub:
#
#   bash scripts/docker-base.sh                      # quanta-base:bookworm, once
#   docker build --build-arg BASE=quanta-base:bookworm -t quanta .
#
# The image holds what the official python:3.11-slim-bookworm image gives the Dockerfile:
# Python 3.11 with a shared libpython (Triton's Python stub loads it), venv and CA
# certificates, plus the host's own CAs (/usr/local/share/ca-certificates), so a build behind a
# TLS-inspecting proxy reaches the package index. Idempotent: an existing image is kept
# (QUANTA_BASE_REBUILD=1 makes it again). Needs root, debootstrap and a running dockerd.
# QUANTA_DEBIAN_MIRROR picks the mirror (default: deb.debian.org).
set -euo pipefail
image=${1:-quanta-base:bookworm}
mirror=${QUANTA_DEBIAN_MIRROR:-http://deb.debian.org/debian}
if [ "${QUANTA_BASE_REBUILD:-0}" != 1 ] && docker image inspect "$image" >/dev/null 2>&1; then
    echo "$image exists"
    exit 0
fi
if [ "$(id -u)" != 0 ]; then
    echo "debootstrap needs root" >&2
    exit 1
fi
command -v debootstrap >/dev/null || {
    echo "no debootstrap: apt-get install debootstrap" >&2
    exit 1
}
root=$(mktemp -d /tmp/quanta-base.XXXXXX)
trap 'rm -rf "$root"' EXIT
debootstrap --variant=minbase \
    --include=python3,python3-venv,libpython3.11,ca-certificates \
    bookworm "$root" "$mirror"
# The suites the official image has, so `apt-get install` in a build gets the same updates.
cat >"$root/etc/apt/sources.list" <<EOF
deb $mirror bookworm main
deb $mirror bookworm-updates main
deb ${mirror%/debian}/debian-security bookworm-security main
EOF
if compgen -G "/usr/local/share/ca-certificates/*.crt" >/dev/null; then
    cp /usr/local/share/ca-certificates/*.crt "$root/usr/local/share/ca-certificates/"
    chroot "$root" update-ca-certificates >/dev/null
fi
# What the build does not need: the package cache and lists (a build runs apt-get update).
rm -rf "$root"/var/cache/apt/archives/*.deb "$root"/var/lib/apt/lists/* "$root"/tmp/*
# pip verifies with its own bundle unless told: the system's holds the host's CAs.
tar -C "$root" -c . | docker import \
    --change 'ENV LANG=C.UTF-8' \
    --change 'ENV PIP_CERT=/etc/ssl/certs/ca-certificates.crt' \
    --change 'CMD ["python3"]' \
    - "$image" >/dev/null
echo "$image built"

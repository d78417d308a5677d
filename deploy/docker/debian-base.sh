#!/bin/sh
# Build the Dockerfile's base image from Debian packages and tag it with the public name the Dockerfile uses, for a
# machine that reaches Debian's archive but no image registry (root, debootstrap, a running dockerd; ~3 min).
#   sh deploy/docker/debian-base.sh [TAG] [MIRROR]
set -eu
tag=${1:-python:3.11-slim-bookworm}
mirror=${2:-http://deb.debian.org/debian}
root=$(mktemp -d)
trap 'rm -rf "$root"' EXIT
debootstrap --variant=minbase --include=python3,python3-venv,python-is-python3,ca-certificates,passwd \
  bookworm "$root" "$mirror"
chroot "$root" apt-get clean
rm -rf "$root"/var/lib/apt/lists/* "$root"/var/cache/apt/*.bin
tar -C "$root" -c . | docker import -c 'ENV LANG=C.UTF-8' -c 'CMD ["python3"]' - "$tag"

#!/bin/sh
# The base image deploy/Dockerfile builds on where no registry can be pulled from: Debian bookworm's own
# packages (debootstrap, minbase + python3, python3-venv and CA certificates), imported as one layer.
#
#   deploy/debian-base.sh [IMAGE]    # default skrull-base:bookworm; does nothing when IMAGE exists
#
# Needs root, debootstrap and a running Docker engine; takes about a minute.
set -eu
image=${1:-skrull-base:bookworm}
docker=${DOCKER:-docker}
if "$docker" image inspect "$image" >/dev/null 2>&1; then
    exit 0
fi
root=$(mktemp -d)
trap 'rm -rf "$root"' EXIT
debootstrap --variant=minbase --include=python3,python3-venv,ca-certificates bookworm "$root"
# Package lists and downloaded .debs are only needed to install packages, which the images never do.
rm -rf "$root"/var/lib/apt/lists/* "$root"/var/cache/apt/archives/*.deb
tar -C "$root" -c . | "$docker" import - "$image"

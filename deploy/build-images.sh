#!/bin/sh
# `make images`: both targets of deploy/Dockerfile, on a base made from Debian's packages (no registry can be
# pulled from here), with this machine's CA bundle as the build secret pip needs to reach the index.
#
#   BASE_IMAGE   base to build on (default skrull-base:bookworm, made by deploy/debian-base.sh when absent;
#                any python:3.1x-slim works where a registry is reachable)
#   PIP_CA       CA bundle passed as the secret `pip_ca` (default /etc/ssl/certs/ca-certificates.crt)
#   DOCKER       the Docker client (default: Debian's /usr/bin/docker when present — BuildKit through the
#                daemon's builder, no buildx plugin needed — else `docker` on PATH)
#
# The trainer's torch is the CPU wheel this machine's pip resolves for torch==2.13.0, copied into deploy/wheels/
# (git-ignored); see deploy/Dockerfile.
set -eu
cd "$(dirname "$0")/.."
base=${BASE_IMAGE:-skrull-base:bookworm}
ca=${PIP_CA:-/etc/ssl/certs/ca-certificates.crt}
if [ -z "${DOCKER:-}" ]; then
    if [ -x /usr/bin/docker ]; then DOCKER=/usr/bin/docker; else DOCKER=docker; fi
fi
export DOCKER DOCKER_BUILDKIT=1
python=${PYTHON:-python3}

case "$base" in
    skrull-base:*) deploy/debian-base.sh "$base" ;;
esac
if ! ls deploy/wheels/torch-*.whl >/dev/null 2>&1; then
    "$python" -m pip download --quiet --no-deps --only-binary=:all: --dest deploy/wheels torch==2.13.0
fi
for target in scheduler trainer; do
    start=$(date +%s)
    "$DOCKER" build --progress=plain -f deploy/Dockerfile --target "$target" --build-arg "PYTHON_IMAGE=$base" \
        --secret "id=pip_ca,src=$ca" -t "skrull-$target:0.1.0" .
    echo "built skrull-$target:0.1.0 on $base in $(( $(date +%s) - start )) s"
done
"$DOCKER" image ls --format '{{.Repository}}:{{.Tag}} {{.Size}}' | grep -E '^skrull-(scheduler|trainer|base):'

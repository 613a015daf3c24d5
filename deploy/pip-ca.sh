#!/bin/sh
# pip inside an image build, trusting the build secret `pip_ca` as its CA bundle when the build was given one
# (deploy/Dockerfile). The secret is mounted only for the RUN that calls this; nothing of it stays in a layer.
set -eu
if [ -f /run/secrets/pip_ca ]; then
    export PIP_CERT=/run/secrets/pip_ca
fi
exec /opt/venv/bin/pip --no-cache-dir --disable-pip-version-check "$@"

#!/usr/bin/env bash
# Create .venv with the package, the client and a tritonserver (nvidia-pytriton wheel: server binary,
# Python backend and its stubs). The wheel's own Python deps are for pytriton's Python API, which we
# do not use, hence --no-deps. Usage: bash ci/install.sh [extra], e.g. "test".
set -euo pipefail
cd "$(dirname "$0")/.."
python3 -m venv .venv
. .venv/bin/activate
pip install -q --upgrade pip
# --no-compile: Python compiles what is imported when it is imported; compiling every file of torch and the rest up
# front took 37 of the install's 85 s on the 2-CPU machine
pip install -q --no-compile torch==2.13.0  # CPU build from local disk on the dev/CI machines
pip install -q --no-compile -e ".[client${1:+,$1}]"
pip install -q --no-compile --no-deps nvidia-pytriton==0.7.0
if [ "${1:-}" = test ]; then
    # the official Moondream client, the gateway tests' caller: its metadata pulls in Kestrel, which its HTTP client
    # never imports, so without its dependencies (Pillow, the one it uses, comes with the test extra)
    pip install -q --no-compile --no-deps moondream==2.6.1
    bash ci/docker.sh  # the container tests' Docker engine
    bash ci/packages.sh  # PostgreSQL, Prometheus, Chromium: the batch, dashboard and playground tests
fi

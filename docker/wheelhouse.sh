#!/usr/bin/env bash
# Fill dist/ with this package's wheel and every wheel it and its client and gateway extras need, so that images and
# containers install with no index: `docker build --build-arg PIP_INSTALL_OPTIONS=--no-index` (README, "Deploying")
# and the stand-in base's `pip install /wheels/kestrel_triton-*.whl` with dist/ mounted at /wheels. TORCH picks the
# torch build: by default torch==2.13.0, which pip finds on our machines as the CPU build for Python 3.11 (Debian 12's
# python3, the stand-in base's); wheels are for the Python running this script.
set -euo pipefail
cd "$(dirname "$0")/.."
python3 -m pip wheel -q --wheel-dir dist "${TORCH:-torch==2.13.0}" ".[client,gateway]" setuptools

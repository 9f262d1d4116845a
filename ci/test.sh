#!/usr/bin/env bash
# Install everything the tests need into .venv (fresh machine or not) and run them.
set -euo pipefail
cd "$(dirname "$0")/.."
bash ci/install.sh test
. .venv/bin/activate
python -m pytest -q "$@"

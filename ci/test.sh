#!/usr/bin/env bash
# Install everything the tests need into .venv (fresh machine or not) and run them.
set -euo pipefail
cd "$(dirname "$0")/.."
python3 -m venv .venv
. .venv/bin/activate
pip install -q --upgrade pip
pip install -q torch==2.13.0  # CPU build from local disk on the dev/CI machines
pip install -q -e '.[test]'
python -m pytest -q "$@"

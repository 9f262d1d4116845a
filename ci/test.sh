#!/usr/bin/env bash
# Install everything the tests need into .venv (fresh machine or not) and run them.
set -euo pipefail
cd "$(dirname "$0")/.."
bash ci/install.sh test
. .venv/bin/activate
# PYTEST_WORKERS=N: N pytest-xdist workers (order-dependent modules share an xdist_group). Off by default: on CI's
# 2 CPUs two workers took 16:52 of pytest, the CPU-bound kernel compile test alone 660 s of it against its others
python -m pytest -q -n "${PYTEST_WORKERS:-0}" --dist loadgroup --durations=10 "$@"

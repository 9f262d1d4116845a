#!/usr/bin/env bash
# Install everything the tests need into .venv (fresh machine or not) and run them.
set -euo pipefail
cd "$(dirname "$0")/.."
bash ci/install.sh test
. .venv/bin/activate
# two pytest-xdist workers (PYTEST_WORKERS=0: one process); order-dependent modules share an xdist_group. On a clean
# clone of this 2-CPU machine: 18:50 in all with two workers against 20:12 without (the CPU-bound kernel compile test
# takes 7 to 11 minutes either way)
python -m pytest -q -n "${PYTEST_WORKERS:-2}" --dist loadgroup --durations=10 "$@"

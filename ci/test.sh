#!/usr/bin/env bash
# Install everything the tests need into .venv (fresh machine or not) and run them.
set -euo pipefail
cd "$(dirname "$0")/.."
bash ci/install.sh test
. .venv/bin/activate
# two workers (pytest-xdist; CI has 2 CPUs): most tests wait on real servers or on Triton's compiler as much as on
# the CPU; order-dependent modules share an xdist_group and run in order on one worker
python -m pytest -q -n "${PYTEST_WORKERS:-2}" --dist loadgroup --durations=10 "$@"

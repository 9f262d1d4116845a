#!/usr/bin/env bash
# Install everything the tests need into .venv (fresh machine or not) and run them.
set -euo pipefail
cd "$(dirname "$0")/.."
bash ci/install.sh test
. .venv/bin/activate
# two pytest-xdist workers (PYTEST_WORKERS=0: one process); order-dependent modules share an xdist_group. On a clean
# clone of a 2-CPU development machine, with a cold Triton cache: 16:00 to 16:32 in all, pytest 14:29 to 14:50 (the
# CPU-bound kernel compile test 9.4 to 10.5 minutes of it); CI's machine ran the suite about twice as fast
python -m pytest -q -n "${PYTEST_WORKERS:-2}" --dist loadgroup --durations=10 "$@"

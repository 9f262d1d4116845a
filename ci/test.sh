#!/usr/bin/env bash
# Install everything the tests need into .venv (fresh machine or not) and run them.
set -euo pipefail
cd "$(dirname "$0")/.."
bash ci/install.sh test
. .venv/bin/activate
# two pytest-xdist workers (PYTEST_WORKERS=0: one process); order-dependent modules share an xdist_group. On a clean
# clone of a 2-CPU development machine, with a cold Triton cache: 10:38 to 11:03 in all, pytest 8:58 to 9:13 (the
# compile test 37 s with its variants recorded; 16:34 when it compiled them all); CI took 701 s for that tree
python -m pytest -q -n "${PYTEST_WORKERS:-2}" --dist loadgroup --durations=10 "$@"

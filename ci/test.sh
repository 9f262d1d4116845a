#!/usr/bin/env bash
# Install everything the tests need into .venv (fresh machine or not) and run them.
set -euo pipefail
cd "$(dirname "$0")/.."
bash ci/install.sh test
. .venv/bin/activate
# three pytest-xdist workers on CI's two CPUs (PYTEST_WORKERS=0: one process): many tests wait on servers, containers
# or a browser, and a third worker fills those waits (pytest 6:09 against 6:46-6:50 with two, 6:12 with four, in a
# clean clone of a 2-CPU development machine with the base image present, 2026-11-29); order-dependent modules share
# an xdist_group. With its images and the pip cache removed, 9:57 (an earlier tree and two workers, pytest 9:18: the
# stand-in base and the image built in it)
python -m pytest -q -n "${PYTEST_WORKERS:-3}" --dist loadgroup --durations=10 "$@"

#!/usr/bin/env bash
# Install everything the tests need into .venv (fresh machine or not) and run them.
set -euo pipefail
cd "$(dirname "$0")/.."
bash ci/install.sh test
. .venv/bin/activate
# two pytest-xdist workers (PYTEST_WORKERS=0: one process); order-dependent modules share an xdist_group. On a clean
# clone of a 2-CPU development machine with the base image present (Docker, PostgreSQL, Prometheus and Chromium
# installed), nothing else running: 7:07 to 8:02 in all in five runs of 364 tests on 2026-11-29 (pytest 6:32 to
# 7:29; three workers, once: 8:04, pytest 7:29); with its images and the pip cache removed, 9:57 (an earlier tree,
# pytest 9:18: the stand-in base and the image built in it)
python -m pytest -q -n "${PYTEST_WORKERS:-2}" --dist loadgroup --durations=10 "$@"

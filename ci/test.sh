#!/usr/bin/env bash
# Install everything the tests need into .venv (fresh machine or not) and run them.
set -euo pipefail
cd "$(dirname "$0")/.."
bash ci/install.sh test
. .venv/bin/activate
# two pytest-xdist workers (PYTEST_WORKERS=0: one process); order-dependent modules share an xdist_group. On a clean
# clone of a 2-CPU development machine (2026-11-29, after the Batch API, the dashboard, the playground and gaze;
# Docker, PostgreSQL, Prometheus and Chromium installed): its images and the pip cache removed, 9:57 in all, pytest
# 9:18 (the stand-in base and the image built in it); with the base image present 8:00 to 9:11 in three runs,
# pytest 7:26 to 8:25 (over the container issue's 8 minutes: the new modules' tests and servers)
python -m pytest -q -n "${PYTEST_WORKERS:-2}" --dist loadgroup --durations=10 "$@"

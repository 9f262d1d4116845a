#!/usr/bin/env bash
# A Docker engine for the container tests: Debian's docker.io, docker-compose and debootstrap (the stand-in base
# image's maker) where missing, and dockerd started where none answers. As root (as CI runs); elsewhere it says what
# is missing and leaves the machine alone (the container tests then skip, or fail where CI=true).
set -euo pipefail
if [ "$(id -u)" != 0 ]; then
    docker info >/dev/null 2>&1 || echo "ci/docker.sh: not root, no Docker engine answers: container tests will skip" >&2
    exit 0
fi
missing=()
command -v dockerd >/dev/null || missing+=(docker.io)
command -v docker-compose >/dev/null || missing+=(docker-compose)
command -v debootstrap >/dev/null || missing+=(debootstrap)
if [ ${#missing[@]} -gt 0 ]; then
    apt-get update -qq
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "${missing[@]}" >/dev/null
fi
if ! docker info >/dev/null 2>&1; then
    nohup dockerd >/var/log/dockerd.log 2>&1 &
    for _ in $(seq 60); do docker info >/dev/null 2>&1 && break; sleep 0.5; done
    docker info >/dev/null 2>&1 || { tail -20 /var/log/dockerd.log >&2; exit 1; }
fi

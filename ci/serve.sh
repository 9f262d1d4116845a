#!/usr/bin/env bash
# Install and start tritonserver with model_repository/ on ports 8000 (HTTP), 8001 (gRPC), 8002 (metrics).
# With no KESTREL_MODEL / KESTREL_MODEL_PATH set, it serves the tiny random-weight test checkpoint.
set -euo pipefail
cd "$(dirname "$0")/.."
bash ci/install.sh
. .venv/bin/activate
exec python -m kestrel_backend.server.local_server "$@"

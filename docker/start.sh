#!/usr/bin/env bash
# Start tritonserver on the model repository; picks the GPU when one is visible, else the CPU.
set -euo pipefail
if [ -z "${KESTREL_DEVICE:-}" ]; then
  if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then
    export KESTREL_DEVICE=cuda
  else
    export KESTREL_DEVICE=cpu
  fi
fi
echo "kestrel: KESTREL_DEVICE=${KESTREL_DEVICE}" >&2
exec tritonserver --model-repository="${MODEL_REPOSITORY:-/models}" "$@"

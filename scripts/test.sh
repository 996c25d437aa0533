#!/usr/bin/env bash
# Set up (idempotent) and run the whole CPU test suite with the environment CI uses.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
export OMP_NUM_THREADS=1 TRITON_INTERPRET=1 HF_HUB_OFFLINE=1 RAY_AUTH_MODE=disabled TOKENIZERS_PARALLELISM=false
# Nothing in the environment may be a CUDA wheel: the pins keep torch on its CPU build.
.venv/bin/python -m pip list 2>/dev/null | grep -iE '^(torch|triton|transformers|grpcio|protobuf|ray) '
exec .venv/bin/python -m pytest "$@"

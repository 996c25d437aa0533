#!/usr/bin/env bash
# Set up (idempotent) and run the whole CPU test suite with the environment CI uses.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
export OMP_NUM_THREADS=1 TRITON_INTERPRET=1 HF_HUB_OFFLINE=1 RAY_AUTH_MODE=disabled TOKENIZERS_PARALLELISM=false
# Python's stacks on a crash, also after pytest's own handler is off (at the interpreter's exit)
export PYTHONFAULTHANDLER=1
# Nothing in the environment may be a CUDA wheel: the pins keep torch on its CPU build.
.venv/bin/python -m pip list 2>/dev/null | grep -iE '^(torch|triton|transformers|grpcio|protobuf|ray) '
if [ $# -eq 0 ]; then
  # tests/orchestrator/test_coordinator.py is the one module that runs a Ray driver inside pytest.
  # Ray's own gRPC and absl stay loaded after it, and later gRPC tests in the same process have
  # aborted now and then (an absl mutex check, after that module only): it gets a process of its own.
  .venv/bin/python -m pytest --ignore=tests/orchestrator/test_coordinator.py
  exec .venv/bin/python -m pytest tests/orchestrator/test_coordinator.py
fi
exec .venv/bin/python -m pytest "$@"

#!/usr/bin/env bash
# Create .venv and install treeserve with its pinned dependencies (CPU torch, no CUDA wheels).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
[ -x .venv/bin/python ] || "$PY" -m venv .venv
# Debian's docker-compose validates docker-compose.yml in the tests (no Docker engine needed).
if ! command -v docker-compose >/dev/null 2>&1 && [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
  (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq docker-compose >/dev/null) \
    || echo "setup: docker-compose not installed; its test will be skipped" >&2
fi
# torch first and alone, so that nothing resolves an unpinned torch from the registry.
.venv/bin/python -m pip show torch 2>/dev/null | grep -q "^Version: 2.13.0" || .venv/bin/python -m pip install -q "torch==2.13.0"
.venv/bin/python -m pip install -q -e ".[test,bench]"
if .venv/bin/python -m pip list 2>/dev/null | grep -qiE '^nvidia-|^cuda-'; then
  echo "setup: CUDA wheels were installed; the pins are broken" >&2
  exit 1
fi

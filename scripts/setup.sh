#!/usr/bin/env bash
# Idempotent set-up: a virtual environment in .venv with Quanta and its test tools.
# torch is pinned to the CPU build (2.13.0) in pyproject.toml; on a GPU host install the CUDA
# build of the same version first and pip keeps it.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3.11}
command -v "$PYTHON" >/dev/null 2>&1 || PYTHON=python3
if [ ! -x .venv/bin/python ]; then
    "$PYTHON" -m venv .venv
fi
stamp=.venv/.quanta-installed
if [ ! -f "$stamp" ] || [ pyproject.toml -nt "$stamp" ]; then
    .venv/bin/python -m pip install -q --upgrade pip
    .venv/bin/python -m pip install -q -e '.[test]'
    touch "$stamp"
fi

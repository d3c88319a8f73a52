#!/usr/bin/env bash
# Sets up (idempotently) and runs the whole test suite plus the linter.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
.venv/bin/ruff check .
.venv/bin/python -m pytest -q "$@"

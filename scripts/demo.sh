#!/usr/bin/env bash
# Sets up (idempotently), then brings the real Triton server up on the tiny default model
# (built on first use in engines/opt-tiny), streams one request and shuts the server down.
# Pass "serve" to keep serving instead: bash scripts/demo.sh serve
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
if [ "${1:-}" = "serve" ]; then
    exec .venv/bin/quanta serve
fi
exec .venv/bin/quanta serve --demo "Hello, Quanta! Tell me a story:"

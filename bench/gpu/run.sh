#!/usr/bin/env bash
# The prepared GPU run (bench/gpu/README.md): on a fresh GPU machine with no network, in about
# 8 minutes, install Quanta beside the machine's own torch, run the GPU tests, then time Quanta,
# HF continuous batching and HF generate on LLaMA-3.2-1B, LLaMA-3-8B and OPT-13B shapes against
# the card's measured bandwidth and GEMM rate, printing one report and writing it as JSON.
#
#   bench/gpu/run.sh --output out/gpu.json                 # on the GPU machine
#   bench/gpu/run.sh --device cpu --presets llama-tiny ... # the smoke test, in seconds
#
# Arguments go to `quanta bench gpu` (its --help lists them). Env: PYTHON (default python3),
# QUANTA_GPU_RUN_S (the whole run's seconds, default 480: the timings get what the install
# and the tests leave), QUANTA_GPU_TEST_S (the tests' limit, default 180).
set -euo pipefail
cd "$(dirname "$0")/../.."
PY="${PYTHON:-python3}"
TOTAL="${QUANTA_GPU_RUN_S:-480}"
WHEELS=bench/gpu/wheels
export HF_HUB_OFFLINE=1  # no network: a hub lookup would only wait for a timeout

if ! "$PY" -c "import quanta, pydantic" 2>/dev/null; then
    # A fresh machine: the wheels it lacks (fetched beforehand by fetch_wheels.sh), each
    # only where what is installed does not already satisfy it, then the project itself
    # without its dependencies, so the machine's torch stays.
    echo "== install ($(date -u +%H:%M:%S))"
    if [[ -d "$WHEELS" ]]; then
        "$PY" -m pip install -q --no-index --find-links "$WHEELS" \
            $(grep -v '^\s*#' bench/gpu/wheels.txt | sed 's/==.*//')
    fi
    "$PY" -m pip install -q --no-index --no-deps --no-build-isolation --ignore-requires-python .
fi

tests="not run: no CUDA device"
if "$PY" -c "import torch, sys; sys.exit(not torch.cuda.is_available())"; then
    echo "== tests/runner/test_cuda.py ($(date -u +%H:%M:%S))"
    log="$(mktemp)"
    timeout "${QUANTA_GPU_TEST_S:-180}" "$PY" -m pytest -q -p no:xdist -p no:cacheprovider \
        -m gpu tests/runner/test_cuda.py 2>&1 | tee "$log" || true
    tests="$(grep -E '(passed|failed|error)' "$log" | tail -1)"
    tests="${tests:-stopped after ${QUANTA_GPU_TEST_S:-180} s}"
fi

# What is left for the timings, less a margin for the last engine's unloading.
budget=$(( TOTAL - SECONDS - 40 ))
(( budget < 30 )) && budget=30
echo "== quanta bench gpu, ${budget} s for the timings ($(date -u +%H:%M:%S))"
exec "$PY" -m quanta.cli bench gpu --budget-s "$budget" --tests "$tests" "$@"

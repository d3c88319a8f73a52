#!/usr/bin/env bash
# Sets up (idempotently), runs the linter, then the fast tier of the test suite: every test
# not marked live (a running tritonserver), engine (a real forward pass or HF transformers) or
# slow (opt-125m, Locust, packaging, supervision). `--all` runs the whole suite, as CI does.
# Other arguments go to pytest (`bash scripts/test.sh tests/test_sim.py -k repro`).
set -euo pipefail
cd "$(dirname "$0")/.."
tier=(-m "not live and not engine and not slow")
args=()
for arg in "$@"; do
    if [ "$arg" = "--all" ]; then
        tier=()
    else
        args+=("$arg")
    fi
done
bash scripts/setup.sh
.venv/bin/ruff check .
# --durations: a slow test that lands in the fast tier shows at the top of this list.
status=0
.venv/bin/python -m pytest -q --durations=25 ${tier[@]+"${tier[@]}"} ${args[@]+"${args[@]}"} || status=$?
# 5: no test was selected (a -k or a path outside the tier), which is not a failure
if [ "$status" -eq 5 ]; then
    status=0
fi
exit "$status"

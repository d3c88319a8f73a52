#!/usr/bin/env bash
# Sets up (idempotently), runs the linter, then the fast tier of the test suite: every test
# not marked live (a running tritonserver), engine (a real forward pass or HF transformers) or
# slow (opt-125m, Locust, packaging, supervision) or docker (the container image). `--all`
# runs the whole suite, as CI does.
# Other arguments go to pytest (`bash scripts/test.sh tests/sim/test_sim.py -k repro`).
#
# A whole tier runs on QUANTA_TEST_WORKERS pytest-xdist workers (default 3 on the 2-core CI
# machine; 0 runs in this process): most live and engine tests wait on servers and
# subprocesses, and with two workers the CPU still sat idle a quarter of the time; a third
# took the whole suite from 12:38 to 9:41 here. Each module is one
# unit of work and the modules on the shared server one more (tests/conftest.py). A run that
# picks tests (a path, a node id or -k) runs in this process, with no workers to start.
set -euo pipefail
cd "$(dirname "$0")/.."
tier=(-m "not live and not engine and not slow and not docker")
args=()
workers=${QUANTA_TEST_WORKERS:-3}
for arg in "$@"; do
    if [ "$arg" = "--all" ]; then
        tier=()
    else
        args+=("$arg")
        case "$arg" in
            -k* | *::* | -n* | --numprocesses*) workers=0 ;;
            -*) ;;
            *) [ -e "$arg" ] && workers=0 ;;
        esac
    fi
done
parallel=()
if [ "$workers" -gt 1 ]; then
    # one module a unit of work, the shared server's modules one more (tests/conftest.py)
    parallel=(-n "$workers" --dist loadscope --no-loadscope-reorder)
fi
bash scripts/setup.sh
.venv/bin/ruff check .
# --durations: a slow test that lands in the fast tier shows at the top of this list.
status=0
.venv/bin/python -m pytest -q --durations=25 ${parallel[@]+"${parallel[@]}"} \
    ${tier[@]+"${tier[@]}"} ${args[@]+"${args[@]}"} || status=$?
# 5: no test was selected (a -k or a path outside the tier), which is not a failure
if [ "$status" -eq 5 ]; then
    status=0
fi
exit "$status"

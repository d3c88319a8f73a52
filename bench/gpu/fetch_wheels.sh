#!/usr/bin/env bash
# Download the wheels of bench/gpu/wheels.txt for a GPU machine with no network: CPython 3.12
# on x86-64 Linux (the lent machines' python3), into bench/gpu/wheels/ (git-ignored), where
# run.sh installs them from. Run it where pip reaches PyPI, before the GPU run.
#
#   bench/gpu/fetch_wheels.sh            # PYTHON (default python3) runs pip; PY_VERSION=3.12
set -euo pipefail
HERE="$(cd "$(dirname "$0")" && pwd)"
PY="${PYTHON:-python3}"
mkdir -p "$HERE/wheels"
platforms=()
for n in 17 24 27 28 31 34 35; do platforms+=(--platform "manylinux_2_${n}_x86_64"); done
grep -v '^\s*#' "$HERE/wheels.txt" | grep -v '^\s*$' | while read -r req; do
    "$PY" -m pip download -q --no-deps --only-binary=:all: --implementation cp \
        --python-version "${PY_VERSION:-3.12}" "${platforms[@]}" \
        --platform manylinux2014_x86_64 -d "$HERE/wheels" "$req"
done
du -ch "$HERE"/wheels/*.whl | tail -1

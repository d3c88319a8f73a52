# Quanta: `quanta serve` (Triton + the quanta backend + the OpenAI gateway) in one image.
#
#   docker build -t quanta .                                   # CPU image (torch's CPU wheel)
#   docker run --rm -p 9000:9000 quanta                        # the tiny default model
#   docker run --rm -v $PWD/engines:/opt/quanta/engines -p 9000:9000 quanta \
#       engines/my-model --policy sj-mlfq --openai-port 9000   # an engine built on the host
#
# Only the OpenAI gateway (9000) leaves the container: Triton's HTTP, gRPC and metrics ports
# (8000-8002) bind the container's loopback (`quanta serve --triton-host`, default 127.0.0.1),
# where the health check and the gateway reach them; add `--triton-host 0.0.0.0` and publish
# them only to expose Triton itself on purpose.
#
# Without Docker Hub, a Debian base made from Debian's packages (scripts/docker-base.sh) stands
# in for the official image, and torch's CPU wheel can come from a pip --find-links location
# instead of its index, e.g. a local directory served on the host's loopback:
#   bash scripts/docker-base.sh
#   docker build --network host --build-arg BASE=quanta-base:bookworm --build-arg TORCH_INDEX= \
#       --build-arg WHEELS=http://127.0.0.1:8765/ -t quanta .
#
# GPU variant (not built or run here): a CUDA base image with Python 3.11 built with a shared
# libpython, and torch's CUDA wheel, e.g.
#   docker build --build-arg BASE=<cuda image with python3.11> \
#       --build-arg TORCH_INDEX=https://download.pytorch.org/whl/cu126 -t quanta:gpu .
# and run with --gpus all and `--device cuda` (see the README).
ARG BASE=python:3.11-slim-bookworm
FROM ${BASE}

# TORCH_INDEX: an extra index for torch (empty: the package index only); WHEELS: a pip
# --find-links location whose wheels win over the indexes' (torch 2.13.0+cpu sorts above
# PyPI's 2.13.0, which is the multi-GB CUDA build on Linux).
ARG TORCH_INDEX=https://download.pytorch.org/whl/cpu
ARG WHEELS=
ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PATH=/opt/venv/bin:$PATH

# curl: the health check; libgomp1: torch's OpenMP runtime on slim images; gcc and g++: the
# engine builds its native decode-attention kernel (C) and torch.compile its fused one (C++)
# at load, and without them decode attention runs eagerly (slower, never broken).
RUN apt-get update \
    && apt-get install -y --no-install-recommends curl libgomp1 gcc g++ libc6-dev \
    && rm -rf /var/lib/apt/lists/*

# A virtual environment: Debian's own python3 refuses pip installs into it (PEP 668), and the
# official image's is the same either way. torch first, from WHEELS or the index that matches
# the base (CPU by default), then the other dependencies: two layers a change to Quanta's
# sources does not rebuild. With torch's CPU build, OpenAI's triton goes again (1 GB that
# xgrammar requires for its CUDA kernels only; a CUDA torch requires and keeps it).
RUN python3 -m venv /opt/venv \
    && pip install ${WHEELS:+--find-links "$WHEELS"} \
        ${TORCH_INDEX:+--extra-index-url "$TORCH_INDEX"} torch==2.13.0
WORKDIR /opt/quanta
COPY pyproject.toml ./
RUN python3 -c 'import tomllib; print(*tomllib.load(open("pyproject.toml", "rb"))["project"]["dependencies"], sep="\n")' \
        >/tmp/requirements.txt \
    && pip install ${WHEELS:+--find-links "$WHEELS"} -r /tmp/requirements.txt \
    && rm /tmp/requirements.txt \
    && if python3 -c 'import sys, torch; sys.exit(torch.version.cuda is not None)'; then \
        pip uninstall -y triton; fi
COPY README.md ./
COPY scheduler_backend ./scheduler_backend
# Quanta itself; the sources go once installed.
RUN pip install --no-deps . \
    && rm -rf scheduler_backend build ./*.egg-info

COPY triton_models ./triton_models
RUN useradd --create-home quanta && mkdir -p engines && chown quanta engines
USER quanta

EXPOSE 9000
# Healthy means the engine serves: the gateway's /health asks the engine itself (503 with the
# reason once its loop died or stalled); without a gateway (curl: 7, nothing listens), Triton's
# readiness, which fails while the backend restarts an unhealthy tritonserver.
HEALTHCHECK --interval=15s --timeout=5s --start-period=180s --retries=3 \
    CMD curl -fsS -m 4 http://127.0.0.1:9000/health || { [ $? -eq 7 ] && curl -fsS -m 4 http://127.0.0.1:8000/v2/health/ready; } || exit 1
# SIGTERM (docker stop) drains: give --drain-timeout plus Triton's unload in `docker stop -t`.
STOPSIGNAL SIGTERM
ENTRYPOINT ["quanta", "serve", "--host", "0.0.0.0"]
CMD ["--openai-port", "9000"]

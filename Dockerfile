# Quanta: `quanta serve` (Triton + the quanta backend + the OpenAI gateway) in one image.
#
#   docker build -t quanta .                                   # CPU image (torch's CPU wheel)
#   docker run --rm -p 8000-8002:8000-8002 -p 9000:9000 quanta # the tiny default model
#   docker run --rm -v $PWD/engines:/opt/quanta/engines -p 8000-8002:8000-8002 quanta \
#       engines/my-model --policy sj-mlfq                      # an engine built on the host
#
# GPU variant (not built or run here): a CUDA base image with Python 3.11 built with a shared
# libpython, and torch's CUDA wheel, e.g.
#   docker build --build-arg BASE=<cuda image with python3.11> \
#       --build-arg TORCH_INDEX=https://download.pytorch.org/whl/cu126 -t quanta:gpu .
# and run with --gpus all and `--device cuda` (see the README).
ARG BASE=python:3.11-slim-bookworm
FROM ${BASE}

ARG TORCH_INDEX=https://download.pytorch.org/whl/cpu
ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1

# curl: the health check; libgomp1: torch's OpenMP runtime on slim images; gcc and g++: the
# engine builds its native decode-attention kernel (C) and torch.compile its fused one (C++)
# at load, and without them decode attention runs eagerly (slower, never broken).
RUN apt-get update \
    && apt-get install -y --no-install-recommends curl libgomp1 gcc g++ libc6-dev \
    && rm -rf /var/lib/apt/lists/*

WORKDIR /opt/quanta
COPY pyproject.toml README.md ./
COPY scheduler_backend ./scheduler_backend
COPY build_scripts ./build_scripts
# torch first, from the index that matches the base (CPU by default), then Quanta itself.
RUN pip install --extra-index-url "${TORCH_INDEX}" torch==2.13.0 \
    && pip install . \
    && rm -rf scheduler_backend build_scripts

COPY triton_models ./triton_models
RUN useradd --create-home quanta && mkdir -p engines && chown quanta engines
USER quanta

EXPOSE 8000 8001 8002 9000
# Ready means the model is loaded (Triton's readiness), not only that the process is up.
HEALTHCHECK --interval=15s --timeout=5s --start-period=180s --retries=3 \
    CMD curl -fsS http://127.0.0.1:8000/v2/health/ready || exit 1
# SIGTERM (docker stop) drains: give --drain-timeout plus Triton's unload in `docker stop -t`.
STOPSIGNAL SIGTERM
ENTRYPOINT ["quanta", "serve", "--host", "0.0.0.0"]
CMD ["--openai-port", "9000"]

#!/usr/bin/env bash
# NVIDIA's genai-perf, unpatched, in TensorRT-LLM mode against Quanta served as `ensemble`
# in the tensorrt_llm layout (streaming and not). It needs perf_analyzer, which tritonclient
# 2.51's wheel ships but which loads libb64 and CUDA's runtime library: both are fetched here
# (a Debian package and a pip wheel) into a scratch directory. Usage:
#   bash loadtests/genai_perf.sh [CHECKPOINT_OR_ENGINE] [WORKDIR]
set -euo pipefail
MODEL=${1:-engines/opt-tiny}
WORK=${2:-$(mktemp -d)}
PORT=${GRPC_PORT:-18101}
python3.11 -m venv "$WORK/venv"
"$WORK/venv/bin/pip" install -q genai-perf==0.0.8 "tritonclient[all]==2.51.0" nvidia-cuda-runtime-cu12
(cd "$WORK" && apt-get download libb64-0d >/dev/null && dpkg-deb -x libb64-0d_*.deb b64)
CUDART=$(dirname "$(find "$WORK/venv" -name 'libcudart.so.12' | head -1)")
export PATH="$WORK/venv/bin:$PATH"
export LD_LIBRARY_PATH="$WORK/b64/usr/lib/x86_64-linux-gnu:$CUDART"
quanta serve "$MODEL" --served-model-name ensemble --io-layout tensorrt_llm \
    --grpc-port "$PORT" --http-port 0 --metrics-port 0 --log-file "$WORK/triton.log" \
    > "$WORK/serve.log" 2>&1 &
SERVER=$!
trap 'kill -INT $SERVER; wait $SERVER' EXIT
until grep -q "^ready" "$WORK/serve.log"; do sleep 1; done
for mode in --streaming ""; do
    (cd "$WORK" && genai-perf profile -m ensemble --backend tensorrtllm $mode \
        -u "127.0.0.1:$PORT" --tokenizer "$MODEL" --synthetic-input-tokens-mean 32 \
        --synthetic-input-tokens-stddev 0 --output-tokens-mean 16 --num-prompts 20 \
        --concurrency 2 --measurement-interval 4000)
done

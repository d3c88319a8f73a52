#!/usr/bin/env bash
# lm-evaluation-harness on the project's own tasks, twice: against Quanta's OpenAI gateway
# (lm_eval's `local-completions` model) and against HF transformers (its `hf` model) on the same
# checkpoint, then the two scores side by side.
#
#   bench/lm_eval/run.sh [MODEL]       # default: smollm2-135m-instruct (quanta fetch-model)
#
# MODEL is a `quanta fetch-model` catalogue name or an engine directory (HF layout). Why a venv
# of its own: lm_eval is a benchmark tool with dependencies of its own (datasets, evaluate,
# scikit-learn, ...), never part of Quanta's install. Env: LMEVAL_VENV (default
# /tmp/lmeval-venv), LMEVAL_VERSION (default 0.4.13, the version docs/results/benchmarks.md used),
# PYTHON (interpreter for the venv), QUANTA (default .venv/bin/quanta), OUT (default
# out/lm_eval), LIMIT (documents per task, default all), TORCH_THREADS (default 2, both sides).
set -euo pipefail
cd "$(dirname "$0")/../.."

MODEL="${1:-smollm2-135m-instruct}"
VENV="${LMEVAL_VENV:-/tmp/lmeval-venv}"
VERSION="${LMEVAL_VERSION:-0.4.13}"
PYTHON="${PYTHON:-$(command -v python3.11 || command -v python3)}"
QUANTA="${QUANTA:-.venv/bin/quanta}"
OUT="${OUT:-out/lm_eval}"
THREADS="${TORCH_THREADS:-2}"
TASKS=quanta_facts_mc,quanta_facts_gen

installed() {
    "$VENV/bin/python" -c "import importlib.metadata as m; print(m.version('lm_eval'))" 2>/dev/null
}
if [[ -x "$VENV/bin/python" && "$(installed || true)" == "$VERSION" ]]; then
    echo "lm_eval $VERSION already in $VENV"
else
    echo "creating $VENV and installing lm_eval[api,hf]==$VERSION (minutes)"
    "$PYTHON" -m venv "$VENV"
    # torch pinned as Quanta pins it, so both sides run the same kernels' library
    "$VENV/bin/python" -m pip install -q "torch==2.13.0" "lm_eval[api,hf]==$VERSION"
fi

if [[ -d "$MODEL" ]]; then
    ENGINE="$MODEL"
else
    ENGINE="$("$QUANTA" fetch-model "$MODEL" --dtype float32 | tail -n 1)"
fi
echo "engine: $ENGINE"

# Offline: the tasks' data are local JSON files and the model a local directory.
export HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1 TOKENIZERS_PARALLELISM=false
export OMP_NUM_THREADS="$THREADS"
LIMIT_ARGS=()
[[ -n "${LIMIT:-}" ]] && LIMIT_ARGS=(--limit "$LIMIT")
mkdir -p "$OUT"
rm -rf "$OUT/quanta" "$OUT/hf"

# shellcheck source=bench/serve_quanta.sh
source "$(dirname "$0")/../serve_quanta.sh"
start_quanta_serve "$QUANTA" "$VENV/bin/python" "$OUT" "$ENGINE" --dtype float32 \
    --torch-threads "$THREADS"
URL="http://127.0.0.1:$OPENAI_PORT/v1/completions"
echo "quanta serve is up: $URL"

start=$SECONDS
# Prompts go as token ids from the checkpoint's own tokenizer, as lm_eval's hf model makes them.
"$VENV/bin/lm_eval" --model local-completions \
    --model_args "model=quanta,base_url=$URL,tokenizer_backend=huggingface,tokenizer=$ENGINE,num_concurrent=1,max_retries=1,max_length=2048" \
    --tasks "$TASKS" --include_path bench/lm_eval/tasks "${LIMIT_ARGS[@]}" \
    --output_path "$OUT/quanta" --log_samples
quanta_s=$((SECONDS - start))
stop_server

start=$SECONDS
"$VENV/bin/lm_eval" --model hf \
    --model_args "pretrained=$ENGINE,dtype=float32" --device cpu --batch_size 1 \
    --tasks "$TASKS" --include_path bench/lm_eval/tasks "${LIMIT_ARGS[@]}" \
    --output_path "$OUT/hf" --log_samples
hf_s=$((SECONDS - start))

echo
echo "lm_eval $VERSION, $ENGINE, $(date -u +%Y-%m-%d); Quanta ${quanta_s}s, HF ${hf_s}s"
"$VENV/bin/python" bench/lm_eval/compare.py "$OUT/quanta" "$OUT/hf"

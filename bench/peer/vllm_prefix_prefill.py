"""vLLM's time to first token for prompts whose prefix it has cached, on given token ids.

Run in vLLM's venv by ``quanta bench prefix-prefill --vllm-venv``:

    bench/peer/vllm_prefix_prefill.py --model ENGINE_DIR --prompts pairs.json

``pairs.json`` maps a shape ("PREFIX:NEW") to a list of [prefix ids, new ids] pairs. For each
pair the prefix is generated first (one token, so vLLM caches its full blocks), then the whole
prompt is timed; the best per shape is printed as the last stdout line, ``{"rows": [...]}``.
"""

from __future__ import annotations

import argparse
import json
import time


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", required=True, help="HF checkpoint directory")
    parser.add_argument("--prompts", required=True, help="JSON: shape -> [prefix, new] pairs")
    parser.add_argument("--dtype", default="bfloat16", choices=["float32", "bfloat16"])
    parser.add_argument("--max-model-len", type=int, default=2048)
    parser.add_argument("--kv-cache-bytes", type=int, default=1 << 30)
    args = parser.parse_args()

    from vllm import LLM, SamplingParams

    with open(args.prompts, encoding="utf-8") as f:
        shapes = json.load(f)
    llm = LLM(
        model=args.model,
        dtype=args.dtype,
        max_model_len=args.max_model_len,
        enforce_eager=True,
        # as quanta bench peer's vLLM server (and Quanta's defaults)
        block_size=32,
        kv_cache_memory_bytes=args.kv_cache_bytes,
        enable_prefix_caching=True,
        max_num_batched_tokens=2048,
        max_num_seqs=32,
        seed=0,
    )
    one = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)

    def run(ids: list[int]) -> float:
        start = time.perf_counter()
        llm.generate([{"prompt_token_ids": ids}], one, use_tqdm=False)
        return time.perf_counter() - start

    run([101, 102, 103])  # warm-up
    rows = []
    for shape, pairs in shapes.items():
        best = float("inf")
        for prefix, new in pairs:
            if prefix:
                run(prefix)
            best = min(best, run(prefix + new))
        rows.append({"shape": shape, "ms": best * 1e3})
    import vllm

    print(json.dumps({"rows": rows, "vllm": vllm.__version__}))


if __name__ == "__main__":  # vLLM's engine spawns processes that re-import this module
    main()

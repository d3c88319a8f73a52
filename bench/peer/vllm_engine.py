"""Engine-only prefill/decode tokens/s of vLLM's offline ``LLM.generate`` — run with the vLLM
virtual environment's Python, not Quanta's (the two need different torch builds).

It measures exactly what ``quanta.bench.engine`` measures for Quanta: for each batch of the
given prompts (token ids), one warm-up, then the best of ``--repeat`` prefill-only runs
(``max_tokens=1``) and of as many full runs (``max_tokens=gen_len``, ``ignore_eos``, greedy);
decode tokens/s = batch * (gen_len - 1) / (full - prefill). The result is one JSON line on
stdout; vLLM logs to stdout too (even after it), so read the line that starts with ``{"rows"``.

    OMP_NUM_THREADS=1 VLLM_CPU_OMP_THREADS_BIND=nobind /tmp/vllm-venv/bin/python \\
        bench/peer/vllm_engine.py --model engines/opt-125m --prompts prompts.json --gen-len 32

``prompts.json``: ``{"1": [[ids...]], "8": [[...], ...], ...}`` (batch size -> prompts).
"""

from __future__ import annotations

import argparse
import json
import time


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", required=True, help="HF checkpoint directory")
    parser.add_argument("--prompts", required=True, help="JSON: batch size -> token id lists")
    parser.add_argument("--gen-len", type=int, default=32)
    parser.add_argument("--max-model-len", type=int, default=2048)
    parser.add_argument("--kv-cache-bytes", type=int, default=1 << 30)
    parser.add_argument("--repeat", type=int, default=3, help="runs per timing; the best counts")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    args = parser.parse_args()

    from vllm import LLM, SamplingParams

    with open(args.prompts, encoding="utf-8") as f:
        batches = {int(b): p for b, p in json.load(f).items()}
    max_batch = max(batches)
    llm = LLM(
        model=args.model,
        dtype=args.dtype,
        max_model_len=args.max_model_len,
        enforce_eager=True,
        kv_cache_memory_bytes=args.kv_cache_bytes,
        max_num_seqs=max_batch,
        max_num_batched_tokens=4096,  # as quanta.bench.engine
        enable_prefix_caching=False,  # the full run repeats the prefill run's prompts
        seed=0,
    )

    def timed(prompts: list[list[int]], n: int) -> float:
        params = SamplingParams(max_tokens=n, min_tokens=n, temperature=0.0, ignore_eos=True)
        inputs = [{"prompt_token_ids": p} for p in prompts]
        start = time.perf_counter()
        outs = llm.generate(inputs, params, use_tqdm=False)
        elapsed = time.perf_counter() - start
        assert all(len(o.outputs[0].token_ids) == n for o in outs), "wrong output length"
        return elapsed

    rows = []
    for batch in sorted(batches):
        prompts = batches[batch]
        timed(prompts[:1], 2)  # warm-up
        # NOTE: best of ``repeat``, as quanta.bench.engine: other processes only add time.
        prefill = min(timed(prompts, 1) for _ in range(args.repeat))
        total = min(timed(prompts, args.gen_len) for _ in range(args.repeat))
        prompt_len = len(prompts[0])
        rows.append(
            {
                "batch": batch,
                "prefill_s": prefill,
                "total_s": total,
                "prefill_tps": batch * prompt_len / prefill,
                "decode_tps": batch * (args.gen_len - 1) / max(total - prefill, 1e-9),
            }
        )
    import torch
    import vllm

    meta = {
        "vllm": vllm.__version__,
        "torch": torch.__version__,
        "threads": torch.get_num_threads(),
    }
    print(json.dumps({"rows": rows, **meta}))


if __name__ == "__main__":  # vLLM's engine spawns processes that re-import this module
    main()

"""Engine-only prefill/decode tokens/s of vLLM's offline ``LLM.generate`` — run with the vLLM
virtual environment's Python, not Quanta's (the two need different torch builds).

It measures exactly what ``quanta.bench.engine`` measures for Quanta: for each batch of the
given prompts (token ids), one warm-up, then ``--repeat`` rounds of a prefill-only run
(``max_tokens=1``) and a full run (``max_tokens=gen_len``, ``ignore_eos``, greedy) back to
back; decode tokens/s = batch * (gen_len - 1) / the median of the rounds' own (full -
prefill), prefill tokens/s from the shortest prefill-only run (``paired_rates``). The result
is one JSON line on stdout; vLLM logs to stdout too (even after it), so read the line that
starts with ``{"rows"``.

    OMP_NUM_THREADS=1 VLLM_CPU_OMP_THREADS_BIND=nobind /tmp/vllm-venv/bin/python \\
        bench/peer/vllm_engine.py --model engines/opt-125m --prompts prompts.json --gen-len 32

``prompts.json``: ``{"1": [[ids...]], "8": [[...], ...], ...}`` (batch size -> prompts).
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
import time


def paired_rates(
    rounds: list[tuple[float, float]], batch: int, prompt_len: int, gen_len: int
) -> tuple[float, float]:
    """(prefill, decode) tokens/s from rounds of (prefill-only seconds, full-run seconds): as
    ``quanta.bench.engine.paired_rates`` (this venv cannot import Quanta), which says why.
    A round whose full run was not longer than its prefill run is dropped; with none left
    the decode rate is NaN."""
    prefill_tps = batch * prompt_len / min(prefill for prefill, _ in rounds)
    decode_s = [full - prefill for prefill, full in rounds if full > prefill]
    decode_tps = batch * (gen_len - 1) / statistics.median(decode_s) if decode_s else math.nan
    return prefill_tps, decode_tps


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", required=True, help="HF checkpoint directory")
    parser.add_argument("--prompts", required=True, help="JSON: batch size -> token id lists")
    parser.add_argument("--gen-len", type=int, default=32)
    parser.add_argument("--max-model-len", type=int, default=2048)
    parser.add_argument("--kv-cache-bytes", type=int, default=1 << 30)
    parser.add_argument("--repeat", type=int, default=3, help="rounds: prefill, then full")
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
        # NOTE: rounds of a prefill-only then a full run, as quanta.bench.engine: a round's
        # decode time is the difference of two runs under the same load.
        rounds = [(timed(prompts, 1), timed(prompts, args.gen_len)) for _ in range(args.repeat)]
        prefill_tps, decode_tps = paired_rates(rounds, batch, len(prompts[0]), args.gen_len)
        row = {
            "batch": batch,
            "prefill_s": min(prefill for prefill, _ in rounds),
            "total_s": min(full for _, full in rounds),
            "rounds": rounds,
            "prefill_tps": prefill_tps,
            "decode_tps": decode_tps,
        }
        if math.isnan(decode_tps):
            row["note"] = "no round's full run took longer than its prefill-only run"
            print(f"batch {batch}: {row['note']}, so no decode rate (NaN)", file=sys.stderr)
        rows.append(row)
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

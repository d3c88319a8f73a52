"""Engine-only prefill/decode tokens/s of llama.cpp (llama-cpp-python) at batch 1 — run with
the llama.cpp virtual environment's Python, not Quanta's (a peer, never a dependency).

It measures what ``quanta.bench.engine`` measures for Quanta at batch 1, on the same token ids:
one warm-up, then the best of ``--repeat`` prefill-only runs (the prompt evaluated from an
empty cache) and of as many full runs (prompt, then ``gen_len - 1`` greedy steps, each the
argmax of the last logits fed back); decode tokens/s = (gen_len - 1) / the best full run's
decode part, timed within that run (the difference of two separate bests was fragile: one
slow set of prefill runs once gave a decode part of 3 ms, 9,249 tokens/s).
llama-cpp-python evaluates one sequence, so only batch 1 is measured. One JSON line on stdout.

    /tmp/llamacpp-venv/bin/python bench/peer/llama_cpp_engine.py --gguf MODEL.gguf \\
        --prompts prompts.json --gen-len 32 --threads 1
"""

from __future__ import annotations

import argparse
import json
import time


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--gguf", required=True, help="GGUF file")
    parser.add_argument("--prompts", required=True, help="JSON: batch size -> token id lists")
    parser.add_argument("--gen-len", type=int, default=32)
    parser.add_argument("--repeat", type=int, default=3, help="runs per timing; the best counts")
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()

    import llama_cpp
    import numpy as np
    from llama_cpp import Llama

    with open(args.prompts, encoding="utf-8") as f:
        prompt: list[int] = json.load(f)["1"][0]
    llm = Llama(
        model_path=args.gguf,
        n_ctx=len(prompt) + args.gen_len + 8,
        n_batch=512,
        n_threads=args.threads,
        n_threads_batch=args.threads,
        logits_all=False,
        verbose=False,
    )

    def run(steps: int) -> tuple[float, float]:
        """(prefill seconds, decode seconds) of one run from an empty cache."""
        llm.reset()
        start = time.perf_counter()
        llm.eval(prompt)
        prefilled = time.perf_counter()
        for _ in range(steps):
            token = int(np.argmax(llm.scores[llm.n_tokens - 1]))
            llm.eval([token])
        return prefilled - start, time.perf_counter() - prefilled

    run(1)  # warm-up
    # NOTE: best of ``repeat``, as quanta.bench.engine: other processes only add time.
    prefill = min(run(0)[0] for _ in range(args.repeat))
    decode = min(run(args.gen_len - 1)[1] for _ in range(args.repeat))
    row = {
        "batch": 1,
        "prefill_s": prefill,
        "total_s": prefill + decode,
        "prefill_tps": len(prompt) / prefill,
        "decode_tps": (args.gen_len - 1) / max(decode, 1e-9),
    }
    meta = {"llama_cpp_python": llama_cpp.__version__, "threads": args.threads}
    print(json.dumps({"rows": [row], **meta}))


if __name__ == "__main__":
    main()

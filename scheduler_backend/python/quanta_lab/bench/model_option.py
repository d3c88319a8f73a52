"""The ``--model`` and ``--dtype`` of the benchmarks that load a real model: a catalogue name,
a ``.gguf`` file or an engine directory, in bf16 where the CPU computes it."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

# The options every real-model benchmark takes, spelled once.
ModelOpt = Annotated[
    str,
    typer.Option(help="catalogue name (quanta fetch-model --list), a .gguf file or an engine"),
]
DtypeOpt = Annotated[
    str | None, typer.Option(help="float32 or bfloat16 (default: bf16 where the CPU runs it)")
]
ThreadsOpt = Annotated[int | None, typer.Option(help="torch threads")]
OutOpt = Annotated[Path | None, typer.Option(help="write the report as JSON here")]


def bench_model(model: str, dtype: str | None) -> tuple[Path, str]:
    """(the engine directory, the dtype): a catalogue name or a GGUF file is built into the
    engine cache once; anything else must be an engine or checkpoint directory."""
    import torch
    from quanta.frontends.triton.cli import resolve_model
    from quanta.runner.linear import onednn_supports

    if dtype is None:
        dtype = "bfloat16" if onednn_supports(torch.bfloat16, torch.device("cpu")) else "float32"
    source = resolve_model(Path(model), dtype)
    if not (source / "config.json").is_file():
        raise typer.BadParameter(
            f"{model} is not a catalogue name, a .gguf file or a model directory", "--model"
        )
    return source, dtype

"""``quanta bench speculative`` (Typer): prompt lookup's speed-up and its cost."""

from __future__ import annotations

import json
from typing import Annotated

import typer
from quanta.cli_options import SpeculativeConfigOpt, batch_sizes, parse_speculative_config

from quanta_lab.bench.model_option import DtypeOpt, ModelOpt, OutOpt, ThreadsOpt

_DEFAULT = '{"method": "ngram", "num_speculative_tokens": 4}'


def register(app: typer.Typer, bench_app: typer.Typer) -> None:
    bench_app.command("speculative")(bench_speculative)


def bench_speculative(
    model: ModelOpt = "smollm2-135m-instruct",
    workload: Annotated[
        str, typer.Option(help="comma-separated: edit (copies its input), chat (does not)")
    ] = "edit,chat",
    batch: Annotated[str, typer.Option(help="comma-separated batch sizes")] = "1",
    max_tokens: Annotated[int, typer.Option(min=2, help="longest answer")] = 128,
    speculative_config: SpeculativeConfigOpt = _DEFAULT,
    repeats: Annotated[int, typer.Option(min=1, help="passes over each workload")] = 1,
    temperature: Annotated[
        float, typer.Option(min=0.0, help="0: greedy; above: seeded sampling")
    ] = 0.0,
    dtype: DtypeOpt = None,
    threads: ThreadsOpt = None,
    out: OutOpt = None,
) -> None:
    """Decode tokens/s with and without speculative decoding, acceptance rates, and a check
    that both answer the same, on the same model in one run (docs/decoding.md)."""
    import torch
    from rich.console import Console
    from rich.table import Table

    from quanta_lab.bench.model_option import bench_model
    from quanta_lab.bench.speculative import WORKLOADS, run_speculative

    names = [w.strip() for w in workload.split(",") if w.strip()]
    unknown = [w for w in names if w not in WORKLOADS]
    if unknown:
        raise typer.BadParameter(f"unknown workload {unknown[0]!r}", param_hint="--workload")
    config = parse_speculative_config(speculative_config) or {}
    source, dtype = bench_model(model, dtype)
    sizes = batch_sizes(batch)
    report = run_speculative(
        str(source),
        workloads=names,
        batches=sizes,
        max_tokens=max_tokens,
        config=config,
        dtype=dtype,
        threads=threads,
        repeats=repeats,
        temperature=temperature,
    )
    table = Table(
        title=f"speculative decoding ({json.dumps(config)}), temperature {temperature}: "
        f"{report.dtype}, CPU "
        f"{report.cpu_isa}, threads {torch.get_num_threads()}"
    )
    for column in ("workload", "batch", "plain tok/s", "spec tok/s", "speed-up"):
        table.add_column(column, justify="right")
    for column in ("acceptance", "tokens/verification", "same output"):
        table.add_column(column, justify="right")
    for name in names:
        for size in sizes:
            plain, spec = (
                next(r for r in report.runs if (r.workload, r.batch, r.speculative) == key)
                for key in ((name, size, False), (name, size, True))
            )
            speedup = report.speedup(name, size)
            table.add_row(
                name,
                str(size),
                f"{plain.decode_tok_s:.1f}",
                f"{spec.decode_tok_s:.1f}",
                "-" if speedup is None else f"{speedup:.2f}x",
                "-" if spec.acceptance is None else f"{spec.acceptance:.0%}",
                "-"
                if spec.tokens_per_verification is None
                else f"{spec.tokens_per_verification:.2f}",
                "{}/{}".format(*report.identical[f"{name}@{size}"]),
            )
    Console(width=120).print(table)
    if out is not None:
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(report.to_dict(), indent=2) + "\n", encoding="utf-8")
        typer.echo(f"wrote {out}")

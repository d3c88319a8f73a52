"""``quanta bench structured`` (Typer): the cost and the yield of structured output."""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING, Annotated

import typer
from quanta.cli_options import batch_sizes

from quanta_lab.bench.model_option import DtypeOpt, ModelOpt, OutOpt, ThreadsOpt

if TYPE_CHECKING:
    from rich.table import Table

    from quanta_lab.bench.structured import StructuredReport


def register(app: typer.Typer, bench_app: typer.Typer) -> None:
    bench_app.command("structured")(bench_structured)


def bench_structured(
    model: ModelOpt = "smollm2-135m-instruct",
    batch: Annotated[str, typer.Option(help="comma-separated batch sizes")] = "1,8,32",
    max_tokens: Annotated[int, typer.Option(min=8, help="longest answer")] = 64,
    dtype: DtypeOpt = None,
    threads: ThreadsOpt = None,
    repeats: Annotated[
        int, typer.Option(min=1, help="free and guided runs per batch size (the median counts)")
    ] = 3,
    compare_outlines: Annotated[
        bool,
        typer.Option(
            help="also time xgrammar against outlines-core (when installed) on the same schema "
            "and vocabulary: compile and per-token mask fill"
        ),
    ] = False,
    out: OutOpt = None,
) -> None:
    """TPOT with and without a tool-call JSON schema, and the share of answers that are
    valid tool calls, on the same engine in the same run (docs/decoding.md)."""
    from rich.console import Console

    from quanta_lab.bench.model_option import bench_model
    from quanta_lab.bench.structured import run_structured

    source, dtype = bench_model(model, dtype)
    sizes = batch_sizes(batch)
    report = run_structured(
        str(source),
        batches=sizes,
        max_tokens=max_tokens,
        dtype=dtype,
        threads=threads,
        repeats=repeats,
    )
    console = Console(width=max(Console().width, 120))
    console.print(_table(report, sizes))
    for kind, text in report.sample.items():
        console.print(f"[dim]{kind}:[/dim] {text[:160]!r}")
    if compare_outlines:
        console.print(_compare(report, source))
    if out is not None:
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(report.to_dict(), indent=2) + "\n", encoding="utf-8")
        typer.echo(f"wrote {out}")


def _table(report: StructuredReport, sizes: list[int]) -> Table:
    from rich.table import Table

    load = "/".join(f"{x:.1f}" for x in report.load_average)
    table = Table(
        title=f"structured output: tool calls, {report.dtype}, CPU {report.cpu_isa}, "
        f"{report.threads} threads, median of {report.repeats}, load {load} (vocabulary "
        f"{report.vocab_ms:.0f} ms once, schema compiled in {report.compile_ms:.1f} ms)",
        caption="TPOT: mean step over the same whole-batch steps of every run (steps); right "
        "tool and tokens: free/guided",
    )
    columns = ("batch", "steps", "TPOT free ms", "guided ms", "overhead", "valid free")
    for column in (*columns, "found free", "valid guided", "right tool", "tokens"):
        table.add_column(column, justify="right")
    for size in sizes:
        free = next(r for r in report.runs if r.batch == size and not r.guided)
        guided = next(r for r in report.runs if r.batch == size and r.guided)
        overhead = report.overhead(size)
        table.add_row(
            str(size),
            str(free.steps),
            f"{free.tpot_ms:.1f}",
            f"{guided.tpot_ms:.1f}",
            "-" if overhead is None else f"{overhead:+.1%}",
            f"{free.valid}/{free.total}",
            f"{free.found}/{free.total}",
            f"{guided.valid}/{guided.total}",
            f"{free.right_tool}/{guided.right_tool}",
            f"{free.mean_output_tokens:.0f}/{guided.mean_output_tokens:.0f}",
        )
    return table


def _compare(report: StructuredReport, model_dir: Path) -> Table:
    """Time both grammar libraries on the bench's schema and the model's vocabulary; the
    report keeps the numbers."""
    from dataclasses import asdict

    from quanta.runner.models.config import load_model_config
    from quanta.text.tokenizer import load_tokenizer
    from rich.table import Table

    from quanta_lab.bench.structured import ANSWERS, TOOL_CALL
    from quanta_lab.bench.structured_compare import compare_libraries

    config = load_model_config(model_dir)
    results, skipped = compare_libraries(
        load_tokenizer(model_dir),
        config.vocab_size,
        config.eos_token_ids,
        json.dumps(TOOL_CALL.json_schema()),
        ANSWERS,
    )
    report.libraries = [asdict(r) for r in results]
    table = Table(
        title=f"grammar libraries: the tool-call schema, {config.vocab_size} tokens, "
        f"{results[0].tokens} masks per walk",
        caption=skipped,
    )
    columns = ("library", "vocabulary ms", "compile ms", "fill us median", "mean", "max")
    for column in columns:
        table.add_column(column, justify="left" if column == "library" else "right")
    for r in results:
        table.add_row(
            f"{r.library} {r.version}",
            f"{r.vocab_ms:.0f}",
            f"{r.compile_ms:.1f}",
            f"{r.fill_us_median:.1f}",
            f"{r.fill_us_mean:.1f}",
            f"{r.fill_us_max:.0f}",
        )
    return table

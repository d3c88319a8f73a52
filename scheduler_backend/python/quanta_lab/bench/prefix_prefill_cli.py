"""``quanta bench prefix-prefill`` (Typer): TTFT after a cached prefix, AMX against SDPA and
vLLM (``quanta_lab.bench.prefix_prefill``)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated

import typer

from quanta_lab.bench.model_option import DtypeOpt, ModelOpt, OutOpt, ThreadsOpt, bench_model


def register(app: typer.Typer, bench_app: typer.Typer) -> None:
    bench_app.command("prefix-prefill")(bench_prefix_prefill)


def bench_prefix_prefill(
    model: ModelOpt = "smollm2-135m-instruct",
    shapes: Annotated[
        str, typer.Option(help="comma-separated CACHED:NEW token counts of the timed prompts")
    ] = "460:335,1500:100,800:300,200:30,0:800",
    repeats: Annotated[int, typer.Option(min=1, help="timings per shape; the best counts")] = 5,
    vllm_venv: Annotated[
        Path | None, typer.Option(help="vLLM's venv: time it on the same token ids")
    ] = None,
    dtype: DtypeOpt = None,
    threads: ThreadsOpt = None,
    out: OutOpt = None,
) -> None:
    """Time to first token of prompts whose first tokens are cached: prefill attention on AMX
    tiles against SDPA in one process, and vLLM's on the same ids (docs/prefix-caching.md)."""
    from rich.console import Console
    from rich.table import Table

    from quanta_lab.bench.prefix_prefill import parse_shapes, report, run_prefix_prefill

    try:
        parsed = parse_shapes(shapes)
    except ValueError as exc:
        raise typer.BadParameter(str(exc), param_hint="--shapes") from exc
    vllm_python = None
    if vllm_venv is not None:
        vllm_python = vllm_venv / "bin" / "python"
        if not vllm_python.is_file():
            raise typer.BadParameter(f"no {vllm_python}", param_hint="--vllm-venv")
    model_dir, dtype = bench_model(model, dtype)
    rows, meta = run_prefix_prefill(
        model_dir,
        dtype,
        parsed,
        repeats,
        vllm_python=vllm_python,
        threads=threads or 1,
        log_dir=None if out is None else out.parent / "logs",
    )
    table = Table(
        title=f"TTFT after a cached prefix, {model_dir.name}, {dtype}, "
        f"{meta['threads']} thread(s), {meta['cpu_isa']}, best of {repeats}"
    )
    for column in ("cached", "new", "AMX ms", "SDPA ms", "SDPA / AMX", "vLLM ms", "vLLM / AMX"):
        table.add_column(column, justify="right")
    for r in rows:
        ours = r.amx_ms if r.amx_ms is not None else r.sdpa_ms
        table.add_row(
            str(r.prefix),
            str(r.new),
            "-" if r.amx_ms is None else f"{r.amx_ms:.1f}",
            f"{r.sdpa_ms:.1f}",
            "-" if r.amx_ms is None else f"{r.sdpa_ms / r.amx_ms:.2f}x",
            "-" if r.vllm_ms is None else f"{r.vllm_ms:.1f}",
            "-" if r.vllm_ms is None else f"{r.vllm_ms / ours:.2f}x",
        )
    console = Console()
    console.print(table)
    if meta["prefill_attention"] != "amx":
        console.print("prefill attention runs on SDPA here (no AMX, or not bf16): no AMX column")
    if out is not None:
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(report(rows, meta), indent=2))

"""``quanta bench gpu`` (Typer): the prepared GPU run that ``bench/gpu/run.sh`` calls.

The measurement (``quanta_lab.bench.gpu``) loads torch and transformers, so it is imported
inside the command.
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer
from quanta.cli_options import batch_sizes


def register(app: typer.Typer, bench_app: typer.Typer) -> None:
    """Add ``bench gpu``."""
    bench_app.command("gpu")(bench_gpu)


def bench_gpu(
    device: Annotated[str, typer.Option(help="cuda, cuda:N, or cpu (the smoke test)")] = "cuda",
    presets: Annotated[
        str, typer.Option(help="comma-separated shapes, random weights made on the device")
    ] = "llama-3-8b,llama-3.2-1b,opt-13b",
    batches: Annotated[str, typer.Option(help="comma-separated batch sizes")] = "1,8,32,64",
    prompt_len: Annotated[int, typer.Option(min=1, help="prompt tokens per request")] = 512,
    gen_len: Annotated[int, typer.Option(min=2, help="generated tokens per request")] = 128,
    dtype: Annotated[str, typer.Option(help="every engine's dtype")] = "bfloat16",
    engines: Annotated[
        str, typer.Option(help="comma-separated: quanta, hf-cb (generate_batch), hf-generate")
    ] = "quanta,hf-cb,hf-generate",
    budget_s: Annotated[
        float, typer.Option(min=1, help="seconds for the timings; points past it are skipped")
    ] = 270,
    repeat: Annotated[int, typer.Option(min=1, help="runs per timing; the best counts")] = 1,
    copy_mib: Annotated[
        int | None, typer.Option(help="MiB of the bandwidth copy (default: 1024 on a GPU, 64)")
    ] = None,
    gemm_n: Annotated[
        int | None, typer.Option(help="size of the square GEMM (default: 8192 on a GPU, 512)")
    ] = None,
    tests: Annotated[
        str | None, typer.Option(help="what the GPU tests said, kept with the results")
    ] = None,
    output: Annotated[Path | None, typer.Option(help="also write the report as JSON")] = None,
) -> None:
    """Quanta, HF continuous batching and HF generate on real shapes, against the card's
    measured bandwidth and GEMM rate (bench/gpu/README.md)."""
    from quanta_lab.bench.gpu import Settings, print_report, run_gpu_bench, write_report

    on_gpu = device.startswith("cuda")
    settings = Settings(
        device=device,
        presets=tuple(p.strip() for p in presets.split(",") if p.strip()),
        batches=tuple(batch_sizes(batches)),
        prompt_len=prompt_len,
        gen_len=gen_len,
        dtype=dtype,
        engines=tuple(e.strip() for e in engines.split(",") if e.strip()),
        budget_s=budget_s,
        repeat=repeat,
        copy_mib=copy_mib or (1024 if on_gpu else 64),
        gemm_n=gemm_n or (8192 if on_gpu else 512),
    )
    report = run_gpu_bench(settings, tests)
    print_report(report)
    if output is not None:
        write_report(report, output)
        typer.echo(f"wrote {output}")

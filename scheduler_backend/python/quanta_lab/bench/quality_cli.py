"""``quanta bench quality`` (Typer): the quality checks of ``quanta_lab.bench.quality``."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer


def register(app: typer.Typer, bench_app: typer.Typer) -> None:
    bench_app.command("quality")(bench_quality)


def bench_quality(
    model: Annotated[
        str, typer.Option(help="catalogue name (quanta fetch-model --list) or a LLaMA .gguf file")
    ] = "smollm2-135m-instruct",
    max_tokens: Annotated[int, typer.Option(min=1, help="longest greedy answer")] = 48,
    questions: Annotated[
        int | None,
        typer.Option(min=1, help="ask only the first N chat questions (default: all 22)"),
    ] = None,
    llama_cpp_venv: Annotated[
        Path | None,
        typer.Option(help="virtual environment with llama-cpp-python (the llama.cpp peer)"),
    ] = None,
    hf: Annotated[bool, typer.Option(help="compare with HF transformers (fp32)")] = True,
    bf16: Annotated[
        bool | None, typer.Option(help="also check bf16 (default: where the CPU runs it)")
    ] = None,
    quantization: Annotated[
        list[str] | None,
        typer.Option(
            help="also a quantized engine of the file (int8, int4, keep; repeatable), in bf16 "
            "where the CPU runs it (docs/quantization.md)"
        ),
    ] = None,
    quantize_embedding: Annotated[
        bool,
        typer.Option(
            help="the quantized engines' token embedding too (--quantize-embedding: the tied "
            "head shares the table), as llama.cpp's quantized files hold theirs"
        ),
    ] = False,
    lm_head_quantization: Annotated[
        str | None,
        typer.Option(help="the quantized engines' head (and shared table) in int8 or int4"),
    ] = None,
    out: Annotated[Path | None, typer.Option(help="write the report as JSON here")] = None,
) -> None:
    """Greedy answers, log-probabilities and perplexity of a real model against HF
    transformers and llama.cpp on the same weights."""
    import torch
    from quanta.build.cli import engine_from_gguf
    from quanta.build.fetch import CATALOGUE, FetchError, fetch_gguf
    from quanta.runner.cpu import cpu_isa
    from quanta.runner.linear import onednn_supports
    from rich.console import Console
    from rich.table import Table

    from quanta_lab.bench.quality import run_quality

    try:
        gguf = fetch_gguf(model) if model in CATALOGUE else Path(model)
    except FetchError as exc:
        typer.echo(f"error: {exc}", err=True)
        raise typer.Exit(1) from None
    if not gguf.is_file():
        raise typer.BadParameter(f"{model} is neither a catalogue name nor a file", "--model")
    python = None
    if llama_cpp_venv is not None:
        python = llama_cpp_venv / "bin" / "python"
        if not python.is_file():
            raise typer.BadParameter(f"no {python}", param_hint="--llama-cpp-venv")
    bf16_runs = onednn_supports(torch.bfloat16, torch.device("cpu"))
    if bf16 is None:
        bf16 = bf16_runs
    fp32_engine = engine_from_gguf(gguf, "float32")
    bf16_engine = engine_from_gguf(gguf, "bfloat16") if bf16 else None
    # Quantized engines run bf16 activations wherever the CPU runs bf16 (their packed kernels
    # need it; in fp32 every call dequantizes), whether or not the bf16 check is asked for.
    q_dtype = "bfloat16" if bf16_runs else "float32"
    if lm_head_quantization not in (None, "int8", "int4"):
        raise typer.BadParameter("int8 or int4", param_hint="--lm-head-quantization")
    table = "+embedding" if quantize_embedding else ""
    table += f"+head-{lm_head_quantization}" if lm_head_quantization else ""
    quantized = {
        f"quanta-{mode}{table}-{q_dtype}": engine_from_gguf(
            gguf, q_dtype, mode, quantize_embedding, lm_head_quantization
        )
        for mode in quantization or []
    }
    report = run_quality(
        gguf,
        engine_fp32=fp32_engine,
        engine_bf16=bf16_engine,
        max_tokens=max_tokens,
        llama_cpp_python=python,
        with_hf=hf,
        quantized=quantized,
        questions=questions,
    )
    console = Console()
    table = Table(title=f"quality: {report.model} (CPU {cpu_isa()}, torch {torch.__version__})")
    table.add_column("check")
    table.add_column("result", justify="right")
    for name, cmp in (
        ("greedy fp32 = HF fp32", report.greedy_fp32_vs_hf),
        ("greedy bf16 = Quanta fp32", report.greedy_bf16_vs_fp32),
    ):
        if cmp is not None:
            table.add_row(
                name,
                f"{cmp.identical}/{cmp.total} answers, {cmp.prefix_agreement:.1%} of tokens",
            )
    for label, cmp in report.greedy_quantized.items():
        table.add_row(
            f"greedy {label} = float",
            f"{cmp.identical}/{cmp.total} answers, {cmp.prefix_agreement:.1%} of tokens",
        )
    if report.max_logprob_diff_vs_hf is not None:
        table.add_row(
            f"max |logprob - HF| ({report.text_tokens} tokens)",
            f"{report.max_logprob_diff_vs_hf:.2e}",
        )
    base = report.perplexity.get("quanta-fp32")
    for name, value in report.perplexity.items():
        ratio = (
            f" ({value / base - 1:+.2%} vs quanta-fp32)" if base and name != "quanta-fp32" else ""
        )
        table.add_row(f"perplexity {name}", f"{value:.4f}{ratio}")
    console.print(table)
    for i, answer in enumerate(report.answers.get("quanta-fp32", [])[:3]):
        console.print(f"[dim]answer {i}:[/dim] {answer!r}")
    if out is not None:
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(report.to_json() + "\n", encoding="utf-8")
        typer.echo(f"wrote {out}")

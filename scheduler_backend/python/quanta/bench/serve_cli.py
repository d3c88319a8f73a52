"""``quanta bench serve``: a seeded Poisson workload against a live endpoint, one run per rate.

Writes every request's raw timings and a summary per rate to ``--output`` (JSON), prints the
summaries, and with ``--plot-dir`` draws latency-vs-rate and CDF plots (matplotlib, imported
only then). The same seed gives the same requests at every rate, so rates are comparable.
"""

from __future__ import annotations

import asyncio
import json
import math
from pathlib import Path
from typing import Annotated, Any

import typer


def register(app: typer.Typer, bench_app: typer.Typer) -> None:
    """Add ``bench serve``."""
    bench_app.command("serve")(bench_serve)


def bench_serve(
    url: Annotated[
        str,
        typer.Option(help="gRPC host:port, Triton HTTP http://host:port, or an OpenAI base URL"),
    ],
    transport: Annotated[str, typer.Option(help="grpc, http or openai")] = "grpc",
    model: Annotated[str, typer.Option(help="model name")] = "quanta",
    rate: Annotated[str, typer.Option(help="requests/s, comma-separated for a sweep; inf")] = "1",
    num_requests: Annotated[int, typer.Option(min=1, help="requests per rate")] = 32,
    seed: Annotated[int, typer.Option(help="seed of arrivals, lengths and tenants")] = 0,
    prompt_tokens: Annotated[str, typer.Option(help="uniform prompt length lo:hi")] = "16:64",
    output_tokens: Annotated[str, typer.Option(help="uniform output length lo:hi")] = "8:32",
    tenants: Annotated[str, typer.Option(help="comma-separated, drawn uniformly")] = "default",
    priority_class: Annotated[str | None, typer.Option(help="online or offline")] = None,
    concurrency_limit: Annotated[
        int | None, typer.Option(min=1, help="at most this many requests in flight")
    ] = None,
    temperature: Annotated[float, typer.Option(min=0.0)] = 0.0,
    token_id_range: Annotated[str, typer.Option(help="ids of synthetic prompts lo:hi")] = "10:250",
    metadata: Annotated[
        bool, typer.Option(help="send tenant/priority class (off for peers that reject them)")
    ] = True,
    timeout: Annotated[float, typer.Option(help="seconds one request may take")] = 600.0,
    output: Annotated[Path | None, typer.Option(help="write raw results + summaries here")] = None,
    plot_dir: Annotated[Path | None, typer.Option(help="write PNG plots here")] = None,
) -> None:
    """Replay a seeded Poisson workload at each rate with real timing; print the summaries."""
    from quanta.bench.client import TRANSPORTS, Target

    if transport not in TRANSPORTS:
        raise typer.BadParameter(f"--transport must be one of {', '.join(TRANSPORTS)}")
    target = Target(
        url=url,
        transport=transport,  # type: ignore[arg-type]
        model=model,
        temperature=temperature,
        timeout_s=timeout,
        token_id_range=_range(token_id_range, "--token-id-range"),
        send_metadata=metadata,
    )
    workload = {
        "num_requests": num_requests,
        "seed": seed,
        "prompt_tokens": _range(prompt_tokens, "--prompt-tokens"),
        "output_tokens": _range(output_tokens, "--output-tokens"),
        "tenants": [t for t in tenants.split(",") if t],
        "priority_class": priority_class,
    }
    rates = [float(r) for r in rate.split(",") if r.strip()]
    runs = asyncio.run(_sweep(target, rates, workload, concurrency_limit))
    _print(runs)
    if output is not None:
        config = {
            "url": url,
            "transport": transport,
            "model": model,
            "temperature": temperature,
            "concurrency_limit": concurrency_limit,
            **workload,
        }
        output.parent.mkdir(parents=True, exist_ok=True)
        output.write_text(json.dumps(_jsonable({"config": config, "runs": runs}), indent=1))
        typer.echo(f"wrote {output}")
    if plot_dir is not None:
        for path in write_plots(runs, plot_dir):
            typer.echo(f"wrote {path}")
    if any(run["summary"]["num_errors"] for run in runs):
        first = next(r["error"] for run in runs for r in run["results"] if r["error"])
        typer.echo(f"some requests failed; first error: {first}", err=True)
        raise typer.Exit(1)


async def _sweep(
    target: Any, rates: list[float], workload: dict[str, Any], limit: int | None
) -> list[dict[str, Any]]:
    from rich.progress import Progress

    from quanta.bench.client import poisson_requests, replay, summarize

    runs = []
    with Progress(transient=False) as progress:
        for r in rates:
            requests = poisson_requests(
                workload["num_requests"],
                r,
                seed=workload["seed"],
                prompt_tokens=workload["prompt_tokens"],
                output_tokens=workload["output_tokens"],
                tenants=workload["tenants"] or ["default"],
                priority_class=workload["priority_class"],
            )
            task = progress.add_task(f"rate {r:g} req/s", total=len(requests))
            results = await replay(
                requests,
                target,
                concurrency_limit=limit,
                on_result=lambda _, task=task: progress.advance(task),
            )
            runs.append(
                {
                    "rate": r,
                    "summary": summarize(results),
                    "results": [x.to_dict() for x in results],
                }
            )
    return runs


def _print(runs: list[dict[str, Any]]) -> None:
    from rich.console import Console
    from rich.table import Table

    table = Table(title="quanta bench serve (latencies in ms: mean / p50 / p99)")
    for col in ("rate", "ok/err", "req/s", "tok/s", "TTFT", "TPOT", "E2E", "norm. lat."):
        table.add_column(col, justify="right")
    for run in runs:
        s = run["summary"]
        ok = s["num_requests"] - s["num_errors"]
        cells = [f"{run['rate']:g}", f"{ok}/{s['num_errors']}"]
        if ok:
            cells += [f"{s['request_throughput']:.2f}", f"{s['output_token_throughput']:.1f}"]
            for key in ("ttft_s", "tpot_s", "e2e_s", "normalized_latency_s"):
                st = s[key]
                cells.append(" / ".join(_ms(st[k]) for k in ("mean", "p50", "p99")))
        table.add_row(*cells)
    Console().print(table)


def write_plots(runs: list[dict[str, Any]], out_dir: Path) -> list[Path]:
    """Latency vs rate (mean and p99), and CDFs of TTFT and TPOT per rate, as PNGs."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from quanta.bench.client import ClientResult

    out_dir.mkdir(parents=True, exist_ok=True)
    rates = [run["rate"] for run in runs]
    paths = []
    fig, axes = plt.subplots(1, 3, figsize=(13, 3.8))
    for ax, key, title in zip(
        axes,
        ("ttft_s", "tpot_s", "normalized_latency_s"),
        ("TTFT", "TPOT", "normalized latency"),
        strict=True,
    ):
        for stat in ("mean", "p99"):
            ax.plot(rates, [run["summary"].get(key, {}).get(stat) for run in runs], "o-")
        ax.set(xlabel="request rate (req/s)", ylabel="seconds", title=title)
        ax.legend(["mean", "p99"])
    paths.append(_save(fig, out_dir / "latency_vs_rate.png"))
    for key, title in (("ttft", "TTFT"), ("tpot", "time per output token")):
        fig, ax = plt.subplots(figsize=(5, 3.8))
        for run in runs:
            results = [ClientResult(**r) for r in run["results"] if r["error"] is None]
            values = sorted(v for v in (getattr(r, key) for r in results) if v is not None)
            if values:
                ax.plot(values, [(i + 1) / len(values) for i in range(len(values))])
        ax.set(xlabel="seconds", ylabel="fraction of requests", title=f"CDF of {title}")
        ax.legend([f"{r:g} req/s" for r in rates])
        paths.append(_save(fig, out_dir / f"cdf_{key}.png"))
    return paths


def _save(fig: Any, path: Path) -> Path:
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    import matplotlib.pyplot as plt

    plt.close(fig)
    return path


def _range(text: str, option: str) -> tuple[int, int]:
    try:
        lo, hi = (int(x) for x in text.split(":"))
    except ValueError:
        raise typer.BadParameter(f"{option} takes lo:hi, got {text!r}") from None
    if not 0 < lo <= hi:
        raise typer.BadParameter(f"{option} needs 0 < lo <= hi, got {text!r}")
    return lo, hi


def _ms(seconds: float | None) -> str:
    return "-" if seconds is None or math.isnan(seconds) else f"{seconds * 1000:.1f}"


def _jsonable(value: Any) -> Any:
    """NaN -> None, tuples -> lists: strict JSON for other tools."""
    if isinstance(value, float) and not math.isfinite(value):
        return None if math.isnan(value) else str(value)
    if isinstance(value, dict):
        return {k: _jsonable(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_jsonable(v) for v in value]
    return value

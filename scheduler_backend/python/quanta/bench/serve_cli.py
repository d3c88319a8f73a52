"""``quanta bench serve``: replay a workload against a live endpoint, one run per rate
(``quanta bench workload``, which writes the files, is ``quanta.bench.workload_cli``).

The workload is a file in the shared JSONL format (or a BurstGPT or Azure CSV trace), or
generated: Poisson or Gamma arrivals, lengths from a named distribution or uniform ranges, and
a weighted tenant mix. A generated workload uses the same seed at every rate, so rates see the
same requests; a file is replayed at its own times (divided by ``--time-scale``), or stretched
to each ``--rate`` (``scale_to_rate``); ``--token-scale`` and ``--too-long`` act as in every
tool that reads a file (``quanta.workloads.load_workload``). Calls of multi-call interactions
(``--dataset agents`` files) wait for the call before them and are abandoned after one failed
or was throttled, as in the simulator (``quanta.bench.client``). Writes every request's raw
timings, a summary per rate (``quanta.metrics``) and FairServe's fairness figures
(``quanta.bench.fairness``) to ``--output`` (JSON), prints the summaries, and with
``--plot-dir`` draws latency-vs-rate and CDF plots (matplotlib, imported only then). With an
SLO (``--slo-preset``, or ``--ttft-slo`` with ``--tpot-slo``/``--tbt-slo``; ``quanta.slo``) the
requests carry it and each summary adds goodput and Apt-Serve's ``slo_attainment`` (a
fraction). It exits with 1 when a request failed for any reason but a throttle (or a call
abandoned after one).
"""

from __future__ import annotations

import asyncio
import json
import math
from pathlib import Path
from typing import Annotated, Any

import typer

from quanta.bench.workload_spec import parse_range, spec_from_options
from quanta.cli_options import SloPresetOpt, TbtSloOpt
from quanta.workloads import WorkloadRequest
from quanta.workloads.options import TimeScaleOpt, TokenScaleOpt, TooLongOpt


def register(app: typer.Typer, bench_app: typer.Typer) -> None:
    """Add ``bench serve`` and ``bench workload``."""
    from quanta.bench.workload_cli import bench_workload

    bench_app.command("serve")(bench_serve)
    bench_app.command("workload")(bench_workload)


_WORKLOAD_HELP = (
    "a workload file (JSONL, BurstGPT or Azure CSV) or sharegpt, alpaca, humaneval, longbench"
)


def bench_serve(
    url: Annotated[
        str,
        typer.Option(help="gRPC host:port, Triton HTTP http://host:port, or an OpenAI base URL"),
    ],
    transport: Annotated[str, typer.Option(help="grpc, http or openai")] = "grpc",
    model: Annotated[str, typer.Option(help="model name")] = "quanta",
    workload: Annotated[
        str | None, typer.Option(help=_WORKLOAD_HELP + "; default: uniform lengths")
    ] = None,
    rate: Annotated[
        str | None,
        typer.Option(
            help="requests/s, comma-separated for a sweep; inf. Default: 1, or a file's own times"
        ),
    ] = None,
    num_requests: Annotated[
        int | None,
        typer.Option(min=1, help="requests per rate (default: 32, or all of a file: its first N)"),
    ] = None,
    seed: Annotated[int, typer.Option(help="seed of arrivals, lengths and tenants")] = 0,
    cv: Annotated[float, typer.Option(help="arrival burstiness (1: Poisson)")] = 1.0,
    time_scale: TimeScaleOpt = 1.0,
    token_scale: TokenScaleOpt = 1.0,
    too_long: TooLongOpt = "error",
    max_len: Annotated[
        int, typer.Option(min=2, help="the served model's length: prompt + output must fit")
    ] = 2048,
    prompt_tokens: Annotated[str, typer.Option(help="uniform prompt length lo:hi")] = "16:64",
    output_tokens: Annotated[str, typer.Option(help="uniform output length lo:hi")] = "8:32",
    tenants: Annotated[
        str, typer.Option(help='weighted tenants, e.g. "gold:1,abuser:10" (no weight: 1)')
    ] = "default",
    priority_class: Annotated[str, typer.Option(help="online or offline")] = "online",
    concurrency_limit: Annotated[
        int | None, typer.Option(min=1, help="at most this many requests in flight")
    ] = None,
    temperature: Annotated[float, typer.Option(min=0.0)] = 0.0,
    token_id_range: Annotated[str, typer.Option(help="ids of synthetic prompts lo:hi")] = "10:250",
    metadata: Annotated[
        bool, typer.Option(help="send tenant, app, class, SLOs (off for peers that reject them)")
    ] = True,
    ttft_slo: Annotated[float | None, typer.Option(help="TTFT SLO (s) for goodput")] = None,
    tpot_slo: Annotated[float | None, typer.Option(help="TPOT SLO (s) for goodput")] = None,
    tbt_slo: TbtSloOpt = None,
    slo_preset: SloPresetOpt = None,
    delay_threshold: Annotated[
        float,
        typer.Option(
            min=0.0, help="fairness: a user is delayed when a call's TTFT exceeds this (s)"
        ),
    ] = 2.0,
    timeout: Annotated[float, typer.Option(help="seconds one request may take")] = 600.0,
    output: Annotated[Path | None, typer.Option(help="write raw results + summaries here")] = None,
    plot_dir: Annotated[Path | None, typer.Option(help="write PNG plots here")] = None,
) -> None:
    """Replay a workload at each rate with real timing; print the summaries."""
    from quanta.bench.client import TRANSPORTS, Target
    from quanta.slo import resolve_slo, with_slo
    from quanta.workloads import WorkloadError

    if transport not in TRANSPORTS:
        raise typer.BadParameter(f"--transport must be one of {', '.join(TRANSPORTS)}")
    try:
        slo = resolve_slo(ttft=ttft_slo, tpot=tpot_slo, tbt=tbt_slo, preset=slo_preset)
    except ValueError as exc:
        raise typer.BadParameter(str(exc), param_hint="--slo-preset/--ttft-slo") from None
    target = Target(
        url=url,
        transport=transport,  # type: ignore[arg-type]
        model=model,
        temperature=temperature,
        timeout_s=timeout,
        token_id_range=parse_range(token_id_range, "--token-id-range"),
        send_metadata=metadata,
    )
    spec = spec_from_options(
        workload, num_requests, seed, cv, prompt_tokens, output_tokens, tenants,
        priority_class, max_len, time_scale, token_scale, too_long,
    )  # fmt: skip
    generated = workload is None or not Path(workload).is_file()
    rates: list[float | None] = [float(r) for r in (rate or "").split(",") if r.strip()]
    if not rates:
        rates = [1.0] if generated else [None]
    try:
        plans = [(r, spec.build(r)) for r in rates]
    except WorkloadError as exc:
        raise typer.BadParameter(str(exc), param_hint="--workload") from None
    if slo is not None:  # sent with each request (unless its row has its own), as simulated
        plans = [(r, with_slo(rows, slo)) for r, rows in plans]
    runs = asyncio.run(_sweep(target, plans, concurrency_limit, slo, delay_threshold))
    _print(runs)
    if output is not None:
        config = {
            "url": url,
            "transport": transport,
            "model": model,
            "temperature": temperature,
            "concurrency_limit": concurrency_limit,
            "workload": {k: getattr(spec, k) for k in spec.__slots__},
        }
        output.parent.mkdir(parents=True, exist_ok=True)
        output.write_text(json.dumps(_jsonable({"config": config, "runs": runs}), indent=1))
        typer.echo(f"wrote {output}")
    if plot_dir is not None:
        for path in write_plots(runs, plot_dir):
            typer.echo(f"wrote {path}")
    failed = [r for run in runs for r in run["results"] if _failed(r)]
    if failed:
        typer.echo(f"some requests failed; first error: {failed[0]['error']}", err=True)
        raise typer.Exit(1)


def _failed(result: dict[str, Any]) -> bool:
    """An error that is not the server's throttle, nor a call abandoned after one."""
    from quanta.bench.client import ClientResult

    res = ClientResult(**result)
    return res.error is not None and not (res.throttled or res.abandoned)


async def _sweep(
    target: Any,
    plans: list[tuple[float | None, list[WorkloadRequest]]],
    limit: int | None,
    slo: Any,
    delay_threshold_s: float = 2.0,
) -> list[dict[str, Any]]:
    from rich.progress import Progress

    from quanta.bench.client import replay, to_client_requests
    from quanta.bench.fairness import live_fairness
    from quanta.metrics import from_client_results, summarize

    runs = []
    with Progress(transient=False) as progress:
        for r, rows in plans:
            label = "file times" if r is None else f"rate {r:g} req/s"
            task = progress.add_task(label, total=len(rows))
            results = await replay(
                to_client_requests(rows),
                target,
                concurrency_limit=limit,
                on_result=lambda _, task=task: progress.advance(task),
            )
            runs.append(
                {
                    "rate": r,
                    "offered_rate": r if r is not None else _offered_rate(rows),
                    "summary": summarize(from_client_results(results, rows), slo),
                    "fairness": live_fairness(rows, results, delay_threshold_s=delay_threshold_s),
                    "results": [x.to_dict() for x in results],
                }
            )
    return runs


def _offered_rate(rows: list[WorkloadRequest]) -> float:
    """Arrivals per second of a replayed file: (n - 1) / span; inf when all arrive at once."""
    last = max((r.arrival_time for r in rows), default=0.0)
    return (len(rows) - 1) / last if last > 0 else math.inf


def _label(run: dict[str, Any]) -> str:
    rate = f"{run['offered_rate']:g}"
    return rate if run["rate"] is not None else f"{rate} (file)"


def _print(runs: list[dict[str, Any]]) -> None:
    from rich.console import Console
    from rich.table import Table

    table = Table(title="quanta bench serve (latencies in ms: mean / p50 / p99)")
    for col in ("rate", "ok/err", "req/s", "tok/s", "TTFT", "TPOT", "E2E", "norm. lat."):
        table.add_column(col, justify="right")
    for run in runs:
        s = run["summary"]
        ok = s["num_requests"] - s["num_errors"]
        cells = [_label(run), f"{ok}/{s['num_errors']}"]
        if ok:
            cells += [f"{s['request_throughput']:.2f}", f"{s['output_token_throughput']:.1f}"]
            for key in ("ttft_s", "tpot_s", "e2e_s", "normalized_latency_s"):
                st = s[key]
                cells.append(" / ".join(_ms(st[k]) for k in ("mean", "p50", "p99")))
        table.add_row(*cells)
    console = Console()
    console.print(table)
    for run in runs:
        f = run["fairness"]
        console.print(
            f"fairness at {_label(run)} req/s: {f['completed_interactions']}/"
            f"{f['num_interactions']} interactions answered, {f['throttled_requests']} calls "
            f"throttled, {f['abandoned_requests']} abandoned, {f['wasted_tokens']} wasted "
            f"tokens; users served {_share(f['served_users_fraction'])}, delayed "
            f"{_share(f['delayed_users_fraction'])}; Jain {f['jain_index']:.3f}"
        )
        s = run["summary"]
        if "slo_attainment" in s:
            limits = s["slo"]
            console.print(
                f"SLO attainment at {_label(run)} req/s: {_percent(s['slo_attainment'])} "
                f"(TTFT <= {limits['ttft_s']:g} s and P99 TBT <= {limits['tbt_s']:g} s; "
                f"goodput {s['goodput_rps']:.2f} req/s)"
            )


def write_plots(runs: list[dict[str, Any]], out_dir: Path) -> list[Path]:
    """Latency vs rate (mean and p99), and CDFs of TTFT and TPOT per rate, as PNGs."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from quanta.bench.client import ClientResult

    out_dir.mkdir(parents=True, exist_ok=True)
    rates = [run["offered_rate"] for run in runs]
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
        ax.legend([f"{_label(run)} req/s" for run in runs])
        paths.append(_save(fig, out_dir / f"cdf_{key}.png"))
    return paths


def _save(fig: Any, path: Path) -> Path:
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    import matplotlib.pyplot as plt

    plt.close(fig)
    return path


def _share(fraction: float) -> str:
    return "-" if math.isnan(fraction) else f"{fraction:.0%}"


def _percent(fraction: float) -> str:
    return "-" if math.isnan(fraction) else f"{100 * fraction:.1f}%"


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

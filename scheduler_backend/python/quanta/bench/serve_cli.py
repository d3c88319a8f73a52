"""``quanta bench serve``: replay a workload against a live endpoint, one run per rate; and
``quanta bench workload``: write a seeded workload file, or convert a trace to one.

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
``--plot-dir`` draws latency-vs-rate and CDF plots (matplotlib, imported only then). It exits
with 1 when a request failed for any reason but a throttle (or a call abandoned after one).
"""

from __future__ import annotations

import asyncio
import json
import math
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Annotated, Any

import typer

from quanta.workloads import TooLong, WorkloadRequest
from quanta.workloads.options import TimeScaleOpt, TokenScaleOpt, TooLongOpt


def register(app: typer.Typer, bench_app: typer.Typer) -> None:
    """Add ``bench serve`` and ``bench workload``."""
    bench_app.command("serve")(bench_serve)
    bench_app.command("workload")(bench_workload)


@dataclass(frozen=True, slots=True)
class WorkloadSpec:
    """What to replay: a file, or how to generate requests (seeded)."""

    source: str | None = None  # a JSONL/CSV file or a dataset name; None: uniform lengths
    num_requests: int | None = None  # None: all of a file, or 32 generated
    seed: int = 0
    cv: float = 1.0
    prompt_tokens: tuple[int, int] = (16, 64)
    output_tokens: tuple[int, int] = (8, 32)
    tenants: str = "default"
    priority_class: str = "online"
    max_len: int = 2048  # the model's: prompt + output must fit
    time_scale: float = 1.0  # a file's: its inter-arrival times are divided by it
    token_scale: float = 1.0  # a file's: its prompt lengths are multiplied by it
    too_long: TooLong = "error"  # a file's rows that do not fit max_len

    def build(self, rate: float | None) -> list[WorkloadRequest]:
        """The requests at ``rate`` (None: a file's own times; required to generate)."""
        from quanta import workloads as wl

        if self.source is not None and self.source not in wl.DATASETS:
            if not Path(self.source).is_file():
                known = ", ".join(sorted(wl.DATASETS))
                raise wl.WorkloadError(f"{self.source!r} is neither a file nor a dataset ({known})")
            if rate is not None and self.time_scale != 1.0:
                raise wl.WorkloadError("a file is stretched to --rate or sped up by --time-scale")
            rows = wl.load_workload(
                self.source,
                rate=rate,
                cv=self.cv,
                seed=self.seed,
                limit=self.num_requests,
                time_scale=self.time_scale,
                token_scale=self.token_scale,
                too_long=self.too_long,
                max_len=self.max_len,
            )
            rows = wl.rebase(rows)
            if rate is None or not any(r.arrival_time for r in rows):
                return rows
            if math.isinf(rate):
                return [replace(r, arrival_time=0.0) for r in rows]
            return wl.scale_to_rate(rows, rate)
        if self.time_scale != 1.0 or self.token_scale != 1.0:
            raise wl.WorkloadError(
                "--time-scale and --token-scale rescale a workload file; a generated "
                "workload's rate is --rate and its lengths are the dataset's or the ranges'"
            )
        if rate is None:
            raise wl.WorkloadError("a generated workload needs --rate")
        lengths = self.source or wl.UniformLengths(self.prompt_tokens, self.output_tokens)
        tenants = [
            replace(t, priority_class=self.priority_class) for t in wl.tenant_mix(self.tenants)
        ]
        return wl.synthesize(
            32 if self.num_requests is None else self.num_requests,
            arrivals=rate,
            cv=self.cv,
            lengths=lengths,
            tenants=tenants,
            seed=self.seed,
            max_len=self.max_len,
            id_prefix=f"s{self.seed}-r",
        )


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
    from quanta.metrics import SLO
    from quanta.workloads import WorkloadError

    if transport not in TRANSPORTS:
        raise typer.BadParameter(f"--transport must be one of {', '.join(TRANSPORTS)}")
    if (ttft_slo is None) != (tpot_slo is None):
        raise typer.BadParameter("give both --ttft-slo and --tpot-slo, or neither")
    target = Target(
        url=url,
        transport=transport,  # type: ignore[arg-type]
        model=model,
        temperature=temperature,
        timeout_s=timeout,
        token_id_range=parse_range(token_id_range, "--token-id-range"),
        send_metadata=metadata,
    )
    spec = _spec(workload, num_requests, seed, cv, prompt_tokens, output_tokens, tenants,
                 priority_class, max_len, time_scale, token_scale, too_long)  # fmt: skip
    generated = workload is None or not Path(workload).is_file()
    rates: list[float | None] = [float(r) for r in (rate or "").split(",") if r.strip()]
    if not rates:
        rates = [1.0] if generated else [None]
    try:
        plans = [(r, spec.build(r)) for r in rates]
    except WorkloadError as exc:
        raise typer.BadParameter(str(exc), param_hint="--workload") from None
    slo = SLO(ttft_s=ttft_slo, tpot_s=tpot_slo) if ttft_slo is not None else None
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


def bench_workload(
    out: Annotated[Path, typer.Argument(help="JSONL file to write")],
    dataset: Annotated[
        str | None,
        typer.Option(
            help="sharegpt, alpaca, humaneval, longbench, or agents (FairServe-like "
            "multi-call interactions of --num-users users and --abusers); default uniform"
        ),
    ] = None,
    trace: Annotated[
        Path | None,
        typer.Option(
            help="convert this workload file (JSONL, BurstGPT or Azure CSV) instead of "
            "generating one: its first --num-requests requests, at its own times"
        ),
    ] = None,
    num_requests: Annotated[
        int | None, typer.Option(min=1, help="default: 100, or all of a --trace")
    ] = None,
    rate: Annotated[
        float | None,
        typer.Option(help="requests/s (inf: all at once); default 1, or a --trace's own times"),
    ] = None,
    cv: Annotated[float, typer.Option(help="arrival burstiness (1: Poisson)")] = 1.0,
    seed: Annotated[int, typer.Option()] = 0,
    prompt_tokens: Annotated[str, typer.Option(help="uniform prompt length lo:hi")] = "16:64",
    output_tokens: Annotated[str, typer.Option(help="uniform output length lo:hi")] = "8:32",
    tenants: Annotated[str, typer.Option(help='weighted tenants, e.g. "gold:1,abuser:10"')] = (
        "default"
    ),
    priority_class: Annotated[str, typer.Option(help="online or offline")] = "online",
    max_len: Annotated[int, typer.Option(min=2, help="prompt + output must fit")] = 2048,
    time_scale: TimeScaleOpt = 1.0,
    token_scale: TokenScaleOpt = 1.0,
    too_long: TooLongOpt = "error",
    num_users: Annotated[
        int | None, typer.Option(min=0, help="--dataset agents: benign users (default 20)")
    ] = None,
    abusers: Annotated[
        int | None,
        typer.Option(min=0, help="--dataset agents: users starting interactions 15x as often"),
    ] = None,
) -> None:
    """Write a seeded workload in the JSONL format ``bench serve``, ``simulate`` and Locust
    read, or convert a trace to it (see ``quanta.workloads`` for the format and the Python
    API for richer mixes)."""
    from quanta.workloads import WorkloadError, save_workload

    if dataset is not None and Path(dataset).is_file():
        raise typer.BadParameter(
            "give a dataset name, not a file (--trace converts a file)", param_hint="--dataset"
        )
    if dataset is not None and trace is not None:
        raise typer.BadParameter("give --dataset or --trace, not both", param_hint="--trace")
    if trace is not None and not trace.is_file():
        raise typer.BadParameter(f"no file {trace}", param_hint="--trace")
    if num_requests is None and trace is None:
        num_requests = 100
    if rate is None and trace is None:
        rate = 1.0
    if dataset == "agents" or num_users is not None or abusers is not None:
        if dataset != "agents":
            raise typer.BadParameter("--num-users and --abusers need --dataset agents")
        if tenants != "default" or time_scale != 1.0 or token_scale != 1.0:
            raise typer.BadParameter(
                "--dataset agents makes its own users and lengths: use --num-users and "
                "--abusers, not --tenants, --time-scale or --token-scale"
            )
        assert num_requests is not None and rate is not None  # NOTE: defaulted above
        rows = _agents(num_requests, rate, seed, cv, max_len, num_users, abusers)
        typer.echo(f"wrote {save_workload(out, rows)} ({len(rows)} requests)")
        return
    source = str(trace) if trace is not None else dataset
    spec = _spec(source, num_requests, seed, cv, prompt_tokens, output_tokens, tenants,
                 priority_class, max_len, time_scale, token_scale, too_long)  # fmt: skip
    try:
        rows = spec.build(rate)
    except WorkloadError as exc:
        raise typer.BadParameter(str(exc)) from None
    typer.echo(f"wrote {save_workload(out, rows)} ({len(rows)} requests)")


def _agents(
    num_requests: int,
    rate: float,
    seed: int,
    cv: float,
    max_len: int,
    num_users: int | None,
    abusers: int | None,
) -> list[WorkloadRequest]:
    """``bench workload --dataset agents`` (``quanta.workloads.agents``)."""
    from quanta.workloads import WorkloadError, agents

    users = 20 if num_users is None else num_users
    try:
        return agents(
            num_requests, rate, num_users=users, abusers=abusers or 0, seed=seed, cv=cv,
            max_len=max_len, id_prefix=f"s{seed}-r",
        )  # fmt: skip
    except WorkloadError as exc:
        raise typer.BadParameter(str(exc)) from None


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


def _spec(
    source: str | None,
    num_requests: int | None,
    seed: int,
    cv: float,
    prompt_tokens: str,
    output_tokens: str,
    tenants: str,
    priority_class: str,
    max_len: int = 2048,
    time_scale: float = 1.0,
    token_scale: float = 1.0,
    too_long: TooLong = "error",
) -> WorkloadSpec:
    """The ``WorkloadSpec`` of the shared command-line options."""
    return WorkloadSpec(
        source=source,
        num_requests=num_requests,
        seed=seed,
        cv=cv,
        prompt_tokens=parse_range(prompt_tokens, "--prompt-tokens"),
        output_tokens=parse_range(output_tokens, "--output-tokens"),
        tenants=tenants,
        priority_class=priority_class,
        max_len=max_len,
        time_scale=time_scale,
        token_scale=token_scale,
        too_long=too_long,
    )


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


def parse_range(text: str, option: str) -> tuple[int, int]:
    """``lo:hi`` of a length option, with 0 < lo <= hi."""
    try:
        lo, hi = (int(x) for x in text.split(":"))
    except ValueError:
        raise typer.BadParameter(f"{option} takes lo:hi, got {text!r}") from None
    if not 0 < lo <= hi:
        raise typer.BadParameter(f"{option} needs 0 < lo <= hi, got {text!r}")
    return lo, hi


def _share(fraction: float) -> str:
    return "-" if math.isnan(fraction) else f"{fraction:.0%}"


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

"""``quanta bench workload``: write a seeded workload file (uniform lengths, a named dataset,
FairServe-like agents or multi-turn chat), or convert a trace file to the shared JSONL
format."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from quanta.bench.workload_spec import spec_from_options
from quanta.workloads import WorkloadRequest
from quanta.workloads.options import TimeScaleOpt, TokenScaleOpt, TooLongOpt


def bench_workload(
    out: Annotated[Path, typer.Argument(help="JSONL file to write")],
    dataset: Annotated[
        str | None,
        typer.Option(
            help="sharegpt, alpaca, humaneval, longbench, agents (FairServe-like "
            "multi-call interactions of --num-users users and --abusers), or chat "
            "(multi-turn conversations, each turn resending the conversation so far); "
            "default uniform"
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
    if dataset == "chat":
        if tenants != "default" or time_scale != 1.0 or token_scale != 1.0:
            raise typer.BadParameter(
                "--dataset chat makes its own conversations and lengths: not --tenants, "
                "--time-scale or --token-scale"
            )
        assert num_requests is not None and rate is not None  # NOTE: defaulted above
        rows = _chat(num_requests, rate, seed, cv, max_len)
        typer.echo(f"wrote {save_workload(out, rows)} ({len(rows)} requests)")
        return
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
    spec = spec_from_options(
        source, num_requests, seed, cv, prompt_tokens, output_tokens, tenants,
        priority_class, max_len, time_scale, token_scale, too_long,
    )  # fmt: skip
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


def _chat(
    num_requests: int, rate: float, seed: int, cv: float, max_len: int
) -> list[WorkloadRequest]:
    """``bench workload --dataset chat`` (``quanta.workloads.chat``)."""
    from quanta.workloads import WorkloadError, chat

    try:
        return chat(num_requests, rate, seed=seed, cv=cv, max_len=max_len, id_prefix=f"s{seed}-r")
    except WorkloadError as exc:
        raise typer.BadParameter(str(exc)) from None

"""``quanta simulate``: a seeded workload on the cost model with the real loop and policy;
registered on the lead's Typer app by ``register``. The lab (``quanta_lab.sim.cli``) adds
``simulate repro`` and ``simulate validate`` to the same group.

Heavy imports happen inside the commands so that ``quanta --help`` stays fast and torch-free.
"""

from __future__ import annotations

import json
from enum import StrEnum
from pathlib import Path
from typing import Annotated, Any

import typer

from quanta.cli_options import (
    RouterOpt,
    SloPresetOpt,
    TbtSloOpt,
    tensor_parallel_option,
)
from quanta.config.cli import env_prefix, options_from
from quanta.config.models import CacheArgs, EngineArgs, SchedulerArgs
from quanta.workloads.options import TimeScaleOpt, TokenScaleOpt, TooLongOpt


class OnOff(StrEnum):
    on = "on"
    off = "off"


# The simulator's own defaults of the shared options: a paper's batch, not the engine's.
SIM_DEFAULTS: dict[str, Any] = {
    "policy": "sj-mlfq",
    "max_num_seqs": 16,
    "max_num_batched_tokens": 2048,
    "block_size": 16,
    "enable_prefix_caching": True,
}
SIM_LIMITS = {"max_num_seqs", "max_num_batched_tokens"}


@options_from(
    scheduler=SchedulerArgs,
    cache=CacheArgs,
    engine=EngineArgs,
    only={
        "scheduler": ("policy", "policy_option", "max_num_seqs", "max_num_batched_tokens"),
        "cache": ("block_size", "device_blocks", "host_blocks"),
        "engine": ("enable_prefix_caching",),
    },
    defaults=SIM_DEFAULTS,
)
def simulate_cmd(
    ctx: typer.Context,
    workload: Annotated[
        str,
        typer.Option(
            help="sharegpt, alpaca, humaneval, longbench, agents (multi-call interactions, "
            "FairServe-like), chat (multi-turn conversations), or a workload file (the JSONL "
            "of quanta bench workload, a BurstGPT or an Azure LLM trace CSV); its tenants "
            "and classes reach the policy"
        ),
    ] = "sharegpt",
    rate: Annotated[float, typer.Option(help="arrivals per second")] = 1.0,
    num_requests: Annotated[
        int, typer.Option(min=1, help="requests; of a file: its first N by arrival")
    ] = 500,
    profile: Annotated[str, typer.Option(help="cost-model preset or profile JSON")] = (
        "a100-opt13b"
    ),
    seed: Annotated[int, typer.Option()] = 0,
    cv: Annotated[float, typer.Option(help="arrival CV: 1 Poisson, >1 bursty Gamma")] = 1.0,
    io_ratio: Annotated[float | None, typer.Option(help="rescale to mean in/out ratio")] = None,
    time_scale: TimeScaleOpt = 1.0,
    token_scale: TokenScaleOpt = 1.0,
    too_long: TooLongOpt = "error",
    num_users: Annotated[
        int | None, typer.Option(min=0, help="--workload agents: benign users (default 20)")
    ] = None,
    abusers: Annotated[
        int | None, typer.Option(min=0, help="--workload agents: abusive users (default 0)")
    ] = None,
    abuse_factor: Annotated[
        float | None,
        typer.Option(
            min=1.0,
            help="--workload agents: how many times as often an abuser starts "
            "interactions as a benign user (default 15)",
        ),
    ] = None,
    tenants: Annotated[
        str | None,
        typer.Option(
            help="each request's tenant drawn by weight, e.g. victim:1,sybil*:8: a name is "
            "an authenticated tenant's (an API key's) unless it ends in ? (a name the client "
            "chose) or * (a fresh name for every request); not with agents or chat"
        ),
    ] = None,
    delay_threshold: Annotated[
        float, typer.Option(min=0.0, help="seconds queued that make a user delayed (fairness)")
    ] = 2.0,
    output: Annotated[Path | None, typer.Option(help="write the metrics JSON here")] = None,
    ttft_slo: Annotated[
        float | None, typer.Option(min=0.0, help="TTFT SLO (s) of SLO attainment")
    ] = None,
    tbt_slo: TbtSloOpt = None,
    slo_preset: SloPresetOpt = None,
    replicas: Annotated[
        int, typer.Option(min=1, help="engines behind one router on one virtual clock")
    ] = 1,
    router: Annotated[
        RouterOpt, typer.Option(help="how --replicas share the requests")
    ] = RouterOpt.least_outstanding,
    shared_state: Annotated[
        OnOff,
        typer.Option(
            help="on: the replicas' fair policies share one state (counters, windows, "
            "interactions), as with --state-url redis://...; off: each its own"
        ),
    ] = OnOff.off,
    tensor_parallel_size: Annotated[
        int,
        tensor_parallel_option(
            "split the profile's model over this many GPUs: 1/N of the weights, FLOPs "
            "and KV each, 2 all-reduces per layer over --allreduce-bandwidth, and each added "
            "GPU's free memory as KV space (a single-GPU profile)"
        ),
    ] = 1,
    allreduce_bandwidth: Annotated[
        float,
        typer.Option(min=1.0, help="GB/s of a ring all-reduce per GPU (NVLink 3 on A100: 230)"),
    ] = 230.0,
    *,
    scheduler: SchedulerArgs,
    cache: CacheArgs,
    engine: EngineArgs,
) -> None:
    """Serve a seeded workload on the cost model with the real loop and policy.

    With an SLO (``--slo-preset``, or ``--ttft-slo`` and ``--tbt-slo``) the requests carry it
    (those without their own) for SLO-aware policies, and the JSON's ``slo_attainment`` is
    the fraction of requests within it."""
    if ctx.invoked_subcommand is not None:
        return
    from quanta.core.config import SchedulerConfig
    from quanta.costmodel import load_profile, tensor_parallel
    from quanta.policies import parse_policy
    from quanta.sim import SimSetup, simulate, summarize
    from quanta.slo import resolve_slo, with_slo
    from quanta.workloads import WorkloadError, make_workload, with_io_ratio

    try:
        slo = resolve_slo(ttft=ttft_slo, tbt=tbt_slo, preset=slo_preset)
    except ValueError as exc:
        raise typer.BadParameter(str(exc), param_hint="--slo-preset/--ttft-slo/--tbt-slo") from None
    cost = load_profile(profile)
    try:
        cost = tensor_parallel(cost, tensor_parallel_size, bandwidth=allreduce_bandwidth * 1e9)
    except ValueError as exc:
        raise typer.BadParameter(str(exc), param_hint="--tensor-parallel-size") from None
    try:
        trace = make_workload(
            workload,
            num_requests,
            rate,
            seed=seed,
            cv=cv,
            max_len=cost.max_model_len,
            time_scale=time_scale,
            token_scale=token_scale,
            too_long=too_long,
            num_users=num_users,
            abusers=abusers,
            abuse_factor=abuse_factor,
            tenants=tenants,
        )
    except WorkloadError as exc:
        raise typer.BadParameter(str(exc), param_hint="--workload") from None
    if io_ratio is not None:
        trace = with_io_ratio(trace, io_ratio, cost.max_model_len)
    if slo is not None:
        trace = with_slo(trace, slo)
    sched = SchedulerConfig.model_validate(scheduler.model_dump(include=SIM_LIMITS))
    options = scheduler.policy_options()
    policy = scheduler.policy or SIM_DEFAULTS["policy"]
    try:
        parse_policy(policy, options)  # NOTE: names and options fail here, before any run
    except ValueError as exc:
        raise typer.BadParameter(str(exc), param_hint="--policy/--policy-option") from None
    setup = SimSetup(
        policy,
        cost,
        sched,
        cache.block_size or SIM_DEFAULTS["block_size"],
        cache.device_blocks,
        cache.host_blocks,
        options,
        prefix_caching=engine.enable_prefix_caching is not False,
    )
    if replicas == 1 and shared_state is OnOff.off:
        result = summarize(simulate(trace, setup), delay_threshold_s=delay_threshold, slo=slo)
    else:
        from quanta.sim.replicas import summarize_replicas

        result = summarize_replicas(
            trace,
            setup,
            replicas,
            router=router.value,
            shared_state=shared_state is OnOff.on,
            delay_threshold_s=delay_threshold,
            slo=slo,
        )
    result["workload"] = {
        "name": workload,
        "rate": rate,
        "num_requests": num_requests,
        "seed": seed,
        "cv": cv,
        "io_ratio": io_ratio,
        "time_scale": time_scale,
        "token_scale": token_scale,
        "too_long": too_long,
        **(
            {"num_users": num_users, "abusers": abusers, "abuse_factor": abuse_factor}
            if workload == "agents"
            else {}
        ),
    }
    for key in (
        "mean_normalized_latency",
        "p95_normalized_latency",
        "mean_ttft",
        "p95_ttft",
        "mean_tpot",
        "throughput_rps",
        "num_preemptions",
        "swap_out_blocks",
        "slo_attainment",
    ):
        typer.echo(f"{key:>24}: {result[key]}")
    fair = {k: v for k, v in result["fairness"].items() if k != "by_tenant"}
    typer.echo(f"{'fairness':>24}: {json.dumps(fair, sort_keys=True)}")
    typer.echo(f"{'prefix_cache_hit_rate':>24}: {_hit_rate(result['prefix_cache'])}")
    if output is not None:
        output.write_text(json.dumps(result, indent=2, sort_keys=True) + "\n")
        typer.echo(f"wrote {output}")


def _hit_rate(figures: dict[str, Any]) -> str:
    """'rate (hits/queries tokens)', or why there is none."""
    if not figures.get("enabled", True):
        return "off"
    if figures["hit_rate"] is None:
        return "- (no lookup)"
    return f"{figures['hit_rate']:.3f} ({figures['hits']}/{figures['queries']} tokens)"


def register(app: typer.Typer, bench_app: typer.Typer) -> None:
    """Add ``quanta simulate`` to the ``quanta`` CLI; the lab adds its subcommands."""
    sim_app = typer.Typer(help="Simulate policies on a cost model (see `repro`).")
    sim_app.callback(invoke_without_command=True, context_settings=env_prefix("simulate"))(
        simulate_cmd
    )
    app.add_typer(sim_app, name="simulate")

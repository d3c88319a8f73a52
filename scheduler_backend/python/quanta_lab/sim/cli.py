"""The lab's simulator commands: ``quanta simulate repro`` and ``validate``, ``quanta profile``,
``quanta bench policies``, ``quanta bench scheduler`` and ``quanta bench schedule-step``;
attached to the ``quanta`` CLI by ``register``.

Heavy imports happen inside the commands so that ``quanta --help`` stays fast and torch-free.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated

import typer
from quanta.workloads.options import TokenScaleOpt, TooLongOpt

CalibrationOpt = Annotated[
    float,
    typer.Option(
        min=0,
        help="engine seconds of a serving replay the profile is refitted on (0: sweep only)",
    ),
]
StepRepeatsOpt = Annotated[
    int,
    typer.Option(
        min=1,
        help="time each engine step by its fastest of N runs (greedy steps without copies): "
        "keeps a shared machine's interference out of the measurement",
    ),
]


def repro_cmd(
    figure: Annotated[
        str,
        typer.Option(
            help="14, 15a, azure, all (FastServe), fair (FairServe), apt (Apt-Serve "
            "Tables 4 and 5), conserve (ConServe under ON/OFF load, needs --trace) or "
            "safepoints (ConServe's layer-level preemption against iteration-level, needs "
            "--trace)"
        ),
    ] = "all",
    output: Annotated[
        Path | None,
        typer.Option(
            help="markdown file whose tables are (re)written (default docs/results/fastserve.md; "
            "apt: docs/results/aptserve.md, conserve and safepoints: docs/results/conserve.md; "
            "none with --quick)"
        ),
    ] = None,
    num_requests: Annotated[
        int | None,
        typer.Option(
            min=1,
            help="jobs per point (default 500; apt: 1000; conserve: online requests, 360; "
            "safepoints: online requests, 30)",
        ),
    ] = None,
    seed: Annotated[int, typer.Option()] = 0,
    loads: Annotated[str, typer.Option(help="Fig. 14 loads, comma-separated")] = "0.7,0.9",
    jobs: Annotated[int, typer.Option(help="worker processes")] = 2,
    plots: Annotated[Path | None, typer.Option(help="directory for PNG plots")] = None,
    trace: Annotated[
        Path | None,
        typer.Option(help="Azure conversation trace CSV (azure's sweep, conserve's online load)"),
    ] = None,
    seeds: Annotated[
        str,
        typer.Option(help="seeds of the fair, apt and safepoints figures, comma-separated"),
    ] = "0,1,2",
    quick: Annotated[
        bool,
        typer.Option(
            help="apt: 40 requests per trace and seed 0; conserve: 24 online requests, "
            "safepoints: 4 "
            "(seconds, for a smoke test); the tables are printed, and written only to an "
            "explicit --output"
        ),
    ] = False,
) -> None:
    """Reproduce FastServe's Fig. 14 / Fig. 15, and the policies on a real trace,
    FairServe's comparison or Apt-Serve's ablations on the simulator; update the doc's
    tables."""
    from quanta_lab.sim.report import run_repro

    figures = ("14", "15a", "azure", "all", "fair", "apt", "conserve", "safepoints")
    if figure not in figures:
        raise typer.BadParameter(f"figure must be one of {', '.join(figures)}")
    if quick and figure not in ("apt", "conserve", "safepoints"):
        raise typer.BadParameter(
            "--quick shrinks the apt, conserve and safepoints figures only", param_hint="--quick"
        )
    if figure in ("azure", "conserve", "safepoints") and trace is None:
        raise typer.BadParameter(f"--figure {figure} needs --trace", param_hint="--trace")
    docs = {
        "apt": "docs/results/aptserve.md",
        "conserve": "docs/results/conserve.md",
        "safepoints": "docs/results/conserve.md",
    }
    if quick:
        num_requests = num_requests or {"conserve": 24, "safepoints": 4}.get(figure, 40)
        seeds = "0"
    elif output is None:
        output = Path(docs.get(figure, "docs/results/fastserve.md"))
    if num_requests is None:
        num_requests = {"apt": 1000, "conserve": 360, "safepoints": 30}.get(figure, 500)
    if figure == "safepoints":
        from quanta_lab.sim.safepoint_repro import safepoints_report

        assert trace is not None  # NOTE: checked above
        safepoints_report(
            trace,
            output,
            num_requests=num_requests,
            seeds=[int(x) for x in seeds.split(",")],
            jobs=jobs,
            echo=typer.echo,
        )
        return
    if figure == "conserve":
        from quanta_lab.sim.conserve_repro import conserve_report

        assert trace is not None  # NOTE: checked above
        conserve_report(
            trace, output, num_requests=num_requests, seed=seed, jobs=jobs, echo=typer.echo
        )
        return
    run_repro(
        figure,
        output,
        num_requests=num_requests,
        seed=seed,
        loads=[float(x) for x in loads.split(",")],
        jobs=jobs,
        plots=plots,
        trace=trace,
        seeds=[int(x) for x in seeds.split(",")],
        echo=typer.echo,
    )


def profile_cmd(
    model: Annotated[Path, typer.Option(help="checkpoint directory")],
    output: Annotated[Path, typer.Option(help="profile JSON to write")],
    dtype: Annotated[str | None, typer.Option(help="float32, float16, bfloat16")] = None,
    device: Annotated[str, typer.Option()] = "cpu",
    block_size: Annotated[int, typer.Option()] = 16,
    repeats: Annotated[int, typer.Option(min=1)] = 3,
    calibration_seconds: CalibrationOpt = 20.0,
    max_num_seqs: Annotated[int, typer.Option(help="batch limit of the calibration replay")] = 8,
) -> None:
    """Measure the real engine's iteration and swap times and fit a cost-model profile:
    a sweep of hand-built steps, then a short serving replay the fit is refined on."""
    from quanta.costmodel import save_profile

    from quanta_lab.sim.profile import profile_engine

    cost = profile_engine(
        model,
        dtype=dtype,
        device=device,
        block_size=block_size,
        repeats=repeats,
        echo=typer.echo,
        calibration_s=calibration_seconds,
        max_num_seqs=max_num_seqs,
    )
    save_profile(cost, output)
    typer.echo(f"wrote {output}")


def bench_policies_cmd(
    model: Annotated[Path | None, typer.Option(help="checkpoint dir (default: opt-tiny)")] = None,
    policies: Annotated[
        str,
        typer.Option(
            help="comma-separated; each a policy or POLICY:KEY=VALUE[:KEY=VALUE] "
            "(sj-mlfq:overload_after_s=12)"
        ),
    ] = "fcfs,sj-mlfq",
    num_requests: Annotated[int, typer.Option(min=1)] = 200,
    load: Annotated[float, typer.Option(help="rate as a multiple of estimated capacity")] = 2.0,
    rate: Annotated[float | None, typer.Option(help="arrivals/s (overrides --load)")] = None,
    seed: Annotated[int, typer.Option()] = 0,
    max_num_seqs: Annotated[int, typer.Option()] = 8,
    profile: Annotated[Path | None, typer.Option(help="profile JSON (default: measure)")] = None,
    workload: Annotated[
        str | None,
        typer.Option(
            help="a trace file (JSONL, BurstGPT or Azure CSV) instead of ShareGPT-like lengths; "
            "its arrivals are stretched to the rate, bursts kept"
        ),
    ] = None,
    token_scale: TokenScaleOpt = 1.0,
    too_long: TooLongOpt = "error",
    calibration_seconds: CalibrationOpt = 20.0,
) -> None:
    """The same seeded trace through the real loop on the real engine, per policy."""
    from quanta_lab.sim.bench import bench_policies

    bench_policies(
        model,
        [p for p in policies.split(",") if p],
        num_requests=num_requests,
        load=load,
        seed=seed,
        max_num_seqs=max_num_seqs,
        profile=profile,
        rate=rate,
        workload=workload,
        token_scale=token_scale,
        too_long=too_long,
        calibration_s=calibration_seconds,
        echo=typer.echo,
    )


def bench_scheduler_cmd(
    policies: Annotated[str, typer.Option()] = "sj-mlfq,fcfs",
    candidates: Annotated[str, typer.Option(help="comma-separated request counts")] = (
        "50,200,1600"
    ),
    repeats: Annotated[int, typer.Option(min=1)] = 20,
) -> None:
    """Time one schedule() call against the number of candidate requests."""
    from quanta_lab.sim.bench import bench_scheduler

    bench_scheduler(
        [p for p in policies.split(",") if p],
        [int(n) for n in candidates.split(",") if n],
        repeats=repeats,
        echo=typer.echo,
    )


def bench_schedule_step_cmd(
    policies: Annotated[str, typer.Option()] = "fcfs,sj-mlfq",
    waiting: Annotated[int, typer.Option(min=1, help="requests waiting behind the batch")] = 1600,
    workload: Annotated[
        str,
        typer.Option(
            help="whose prompts wait: chat (turns sharing their conversation and system "
            "prompt), agents, or sharegpt (unrelated prompts)"
        ),
    ] = "chat",
    warm: Annotated[
        bool,
        typer.Option(
            help="serve every waiting prompt once first, so each lookup finds its whole "
            "prompt cached (the lookups' worst case)"
        ),
    ] = False,
    max_num_seqs: Annotated[int, typer.Option(min=1, help="the batch that runs")] = 32,
    steps: Annotated[int, typer.Option(min=1, help="full-batch steps timed")] = 60,
) -> None:
    """Time a loop step up to the runner (prefix lookups, the policy, the applier) with
    WAITING requests waiting, with prefix caching off and on."""
    from quanta_lab.sim.step_time import bench_schedule_step, workload_prompts

    bench_schedule_step(
        [p for p in policies.split(",") if p],
        workload_prompts(workload, waiting),
        warm=warm,
        max_num_seqs=max_num_seqs,
        steps=steps,
        echo=typer.echo,
    )


def validate_cmd(
    model: Annotated[Path | None, typer.Option(help="checkpoint dir (default: opt-tiny)")] = None,
    policies: Annotated[
        str,
        typer.Option(
            help="comma-separated; each a policy or POLICY:KEY=VALUE[:KEY=VALUE] (apt:cache=kv), "
            "its options given to the engine and the simulator alike"
        ),
    ] = "fcfs,sj-mlfq",
    loads: Annotated[str, typer.Option(help="multiples of the estimated capacity")] = (
        "0.5,0.7,0.9"
    ),
    num_requests: Annotated[int, typer.Option(min=2)] = 200,
    seed: Annotated[int, typer.Option()] = 0,
    max_num_seqs: Annotated[int, typer.Option()] = 8,
    profile: Annotated[Path | None, typer.Option(help="profile JSON (default: fit one)")] = None,
    workload: Annotated[
        str | None,
        typer.Option(
            help="chat or agents (requests that share prefixes), or a trace file, instead of "
            "ShareGPT-like lengths x 0.25"
        ),
    ] = None,
    token_scale: TokenScaleOpt = 1.0,
    enable_prefix_caching: Annotated[
        bool,
        typer.Option(help="prefix caching in the engine and the simulator alike"),
    ] = True,
    output: Annotated[Path | None, typer.Option(help="write the rows as JSON here")] = None,
    plot: Annotated[Path | None, typer.Option(help="PNG of simulated / measured")] = None,
    repeats: Annotated[
        int, typer.Option(min=1, help="engine runs per cell (median; spread = noise floor)")
    ] = 3,
    calibration_seconds: CalibrationOpt = 20.0,
    step_repeats: StepRepeatsOpt = 1,
    length_scale: Annotated[
        float,
        typer.Option(min=0.01, help="ShareGPT-like lengths times this (smaller for slower models)"),
    ] = 0.25,
    num_users: Annotated[
        int | None, typer.Option(min=1, help="--workload agents: benign users (default 20)")
    ] = None,
    abusers: Annotated[
        int | None, typer.Option(min=0, help="--workload agents: abusive users (default 0)")
    ] = None,
    abuse_factor: Annotated[
        float | None,
        typer.Option(
            min=1.0,
            help="--workload agents: how many times as often an abuser starts interactions "
            "as a benign user (default 15)",
        ),
    ] = None,
    delay_threshold: Annotated[
        float | None,
        typer.Option(
            min=0.0,
            help="--workload agents: seconds queued that make a user delayed (default: "
            "FairServe's 2 s scaled to the engine's capacity)",
        ),
    ] = None,
    offline_backlog: Annotated[
        bool,
        typer.Option(
            help="serve the trace as ConServe's online load (ON/OFF phases) beside an "
            "offline backlog, cut off at the end of the last OFF phase; compares the online "
            "SLO, P99 TTFT and TPOT and the offline throughput"
        ),
    ] = False,
    ttft_slo: Annotated[
        float | None,
        typer.Option(
            min=0.0,
            help="TTFT SLO (s) every (online) request carries (default, for apt, conserve "
            "and --offline-backlog: the paper's, in the engine's decode steps)",
        ),
    ] = None,
    tbt_slo: Annotated[
        float | None, typer.Option(min=0.0, help="P99 TBT (and TPOT) SLO (s), with --ttft-slo")
    ] = None,
) -> None:
    """The same trace through the real engine and the simulator; the simulator's error.

    Besides latency: FairServe's figures with ``--workload agents`` (``--abusers``), ConServe's
    with ``--offline-backlog``, Apt-Serve's SLO attainment with an SLO (given, or scaled to
    the engine for ``apt`` and ``conserve``)."""
    from quanta.policies import parse_policy
    from quanta.slo import resolve_slo

    from quanta_lab.sim.bench import AgentUsers, EngineBench, parse_entry
    from quanta_lab.sim.validate import hit_rates, table, validate
    from quanta_lab.sim.validate import plot as plot_rows
    from quanta_lab.sim.validate_scenarios import FIGURE_GROUPS

    entries = [p for p in policies.split(",") if p]
    try:
        for entry in entries:
            parse_policy(*parse_entry(entry))  # NOTE: names and options fail here, before a run
    except ValueError as exc:
        raise typer.BadParameter(str(exc), param_hint="--policies") from None
    shaped = (num_users, abusers, abuse_factor)
    if workload != "agents" and (delay_threshold is not None or any(x is not None for x in shaped)):
        raise typer.BadParameter(
            "--num-users, --abusers, --abuse-factor and --delay-threshold shape and judge "
            "--workload agents only"
        )
    try:
        slo = resolve_slo(ttft=ttft_slo, tbt=tbt_slo)
    except ValueError as exc:
        raise typer.BadParameter(str(exc), param_hint="--ttft-slo/--tbt-slo") from None
    bench = EngineBench.create(
        model,
        profile,
        calibration_s=calibration_seconds,
        max_num_seqs=max_num_seqs,
        step_repeats=step_repeats,
        length_scale=length_scale,
        prefix_caching=enable_prefix_caching,
    )
    rows = validate(
        bench,
        entries,
        [float(x) for x in loads.split(",")],
        num_requests=num_requests,
        seed=seed,
        max_num_seqs=max_num_seqs,
        repeats=repeats,
        length_scale=length_scale,
        workload=workload,
        token_scale=token_scale,
        users=None if all(x is None for x in shaped) else AgentUsers(*shaped),
        offline_backlog=offline_backlog,
        slo=slo,
        delay_threshold_s=delay_threshold,
        echo=typer.echo,
    )
    typer.echo(table(rows, ("mean_ttft", "mean_tpot", "mean_e2e", "p95_normalized_latency")))
    for group in FIGURE_GROUPS:
        if group[0] in rows[0]["measured"]:
            typer.echo(table(rows, group))
    if enable_prefix_caching:
        typer.echo(hit_rates(rows))
    if output is not None:
        output.write_text(json.dumps(rows, indent=2) + "\n")
        typer.echo(f"wrote {output}")
    if plot is not None:
        drawn = plot_rows(rows, plot)
        typer.echo(f"wrote {drawn}" if drawn else "matplotlib is not installed: no plot")


def register(app: typer.Typer, sim_app: typer.Typer, bench_app: typer.Typer) -> None:
    """Add the paper reproductions, the validation, the profiler and the engine benchmarks."""
    sim_app.command("repro")(repro_cmd)
    sim_app.command("validate")(validate_cmd)
    app.command("profile")(profile_cmd)
    bench_app.command("policies")(bench_policies_cmd)
    bench_app.command("scheduler")(bench_scheduler_cmd)
    bench_app.command("schedule-step")(bench_schedule_step_cmd)

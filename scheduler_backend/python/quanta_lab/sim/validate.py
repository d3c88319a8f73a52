"""``quanta simulate validate``: the same trace through the real engine and through the
simulator, and how far the simulator's predictions are from what the engine did.

Every paper reproduction runs on the simulator; its numbers mean something only as far as the
simulator predicts the engine. Here both serve one seeded trace with the same policy, limits
and pools, at each load (a multiple of the estimated capacity): the engine on a virtual clock
advanced by each step's measured CPU time (``EngineBench``, as ``quanta bench policies``),
the simulator on the cost profile fitted to that engine (or given). The error of a figure is
(simulated - measured) / measured.

A shared machine is not a stable clock: the same fixed step, timed by its own thread's CPU
clock, drifts by 20-45% from one second to the next on the machine these docs were measured
on, and near saturation that drift moves queueing delays much more. So the engine serves
each cell ``repeats`` times; the measured figure is the median of the runs, and the spread
of the runs ((max - min) / median) is reported beside each error as the noise floor no
simulator can beat. The recorded steps also say how far the profile's step times were from
the measured ones in those runs (``step_error``), which separates a biased cost model from
queueing that amplifies small per-step differences. Each cell is also simulated with the
profile rescaled by that step error (``rescaled``): the simulator's error once the machine's
speed during the run is known, i.e. what its model of batching, scheduling and queueing adds
on its own. That figure uses one number measured in the run and is labelled as such.

Besides latency, the figures the paper reproductions stand on are compared the same way
(``quanta_lab.sim.validate_scenarios``): FairServe's on an agents workload with abusers,
ConServe's on online requests beside an offline backlog, Apt-Serve's SLO attainment.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from quanta.core.config import CacheConfig, SchedulerConfig
from quanta.metrics import SLO
from quanta.sim.driver import SimResult, SimSetup, StepSample, simulate
from quanta.sim.metrics import plot_lines, prefix_cache_figures, request_metrics
from quanta.slo import describe, with_slo
from quanta.workloads import WorkloadRequest

from quanta_lab.sim.bench import AgentUsers, EngineBench, parse_entry, with_arrivals
from quanta_lab.sim.calibrate import report, rescale
from quanta_lab.sim.repro import batched_capacity
from quanta_lab.sim.validate_scenarios import (
    APT_SLO_STEPS,
    CONSERVE_SLO_STEPS,
    Scenario,
    Served,
    delay_threshold,
    engine_slo,
    needs_slo,
    with_backlog,
)

FIGURES = (
    "mean_ttft",
    "p95_ttft",
    "mean_tpot",
    "p95_tpot",
    "mean_e2e",
    "p95_e2e",
    "mean_normalized_latency",
    "p95_normalized_latency",
    "throughput_rps",
    "num_preemptions",
)


def error(simulated: float, measured: float) -> float:
    """Relative error of a prediction; nan when the measurement is 0 or not a number."""
    if not math.isfinite(measured) or measured == 0 or not math.isfinite(simulated):
        return math.nan
    return (simulated - measured) / measured


def validate(
    bench: EngineBench,
    policies: Sequence[str],
    loads: Sequence[float],
    *,
    num_requests: int,
    seed: int,
    max_num_seqs: int,
    repeats: int = 3,
    workload: str | None = None,
    token_scale: float = 1.0,
    length_scale: float = 0.25,
    users: AgentUsers | None = None,
    offline_backlog: bool = False,
    slo: SLO | None = None,
    delay_threshold_s: float | None = None,
    echo: Callable[[str], object] = print,
) -> list[dict[str, Any]]:
    """One row per (load, policy): measured and simulated figures and their errors.

    A policy is a name or ``NAME:KEY=VALUE[:KEY=VALUE...]`` (``apt:cache=kv``), its options
    given to the engine's policy and the simulator's alike. Besides the latency ``FIGURES``
    (``quanta_lab.sim.validate_scenarios``): with the ``agents`` workload FairServe's figures
    (``users`` shapes it, abusers included; a delayed user queued ``delay_threshold_s``,
    default scaled to the engine); with ``offline_backlog`` ConServe's, the trace served as
    the online load beside an offline backlog; with ``slo`` (default scaled to the engine
    when a policy schedules by SLOs or with ``offline_backlog``) Apt-Serve's attainment."""
    sched = SchedulerConfig(max_num_seqs=max_num_seqs, max_num_batched_tokens=2048)
    base = bench.trace(
        num_requests,
        seed,
        scale=length_scale,
        workload=workload,
        token_scale=token_scale,
        users=users,
    )
    capacity = batched_capacity(base, bench.cost, sched)
    if slo is None and (offline_backlog or any(needs_slo(p.split(":")[0]) for p in policies)):
        steps = CONSERVE_SLO_STEPS if offline_backlog else APT_SLO_STEPS
        slo = engine_slo(bench.cost, base, sched, steps)
    if workload == "agents" and delay_threshold_s is None:
        delay_threshold_s = delay_threshold(capacity)
    rows = []
    for load in loads:
        trace = with_arrivals(base, load * capacity, seed, workload is not None)
        cache = bench.cache(trace, max_num_seqs)
        trace = trace if slo is None else with_slo(trace, slo)
        until = None
        if offline_backlog:
            trace, until = with_backlog(trace, load * capacity, bench.cost, sched, seed)
        scenario = Scenario(delay_threshold_s if workload == "agents" else None, slo, until)
        cell = Cell(bench, trace, sched, cache, seed, repeats, scenario)
        for policy in policies:
            row = cell.row(policy)
            rows.append({"load": load, "rate": load * capacity, **row})
            extra = scenario.figures
            echo(
                f"load {load:g} {policy}: {_brief(row['error'])}; "
                f"profile vs measured steps {_pct(row['step_error']['total'])}"
                + (f"; {_brief(row['error'], extra)}" if extra else "")
            )
    return rows


@dataclass(frozen=True)
class Cell:
    """One load's trace and pools: each policy served there by the engine ``repeats`` times
    and by the simulator, as one row."""

    bench: EngineBench
    trace: list[WorkloadRequest]
    sched: SchedulerConfig
    cache: CacheConfig
    seed: int
    repeats: int
    scenario: Scenario

    def row(self, policy: str) -> dict[str, Any]:
        name, options = parse_entry(policy)
        bench, cache, until = self.bench, self.cache, self.scenario.until
        keys = (*FIGURES, *self.scenario.figures)
        steps: list[StepSample] = []
        served = [
            bench.serve(
                name,
                self.trace,
                self.sched,
                cache,
                self.seed,
                record=steps,
                options=options,
                until=until,
            )
            for _ in range(self.repeats)
        ]
        runs = [self._figures(run) for run in served]
        measured = {k: statistics.median(run[k] for run in runs) for k in keys}
        setup = SimSetup(
            name,
            bench.cost,
            self.sched,
            cache.block_size,
            cache.num_device_blocks,
            cache.num_host_blocks,
            options,
            prefix_caching=bench.prefix_caching,
        )
        sim = simulate(self.trace, setup, until=until)
        simulated = self._figures(sim)
        fit = report(bench.cost, steps, cache.block_size)
        speed = 1 / (1 + fit.total_error) if math.isfinite(fit.total_error) else 1.0
        scaled = replace(setup, profile=rescale(bench.cost, speed))
        rescaled = self._figures(simulate(self.trace, scaled, until=until))
        row: dict[str, Any] = {
            "policy": policy,
            "repeats": self.repeats,
            "measured": measured,
            "simulated": {k: simulated[k] for k in keys},
            "error": {k: error(simulated[k], measured[k]) for k in keys},
            "noise": {k: spread([run[k] for run in runs]) for k in keys},
            "step_error": {"median": fit.median_error, "total": fit.total_error},
            "rescaled": {k: rescaled[k] for k in keys},
            "rescaled_error": {k: error(rescaled[k], measured[k]) for k in keys},
            "prefix_cache": {
                "measured": [prefix_cache_figures(run.stats) for run in served],
                "simulated": prefix_cache_figures(sim.loop),
            },
        }
        if self.scenario.figures:
            row["scenario"] = self._describe(sim)
        return row

    def _figures(self, run: Served) -> dict[str, float]:
        return {**request_metrics(run.requests), **self.scenario.measure(run)}

    def _describe(self, sim: SimResult) -> dict[str, Any]:
        """What the scenario's figures were judged by, and what only the simulator did."""
        s = self.scenario
        return {
            "delay_threshold_s": s.delay_threshold_s,
            "slo": None if s.slo is None else describe(s.slo),
            "until_s": s.until,
            "offline_requests": sum(r.priority_class == "offline" for r in self.trace),
            "simulated_safepoint_aborts": sim.runner.safepoint_aborts,
        }


def spread(values: Sequence[float]) -> float:
    """(max - min) / median of repeated measurements: how far apart the engine's own runs
    were; nan with fewer than two runs or a zero median."""
    finite = [v for v in values if math.isfinite(v)]
    if len(finite) < 2 or statistics.median(finite) == 0:
        return math.nan
    return (max(finite) - min(finite)) / abs(statistics.median(finite))


def table(rows: list[dict[str, Any]], figures: Sequence[str] = FIGURES) -> str:
    """Markdown: one row per (load, policy), each cell 'measured -> simulated (error, spread
    of the engine's runs)', then the profile's total error on the steps the engine ran, and
    each figure's error with the profile rescaled by it."""
    head = ["load", "policy", *figures, "steps", "rescaled"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for row in rows:
        cells = [
            f"{_num(row['measured'][k])} -> {_num(row['simulated'][k])} "
            f"({_pct(row['error'][k])}, {_half_spread(row['noise'][k], row['repeats'])})"
            for k in figures
        ]
        cells.append(_pct(row["step_error"]["total"]))
        cells.append(" / ".join(_pct(row["rescaled_error"][k]) for k in figures))
        lines.append(f"| {row['load']:g} | {row['policy']} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def hit_rates(rows: list[dict[str, Any]]) -> str:
    """Markdown: the prefix cache's hit rate (tokens) in each of the engine's runs and in the
    simulation of the same trace, per (load, policy)."""
    lines = ["| load | policy | engine hit rate | simulated |", "|---|---|---|---|"]
    for row in rows:
        cache = row["prefix_cache"]
        engine = ", ".join(_rate(m) for m in cache["measured"])
        lines.append(
            f"| {row['load']:g} | {row['policy']} | {engine} | {_rate(cache['simulated'])} |"
        )
    return "\n".join(lines)


def _rate(figures: dict[str, Any]) -> str:
    rate = figures["hit_rate"]
    return "-" if rate is None else f"{rate:.3f} ({figures['hits']}/{figures['queries']})"


def plot(rows: list[dict[str, Any]], path: Path) -> Path | None:
    """Each figure's simulated / measured ratio against the load, one line per policy and
    figure: 1.0 is a perfect prediction."""
    loads = sorted({row["load"] for row in rows})
    series: dict[str, list[float]] = {}
    for key in ("mean_ttft", "mean_tpot", "mean_e2e"):
        for policy in dict.fromkeys(row["policy"] for row in rows):
            by_load = {r["load"]: r for r in rows if r["policy"] == policy}
            series[f"{policy} {key}"] = [1 + by_load[x]["error"][key] for x in loads]
    return plot_lines(
        path,
        loads,
        series,
        xlabel="load (x estimated capacity)",
        ylabel="simulated / measured",
        title="Simulator vs real engine",
    )


def _brief(
    errors: dict[str, float],
    keys: Sequence[str] = ("mean_ttft", "mean_tpot", "mean_e2e", "p95_normalized_latency"),
) -> str:
    return ", ".join(f"{k} {_pct(errors[k])}" for k in keys)


def _pct(x: float) -> str:
    return "-" if math.isnan(x) else f"{100 * x:+.0f}%"


def _half_spread(x: float, repeats: int) -> str:
    """± half the spread of the engine's runs; none for one run, or for runs whose median is
    0 or not a number (a figure none of them had)."""
    if math.isnan(x):
        return "one run" if repeats < 2 else "±-"
    return f"±{50 * x:.0f}%"


def _num(x: float) -> str:
    if math.isnan(x):
        return "-"
    return f"{x:.3g}"

"""ConServe's layer-level preemption where it matters: an offline backlog of long prefills,
sparse online arrivals that mostly find the engine running offline work alone, and TTFT SLOs
from tight to the paper's 1.5 s. Each SLO runs twice on the same load: ``conserve`` as it is
(offline-only steps stop at a safepoint every 8 layers, at the 4% the paper measured) and
with ``safepoints=false`` (iteration-level preemption: an arrival waits for the step to end).

The figure safepoints buy is the head-of-line wait: from an online request's arrival to the
end (or the stop) of the step it arrived in, the time before the loop can schedule it at all;
for an arrival that stopped a step, also the wait the step's end would have meant in the same
run. Each row pools a few draws of the offline backlog, which move where the arrivals land.
What they cost is the 4% on every offline-only step and the compute of the steps they stop,
thrown away. The rule stops a step only for an arrival that would otherwise miss its TTFT
(``MissesTTFT``), so at a loose SLO they never fire and cost only the 4%.

Ours, not the paper's (it reports only the 5.41 ms stop latency, §6.4.2): the lengths, the
rate and the SLO sweep. The online requests are the Azure LLM conversation trace's (arrivals
and lengths), scaled to ``ONLINE_RATE``.
"""

from __future__ import annotations

import bisect
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path
from typing import Any

from quanta.costmodel import CostModel
from quanta.metrics import SLO, from_requests, percentile
from quanta.sim.driver import SimSetup, simulate
from quanta.slo import with_slo
from quanta.workloads import WorkloadRequest, load_workload, scale_to_rate

from quanta_lab.sim.conserve_repro import (
    CONSERVE_PROFILE,
    CONSERVE_SCHEDULER,
    SAFEPOINT_INTERVAL,
    SAFEPOINT_OVERHEAD,
    conserve_profile,
    offline_backlog,
)
from quanta_lab.sim.report import publish_sections

# Sparse enough that most arrivals find no online request in flight, so the step they land
# in is offline-only: the only steps ConServe makes preemptible.
ONLINE_RATE = 0.05
TTFT_SLOS = (0.2, 0.3, 0.5, 1.5)  # seconds; 1.5 s is the paper's
TPOT_SLO = 0.11
TAIL_S = 30.0  # the run goes on this long after the last arrival
VARIANTS = {"layer-level (safepoints)": {}, "iteration-level": {"safepoints": False}}

Task = tuple[float, str, list[WorkloadRequest], SimSetup, float]


def head_of_line_waits(
    spans: Sequence[tuple[float, float, bool]], arrivals: Sequence[float]
) -> list[tuple[float, bool]]:
    """For each arrival, how long the step running then went on (0 between steps) and whether
    that step was preemptible: ``spans`` are the runner's (start, end, preemptible) in order."""
    starts = [s for s, _, _ in spans]
    out = []
    for t in arrivals:
        i = bisect.bisect_right(starts, t) - 1
        if i >= 0 and spans[i][1] > t:
            out.append((spans[i][1] - t, spans[i][2]))
        else:
            out.append((0.0, False))
    return out


def make_load(
    trace: Path, num_requests: int, seed: int, cost: CostModel
) -> tuple[list[WorkloadRequest], list[WorkloadRequest], float]:
    """(online rows without SLOs, the offline backlog, the run's length)."""
    rows = load_workload(trace, limit=num_requests, too_long="clip", max_len=cost.max_model_len)
    online = scale_to_rate(rows, ONLINE_RATE) if len(rows) > 1 else rows
    duration = max(r.arrival_time for r in online) + TAIL_S
    return online, offline_backlog(duration, cost, seed), duration


def _run(task: Task) -> dict[str, Any]:
    ttft, name, trace, setup, until = task
    result = simulate(trace, setup, until=until)
    records = from_requests(result.requests)
    online = [r for r in records if r.priority_class == "online"]
    st = result.runner
    return {
        "ttft_slo": ttft,
        "name": name,
        "ttfts": [r.ttft for r in online],  # None: no token by the end (a miss)
        "waits": head_of_line_waits(st.spans, [r.arrival for r in online]),
        "offline_tps": sum(
            1 for r in records if r.priority_class == "offline" for t in r.token_times if t <= until
        )
        / until,
        "aborts": st.safepoint_aborts,
        "abort_wait_s": st.abort_wait_s,
        "abort_end_wait_s": st.abort_end_wait_s,
        "wasted_s": st.aborted_compute_s,
    }


def pooled(runs: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """One row per (SLO, variant), over its runs (one per seed): every online request's TTFT
    and wait pooled, counters summed, offline throughput averaged."""
    groups: dict[tuple[float, str], list[dict[str, Any]]] = {}
    for r in runs:
        groups.setdefault((r["ttft_slo"], r["name"]), []).append(r)
    rows = []
    for (slo, name), group in groups.items():
        ttfts = [t for r in group for t in r["ttfts"]]
        waits = [w for r in group for w in r["waits"]]
        served = [t for t in ttfts if t is not None]
        aborts = sum(r["aborts"] for r in group)
        rows.append(
            {
                "ttft_slo": slo,
                "name": name,
                "p50_ttft": percentile(served, 50) if served else None,
                "p99_ttft": percentile(served, 99) if served else None,
                "ttft_met": sum(t is not None and t <= slo for t in ttfts) / max(1, len(ttfts)),
                "preemptible_share": sum(p for _, p in waits) / max(1, len(waits)),
                "hol_mean": sum(w for w, _ in waits) / max(1, len(waits)),
                "hol_p99": percentile([w for w, _ in waits], 99) if waits else None,
                "aborts": aborts,
                "abort_wait": sum(r["abort_wait_s"] for r in group) / aborts if aborts else None,
                "abort_end_wait": (
                    sum(r["abort_end_wait_s"] for r in group) / aborts if aborts else None
                ),
                "wasted_s": sum(r["wasted_s"] for r in group),
                "offline_tps": sum(r["offline_tps"] for r in group) / len(group),
            }
        )
    return rows


def run_safepoints(
    trace: Path, *, num_requests: int, seeds: Sequence[int] = (0,), jobs: int = 2
) -> tuple[tuple[int, int, float], list[dict[str, Any]]]:
    """Every (SLO, variant) on the same loads, one per seed (the offline backlog's draw, and
    with it where in the offline work each arrival lands); ((online requests, offline
    requests of the first seed), D) and the pooled rows in table order."""
    cost = conserve_profile()
    tasks: list[Task] = []
    sizes: tuple[int, int, float] | None = None
    for seed in seeds:
        rows, offline, duration = make_load(trace, num_requests, seed, cost)
        sizes = sizes or (len(rows), len(offline), duration)
        for ttft in TTFT_SLOS:
            online = with_slo(rows, SLO(ttft_s=ttft, tpot_s=TPOT_SLO))
            both = sorted(online + offline, key=lambda r: r.arrival_time)
            for name, options in VARIANTS.items():
                setup = SimSetup(
                    "conserve",
                    cost,
                    CONSERVE_SCHEDULER,
                    policy_options={"ttft_slo_s": ttft, "tpot_slo_s": TPOT_SLO, **options},
                    safepoint_interval=SAFEPOINT_INTERVAL,
                )
                tasks.append((ttft, name, both, setup, duration))
    assert sizes is not None  # NOTE: at least one seed
    if jobs <= 1:
        runs = [_run(t) for t in tasks]
    else:
        with ProcessPoolExecutor(max_workers=jobs) as pool:
            runs = list(pool.map(_run, tasks, chunksize=1))
    return sizes, pooled(runs)


def _ms(x: float | None) -> str:
    return "-" if x is None else f"{1000 * x:.0f}"


def safepoints_table(rows: Sequence[dict[str, Any]]) -> str:
    head = (
        "| TTFT SLO | preemption | online TTFT P50 / P99 (ms) | TTFT SLO met (%) | "
        "arrivals into a preemptible step (%) | head-of-line wait mean / P99 (ms) | "
        "steps stopped | their arrivals' wait: to the stop / to the step's end (ms) | "
        "compute thrown away (s) | offline tokens/s |\n"
        "|---|---|---|---|---|---|---|---|---|---|"
    )
    lines = [head]
    for r in rows:
        lines.append(
            f"| {r['ttft_slo']:g} s | {r['name']} | {_ms(r['p50_ttft'])} / {_ms(r['p99_ttft'])} "
            f"| {100 * r['ttft_met']:.1f} | {100 * r['preemptible_share']:.0f} "
            f"| {_ms(r['hol_mean'])} / {_ms(r['hol_p99'])} | {r['aborts']} "
            f"| {_ms(r['abort_wait'])} / {_ms(r['abort_end_wait'])} | {r['wasted_s']:.1f} "
            f"| {r['offline_tps']:.0f} |"
        )
    return "\n".join(lines)


def safepoints_report(
    trace: Path,
    output: Path | None,
    *,
    num_requests: int,
    seeds: Sequence[int] = (0,),
    jobs: int = 2,
    echo: Callable[[str], object] = print,
) -> dict[str, str]:
    """Run the experiment, print its table and, with ``output``, rewrite its section."""
    t0 = time.perf_counter()
    command = f"quanta simulate repro --figure safepoints --num-requests {num_requests}"
    command += f" --seeds {','.join(map(str, seeds))}"
    command += f" --trace {trace}" + (f" --output {output}" if output is not None else "")
    (n_on, n_off, duration), rows = run_safepoints(
        trace, num_requests=num_requests, seeds=seeds, jobs=jobs
    )
    setup = (
        f"`{CONSERVE_PROFILE}`, safepoints every {SAFEPOINT_INTERVAL} layers costing "
        f"{SAFEPOINT_OVERHEAD:.0%} of an offline-only step; steps of up to "
        f"{CONSERVE_SCHEDULER.max_num_batched_tokens} tokens; {n_on} online requests (Azure "
        f"LLM conversation trace, Azure Public Dataset, CC BY 4.0; Patel et al., Splitwise, "
        f"ISCA 2024) at {ONLINE_RATE:g} req/s, TPOT SLO {1000 * TPOT_SLO:.0f} ms; about "
        f"{n_off} offline requests at t=0; {duration:.0f} s; each row pools the runs of "
        f"{len(seeds)} offline draws (seeds {', '.join(map(str, seeds))}), "
        f"{len(seeds) * n_on} online requests."
    )
    sections = {
        "conserve-safepoints": f"{setup}\n\n{safepoints_table(rows)}\n\nGenerated by `{command}`."
    }
    publish_sections(
        sections, output, "ConServe in Quanta", label="safepoints", started=t0, echo=echo
    )
    return sections

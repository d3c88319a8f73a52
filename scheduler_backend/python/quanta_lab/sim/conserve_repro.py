"""ConServe's online/offline co-serving on the simulator: ON/OFF online load from a real trace
beside an offline backlog, ConServe against its baselines and its ablations, side by side with
the paper's numbers.

Setup as the paper's where it says: LLaMA-2-7B on one A100-40GB (the ``a100-llama7b``
profile), the SLOs P99 TTFT 1.5 s and TPOT 110 ms carried by every online request, chunked
prefill, an online load in ON/OFF phases and a LongBench-like summarisation backlog. Ours where
it differs or is silent: the online requests are the Azure LLM conversation trace's (the
paper's BurstGPT is not available offline), its real arrival pattern scaled to ``ONLINE_RATE``
within ON phases; vLLM's batch limits of its chunked-prefill era; the offline lengths (below);
safepoints every 8 layers cost the 4% the paper measured (§5). Everything runs for the
same virtual duration D, the end of the last OFF phase: the backlog outlasts it by
construction, and what is in flight at D is cut off, not drained.
"""

from __future__ import annotations

import math
import random
import time
from collections.abc import Callable
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from quanta.core.config import SchedulerConfig
from quanta.costmodel import CostModel, get_profile
from quanta.metrics import SLO, from_requests
from quanta.sim.driver import SimSetup, simulate
from quanta.sim.metrics import class_figures
from quanta.slo import with_slo
from quanta.workloads import LengthDist, WorkloadRequest, load_workload, scale_to_rate

from quanta_lab.sim.report import publish_sections

CONSERVE_PROFILE = "a100-llama7b"
# ConServe §5: safepoints every 8 layers cost 3.99 ms (4%) of a Llama-2-7B step on an A100.
SAFEPOINT_OVERHEAD = 0.04
SAFEPOINT_INTERVAL = 8
# vLLM with chunked prefill (the paper's baselines enable it): 256 sequences, 2048 tokens.
CONSERVE_SCHEDULER = SchedulerConfig(
    max_num_seqs=256, max_num_batched_tokens=2048, enable_chunked_prefill=True
)
CONSERVE_SLO = SLO(ttft_s=1.5, tpot_s=0.11)  # §6.2: vLLM's own P99s on the online trace
# req/s within ON phases: the highest of 1.5, 2, 2.5 at which the online load alone keeps its
# P99 TTFT within the SLO (the paper's R, §6.1); the engine is then busy through each ON phase.
ONLINE_RATE = 1.5
CYCLES = 4  # ON/OFF cycles; each ON phase holds a quarter of the online requests
# LongBench summarisation on LLaMA-2's 4k context: the ``longbench`` shape (log-normal,
# sigma 0.35) at ~3/4 of the context as the 2048-token table entry is at ~3/4 of OPT's, and
# short summaries. Ours: the paper gives no lengths.
OFFLINE_LENGTHS = LengthDist(3000, 150, sigma_input=0.35, sigma_output=0.6)
BACKLOG_MARGIN = 1.1  # the backlog's prefill alone takes this x D at the roofline's peak

# Column -> (policy, options). "scheduler only" is the paper's first breakdown step (§6.4).
SYSTEMS: dict[str, tuple[str, dict[str, Any]]] = {
    "online-only": ("online-only", {}),
    "priority (vLLM++)": ("priority", {}),
    "conserve": ("conserve", {}),
    "conserve, no safepoints": ("conserve", {"safepoints": False}),
    "conserve, no checkpoint": ("conserve", {"checkpoint": False}),
    "conserve, no prefetch": ("conserve", {"prefetch": False}),
    "conserve, scheduler only": ("conserve", {"checkpoint": False, "prefetch": False}),
}
ALONE = ("offline alone", "online alone")  # the ideal's two measurements

PAPER = {
    "throughput_vs_online_only": 2.35,  # §6.2: 3702 vs 1999 tokens/s overall
    "ttft_vs_priority": 84.0,  # §6.2: vLLM++ P99 TTFT 83825 ms
    "share_of_ideal": 0.86,  # Fig. 5
    "ttft_cut_scheduler": -0.714,  # §6.4: 1346 -> 446 ms
    "gain_checkpoint": 0.140,  # §6.4, offline throughput
    "gain_prefetch": 0.136,
    "onoff_p99_ttft_s": 0.350,  # §6.3.1: ConServe under ON/OFF load
    "onoff_p99_tpot_s": 0.090,
}


@dataclass(frozen=True)
class Load:
    """The experiment's two workloads and how long it runs."""

    online: list[WorkloadRequest]
    offline: list[WorkloadRequest]
    on_s: float  # each ON phase (and each OFF phase)
    duration_s: float  # D: the end of the last OFF phase


def online_load(
    trace: Path, num_requests: int, rate: float, cycles: int, max_len: int
) -> tuple[list[WorkloadRequest], float]:
    """The trace's first ``num_requests`` rows, times scaled to a mean ``rate``, cut into
    ``cycles`` ON phases of equal length with an OFF phase as long after each; and that
    length. Rows longer than the model are clipped; every row carries the SLOs."""
    rows = load_workload(trace, limit=num_requests, too_long="clip", max_len=max_len)
    rows = scale_to_rate(rows, rate) if len(rows) > 1 else rows
    out, on_s = on_off(rows, rate, cycles)
    return with_slo(out, CONSERVE_SLO), on_s


def on_off(
    rows: list[WorkloadRequest], rate: float, cycles: int
) -> tuple[list[WorkloadRequest], float]:
    """``rows`` (arriving at a mean ``rate``) cut into ``cycles`` ON phases of equal length,
    each followed by an OFF phase as long with no arrivals, and that length."""
    on_s = max(len(rows) / rate / cycles, 1e-3)
    out = [
        replace(r, arrival_time=r.arrival_time + math.floor(r.arrival_time / on_s) * on_s)
        for r in rows
    ]
    return out, on_s


def offline_backlog(duration_s: float, cost: CostModel, seed: int) -> list[WorkloadRequest]:
    """Offline requests, all at t=0, until their prompts alone would keep the engine busy
    for ``BACKLOG_MARGIN`` x ``duration_s`` at the cost model's peak FLOPs (no step runs a
    token faster), so that no system can run out of offline work within the run."""
    rng = random.Random(f"{seed}-offline")
    out: list[WorkloadRequest] = []
    floor = 0.0
    while floor < BACKLOG_MARGIN * duration_s:
        n_in, n_out = OFFLINE_LENGTHS.sample(rng, cost.max_model_len)
        out.append(
            WorkloadRequest(0.0, n_in, n_out, request_id=f"b{len(out)}", priority_class="offline")
        )
        floor += cost.compute_per_token_s * n_in
    return out


def make_load(trace: Path, num_requests: int, seed: int, cost: CostModel) -> Load:
    online, on_s = online_load(trace, num_requests, ONLINE_RATE, CYCLES, cost.max_model_len)
    duration = 2 * on_s * CYCLES
    return Load(online, offline_backlog(duration, cost, seed), on_s, duration)


def conserve_profile() -> CostModel:
    return get_profile(CONSERVE_PROFILE).model_copy(
        update={"safepoint_overhead": SAFEPOINT_OVERHEAD}
    )


Task = tuple[str, list[WorkloadRequest], SimSetup, float]


def _run(task: Task) -> dict[str, Any]:
    """One run's figures: per class, the offline tokens generated by D, busy time, counters."""
    name, trace, setup, until = task
    result = simulate(trace, setup, until=until)
    records = from_requests(result.requests)
    offline_tokens = sum(
        1 for r in records if r.priority_class == "offline" for t in r.token_times if t <= until
    )
    online_tokens = sum(
        r.num_output_tokens for r in records if r.priority_class == "online" and r.ok
    )
    return {
        "name": name,
        "online": class_figures(records, "online", CONSERVE_SLO, until),
        "offline_tps": offline_tokens / until,
        "online_tps": online_tokens / until,
        "busy_s": result.runner.compute_s,
        "aborts": result.runner.safepoint_aborts,
        "checkpoint_blocks": result.runner.checkpoint_blocks,
        "swap_blocks": result.runner.swap_out_blocks + result.runner.swap_in_blocks,
        "preemptions": sum(r.num_preemptions for r in result.requests),
    }


def run_conserve(
    trace: Path, *, num_requests: int, seed: int = 0, jobs: int = 2
) -> tuple[Load, dict[str, dict[str, Any]]]:
    """Every system on the same load, plus the two runs the ideal needs: the backlog alone
    and the online load alone (``priority``: vLLM eagerly batching whatever it has)."""
    cost = conserve_profile()
    load = make_load(trace, num_requests, seed, cost)
    both = sorted(load.online + load.offline, key=lambda r: r.arrival_time)

    def setup(policy: str, options: dict[str, Any]) -> SimSetup:
        return SimSetup(
            policy,
            cost,
            CONSERVE_SCHEDULER,
            policy_options=dict(options),
            safepoint_interval=SAFEPOINT_INTERVAL,
        )

    tasks: list[Task] = [
        (name, both, setup(p, o), load.duration_s) for name, (p, o) in SYSTEMS.items()
    ]
    tasks.append(("offline alone", load.offline, setup("priority", {}), load.duration_s))
    tasks.append(("online alone", load.online, setup("priority", {}), load.duration_s))
    tasks.sort(key=lambda t: -len(t[1]))  # NOTE: big runs first keeps both workers busy
    if jobs <= 1:
        results = [_run(t) for t in tasks]
    else:
        with ProcessPoolExecutor(max_workers=jobs) as pool:
            results = list(pool.map(_run, tasks, chunksize=1))
    return load, {r["name"]: r for r in results}


# -- reporting -----------------------------------------------------------------------------
def ideal_offline(runs: dict[str, dict[str, Any]], duration_s: float) -> tuple[float, float]:
    """(ideal offline tokens/s, the share of the engine the online load takes): the backlog
    alone's offline throughput x (1 - the online load alone's busy time / D)."""
    online_share = runs["online alone"]["busy_s"] / duration_s
    return runs["offline alone"]["offline_tps"] * (1 - online_share), online_share


def _fmt(x: float | None, digits: int = 2, unit: str = "", *, signed: bool = False) -> str:
    """A cell: the number, or "-" when there is none (a tiny run may finish nothing)."""
    if x is None or not math.isfinite(x):
        return "-"
    return f"{x:{'+' if signed else ''}.{digits}f}{unit}"


def _ratio(a: float, b: float) -> float:
    return a / b if b and math.isfinite(b) else math.nan


def systems_table(runs: dict[str, dict[str, Any]], ideal: float) -> str:
    head = (
        "| system | online P99 TTFT (s) | online P99 TPOT (ms) | online SLO met (%) | "
        "offline tokens/s | % of ideal | % of vLLM++ | overall tokens/s | aborts | "
        "checkpoint blocks | swapped blocks | preemptions |"
    )
    lines = [head, "|" + "---|" * 12]
    eager = runs["priority (vLLM++)"]["offline_tps"]
    for name in (*SYSTEMS, "online alone"):
        r = runs[name]
        on = r["online"]
        met = on["frac_meeting_slo"]
        lines.append(
            f"| {name} | {_fmt(on['p99_ttft'])} | {_fmt(1000 * on['p99_tpot'], 0)} | "
            f"{_fmt(None if met is None else 100 * met, 1)} | {r['offline_tps']:.0f} | "
            f"{_fmt(100 * _ratio(r['offline_tps'], ideal), 0)} | "
            f"{_fmt(100 * _ratio(r['offline_tps'], eager), 0)} | "
            f"{r['online_tps'] + r['offline_tps']:.0f} | {r['aborts']} | "
            f"{r['checkpoint_blocks']} | {r['swap_blocks']} | {r['preemptions']} |"
        )
    return "\n".join(lines)


def headline(runs: dict[str, dict[str, Any]], ideal: float) -> list[tuple[str, str, str]]:
    """(claim, ours, paper's) for each of the paper's headline numbers. The breakdown follows
    the paper's incremental path: vLLM++, then ConServe's scheduler alone, + checkpointing
    (``no prefetch``), + prefetch (the whole system)."""

    def overall(name: str) -> float:
        return runs[name]["online_tps"] + runs[name]["offline_tps"]

    def ttft(name: str) -> float:
        return runs[name]["online"]["p99_ttft"]

    def offline(name: str) -> float:
        return runs[name]["offline_tps"]

    con, sched, prio = "conserve", "conserve, scheduler only", "priority (vLLM++)"
    plus_ckpt = "conserve, no prefetch"
    tpot = runs[con]["online"]["p99_tpot"]
    return [
        (
            "overall throughput, ConServe / online alone (the paper's Online-Only)",
            _fmt(_ratio(overall(con), overall("online alone")), 2, "x"),
            f"{PAPER['throughput_vs_online_only']}x",
        ),
        (
            "overall throughput, ConServe / `online-only` (offline only in online idle time)",
            _fmt(_ratio(overall(con), overall("online-only")), 2, "x"),
            "-",
        ),
        (
            "online P99 TTFT, vLLM++ (`priority`) / ConServe",
            _fmt(_ratio(ttft(prio), ttft(con)), 1, "x"),
            f"{PAPER['ttft_vs_priority']:.0f}x",
        ),
        (
            "ConServe's offline throughput, share of the ideal (backlog alone x idle share)",
            _fmt(100 * _ratio(offline(con), ideal), 0, "%"),
            f"{100 * PAPER['share_of_ideal']:.0f}%",
        ),
        (
            "ConServe's offline throughput, share of vLLM++'s (the paper's ideal, Fig. 5)",
            _fmt(100 * _ratio(offline(con), offline(prio)), 0, "%"),
            f"{100 * PAPER['share_of_ideal']:.0f}%",
        ),
        (
            "online P99 TTFT, vLLM++ -> ConServe's scheduler (no checkpoint, no prefetch)",
            _fmt(100 * (_ratio(ttft(sched), ttft(prio)) - 1), 1, "%", signed=True),
            f"{100 * PAPER['ttft_cut_scheduler']:+.1f}%",
        ),
        (
            "offline throughput, + incremental checkpointing",
            _fmt(100 * (_ratio(offline(plus_ckpt), offline(sched)) - 1), 1, "%", signed=True),
            f"{100 * PAPER['gain_checkpoint']:+.1f}%",
        ),
        (
            "offline throughput, + background prefetch",
            _fmt(100 * (_ratio(offline(con), offline(plus_ckpt)) - 1), 1, "%", signed=True),
            f"{100 * PAPER['gain_prefetch']:+.1f}%",
        ),
        (
            "ConServe's online P99 TTFT / TPOT under ON/OFF load",
            f"{_fmt(1000 * ttft(con), 0, ' ms')} / {_fmt(1000 * tpot, 0, ' ms')}",
            f"< {1000 * PAPER['onoff_p99_ttft_s']:.0f} ms / "
            f"< {1000 * PAPER['onoff_p99_tpot_s']:.0f} ms",
        ),
    ]


def conserve_sections(
    load: Load, runs: dict[str, dict[str, Any]], *, seed: int, command: str
) -> dict[str, str]:
    """The doc's generated sections: the workload, the systems, the headline comparison."""
    ideal, share = ideal_offline(runs, load.duration_s)
    n_on, n_off = len(load.online), len(load.offline)
    mean_in = sum(r.prompt_tokens for r in load.offline) / max(1, n_off)
    mean_out = sum(r.output_tokens for r in load.offline) / max(1, n_off)
    setup = (
        f"`{CONSERVE_PROFILE}` with safepoint overhead {SAFEPOINT_OVERHEAD:.0%} every "
        f"{SAFEPOINT_INTERVAL} layers; {n_on} online requests (Azure LLM conversation trace, "
        f"Azure Public Dataset, CC BY 4.0; Patel et al., Splitwise, ISCA 2024) at "
        f"{ONLINE_RATE:g} req/s in {CYCLES} ON phases of {load.on_s:.1f} s, each followed by "
        f"an OFF phase as long; {n_off} offline requests at t=0 (mean {mean_in:.0f} prompt / "
        f"{mean_out:.0f} output tokens, seed {seed}); D = {load.duration_s:.0f} s. Ideal "
        f"offline throughput = {runs['offline alone']['offline_tps']:.0f} tokens/s (the "
        f"backlog alone) x (1 - {share:.3f}, the online load alone's busy time / D) = "
        f"{ideal:.0f} tokens/s."
    )
    footer = f"Generated by `{command}`."
    rows = headline(runs, ideal)
    table = "| | ours | paper |\n|---|---|---|\n" + "\n".join(
        f"| {claim} | {ours} | {paper} |" for claim, ours, paper in rows
    )
    return {
        "conserve-systems": f"{setup}\n\n{systems_table(runs, ideal)}\n\n{footer}",
        "conserve-headline": f"{table}\n\n{footer}",
    }


def conserve_report(
    trace: Path,
    output: Path | None,
    *,
    num_requests: int,
    seed: int = 0,
    jobs: int = 2,
    echo: Callable[[str], object] = print,
) -> dict[str, str]:
    """Run the experiment, print its tables and, with ``output``, rewrite their sections."""
    t0 = time.perf_counter()
    command = f"quanta simulate repro --figure conserve --num-requests {num_requests}"
    command += f" --seed {seed}" if seed else ""
    command += f" --trace {trace}" + (f" --output {output}" if output is not None else "")
    load, runs = run_conserve(trace, num_requests=num_requests, seed=seed, jobs=jobs)
    sections = conserve_sections(load, runs, seed=seed, command=command)
    publish_sections(
        sections, output, "ConServe in Quanta", label="conserve", started=t0, echo=echo
    )
    return sections

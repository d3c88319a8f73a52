"""Latency and memory metrics of a run, as a flat JSON-able dict, plus optional plots.

Conventions (shared/design/REFERENCE_FACTS.md): normalized latency = E2E / output tokens
(FastServe's "per-token latency"), TTFT = first token - arrival, TPOT = (E2E - TTFT) /
(output - 1). Per-tenant service (Jain's index) and per-class figures come from
``quanta.metrics``, as for a live run. Time breakdown per request (FastServe Fig. 15b):
executing = steps it took part in, less the part of them stalled on its swaps; swapping = that
stall; queued = the rest. Online and offline requests (ConServe) also get an object each
(``class_figures``).
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from quanta.core.loop import LoopStats
from quanta.core.request import Request
from quanta.metrics import (
    SLO,
    RequestRecord,
    from_requests,
    json_safe,
    meets_slo,
    metric_values,
    per_class,
    per_tenant,
    percentile,
)
from quanta.metrics import mean as _mean
from quanta.sim.fairness import fairness
from quanta.slo import attainment, describe


def request_metrics(
    requests: Sequence[Request], stall_by_request: Mapping[str, float] | None = None
) -> dict[str, float]:
    """Latency statistics over the requests that finished without error."""
    done = [r for r in requests if r.finish_time is not None and r.error is None]
    stall = stall_by_request or {}
    e2e = [r.finish_time - r.arrival_time for r in done]  # type: ignore[operator]
    norm = [e / max(1, r.num_output_tokens) for e, r in zip(e2e, done, strict=True)]
    ttft = [r.first_token_time - r.arrival_time for r in done]  # type: ignore[operator]
    tpot = [
        (e - t) / (r.num_output_tokens - 1)
        for e, t, r in zip(e2e, ttft, done, strict=True)
        if r.num_output_tokens > 1
    ]
    # Time between tokens: every gap between a request's consecutive tokens, pooled.
    tbt = [b - a for r in done for a, b in itertools.pairwise(r.token_times)]
    swapping = [stall.get(r.request_id, 0.0) for r in done]
    executing = [r.attained_service - s for r, s in zip(done, swapping, strict=True)]
    queued = [e - r.attained_service for e, r in zip(e2e, done, strict=True)]
    span = (
        max(r.finish_time for r in done) - min(r.arrival_time for r in done)  # type: ignore[type-var]
        if done
        else math.nan
    )
    total = sum(e2e) or math.nan
    return {
        "num_requests": len(requests),
        "num_finished": len(done),
        "mean_normalized_latency": _mean(norm),
        "p50_normalized_latency": percentile(norm, 50),
        "p95_normalized_latency": percentile(norm, 95),
        "p99_normalized_latency": percentile(norm, 99),
        "mean_e2e": _mean(e2e),
        "p95_e2e": percentile(e2e, 95),
        "mean_ttft": _mean(ttft),
        "p50_ttft": percentile(ttft, 50),
        "p95_ttft": percentile(ttft, 95),
        "mean_tpot": _mean(tpot),
        "p95_tpot": percentile(tpot, 95),
        "p99_tbt": percentile(tbt, 99),
        "throughput_rps": len(done) / span if span and span > 0 else math.nan,
        "throughput_tokens_s": (
            sum(r.num_output_tokens for r in done) / span if span and span > 0 else math.nan
        ),
        "mean_time_queued": _mean(queued),
        "mean_time_swapping": _mean(swapping),
        "mean_time_executing": _mean(executing),
        "frac_queued": sum(queued) / total,
        "frac_swapping": sum(swapping) / total,
        "frac_executing": sum(executing) / total,
        "num_preemptions": sum(r.num_preemptions for r in requests),
        "num_swap_outs": sum(r.num_swap_outs for r in requests),
        "num_recomputed_tokens": sum(r.num_recomputed_tokens for r in requests),
    }


def makespan(records: Sequence[RequestRecord]) -> float:
    """From the first arrival to the last token or end of any request, finished or not (NaN
    when nothing happened)."""
    starts = [r.arrival for r in records if r.token_times or math.isfinite(r.end)]
    ends = [t for r in records for t in (*r.token_times[-1:], r.end) if math.isfinite(t)]
    return max(ends) - min(starts) if starts and ends else math.nan


def class_figures(
    records: Sequence[RequestRecord], priority_class: str, slo: SLO | None, span: float
) -> dict[str, Any]:
    """One priority class's latency, SLO and throughput figures.

    ``throughput_tokens_per_s`` is the output tokens the class's requests generated (finished
    or not: a run cut short still produced them) over ``span``, the *whole run's* makespan,
    so the two classes' throughputs add up to the engine's. SLO figures judge each request
    by its own SLOs, else ``slo``; None when neither gives one: ``slo_attainment`` is
    Apt-Serve's (TTFT and the request's P99 time between tokens, as the top-level key) and
    ``frac_meeting_slo`` DistServe's (TTFT and TPOT), the check ConServe's SLOs describe.
    Failures and unfinished requests count as misses in both."""
    mine = [r for r in records if r.priority_class == priority_class]
    ttft, tpot = metric_values(mine, "ttft"), metric_values(mine, "tpot")
    tokens = sum(r.num_output_tokens for r in mine)
    limits = _own_or(mine, slo)
    return {
        "num_requests": len(mine),
        "num_finished": sum(r.ok for r in mine),
        "mean_ttft": _mean(ttft),
        "p50_ttft": percentile(ttft, 50),
        "p99_ttft": percentile(ttft, 99),
        "mean_tpot": _mean(tpot),
        "p50_tpot": percentile(tpot, 50),
        "p99_tpot": percentile(tpot, 99),
        "slo_attainment": attainment(mine, slo),
        "frac_meeting_slo": (
            sum(meets_slo(r, limits) for r in mine) / len(mine) if mine and limits else None
        ),
        "output_tokens": tokens,
        "throughput_tokens_per_s": tokens / span if span > 0 else math.nan,
    }


def _own_or(records: Sequence[RequestRecord], slo: SLO | None) -> SLO | None:
    """``slo``, or a stand-in when every request carries both of its own limits (then never
    consulted: ``SLO.for_request`` reads the request's first)."""
    if slo is not None or not records:
        return slo
    if any(r.ttft_slo_s is None or r.tpot_slo_s is None for r in records):
        return None
    first = records[0]
    return SLO(ttft_s=first.ttft_slo_s, tpot_s=first.tpot_slo_s)  # type: ignore[arg-type]


def plot_lines(
    path: Path,
    x: Sequence[float],
    series: Mapping[str, Sequence[float]],
    *,
    xlabel: str,
    ylabel: str,
    title: str,
    logx: bool = False,
) -> Path | None:
    """One line per series; returns None (and draws nothing) without matplotlib."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    fig, ax = plt.subplots(figsize=(5.5, 3.6))
    for name, ys in series.items():
        ax.plot(x, ys, marker="o", label=name)
    if logx:
        ax.set_xscale("log", base=2)
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.set_title(title)
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def prefix_cache_figures(stats: LoopStats) -> dict[str, Any]:
    """Tokens the prefix cache was asked for as requests started and those it held, in
    tokens (vLLM's ``prefix_cache_queries`` and ``prefix_cache_hits``), and their ratio
    (None when nothing was asked)."""
    queries, hits = stats.prefix_cache_queries, stats.prefix_cache_hits
    return {"queries": queries, "hits": hits, "hit_rate": hits / queries if queries else None}


def summarize(
    result: Any, *, delay_threshold_s: float = 2.0, slo: SLO | None = None
) -> dict[str, Any]:
    """The JSON of one simulated run (a ``SimResult``): request metrics, memory traffic and
    the setup, with the keys ``quanta simulate`` promises at the top level, and FairServe's
    figures under ``fairness`` (``quanta.sim.fairness``; a call that queued longer than
    ``delay_threshold_s`` makes its user a delayed one).

    ``slo_attainment`` is Apt-Serve's, a fraction in [0, 1] (``quanta.slo.attainment``): against
    ``slo`` with each request's own SLOs first, or against the requests' own alone; None when
    no SLO applies. ``online`` and ``offline`` hold each priority class's figures
    (``class_figures``), and the ConServe counters (safepoint aborts, checkpoint copies)
    sit beside the swap counters."""
    setup, runner, loop = result.setup, result.runner, result.loop
    per_block = setup.profile.bytes_per_block(setup.block_size)
    device, host = setup.pools()
    out: dict[str, Any] = {
        "policy": setup.policy,
        "profile": setup.profile.name,
        **request_metrics(result.requests, runner.stall_by_request),
        "num_rejected": len(result.rejected),
        "num_cut_off": len(result.cut_off),  # in flight or unsent when the run was stopped
        "num_preemptions_swap": loop.num_preemptions_swap,
        "num_preemptions_recompute": loop.num_preemptions_recompute,
        "swap_out_blocks": runner.swap_out_blocks,
        "swap_in_blocks": runner.swap_in_blocks,
        "swap_bytes": (runner.swap_out_blocks + runner.swap_in_blocks) * per_block,
        "num_steps": runner.steps,
        "compute_s": runner.compute_s,
        "stall_s": runner.stall_s,
        "device_blocks": device,
        "host_blocks": host,
        "block_size": setup.block_size,
        "max_num_seqs": setup.scheduler.max_num_seqs,
        "max_num_batched_tokens": setup.scheduler.max_num_batched_tokens,
        "policy_options": dict(setup.policy_options),
    }
    records = from_requests(result.requests)
    out["slo_attainment"] = attainment(records, slo)
    out["slo"] = describe(slo) if slo is not None else None
    out["by_tenant"] = per_tenant(records)  # service shares and Jain's index across tenants
    out["by_class"] = per_class(records)  # online and offline requests on their own
    span = makespan(records)
    for cls in ("online", "offline"):
        out[cls] = class_figures(records, cls, slo, span)
    out["safepoint_aborts"] = runner.safepoint_aborts
    out["aborted_compute_s"] = runner.aborted_compute_s
    out["checkpoint_blocks"] = runner.checkpoint_blocks
    out["num_preemptions_checkpoint"] = loop.num_preemptions_checkpoint
    out["prefix_cache"] = {"enabled": setup.prefix_caching, **prefix_cache_figures(loop)}
    out["fairness"] = fairness(
        result.requests, result.throttled, result.abandoned, delay_threshold_s=delay_threshold_s
    )
    return json_safe(out)

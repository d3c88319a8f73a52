"""The real engine serving a trace on a virtual clock, timed step by step.

``quanta bench policies``, ``quanta simulate validate`` and the profile's calibration all
need the same thing: the real loop and policy driving the real ``ModelRunner`` over a seeded
trace, with arrivals honoured on a virtual clock that advances by each step's *measured*
time (idle gaps are skipped). Nothing sleeps, and with a thread-CPU timer other processes on
a shared machine stay out of the numbers. Loads torch (inside ``replay``).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from quanta.core.clock import VirtualClock
from quanta.core.config import CacheConfig, EngineConfig, SchedulerConfig
from quanta.core.loop import LoopStats
from quanta.core.request import Request
from quanta.costmodel import CostModel
from quanta.sim.driver import (
    StepSample,
    build_requests,
    drive,
    policy_options,
    replay_of,
    time_runner,
)
from quanta.workloads import WorkloadRequest, make_workload


def bench_trace(num_requests: int, max_len: int, seed: int, scale: float) -> list[WorkloadRequest]:
    """ShareGPT-like lengths scaled by ``scale`` (a small CPU model cannot spend 338 tokens
    per answer on hundreds of requests); the shape of the distribution is kept."""
    trace = make_workload("sharegpt", num_requests, 1.0, seed=seed, max_len=max_len)
    return [
        replace(
            r,
            prompt_tokens=max(1, round(r.prompt_tokens * scale)),
            output_tokens=max(1, round(r.output_tokens * scale)),
        )
        for r in trace
    ]


def pressure_cache(
    trace: Sequence[WorkloadRequest], max_num_seqs: int, max_model_len: int, block_size: int = 16
) -> CacheConfig:
    """Memory pressure as on the A100: room for about two batches of average jobs."""
    per_job = sum(r.input_len + r.output_len for r in trace) / len(trace) / block_size
    return CacheConfig(
        block_size=block_size,
        num_device_blocks=max(int(2 * max_num_seqs * per_job), 2 * max_model_len // block_size),
        num_host_blocks=8 * max_num_seqs * int(per_job + 1),
    )


def replay(
    model: Path,
    policy: str,
    trace: Sequence[WorkloadRequest],
    sched: SchedulerConfig,
    cache: CacheConfig,
    seed: int,
    *,
    cost: CostModel,
    timer: Callable[[], float],
    dtype: str | None = None,
    device: str = "cpu",
    record: list[StepSample] | None = None,
    step_repeats: int = 1,
    prefix_caching: bool = True,
) -> tuple[list[Request], LoopStats]:
    """Serve ``trace`` (with its arrival times, and an interaction's calls after the call
    before them and their think time, as the simulator sends them) through the real loop and
    engine.

    A few warm-up requests run first (allocator, kernels) and are not recorded (their
    prompts share nothing with the trace's); ``cost`` is the profile handed to policies that
    predict iteration times; ``step_repeats`` times each step by its fastest of that many
    runs (``time_runner``); ``prefix_caching`` is the engine's.
    """
    run = serve(
        model,
        policy,
        trace,
        sched,
        cache,
        seed,
        cost=cost,
        timer=timer,
        dtype=dtype,
        device=device,
        record=record,
        step_repeats=step_repeats,
        prefix_caching=prefix_caching,
    )
    return run.requests, run.stats


@dataclass(frozen=True)
class EngineRun:
    """One replay's requests and counters, and what became of the calls that never ran as
    sent: the same outcomes a ``SimResult`` records, so one set of figures reads either."""

    requests: list[Request]
    stats: LoopStats
    throttled: frozenset[str] = frozenset()  # refused by the policy's admission
    abandoned: tuple[str, ...] = ()  # never sent: an earlier call of their interaction failed
    cut_off: tuple[str, ...] = ()  # in flight or unsent when ``until`` came


def serve(
    model: Path,
    policy: str,
    trace: Sequence[WorkloadRequest],
    sched: SchedulerConfig,
    cache: CacheConfig,
    seed: int,
    *,
    cost: CostModel,
    timer: Callable[[], float],
    dtype: str | None = None,
    device: str = "cpu",
    record: list[StepSample] | None = None,
    step_repeats: int = 1,
    prefix_caching: bool = True,
    options: Mapping[str, Any] | None = None,
    until: float | None = None,
) -> EngineRun:
    """``replay``, with the policy's ``options`` (the cost profile added where the policy
    takes one) and, with ``until``, stopped at the first step boundary at or after that many
    seconds of the trace, as ``simulate(..., until=)`` stops: what is in flight then is
    aborted and what was not sent never is."""
    from quanta.frontends.engine import build_engine

    clock = VirtualClock()
    config = EngineConfig(
        model=str(model),
        policy=policy,
        dtype=dtype,
        device=device,
        cache=cache,
        scheduler=sched,
        policy_options=policy_options(policy, dict(options or {}), cost),
        enable_prefix_caching=prefix_caching,
    )
    engine = build_engine(config, clock=clock)
    engine.loop.runner = time_runner(engine.loop.runner, clock, timer, record, step_repeats)
    vocab = engine.model_config.vocab_size
    warm = build_requests(trace[:4], vocab_size=vocab, seed=seed + 1)
    kept = len(record) if record is not None else 0
    drive(engine.loop, clock, [_renamed(r, f"warm{i}") for i, r in enumerate(warm)])
    if record is not None:
        del record[kept:]  # the warm-up's steps are not the trace's
    start = clock.now()
    requests = build_requests(trace, vocab_size=vocab, seed=seed)
    for r in requests:
        r.arrival_time += start
    before = engine.loop.stats()
    plan = replay_of(trace, requests)
    drive(engine.loop, clock, requests, plan, until=None if until is None else start + until)
    cut_off = tuple(r.request_id for r in requests if not r.status.finished)
    if cut_off:
        engine.loop.stop(f"the replay ended at {until} s")
    return EngineRun(
        requests,
        since(engine.loop.stats(), before),
        frozenset(plan.throttled),
        tuple(r.request_id for r in plan.abandoned),
        cut_off,
    )


def since(stats: LoopStats, before: LoopStats) -> LoopStats:
    """``stats`` with the prefix cache's counters taken from ``before`` on: the trace's
    own lookups, not the warm-up's."""
    return replace(
        stats,
        prefix_cache_queries=stats.prefix_cache_queries - before.prefix_cache_queries,
        prefix_cache_hits=stats.prefix_cache_hits - before.prefix_cache_hits,
    )


def _renamed(r: Request, rid: str) -> Request:
    return Request(rid, r.prompt_token_ids, r.params, r.arrival_time, r.seed)

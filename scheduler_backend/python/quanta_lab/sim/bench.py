"""``quanta bench policies`` and ``quanta bench scheduler``.

``policies`` runs one seeded trace through the real loop on the real (CPU) engine once per
policy (``quanta_lab.sim.engine_replay``): the engine runs one torch thread and is timed by that
thread's CPU clock, on a virtual clock. The rate comes from a profile measured the same way
(sweep plus calibration replay), as a multiple (``load``) of the estimated batched capacity.

``scheduler`` times one ``schedule()`` call over N candidate requests (Apt-Serve Table 6
reports 0.3 / 1.0 / 10.8 ms for 50 / 200 / 1600 candidates, GPU-side scheduler in Python).
"""

from __future__ import annotations

import json
import random
import statistics
import tempfile
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, NamedTuple

from quanta.core.apply import DecisionApplier
from quanta.core.blocks import BlockManager
from quanta.core.config import CacheConfig, SchedulerConfig
from quanta.core.plan import PoolView
from quanta.core.request import Request, RequestStatus, SamplingParams, blocks_for
from quanta.core.view import SchedulerView
from quanta.costmodel import CostModel, load_profile
from quanta.policies import make_policy
from quanta.sim.driver import StepSample
from quanta.sim.metrics import request_metrics
from quanta.workloads import WorkloadRequest, arrival_times, make_workload, scale_to_rate
from quanta.workloads.prompts import PromptIds
from quanta.workloads.transforms import TooLong

from quanta_lab.sim.engine_replay import EngineRun, bench_trace, pressure_cache, serve
from quanta_lab.sim.repro import batched_capacity

APT_SERVE_TABLE6_MS = {50: 0.3, 100: 0.5, 200: 1.0, 400: 2.1, 800: 4.8, 1600: 10.8}


def parse_entry(entry: str) -> tuple[str, dict[str, Any]]:
    """``NAME[:KEY=VALUE...]`` -> (NAME, options); a value is read as JSON where it parses
    (``2``, ``false``), else kept as text. Raises ``ValueError`` on a malformed option."""
    name, *pairs = entry.split(":")
    options: dict[str, Any] = {}
    for pair in pairs:
        key, sep, raw = pair.partition("=")
        if not sep or not key:
            raise ValueError(f"{entry!r}: expected NAME:KEY=VALUE, got {pair!r}")
        try:
            options[key] = json.loads(raw)
        except json.JSONDecodeError:
            options[key] = raw
    return name, options


class AgentUsers(NamedTuple):
    """Who sends the ``agents`` workload: benign users, abusers, and how many times as often
    an abuser starts interactions (None: ``make_workload``'s defaults)."""

    num_users: int | None = None
    abusers: int | None = None
    abuse_factor: float | None = None


@dataclass(frozen=True)
class EngineBench:
    """The real (CPU) engine set up for timed replays: one torch thread timed by its own CPU
    clock, so other processes on a shared machine do not leak into the measured step times,
    and the cost profile that predicts it (fitted here unless one is given)."""

    model: Path
    cost: CostModel
    timer: Callable[[], float]
    step_repeats: int = 1  # time each step by its fastest of this many runs
    prefix_caching: bool = True  # the engine's; a simulation of its runs must share alike

    @classmethod
    def create(
        cls,
        model: Path | None,
        profile: Path | None,
        *,
        calibration_s: float = 20.0,
        max_num_seqs: int = 8,
        step_repeats: int = 1,
        length_scale: float = 0.25,
        prefix_caching: bool = True,
    ) -> EngineBench:
        """Without ``profile``, fit one here: the sweep, then ``calibration_s`` seconds of a
        serving replay with ``max_num_seqs`` sequences (0: the sweep alone), its steps timed
        as the bench will time them (``step_repeats``), its ShareGPT-like lengths scaled by
        ``length_scale`` as the bench's own traces are."""
        from quanta_lab.sim.profile import profile_engine

        if model is None:
            from quanta.build.checkpoint import ensure_checkpoint

            model = ensure_checkpoint("opt-tiny", Path(tempfile.gettempdir()) / "quanta-opt-tiny")
        import torch

        torch.set_num_threads(1)
        timer = time.thread_time
        cost = (
            load_profile(profile)
            if profile is not None
            else profile_engine(
                model,
                repeats=3,
                timer=timer,
                echo=lambda _: None,
                calibration_s=calibration_s,
                max_num_seqs=max_num_seqs,
                step_repeats=step_repeats,
                calibration_scale=length_scale,
            )
        )
        return cls(model, cost, timer, step_repeats, prefix_caching)

    def trace(
        self,
        num_requests: int,
        seed: int,
        *,
        scale: float = 0.25,
        workload: str | None = None,
        token_scale: float = 1.0,
        too_long: TooLong = "error",
        users: AgentUsers | None = None,
    ) -> list[WorkloadRequest]:
        """Without ``workload``: ShareGPT-like lengths scaled by ``scale``; with a trace file:
        its first rows, context tokens times ``token_scale``; ``agents`` with ``users``
        (benign users, abusers, abuse factor; seeded by ``seed``). Arrival times come
        later."""
        if workload is None:
            return bench_trace(num_requests, self.cost.max_model_len, seed, scale)
        shape = {} if users is None else {"seed": seed, **users._asdict()}
        return make_workload(
            workload,
            num_requests,
            1.0,
            max_len=self.cost.max_model_len,
            token_scale=token_scale,
            too_long=too_long,
            **shape,
        )

    def cache(self, trace: Sequence[WorkloadRequest], max_num_seqs: int) -> CacheConfig:
        """Memory pressure as on the A100: room for about two batches of average jobs."""
        return pressure_cache(trace, max_num_seqs, self.cost.max_model_len)

    def serve(
        self,
        policy: str,
        trace: Sequence[WorkloadRequest],
        sched: SchedulerConfig,
        cache: CacheConfig,
        seed: int,
        *,
        record: list[StepSample] | None = None,
        options: Mapping[str, Any] | None = None,
        until: float | None = None,
    ) -> EngineRun:
        """Serve ``trace`` (with its arrival times) through the real loop and engine, with the
        policy's ``options``, cut off at ``until`` seconds of the trace
        (``engine_replay.serve``), and what became of refused and abandoned calls."""
        return serve(
            self.model,
            policy,
            trace,
            sched,
            cache,
            seed,
            cost=self.cost,
            timer=self.timer,
            record=record,
            step_repeats=self.step_repeats,
            prefix_caching=self.prefix_caching,
            options=options,
            until=until,
        )


def with_arrivals(
    trace: Sequence[WorkloadRequest], rate: float, seed: int, from_file: bool
) -> list[WorkloadRequest]:
    """Poisson arrivals at ``rate`` for generated lengths; a file's own gaps squeezed or
    stretched as a whole to ``rate`` (bursts keep their shape)."""
    if from_file:
        return scale_to_rate(trace, rate)
    times = arrival_times(len(trace), rate, random.Random(seed))
    return [replace(r, arrival_time=t) for r, t in zip(trace, times, strict=True)]


def bench_policies(
    model: Path | None,
    policies: Sequence[str],
    *,
    num_requests: int,
    load: float,
    seed: int,
    max_num_seqs: int,
    profile: Path | None,
    rate: float | None = None,
    scale: float = 0.25,
    workload: str | None = None,
    token_scale: float = 1.0,
    too_long: TooLong = "error",
    calibration_s: float = 20.0,
    echo: Callable[[str], object] = print,
) -> dict[str, dict[str, float]]:
    """Each policy on the real engine, on one trace (see ``EngineBench.trace``) at ``load``
    times the estimated capacity (or at ``rate``)."""
    bench = EngineBench.create(
        model, profile, calibration_s=calibration_s, max_num_seqs=max_num_seqs
    )
    cost = bench.cost
    sched = SchedulerConfig(max_num_seqs=max_num_seqs, max_num_batched_tokens=2048)
    trace = bench.trace(
        num_requests,
        seed,
        scale=scale,
        workload=workload,
        token_scale=token_scale,
        too_long=too_long,
    )
    capacity = batched_capacity(trace, cost, sched)
    rate = load * capacity if rate is None else rate
    trace = with_arrivals(trace, rate, seed, workload is not None)
    cache = bench.cache(trace, max_num_seqs)
    echo(
        f"{len(trace)} requests at {rate:.2f}/s ({rate / capacity:.2f}x the estimated capacity), "
        f"{cache.num_device_blocks} "
        f"device blocks, min iteration {1e3 * cost.min_iteration_time:.2f} ms"
    )
    results: dict[str, dict[str, float]] = {}
    for name in policies:
        policy, options = parse_entry(name)  # a policy or POLICY:KEY=VALUE[:KEY=VALUE]
        run = bench.serve(policy, trace, sched, cache, seed, options=options)
        requests, stats = run.requests, run.stats
        results[name] = m = request_metrics(requests)
        echo(
            f"{name:>16}: mean {m['mean_normalized_latency'] * 1e3:8.2f} ms/token, "
            f"p95 {m['p95_normalized_latency'] * 1e3:8.2f}, TTFT {m['mean_ttft']:.3f} s, "
            f"TPOT {m['mean_tpot'] * 1e3:.2f} ms, P99 TBT {m['p99_tbt'] * 1e3:.2f} ms, "
            f"preemptions swap/recompute "
            f"{stats.num_preemptions_swap}/{stats.num_preemptions_recompute}"
        )
    if "fcfs" in results:
        base = results["fcfs"]
        for name, m in results.items():
            if name != "fcfs":
                echo(
                    f"fcfs / {name}: mean {base['mean_normalized_latency'] / m['mean_normalized_latency']:.2f}x, "  # noqa: E501
                    f"p95 {base['p95_normalized_latency'] / m['p95_normalized_latency']:.2f}x"
                )
    return results


def candidate_view(
    n: int, *, seed: int = 0, block_size: int = 16
) -> tuple[SchedulerView, list[Request], BlockManager]:
    """N live requests: a quarter running, a quarter swapped, half waiting, ShareGPT-like
    lengths, the device pool nearly full so eviction paths run too."""
    rng = random.Random(seed)
    lengths = [tr for tr in make_workload("sharegpt", n, 1.0, seed=seed)]
    held = sum(blocks_for(t.input_len + 1, block_size) for t in lengths[: n // 2])
    bm = BlockManager(block_size, int(held * 1.05) + 16, held + 16)
    ids = PromptIds(seed=seed)  # NOTE: unrelated prompts, as the trace's rows are
    reqs = []
    for i, t in enumerate(lengths):
        r = Request(
            f"c{i}",
            ids.of(t, i),
            SamplingParams(max_tokens=t.output_len, ignore_eos=True),
            rng.random(),
            i,
        )
        if i < n // 2:
            r.num_computed_tokens = t.input_len
            r.append_token(1, 0.0)
            r.set_status(RequestStatus.RUNNING)
            bm.allocate_slots(r.request_id, t.input_len)
            if i % 2:
                bm.swap_out(r.request_id)
                r.set_status(RequestStatus.SWAPPED)
        reqs.append(r)
    by = {s: [r for r in reqs if r.status is s] for s in RequestStatus}
    view = SchedulerView(
        1.0,
        by[RequestStatus.WAITING],
        by[RequestStatus.RUNNING],
        by[RequestStatus.SWAPPED],
        PoolView(bm),
    )
    return view, reqs, bm


def bench_scheduler(
    policies: Sequence[str],
    candidates: Sequence[int],
    *,
    repeats: int = 20,
    echo: Callable[[str], object] = print,
) -> dict[str, dict[int, float]]:
    out: dict[str, dict[int, float]] = {}
    for name in policies:
        for n in candidates:
            view, reqs, bm = candidate_view(n)
            policy = make_policy(name, SchedulerConfig())
            for r in reqs:
                policy.admit(r, view)
            decision = policy.schedule(view)
            DecisionApplier(bm).validate(decision, {r.request_id: r for r in reqs})
            times = []
            for _ in range(repeats):
                t0 = time.perf_counter()
                policy.schedule(view)
                times.append(time.perf_counter() - t0)
            ms = 1e3 * statistics.median(times)
            out.setdefault(name, {})[n] = ms
            ref = APT_SERVE_TABLE6_MS.get(n)
            echo(
                f"{name:>10} {n:5d} candidates: {ms:7.2f} ms"
                + (f"   (Apt-Serve Table 6: {ref} ms)" if ref is not None else "")
            )
    return out

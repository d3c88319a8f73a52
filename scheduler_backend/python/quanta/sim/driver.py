"""Runs the real ``EngineLoop`` on a virtual clock: the simulator's only driver.

Requests are submitted when the clock reaches their arrival time; while the engine is busy the
clock moves by step times, when it is idle it jumps to the next arrival. A call of a
multi-call interaction waits for the call before it (``quanta.sim.interactions``). Nothing in
the loop or the policy knows it is simulated.

An arrival that falls inside a preemptible step (ConServe's offline work) is shown to the loop
as it would be by a client thread: the runner asks the driver which pending arrival, if any,
the loop's abort rule stops the step for (``SimRunner.interrupt``), stops at the safepoint
after it, and the arrival is submitted as usual once the clock has moved there.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from quanta.core.blocks import BlockManager
from quanta.core.clock import VirtualClock
from quanta.core.config import SchedulerConfig
from quanta.core.errors import InvalidRequestError
from quanta.core.loop import EngineLoop, LoopStats
from quanta.core.output import Runner
from quanta.core.policy import Policy
from quanta.core.request import Request, RequestMetadata, SamplingParams
from quanta.costmodel import CostModel
from quanta.policies import parse_policy
from quanta.sim.interactions import Replay
from quanta.sim.runner import Interrupt, SimRunner, SimStats
from quanta.workloads import WorkloadRequest
from quanta.workloads.prompts import DEFAULT_ID_RANGE, PromptIds

# FastServe's public artifact for OPT-13B: --max-batch-size 16 --max-tokens-per-batch 2048.
PAPER_SCHEDULER = SchedulerConfig(max_num_seqs=16, max_num_batched_tokens=2048)


@dataclass(frozen=True)
class SimSetup:
    """Everything a simulated run depends on besides the trace."""

    policy: str
    profile: CostModel
    scheduler: SchedulerConfig = PAPER_SCHEDULER
    block_size: int = 16
    num_device_blocks: int | None = None  # default: what the profile's KV memory holds
    num_host_blocks: int | None = None
    policy_options: dict[str, Any] = field(default_factory=dict)
    safepoint_interval: int = 8  # layers between the runner's safepoints
    # Share cached prefixes as the engine does (its default too): only uncached prefill is
    # computed, so only it costs time.
    prefix_caching: bool = True

    def pools(self) -> tuple[int, int]:
        device, host = self.profile.num_blocks(self.block_size)
        return (
            device if self.num_device_blocks is None else self.num_device_blocks,
            host if self.num_host_blocks is None else self.num_host_blocks,
        )


@dataclass
class SimResult:
    setup: SimSetup
    requests: list[Request]
    rejected: list[tuple[Request, str]]
    runner: SimStats
    loop: LoopStats
    throttled: frozenset[str] = frozenset()  # ids of requests the policy refused at admission
    abandoned: tuple[str, ...] = ()  # ids of calls never sent: an earlier call of theirs failed
    cut_off: tuple[str, ...] = ()  # ids of requests in flight or unsent when ``until`` came


def build_requests(
    trace: Sequence[WorkloadRequest], *, vocab_size: int | None = None, seed: int = 0
) -> list[Request]:
    """One request per trace row, stopping exactly at its output length (``ignore_eos``),
    with the row's id and scheduling metadata (tenant, class, SLOs) for the policy to read.

    Prompts are the row's ids (``quanta.workloads.prompts``, seeded by ``seed``): a trace's
    own, else synthetic ids in ``[4, vocab_size)`` (without ``vocab_size`` a range as large
    as a real vocabulary's) that unrelated rows do not share and rows of one prefix group
    share exactly as far as the row says: a prefix cache in the simulated loop finds what it
    would find in a live replay of the same rows.
    """
    lo, hi = DEFAULT_ID_RANGE
    ids = PromptIds((lo, hi if vocab_size is None else vocab_size), seed=seed)
    requests = []
    for i, row in enumerate(trace):
        prompt = ids.of(row, i)
        if vocab_size is not None and row.prompt_token_ids and max(prompt) >= vocab_size:
            raise ValueError(
                f"request {row.request_id or i!r}: prompt id {max(prompt)} is outside the "
                f"model's vocabulary of {vocab_size}"
            )
        params = SamplingParams(max_tokens=row.output_len, ignore_eos=True, temperature=0.0)
        requests.append(
            Request(
                row.request_id or f"r{i}",
                prompt,
                params,
                row.arrival_time,
                seed=seed + i,
                metadata=RequestMetadata(**row.metadata()),
            )
        )
    return requests


def policy_options(name: str, options: dict[str, Any], profile: CostModel) -> dict[str, Any]:
    """``options`` plus the cost profile for the systems that predict iteration times (those
    with a ``profile`` option), unless the caller chose one."""
    if "profile" in options or not parse_policy(name, options).accepts("profile"):
        return dict(options)
    return {"profile": profile, **options}


def make_sim_policy(setup: SimSetup) -> Policy:
    spec = parse_policy(setup.policy, setup.policy_options).with_defaults(profile=setup.profile)
    return spec.build(setup.scheduler)


def simulate(
    trace: Sequence[WorkloadRequest], setup: SimSetup, *, until: float | None = None
) -> SimResult:
    """Serve ``trace`` with ``setup`` on the cost model; deterministic for a given trace.

    With ``until`` the run stops at the first step boundary at or after that virtual time:
    requests still in flight are aborted and those not sent yet never are (``cut_off``), so a
    backlog larger than the run needs costs nothing to simulate."""
    clock = VirtualClock()
    device, host = setup.pools()
    runner = SimRunner(
        setup.profile, clock, setup.block_size, safepoint_interval=setup.safepoint_interval
    )
    loop = EngineLoop(
        runner=runner,
        policy=make_sim_policy(setup),
        blocks=BlockManager(
            setup.block_size,
            device,
            host,
            prefix_caching=setup.prefix_caching,
            sliding_window=setup.profile.sliding_window,
        ),
        clock=clock,
        max_model_len=setup.profile.max_model_len,
    )
    requests = build_requests(trace)
    replay = replay_of(trace, requests)
    rejected = drive(loop, clock, requests, replay, until=until)
    cut_off = tuple(r.request_id for r in requests if not r.status.finished)
    if cut_off:
        loop.stop(f"the simulated run ended at {until} s")
    loop.blocks.check_integrity()
    abandoned = tuple(r.request_id for r in replay.abandoned)
    expected = replay.throttled | set(abandoned) | set(cut_off)
    failed = [r for r in requests if r.error is not None and r.request_id not in expected]
    if failed:  # the loop turns a policy bug into failed requests; a simulation must not
        raise RuntimeError(f"{len(failed)} requests failed, first: {failed[0].error}")
    return SimResult(
        setup,
        requests,
        rejected,
        runner.stats,
        loop.stats(),
        frozenset(replay.throttled),
        abandoned,
        cut_off,
    )


def replay_of(trace: Sequence[WorkloadRequest], requests: Sequence[Request]) -> Replay:
    """When each of ``requests`` (built from ``trace``'s rows, in order) may be sent: an
    interaction's next call after the call before it and the row's think time."""
    think = {r.request_id: row.think_time_s for row, r in zip(trace, requests, strict=True)}
    return Replay(requests, think)


def drive(
    loop: EngineLoop,
    clock: VirtualClock,
    requests: Sequence[Request],
    replay: Replay | None = None,
    *,
    until: float | None = None,
) -> list[tuple[Request, str]]:
    """Submit each request when it is due and step until all are done (or the clock reaches
    ``until``): at its arrival time, or for a later call of an interaction after the call
    before it (``replay``, which also records throttled and abandoned requests; default: one
    without think times). A ``SimRunner`` learns from it which arrival stops a preemptible
    step.

    Returns the requests the engine refused at submission, with the reason.
    """
    plan = Replay(requests) if replay is None else replay
    if isinstance(loop.runner, SimRunner):
        loop.runner.interrupt = _first_abort(loop, plan)
    rejected: list[tuple[Request, str]] = []
    while (plan.pending or loop.has_unfinished()) and (until is None or clock.now() < until):
        now = clock.now()
        for req in plan.due(now):
            try:
                loop.submit(req, plan.sink(req))  # metrics come from the requests themselves
            except InvalidRequestError as exc:
                rejected.append((req, str(exc)))
                plan.refused(req)
        if not loop.has_unfinished():
            if (due := plan.next_time()) is not None:
                clock.set(due)
            continue
        if not loop.step():
            if (due := plan.next_time()) is not None:  # nothing runs until someone arrives
                clock.set(max(now, due))
            else:
                loop.run_until_idle()  # fails what the policy left stuck, then returns
    return rejected


def _first_abort(loop: EngineLoop, plan: Replay) -> Interrupt:
    """The runner's hook: the arrival time of the first request due inside a step (after its
    start: those due at the start were submitted before it) that the loop would stop the
    step for."""

    def first(start: float, end: float) -> float | None:
        for req in plan.peek(end):
            if req.arrival_time > start and loop.would_abort(req, req.arrival_time):
                return req.arrival_time
        return None

    return first


@dataclass(frozen=True, slots=True)
class StepSample:
    """One measured step of the real engine: what ran and how long it took."""

    chunks: tuple[tuple[int, int], ...]  # (new_tokens, start_pos) per sequence
    copies: int  # blocks swapped in or out in the step
    seconds: float


def time_runner(
    runner: Runner,
    clock: VirtualClock,
    timer: Any,
    record: list[StepSample] | None = None,
    repeats: int = 1,
) -> Runner:
    """Wrap a real runner so the virtual clock advances by its measured time: the real
    engine under the simulator's arrival handling (``quanta bench policies``). With
    ``record`` every step is appended to it, for fitting and checking the cost model.

    With ``repeats`` > 1 a step without block copies is run that many times and timed by its
    fastest run: interference on a shared machine only ever slows a step down, so the minimum
    is the engine's own time. Running a step again rewrites the same KV slots with the same
    values; it must sample the same tokens (greedy requests), which is checked.
    """
    return _TimedRunner(runner, clock, timer, record, repeats)


class _TimedRunner:
    def __init__(
        self,
        runner: Runner,
        clock: VirtualClock,
        timer: Any,
        record: list[StepSample] | None,
        repeats: int,
    ) -> None:
        self.runner, self.clock, self.timer = runner, clock, timer
        self.record, self.repeats = record, repeats
        self.capabilities = runner.capabilities

    def execute(self, scheduler_output: Any) -> Any:
        so = scheduler_output
        t0 = self.timer()
        out = self.runner.execute(so)
        elapsed = self.timer() - t0
        if self.repeats > 1 and so.seqs and not so.swap_in and not so.swap_out:
            for _ in range(self.repeats - 1):
                t0 = self.timer()
                again = self.runner.execute(so)
                elapsed = min(elapsed, self.timer() - t0)
                if again.sampled_token_ids != out.sampled_token_ids:
                    raise RuntimeError("a repeated step sampled other tokens: not greedy")
        self.clock.advance(elapsed)
        if self.record is not None:
            chunks = tuple((s.num_new_tokens, s.start_pos) for s in so.seqs)
            self.record.append(StepSample(chunks, len(so.swap_in) + len(so.swap_out), elapsed))
        return out
